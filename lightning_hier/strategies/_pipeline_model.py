"""Cutting a LightningModule's blocks into pipeline stages and putting them back together.

During fit each rank keeps only its stage: the other stages' blocks are moved to the meta device
(no memory) and replaced in the container by :class:`Elsewhere` placeholders, so the module's
``parameters()`` and ``state_dict()`` hold this stage only (what ``configure_optimizers`` and the
per-rank checkpoint state see). :func:`reassemble` restores every block with the owners' values
(end of fit) and :func:`gather_state_dict` builds the ordinary whole-model state dict (checkpoints).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn
from typing_extensions import override

from lightning_hier import _validate as v
from lightning_hier.algorithms.decoupled import (
    ORDERS,
    balanced_split,
    block_output_bytes,
    check_split_points,
    measure_block_costs,
    stage_ranges,
)
from lightning_hier.comm import broadcast_, gather_objects
from lightning_hier.comm.collectives import Group
from lightning_hier.strategies._checkpoint import detach_state
from lightning_hier.strategies._user_model import describe, find_network, first_input, first_training_batch

WIRE_DTYPES: dict[str | None, torch.dtype | None] = {None: None, "bf16": torch.bfloat16}
"""The strategy's ``wire_dtype`` choices and the dtype each sends activations and their gradients in."""

if TYPE_CHECKING:
    import lightning.pytorch as pl
    from torch.optim import Optimizer

Container = nn.Sequential | nn.ModuleList


class Elsewhere(nn.Module):
    """Placeholder for a block that lives on another pipeline stage during fit."""

    def __init__(self, index: int, stage: int) -> None:
        super().__init__()
        self.index, self.stage = index, stage

    @override
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(
            f"Block {self.index} lives on pipeline stage {self.stage} while DecoupledStrategy is fitting; "
            "this rank holds only its own stage. The whole model is back on every rank after fit()."
        )

    @override
    def extra_repr(self) -> str:
        return f"block={self.index}, stage={self.stage}"


def resolve_blocks(module: nn.Module, attr: str) -> Container:
    """The blocks at the dotted path ``attr`` of ``module``, in order.

    An ``nn.Sequential`` / ``nn.ModuleList`` is the list of blocks; any other module is a network
    of one block (returned inside a new ``nn.Sequential``, which the module does not hold: one
    block makes one stage, so it is never replaced by a placeholder).

    Raises:
        ValueError: No such attribute.
    """
    try:
        blocks = module.get_submodule(attr)
    except AttributeError:
        raise ValueError(
            f"DecoupledStrategy cannot cut {type(module).__name__}: it has no submodule `{attr}`. The pipeline needs "
            "the network as an nn.Sequential (or nn.ModuleList) of blocks; set `module_attr` to its attribute path."
        ) from None
    return blocks if isinstance(blocks, Container) else nn.Sequential(blocks)


def check_no_outside_parameters(module: nn.Module, attr: str) -> None:
    """The pipeline trains the blocks only: parameters elsewhere would never get a gradient."""
    outside = [n for n, _ in module.named_parameters() if not n.startswith(f"{attr}.")]
    if outside:
        raise ValueError(
            f"DecoupledStrategy cannot cut {type(module).__name__}: parameters outside `{attr}` would never be "
            f"trained by the pipeline: {outside[:5]}{' ...' if len(outside) > 5 else ''}. Move them into a block."
        )


def _prefix(attr: str, index: int) -> str:
    return f"{attr}.{index}."


@dataclass
class CutModel:
    """A module cut for one stage: which blocks are here and where the others went."""

    module: nn.Module
    attr: str
    split: tuple[int, ...]
    stage_index: int
    full_keys: list[str]
    foreign: dict[int, nn.Module] = field(default_factory=dict)

    @property
    def container(self) -> Container:
        return resolve_blocks(self.module, self.attr)

    @property
    def ranges(self) -> list[range]:
        return stage_ranges(self.split, len(self.container))

    def stage(self) -> nn.Sequential:
        """This rank's blocks, in order (the same block objects the module holds)."""
        blocks = self.container
        return nn.Sequential(*[blocks[i] for i in self.ranges[self.stage_index]])

    def foreign_keys(self) -> list[str]:
        prefixes = tuple(_prefix(self.attr, i) for i in self.foreign)
        return [k for k in self.full_keys if k.startswith(prefixes)]


def cut(module: nn.Module, attr: str, split: Sequence[int], num_stages: int, stage_index: int) -> CutModel:
    """Keep stage ``stage_index``'s blocks in ``module``; move the others to meta behind placeholders."""
    blocks = resolve_blocks(module, attr)
    points = check_split_points(split, len(blocks), num_stages)
    result = CutModel(module, attr, points, stage_index, list(module.state_dict().keys()))
    for stage, indices in enumerate(result.ranges):
        if stage == stage_index:
            continue
        for i in indices:
            result.foreign[i] = blocks[i].to("meta")
            blocks[i] = Elsewhere(i, stage)
    return result


def reassemble(model: CutModel, device: torch.device, stage_ranks: Sequence[int], group: Group) -> None:
    """Put every block back; each stage's values come from its owner in ``stage_ranks`` (a collective)."""
    blocks = model.container
    for i, block in model.foreign.items():
        blocks[i] = block.to_empty(device=device)
    model.foreign.clear()
    for stage, indices in enumerate(model.ranges):
        tensors: list[Tensor] = []
        for i in indices:
            tensors += list(blocks[i].parameters()) + list(blocks[i].buffers())
        with torch.no_grad():
            broadcast_([t.data for t in tensors], src=stage_ranks[stage], group=group)


def gather_state_dict(model: CutModel, stage_ranks: Sequence[int], group: Group) -> dict[str, Any] | None:
    """The whole ordinary model's state dict, assembled on ``stage_ranks[0]`` (``None`` elsewhere).

    A collective over the stages of one replica.
    """
    own = detach_state(model.module.state_dict())
    parts = gather_objects(own, dst=stage_ranks[0], group=group)
    if parts is None:
        return None
    merged: dict[str, Any] = {}
    for part in parts:
        merged.update(part)
    missing = [k for k in model.full_keys if k not in merged]
    if missing:
        raise RuntimeError(f"DecoupledStrategy: the stages did not provide {missing[:5]} for the whole model.")
    return {k: merged[k] for k in model.full_keys}


@contextmanager
def forward_replaced(target: nn.Module, forward: Any) -> Iterator[None]:
    """Temporarily route ``target(...)`` to ``forward`` (an instance attribute shadows the class method)."""
    target.forward = forward
    try:
        yield
    finally:
        del target.forward


def check_stages_argument(owner: str, stages: Any) -> int | str:
    """Validate the strategy's ``stages`` argument: ``'auto'`` or a positive integer."""
    if isinstance(stages, str) and stages == "auto":
        return "auto"
    try:
        return v.check_int(owner, "stages", stages, minimum=1)  # any integral type, as every integer argument
    except ValueError:
        raise ValueError(f"{owner}: argument `stages` must be 'auto' or an integer >= 1, got {stages!r}.") from None


def blocks_attr(module: nn.Module, module_attr: str | None) -> str:
    """``module_attr``, or the path :func:`~lightning_hier.strategies._user_model.find_network` finds."""
    if module_attr is not None:
        return module_attr
    try:
        return find_network(module)
    except ValueError as err:
        raise ValueError(
            f"DecoupledStrategy cannot tell which submodule of {type(module).__name__} holds the blocks: {err}. Set "
            "`module_attr` to the attribute path of the nn.Sequential / nn.ModuleList of blocks."
        ) from None


def check_split_argument(owner: str, split: Sequence[int] | None, stages: int) -> tuple[int, ...] | None:
    """Validate the strategy's ``split`` argument at construction (the block count comes later)."""
    if split is None:
        return None
    allowed = f"None or {stages - 1} strictly increasing positive block indices (one per stage after the first)"
    points = v.check_int_list(owner, "split", split, minimum=1, length=stages - 1, increasing=True, allowed=allowed)
    return tuple(points)


def check_order_argument(owner: str, order: Any, schedule: str) -> str:
    """``order`` is one of :data:`ORDERS`, and ``'backward_first'`` comes with ``schedule='fdg'``."""
    v.check_choice(owner, "order", order, ORDERS)
    if order == "backward_first" and schedule != "fdg":
        raise ValueError(
            f"{owner}: order='backward_first' (FDG's order) needs schedule='fdg', got schedule={schedule!r}; "
            "use order='forward_first' with 'ddg' and 'sync'."
        )
    return str(order)


def check_module_attr_argument(owner: str, module_attr: Any) -> str | None:
    """Validate ``module_attr``: ``None`` or a dotted attribute path such as ``model`` or ``net.body``."""
    parts = module_attr.split(".") if isinstance(module_attr, str) else []
    if module_attr is not None and not (parts and all(p.isidentifier() or p.isdigit() for p in parts)):
        raise ValueError(
            f"{owner}: argument `module_attr` must be None (find the blocks) or an attribute path such as 'model' "
            f"or 'net.body', got {module_attr!r}."
        )
    return module_attr


def check_fit_settings(module: Any, accumulate_grad_batches: int, optimizer: Any, stage: nn.Module) -> None:
    """What the pipeline's own optimizer steps need: automatic optimization, no accumulation, one step per call.

    Raises:
        ValueError: Naming the setting and what to use instead.
    """
    if not module.automatic_optimization:
        raise ValueError("DecoupledStrategy runs the optimizer steps itself: use automatic optimization.")
    if accumulate_grad_batches != 1:
        raise ValueError(
            f"DecoupledStrategy: accumulate_grad_batches={accumulate_grad_batches} is not supported; the "
            "pipeline applies one update per batch and stage (use a larger batch instead)."
        )
    if isinstance(optimizer, torch.optim.LBFGS):
        raise ValueError("DecoupledStrategy: LBFGS re-evaluates its closure; use an optimizer that steps once.")
    check_optimizer_params(optimizer, stage)


def check_optimizer_params(optimizer: Optimizer, stage: nn.Module) -> None:
    """The optimizer must hold this stage's parameters only (it was built after the cut)."""
    mine = {id(p) for p in stage.parameters()}
    foreign = [p for group in optimizer.param_groups for p in group["params"] if id(p) not in mine]
    if foreign:
        raise ValueError(
            f"DecoupledStrategy: the optimizer holds {len(foreign)} parameter(s) of other stages; build it in "
            "configure_optimizers from self.parameters() (called after the strategy cut the model)."
        )


def sample_input(module: pl.LightningModule, trainer: pl.Trainer, device: torch.device) -> Tensor:
    """One batch of block inputs: ``example_input_array``, else the first training batch's input.

    The input of a batch is the batch itself (a tensor), its first element or its first dict value.

    Raises:
        ValueError: Neither gives a tensor.
    """
    example = module.example_input_array
    if isinstance(example, Tensor):
        return example.to(device)
    batch = first_training_batch(module, trainer, device)
    inputs = first_input(batch)
    if inputs is None:
        raise ValueError(
            f"cannot find a sample input to balance the stages: the first training batch is {describe(batch)}, with "
            "no input tensor first; pass `split` explicitly or set `example_input_array` on the LightningModule."
        )
    return inputs


def probe_blocks(
    module: pl.LightningModule,
    trainer: pl.Trainer,
    device: torch.device,
    blocks: Container,
    attr: str,
    num_stages: int,
    balance: bool,
    link: tuple[float, torch.dtype | None] | None = None,
) -> tuple[tuple[int, ...] | None, str | None]:
    """``(balanced split or None, error message or None)`` from one sample input (run on one rank).

    ``link``: ``(seconds per byte, wire dtype)`` of the links between stages; the balance then
    charges each stage the transfer time of the cuts it borders (see :func:`balanced_split`).
    """
    try:
        sample = sample_input(module, trainer, device)
    except ValueError as err:
        return None, (str(err) if balance else None)  # without balancing the check is a courtesy
    error = check_blocks_accept(blocks, sample, attr)
    if error is not None or not balance:
        return None, error
    cut_costs = None
    if link is not None:
        seconds_per_byte, wire_dtype = link
        cut_costs = [seconds_per_byte * b for b in block_output_bytes(list(blocks), sample, wire_dtype)[:-1]]
    return balanced_split(measure_block_costs(list(blocks), sample), num_stages, cut_costs), None


def check_blocks_accept(blocks: Container, sample: Tensor, attr: str) -> str | None:
    """Run ``sample`` through the blocks in order (eval mode, no grad); the error message if a block fails.

    The pipeline feeds each batch's input to the first block and every block's output to the next,
    with nothing in between; a network whose ``forward`` (or ``training_step``) reshapes the input
    first fails here with a message naming the block and the shape, not deep inside a stage.
    """
    modes = [b.training for b in blocks]
    h: Any = sample
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=[sample.device] if sample.device.type == "cuda" else []):
            for i, block in enumerate(blocks):
                shape = list(h.shape) if isinstance(h, Tensor) else type(h).__name__
                try:
                    h = block.eval()(h)
                except Exception as err:
                    what = "the input" if i == 0 else f"block {i - 1}'s output"
                    return (
                        f"block {i} of `{attr}` ({type(block).__name__}) cannot take {what} of shape {shape} "
                        f"({type(err).__name__}: {err}). The pipeline feeds each training batch's input (the batch "
                        f"itself, its first element or first dict value; here of shape {list(sample.shape)}) to the "
                        f"blocks of `{attr}` in order, with nothing in between: move input transforms (e.g. a "
                        "flatten in forward or training_step) into a block."
                    )
    finally:
        for block, mode in zip(blocks, modes, strict=True):
            block.train(mode)
    return None
