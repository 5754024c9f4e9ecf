"""Downloads, only through torchvision, and only when asked (``download=True``).

torchvision is not a dependency and there is no extra for it: pip would resolve ``torchvision``
to the newest build on the index, which pins its own torch (a CUDA build) and would replace the
torch already installed. The matching build comes from the index the torch came from (see
:data:`TORCHVISION_HINT`). Every reader works on local files without torchvision.
"""

from __future__ import annotations

from lightning_hier.data.errors import DatasetNotFoundError

TORCHVISION_HINT = (
    "install the torchvision build made for your torch from the index your torch came from "
    "(CPU: pip install torchvision --index-url https://download.pytorch.org/whl/cpu)"
)


def torchvision_download(dataset: str, root: str) -> None:
    """Download ``torchvision.datasets.<dataset>`` into ``root``.

    Raises:
        DatasetNotFoundError: torchvision is not installed (or cannot be imported).
    """
    try:
        import torchvision.datasets as tvd
    except Exception as err:  # not installed, or a build that does not match torch (RuntimeError)
        raise DatasetNotFoundError(
            f"{dataset}: download=True needs torchvision, which could not be imported ({err}): {TORCHVISION_HINT}. "
            f"Otherwise put the files in {root} yourself."
        ) from err
    getattr(tvd, dataset)(root, train=True, download=True)
    getattr(tvd, dataset)(root, train=False, download=True)
