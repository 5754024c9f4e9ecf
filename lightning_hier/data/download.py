"""Downloads, only through torchvision (the optional 'vision' extra)."""

from __future__ import annotations

from lightning_hier.data.errors import DatasetNotFoundError


def torchvision_download(dataset: str, root: str) -> None:
    """Download ``torchvision.datasets.<dataset>`` into ``root``.

    Raises:
        DatasetNotFoundError: torchvision is not installed (or cannot be imported).
    """
    try:
        import torchvision.datasets as tvd
    except Exception as err:  # not installed, or a build that does not match torch
        raise DatasetNotFoundError(
            f"{dataset}: download=True needs torchvision (pip install 'lightning-hier[vision]'), which could not "
            f"be imported ({err}). Otherwise put the files in {root} yourself."
        ) from err
    getattr(tvd, dataset)(root, train=True, download=True)
    getattr(tvd, dataset)(root, train=False, download=True)
