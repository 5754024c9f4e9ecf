"""Calibration: time a model's forward, backward and optimizer step on this machine (pure torch).

The simulator's compute inputs come from a short run of the user's own model on one worker:
:func:`measure_workload` times whole training steps at the real batch size (forward, backward
and optimizer step separately, median of ``repeats`` after a warm-up) and, for an
``nn.Sequential``, each block's forward + backward and output size (what a pipeline stage
computes and sends), with the pipeline strategy's own block timer
(:func:`~lightning_hier.algorithms.decoupled.partition.measure_block_costs`). Block times are
rescaled so that they add up to the whole model's forward + backward. :func:`codec_seconds`
times what each compressed reduction costs the worker's core per byte it compresses.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from statistics import median
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook
from typing_extensions import override

from lightning_hier.algorithms.averaging import float_buffers
from lightning_hier.algorithms.compression import Bf16ErrorFeedback, make_codec
from lightning_hier.algorithms.decoupled.partition import measure_block_costs
from lightning_hier.comm import CommStats
from lightning_hier.simulator.inputs import Block, Workload

CODECS = ("bf16", "int8", "int4", "powersgd")


def time_step(
    model: nn.Module, inputs: Tensor, targets: Tensor, optimizer: torch.optim.Optimizer, repeats: int = 5
) -> tuple[float, float, float]:
    """Median ``(forward, backward, step)`` seconds of one training step on this batch.

    The model is trained by these steps (``repeats + 1`` of them); pass a copy to keep it.
    """
    forward, backward, step = [], [], []
    for i in range(repeats + 1):  # the first step warms allocators and lazy optimizer state up
        optimizer.zero_grad()
        start = time.perf_counter()
        loss = F.cross_entropy(model(inputs), targets)
        mid = time.perf_counter()
        loss.backward()
        end = time.perf_counter()
        optimizer.step()
        if i:
            forward.append(mid - start)
            backward.append(end - mid)
            step.append(time.perf_counter() - end)
    return median(forward), median(backward), median(step)


def _median_s(fn: Callable[[], object], repeats: int) -> float:
    fn()  # the first call allocates
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return median(times)


class _Linear(nn.Module):
    """``params`` under a loss linear in each of them: its backward is one copy per tensor."""

    def __init__(self, params: Sequence[Tensor]) -> None:
        super().__init__()
        self.weights = nn.ParameterList([nn.Parameter(p.detach().clone()) for p in params])

    @override
    def forward(self, scale: Tensor) -> Tensor:
        return sum((w.sum() * scale for w in self.weights), torch.zeros(()))


def _powersgd_s(params: Sequence[Tensor], rank: int, repeats: int) -> float:
    """The ``powerSGD_hook`` of torch on one DDP bucket of ``params``: a backward with it less one without."""
    size_mb = sum(p.numel() * p.element_size() for p in params) / 2**20 + 1
    one = torch.ones(())

    def backward_s(hooked: bool) -> float:
        ddp = nn.parallel.DistributedDataParallel(_Linear(params), bucket_cap_mb=size_mb)
        if hooked:
            state = powerSGD_hook.PowerSGDState(None, matrix_approximation_rank=rank, start_powerSGD_iter=2)
            ddp.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
            for _ in range(2):  # its plain warm-up steps
                ddp(one).backward()
        return _median_s(lambda: ddp(one).backward(), repeats)

    return max(0.0, backward_s(True) - backward_s(False))


def codec_seconds(
    model: nn.Module, codecs: Sequence[str] = CODECS, repeats: int = 10, powersgd_rank: int = 4
) -> dict[str, float]:
    """Each codec's CPU seconds per float32 byte of ``model``'s parameters, on one rank of this machine.

    ``bf16``, ``int8``, ``int4``: a change through :func:`~lightning_hier.algorithms.compression.make_codec`
    (error feedback; the quantized all-reduce's quantize, per-shard sum, requantization and dequantize,
    on a group of one, so no byte is sent). ``powersgd``: torch's hook (error feedback, the two rank-``r``
    products, the orthogonalisation, the decompression) on a group of one rank, which this function
    creates and destroys; it is left out when a process group already exists (its DDP would
    synchronise with the other ranks).
    """
    unknown = sorted(set(codecs) - set(CODECS))
    if unknown:
        raise ValueError(f"codec_seconds: `codecs` must be among {CODECS}, got {unknown}.")
    params = [p.detach().clone() for p in model.parameters() if p.requires_grad]
    nbytes = sum(p.numel() * p.element_size() for p in params)
    out: dict[str, float] = {}
    for codec in codecs:
        if codec != "powersgd":
            out[codec] = _change_codec_s(codec, params, repeats) / nbytes
        elif not dist.is_initialized():
            dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
            try:
                out[codec] = _powersgd_s(params, powersgd_rank, repeats) / nbytes
            finally:
                dist.destroy_process_group()
    return out


def _change_codec_s(codec: str, params: Sequence[Tensor], repeats: int) -> float:
    """One window change of ``params`` through the codec, on a group of one rank."""
    coder = make_codec(codec, list(params), world=1)
    change = [torch.randn_like(p) for p in params]
    if isinstance(coder, Bf16ErrorFeedback):
        return _median_s(lambda: coder.encode_(change), repeats)
    assert coder is not None
    return _median_s(lambda: coder.launch(change, None, CommStats()).wait(), repeats)


def measure_workload(
    name: str,
    model: nn.Module,
    input_shape: Sequence[int],
    batch_size: int,
    samples_per_epoch: int,
    classes: int = 10,
    repeats: int = 5,
    model_spec: dict[str, Any] | None = None,
) -> Workload:
    """A :class:`Workload` measured on this machine with SGD (momentum 0.9) and cross-entropy.

    Args:
        name: Label of the workload.
        model: The network (left trained by a few steps on random data).
        input_shape: One sample's shape, without the batch.
        batch_size: Samples per worker per step.
        samples_per_epoch: Training samples per epoch over all workers.
        classes: Output classes (random targets are drawn from them).
        repeats: Timed steps (median).
        model_spec: How to rebuild the network later (:attr:`Workload.model`).
    """
    g = torch.Generator().manual_seed(0)
    inputs = torch.randn(batch_size, *input_shape, generator=g)
    targets = torch.randint(0, classes, (batch_size,), generator=g)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    forward, backward, step = time_step(model, inputs, targets, optimizer, repeats)
    params = [p for p in model.parameters() if p.requires_grad]
    return Workload(
        name,
        params=sum(p.numel() for p in params),
        batch_size=batch_size,
        samples_per_epoch=samples_per_epoch,
        forward_s=forward / batch_size,
        backward_s=backward / batch_size,
        step_s=step,
        buffers=sum(b.numel() for b in float_buffers(model)),
        tensors=len(params),
        tensor_words=tuple(p.numel() for p in params),
        tensor_shapes=tuple(tuple(p.shape) for p in params),
        codec_s_per_byte=codec_seconds(model, repeats=repeats),
        blocks=_blocks(model, inputs, (forward + backward) / batch_size, repeats),
        model=model_spec,
    )


def _blocks(model: nn.Module, inputs: Tensor, sample_s: float, repeats: int) -> tuple[Block, ...]:
    """Per-block costs of an ``nn.Sequential`` (none for other modules), summing to ``sample_s``."""
    if not isinstance(model, nn.Sequential) or len(model) < 2:
        return ()
    blocks = list(model)
    costs = measure_block_costs(blocks, inputs, repeats)
    scale = sample_s / sum(costs) if sum(costs) > 0 else 0.0
    out, h = [], inputs
    with torch.no_grad():
        for block, cost in zip(blocks, costs, strict=True):
            h = block(h)
            params = sum(p.numel() for p in block.parameters() if p.requires_grad)
            out.append(Block(cost * scale, params, h[0].numel()))
    return tuple(out)
