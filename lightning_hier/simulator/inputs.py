"""What the simulator is told: the workload (compute and sizes), the cluster (link, collectives, speeds).

Units: seconds, bytes, and *words* of ``word_bytes`` bytes (4: float32) for parameter counts, as
in the planner's cost model. A worker's speed is relative to the machine the workload was
calibrated on: a worker of speed ``s`` computes in ``t / s`` what took ``t`` there.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from itertools import pairwise
from pathlib import Path
from statistics import NormalDist
from typing import Any

from lightning_hier.planner.cost import Link

ALGORITHMS = ("ring", "tree", "halving_doubling")
"""All-reduce algorithms the model knows (see :mod:`lightning_hier.simulator.collectives`)."""


FORWARD_SHARE = 1 / 3
"""A forward's share of a sample's compute when none is measured: the backward as two forwards."""


@dataclass(frozen=True)
class Block:
    """One block of an ``nn.Sequential`` network, as a pipeline stage is cut from blocks.

    Attributes:
        compute_s: Forward plus backward seconds per sample.
        params: Parameters (words).
        out_words: Words of the block's output per sample (the activation a stage boundary after it sends).
    """

    compute_s: float
    params: int
    out_words: int


@dataclass(frozen=True)
class Workload:
    """A model's measured costs on one worker of the calibration machine.

    Attributes:
        name: A label.
        params: Trainable parameters (words): one full-model collective moves this many.
        batch_size: Samples per worker per optimizer step (the data-parallel batch).
        samples_per_epoch: Training samples of one epoch over all workers.
        forward_s: Forward seconds per sample.
        backward_s: Backward seconds per sample.
        step_s: Optimizer-step seconds per step (independent of the batch).
        buffers: Float buffers (BatchNorm statistics, words) averaged with the parameters.
        tensors: Parameter tensors (LGRAWA sends one weight per tensor).
        blocks: Per-block costs for the pipeline (empty: the pipeline cannot be predicted).
        tensor_words: Each parameter tensor's words in registration order (DDP fills its buckets
            with whole tensors in reverse order); empty: DDP's buckets are cut at their caps.
        tensor_shapes: Each parameter tensor's shape in registration order (PowerSGD compresses
            a tensor as a ``shape[0] x rest`` matrix); empty: not known (PowerSGD is not predicted).
        codec_s_per_byte: A compressed reduction's CPU time on the worker, per float32 byte it
            compresses, by codec (``'bf16'``, ``'int8'``, ``'int4'``, ``'powersgd'``): encoding,
            error feedback, the quantized all-reduce's requantization, decoding
            (:func:`~lightning_hier.simulator.calibrate.codec_seconds`). A codec not measured costs
            nothing.
        model: How to rebuild the network for the grid's layer list: ``{"spec": name or
            "package.module:factory", "input_shape": [...], "classes": n, "args": {...}}``, or None.
        word_bytes: Bytes per word (4 for float32).
    """

    name: str
    params: int
    batch_size: int
    samples_per_epoch: int
    forward_s: float
    backward_s: float
    step_s: float = 0.0
    buffers: int = 0
    tensors: int = 1
    blocks: tuple[Block, ...] = ()
    tensor_words: tuple[int, ...] = ()
    model: dict[str, Any] | None = None
    word_bytes: int = 4
    tensor_shapes: tuple[tuple[int, ...], ...] = ()
    codec_s_per_byte: Mapping[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in ("params", "batch_size", "samples_per_epoch", "tensors", "word_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"Workload: `{name}` must be >= 1, got {getattr(self, name)!r}.")
        for name in ("forward_s", "backward_s", "step_s"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"Workload: `{name}` must be >= 0 seconds, got {getattr(self, name)!r}.")
        if (
            self.tensor_shapes
            and self.tensor_words
            and [math.prod(s) for s in self.tensor_shapes] != list(self.tensor_words)
        ):
            raise ValueError(
                f"Workload: `tensor_shapes` {list(self.tensor_shapes)} must hold `tensor_words` "
                f"{list(self.tensor_words)}."
            )
        for codec, value in self.codec_s_per_byte.items():
            if not value >= 0:
                raise ValueError(f"Workload: `codec_s_per_byte[{codec!r}]` must be >= 0 seconds, got {value!r}.")

    @property
    def sample_s(self) -> float:
        """Forward plus backward seconds per sample."""
        return self.forward_s + self.backward_s

    @property
    def forward_share(self) -> float:
        """The forward's share of :attr:`sample_s` (:data:`FORWARD_SHARE` when nothing was measured)."""
        return self.forward_s / self.sample_s if self.sample_s > 0 else FORWARD_SHARE

    @property
    def param_bytes(self) -> int:
        return self.params * self.word_bytes

    def codec_s(self, codec: str, nbytes: float) -> float:
        """CPU seconds of compressing ``nbytes`` float32 bytes with ``codec`` (0 for one not measured)."""
        return self.codec_s_per_byte.get(codec, 0.0) * nbytes

    def with_batch(self, batch_size: int) -> Workload:
        """The same model at another per-worker batch."""
        return replace(self, batch_size=batch_size)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Workload:
        data = dict(data)
        data["blocks"] = tuple(Block(**b) for b in data.get("blocks", ()))
        data["tensor_words"] = tuple(data.get("tensor_words", ()))
        data["tensor_shapes"] = tuple(tuple(shape) for shape in data.get("tensor_shapes", ()))
        return cls(**data)

    @classmethod
    def load(cls, path: str | Path) -> Workload:
        return cls.from_dict(json.loads(Path(path).read_text()))


@dataclass(frozen=True)
class Cluster:
    """Workers, the link between them and how collectives use it.

    Attributes:
        workers: Number of workers (ranks).
        link: Latency ``alpha`` (s per message) and ``beta`` (s per word of ``word_bytes``), as the
            planner's :class:`~lightning_hier.planner.Link` and its probe
            (:func:`~lightning_hier.planner.measure_link`) give them.
        algorithm: The all-reduce algorithm, one of :data:`ALGORITHMS`.
        speeds: Relative speed per worker (``len == workers``); empty: all 1.
        cpu_s_per_byte: Compute time a worker loses per byte it sends while computing (gloo on a
            CPU reduces and copies on the compute cores; about 0 for NCCL on a GPU).
        collective_s_per_byte: The fastest a collective alone moves a byte it sends, whatever the
            link (its copies and reductions on otherwise idle cores): a floor on every collective's
            time (0: the link alone bounds it).
        word_bytes: Bytes per word of ``link.beta``.
    """

    workers: int
    link: Link
    algorithm: str = "ring"
    speeds: tuple[float, ...] = ()
    cpu_s_per_byte: float = 0.0
    jitter_s: float = 0.0
    collective_s_per_byte: float = 0.0
    word_bytes: int = 4

    def __post_init__(self) -> None:
        if self.workers < 1:
            raise ValueError(f"Cluster: `workers` must be >= 1, got {self.workers!r}.")
        if self.algorithm not in ALGORITHMS:
            raise ValueError(f"Cluster: `algorithm` must be one of {ALGORITHMS}, got {self.algorithm!r}.")
        if self.speeds and len(self.speeds) != self.workers:
            raise ValueError(f"Cluster: `speeds` needs one value per worker ({self.workers}), got {len(self.speeds)}.")
        if any(not s > 0 for s in self.speeds):
            raise ValueError(f"Cluster: every speed must be > 0, got {self.speeds!r}.")
        if not self.jitter_s >= 0:
            raise ValueError(f"Cluster: `jitter_s` must be >= 0 seconds, got {self.jitter_s!r}.")
        rates = {
            "link.alpha": self.link.alpha,
            "link.beta": self.link.beta,
            "cpu_s_per_byte": self.cpu_s_per_byte,
            "collective_s_per_byte": self.collective_s_per_byte,
        }
        for name, value in rates.items():
            if not value >= 0:
                raise ValueError(f"Cluster: `{name}` must be >= 0 seconds, got {value!r}.")

    @property
    def speed_list(self) -> list[float]:
        return list(self.speeds) if self.speeds else [1.0] * self.workers

    @property
    def byte_s(self) -> float:
        """Seconds per byte on the wire."""
        return self.link.beta / self.word_bytes


# ---------------------------------------------------------------------------- links and speeds
def link_of_rate(bits_per_s: float, alpha: float = 50e-6, word_bytes: int = 4) -> Link:
    """A link of ``bits_per_s`` bandwidth and ``alpha`` latency, in the planner's units."""
    if not bits_per_s > 0:
        raise ValueError(f"link_of_rate: `bits_per_s` must be > 0, got {bits_per_s!r}.")
    return Link(alpha=alpha, beta=8 * word_bytes / bits_per_s)


LINKS = {
    "100mbit": 100e6,
    "1gbit": 1e9,
    "10gbit": 10e9,
    "100gbit": 100e9,
}
"""Named link rates (bits per second); ``parse_link`` also reads ``2.5gbit``, ``400mbit``."""


def parse_link(text: str, alpha: float = 50e-6, efficiency: float = 1.0) -> Link:
    """``'1gbit'``, ``'100mbit'``, ``'2.5gbit'``: a link of that nominal rate times ``efficiency``."""
    t = text.strip().lower()
    for unit, scale in (("gbit", 1e9), ("mbit", 1e6)):
        if t.endswith(unit):
            try:
                rate = float(t[: -len(unit)]) * scale
            except ValueError:
                break
            return link_of_rate(rate * efficiency, alpha)
    raise ValueError(f"parse_link: link {text!r} must look like '100mbit', '1gbit' or '2.5gbit'.")


def one_straggler(workers: int, factor: float) -> tuple[float, ...]:
    """Every worker at speed 1 except the last, ``factor`` times slower."""
    if not factor >= 1:
        raise ValueError(f"one_straggler: `factor` must be >= 1, got {factor!r}.")
    return tuple([1.0] * (workers - 1) + [1.0 / factor])


def lognormal_speeds(workers: int, sigma: float) -> tuple[float, ...]:
    """Deterministic lognormal speeds: the ``(i + 0.5) / W`` quantiles of ``exp(N(0, sigma^2))``.

    Quantiles instead of random draws make a prediction reproducible, and the slowest worker of
    ``W`` is where it is expected to be (the ``0.5 / W`` quantile).
    """
    if sigma < 0:
        raise ValueError(f"lognormal_speeds: `sigma` must be >= 0, got {sigma!r}.")
    normal = NormalDist()
    return tuple(math.exp(sigma * normal.inv_cdf((i + 0.5) / workers)) for i in range(workers))


def parse_speeds(text: str, workers: int) -> tuple[float, ...]:
    """``'none'``, ``'straggler:2'`` (one worker 2x slower) or ``'lognormal:0.2'``."""
    kind, _, value = text.partition(":")
    if kind == "none":
        return ()
    if kind == "straggler" and value:
        return one_straggler(workers, float(value))
    if kind == "lognormal" and value:
        return lognormal_speeds(workers, float(value))
    raise ValueError(f"parse_speeds: stragglers {text!r} must be 'none', 'straggler:F' or 'lognormal:SIGMA'.")


def split_blocks(blocks: Sequence[Block], stages: int) -> list[list[Block]]:
    """Contiguous stages balanced by compute, as the pipeline strategy's default split."""
    from lightning_hier.algorithms.decoupled.partition import balanced_split

    points = (0, *balanced_split([b.compute_s for b in blocks], stages), len(blocks))
    return [list(blocks[a:b]) for a, b in pairwise(points)]


__all__ = [
    "ALGORITHMS",
    "LINKS",
    "Block",
    "Cluster",
    "Workload",
    "link_of_rate",
    "lognormal_speeds",
    "one_straggler",
    "parse_link",
    "parse_speeds",
    "split_blocks",
]
