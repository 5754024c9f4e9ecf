"""The pipeline's loss taken from the user's own ``training_step``.

A pipeline stage never runs the whole network, so the user's ``training_step`` cannot run as
written. But the last stage holds what it needs: the network's output for a batch (the pipeline
computed it) and, because every stage of a replica reads the same batches, the batch itself. So
the last stage calls ``training_step(batch, batch_idx)`` with the network replaced by a function
that returns that output: whatever loss ``training_step`` builds from it (targets from the batch,
a constant target, extra terms without parameters) is the loss the pipeline backpropagates.

Checked on every call: ``training_step`` calls the network exactly once, on the batch's input (what
stage 0 fed the first block). Its ``self.log`` calls are dropped: it runs on the last stage only,
some iterations after the batch was read, so a ``sync_dist`` reduction would wait for stages
that never log; the strategy logs ``train/loss`` itself.
"""

from __future__ import annotations

from collections import deque
from typing import Any

import lightning.pytorch as pl
from torch import Tensor, nn

from lightning_hier.strategies._finite import loss_of
from lightning_hier.strategies._pipeline_model import forward_replaced
from lightning_hier.strategies._user_model import describe, first_input, muted_logs


class TrainingStepLoss:
    """``loss_fn(output, target)`` of the last stage, computed by the module's ``training_step``.

    Args:
        module: The LightningModule.
        network: What ``training_step`` calls to run the network: the blocks' ``nn.Sequential``,
            the single block, or the LightningModule itself (its ``forward`` loops over an
            ``nn.ModuleList``).
        name: How messages call ``network`` (``"model"``, ``"forward"``).
        last: Whether this rank is its replica's last stage (only it keeps batches).
    """

    def __init__(self, module: pl.LightningModule, network: nn.Module, name: str, last: bool) -> None:
        self.module, self.network, self.name, self.last = module, network, name, last
        self.pending: deque[tuple[Any, int, tuple[int, ...]]] = deque()

    def stage_input(self, batch: Any, batch_idx: int) -> Tensor:
        """The tensor stage 0 feeds the first block; the last stage keeps the batch for its loss."""
        inputs = first_input(batch)
        if inputs is None:
            raise ValueError(
                f"DecoupledStrategy: the training batch is {describe(batch)}; the pipeline needs an input tensor: the "
                "batch itself, its first element or its first dict value."
            )
        if self.last:  # batches reach the last stage in the order they were read, some iterations later
            self.pending.append((batch, batch_idx, tuple(inputs.shape)))
        return inputs

    def __call__(self, output: Tensor, target: Tensor | None) -> Tensor:
        batch, batch_idx, shape = self.pending.popleft()
        calls: list[Any] = []

        def network(*args: Any, **kwargs: Any) -> Tensor:
            calls.append(tuple(args[0].shape) if args and isinstance(args[0], Tensor) else None)
            return output

        with forward_replaced(self.network, network), muted_logs(self.module):
            result = self.module.training_step(batch, batch_idx)
        owner = type(self.module).__name__
        if calls != [shape]:
            seen = [list(c) if c else c for c in calls]
            raise ValueError(
                f"DecoupledStrategy computes the loss with {owner}.training_step on the last stage, where "
                f"`{self.name}` returns the pipeline's output. It must call `{self.name}` exactly once, on the batch's "
                f"input (shape {list(shape)}), but called it {len(calls)} time(s) with {seen}. "
                "Call the network once on the batch's input, or define `pipeline_loss(output, target)` on the module."
            )
        loss = loss_of(result)
        if not isinstance(loss, Tensor) or loss.numel() != 1:
            raise ValueError(
                f"DecoupledStrategy: {owner}.training_step must return the loss (a scalar tensor, or a dict with "
                f"'loss'), got {describe(result)}."
            )
        return loss.reshape(())
