"""What the pipeline and grid strategies read from an arbitrary user LightningModule.

Both strategies must work on a module that only defines ``training_step`` and a DataLoader (the
``BoringModel`` pattern): no ``example_input_array``, no ``batch_size`` attribute, sometimes no
``forward``. The rules here say where the network and its input come from:

- **the input** of a batch (:func:`first_input`): the batch itself if it is a tensor, else its first
  element (tuple or list, e.g. ``(x, y)``) or its first value (dict);
- **the first training batch** (:func:`first_training_batch`): drawn from a fresh iterator of the
  training DataLoader, on a forked RNG, so the run's random stream does not shift;
- **the network** (:func:`find_network`): see its docstring.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import lightning.pytorch as pl
import torch
from torch import Tensor, nn

CONTAINERS = (nn.Sequential, nn.ModuleList)


def first_input(batch: Any) -> Tensor | None:
    """The network input of ``batch``: itself (a tensor), its first element, or its first dict value."""
    if isinstance(batch, Tensor):
        return batch
    if isinstance(batch, list | tuple) and batch:
        return batch[0] if isinstance(batch[0], Tensor) else None
    if isinstance(batch, Mapping) and batch:
        value = next(iter(batch.values()))
        return value if isinstance(value, Tensor) else None
    return None


def describe(batch: Any) -> str:
    """A short description of a batch's structure and shapes, for error messages."""
    if isinstance(batch, Tensor):
        return f"a tensor of shape {list(batch.shape)}"
    if isinstance(batch, list | tuple):
        return f"a {type(batch).__name__} of ({', '.join(_short(b) for b in batch)})"
    if isinstance(batch, Mapping):
        return f"a dict of ({', '.join(f'{k!r}: {_short(v)}' for k, v in batch.items())})"
    return f"a {type(batch).__name__}"


def _short(value: Any) -> str:
    return f"tensor {list(value.shape)}" if isinstance(value, Tensor) else type(value).__name__


def first_training_batch(module: pl.LightningModule, trainer: pl.Trainer, device: torch.device) -> Any:
    """The first batch of the training DataLoader, moved to ``device`` like Lightning does.

    Call it after the ``setup`` hooks (a DataModule builds its datasets there).
    """
    with torch.random.fork_rng():  # iterating the loader must not shift the run's random stream
        batch = next(iter(trainer.fit_loop._data_source.dataloader()))
        return module._apply_batch_transfer_handler(batch, device)


def defines_forward(module: nn.Module) -> bool:
    """Whether a LightningModule overrides ``forward`` (Lightning's own raises NotImplementedError)."""
    return type(module).forward is not pl.LightningModule.forward


def find_network(module: nn.Module) -> str:
    """Dotted path of the submodule holding the network, for a module that does not say.

    The rule: breadth first (the module's direct children, then their children, and so on), the
    first level that holds an ``nn.Sequential`` or ``nn.ModuleList`` with parameters decides; it
    must hold exactly one. Without any such container, a module whose parameters all sit in one
    direct child (``BoringModel``'s ``layer``) has that child as its (single-block) network.

    Raises:
        ValueError: Several candidates, or none (the message lists them).
    """
    level = [(name, child) for name, child in module.named_children()]
    while level:
        found = [(n, m) for n, m in level if isinstance(m, CONTAINERS) and _has_params(m)]
        if len(found) == 1:
            return found[0][0]
        if found:
            raise ValueError(f"several containers could be the network: {_names(found)}")
        level = [(f"{n}.{c}", child) for n, m in level for c, child in m.named_children()]
    holders = [(n, m) for n, m in module.named_children() if _has_params(m)]
    if len(holders) == 1 and not any(p for p, _ in module.named_parameters(recurse=False)):
        return holders[0][0]
    raise ValueError(
        "no nn.Sequential / nn.ModuleList holds parameters and the parameters are not in one submodule "
        f"(submodules with parameters: {_names(holders) or 'none'})"
    )


def _has_params(m: nn.Module) -> bool:
    return next(iter(m.parameters()), None) is not None


def _names(found: Sequence[tuple[str, nn.Module]]) -> str:
    return ", ".join(f"`{n}` ({type(m).__name__})" for n, m in found)


@contextmanager
def muted_logs(module: pl.LightningModule) -> Iterator[None]:
    """Drop the module's ``self.log`` / ``self.log_dict`` calls while inside (a hook re-run on the side)."""
    # instance attributes shadow the methods (log_dict calls self.log)
    object.__setattr__(module, "log", _ignore)
    object.__setattr__(module, "log_dict", _ignore)
    try:
        yield
    finally:
        del module.log, module.log_dict


def _ignore(*args: Any, **kwargs: Any) -> None:
    return None


def require_automatic_optimization(owner: str, module: pl.LightningModule, why: str) -> None:
    """Refuse a module under manual optimization (a GAN's several optimizers), saying why.

    Called before anything else looks at the module, so the refusal names the real limit.

    Raises:
        ValueError: ``module.automatic_optimization`` is False.
    """
    if not module.automatic_optimization:
        raise ValueError(
            f"{owner} needs automatic optimization with one optimizer, but {type(module).__name__} sets "
            f"automatic_optimization=False (manual optimization, e.g. a GAN's two optimizers): {why}. Use a "
            "data-parallel strategy (ddp, hpsgd, localsgd, the GRAWA family, dbs) for such a module."
        )
