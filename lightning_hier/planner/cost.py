"""The alpha-beta communication model of the Pr x Pc grid, per layer and for a network.

Gholami, Azad, Jin, Keutzer, Buluc, "Integrated Model, Batch and Domain Parallelism in Training
Neural Networks", SPAA 2018, arXiv 1712.04432, section 4 (the model) and docs/algorithms.md
section 5 (the counting conventions). With ``n`` the size of the full result and ``b = B / Pc``::

    all_gather(n, p) = alpha * ceil(lg p) + beta * (p - 1) / p * n      all_reduce = 2x that
    FC layer i:   AG(b d_i, Pr) + AR(b d_{i-1}, Pr) [not for the first layer] + AR(|W_i| / Pr, Pc)
    conv layer:   halo of n = b C_in W_in floor(k/2) words per message, 2 messages (first layer)
                  or 4 (forward and backward) when Pr > 1 and k > 1, + AR(|W_i|, P)
    pooling:      (added) the rows its windows read across a slab boundary, as a convolution's
    conv -> FC:   AG(b d_in(fc6), Pr)

|W| counts the bias. Terms this implementation adds for layers the paper's networks do not have:
BatchNorm2d on slabs (AR(2C, Pr) forward and backward, AR(2C, P) for the affine gradients), a
Linear narrower than Pr (kept replicated: AR(|W|, Pc)) and other parameterised modules after the
transition (replicated: AR(|W|, Pc)).

Two conventions:

- ``rank=None`` (the paper's; used for planning and the reference values): every slab has two
  neighbours, halos are ``floor(k/2)`` rows, shards are ``|W| / Pr``.
- ``rank=r`` (exactly what rank (r, c) of :mod:`lightning_hier.layers` sends): the rows each
  rank sends and receives come from :func:`lightning_hier.layers.rows.slab_plan`, the plan the
  layers execute (edge slabs, uneven and empty slabs, windows wider than a slab); shards and the
  padded all-gathers of uneven ``out_features`` and slabs are counted as they are. Use it to
  check measured bytes per step.

What the implementation can run is a separate question from what a grid costs:
:func:`grid_problems` asks :func:`lightning_hier.layers.rows.split_problems`, the check the
layers themselves raise, so the planner and the layers agree on feasibility.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from math import ceil, log2

from lightning_hier.layers.rows import RowWindow, slab_plan, split_problems

# which group carries each kind of communication (for per-group alpha / beta)
KIND_GROUP = {
    "fc_gather": "model",
    "fc_dx": "model",
    "halo": "model",
    "bn_stats": "model",
    "transition": "model",
    "input_split": "model",
    "grad_batch": "batch",
    "grad_grid": "grid",
}


@dataclass(frozen=True)
class Link:
    """Latency ``alpha`` (seconds per message) and inverse bandwidth ``beta`` (seconds per word)."""

    alpha: float
    beta: float


REFERENCE_LINK = Link(alpha=2e-6, beta=4 / 10e9)
"""The reference of docs/algorithms.md, section 5: 2 us per message, 10 GB/s for 4-byte words."""


@dataclass(frozen=True)
class Links:
    """One :class:`Link` per group: MODEL (activations), BATCH and the whole grid (gradients)."""

    model: Link
    batch: Link
    grid: Link

    @classmethod
    def uniform(cls, link: Link) -> Links:
        return cls(link, link, link)


# ---------------------------------------------------------------------------- layer descriptions
@dataclass(frozen=True)
class FCLayer:
    """A fully connected layer ``d_in -> d_out``."""

    d_in: int
    d_out: int
    bias: bool = True
    name: str = ""

    @property
    def params(self) -> int:
        return self.d_in * self.d_out + (self.d_out if self.bias else 0)


@dataclass(frozen=True)
class ConvLayer:
    """A convolution on ``c_in x h x w`` inputs (``padding`` defaults to ``k // 2``, ``pad_bottom`` to ``padding``)."""

    c_in: int
    h: int
    w: int
    c_out: int
    k: int
    stride: int = 1
    padding: int | None = None
    kw: int | None = None
    dilation: int = 1
    groups: int = 1
    bias: bool = True
    splits_input: bool = False
    name: str = ""
    pad_bottom: int | None = None
    padding_mode: str = "zeros"

    @property
    def params(self) -> int:
        return self.c_out * (self.c_in // self.groups) * self.k * (self.kw or self.k) + (self.c_out if self.bias else 0)

    @property
    def window(self) -> RowWindow:
        """The layer's window along H (the one :class:`~lightning_hier.layers.DomainConv2d` uses)."""
        top = self.k // 2 if self.padding is None else self.padding
        return RowWindow(self.k, self.stride, top, top if self.pad_bottom is None else self.pad_bottom, self.dilation)

    @property
    def channels(self) -> int:
        return self.c_in

    def problems(self) -> list[str]:
        """Why it cannot run on slabs (:func:`~lightning_hier.layers.rows.split_problems`)."""
        return split_problems(padding_mode=self.padding_mode)

    def halo_rows(self) -> tuple[int, int]:
        """Rows this layer needs from the slab above and below on equal slabs thicker than its reach."""
        return self.window.halo()


@dataclass(frozen=True)
class BNLayer:
    """A BatchNorm2d on ``c`` channels of ``h x w`` slabs."""

    c: int
    h: int
    w: int
    affine: bool = True
    name: str = ""

    @property
    def params(self) -> int:
        return 2 * self.c if self.affine else 0


@dataclass(frozen=True)
class PoolLayer:
    """A max / average pooling on ``c x h x w`` inputs (no parameters; exchanges rows where windows overlap).

    ``kernel`` 0 means ``stride`` (non-overlapping windows); ``c`` and ``w`` 0 mean unknown (no
    words counted).
    """

    h: int
    stride: int
    name: str = ""
    params: int = 0
    kernel: int = 0
    padding: int = 0
    dilation: int = 1
    c: int = 0
    w: int = 0
    ceil_mode: bool = False
    count_include_pad: bool = True
    return_indices: bool = False

    @property
    def window(self) -> RowWindow:
        """The layer's window along H (the one :class:`~lightning_hier.layers.SlabPool2d` uses)."""
        return RowWindow(self.kernel or self.stride, self.stride, self.padding, self.padding, self.dilation)

    @property
    def channels(self) -> int:
        return self.c

    def problems(self) -> list[str]:
        """Why it cannot run on slabs (:func:`~lightning_hier.layers.rows.split_problems`)."""
        return split_problems(
            ceil_mode=self.ceil_mode,
            count_include_pad=self.count_include_pad,
            pad_rows=self.padding,
            return_indices=self.return_indices,
        )

    def halo_rows(self) -> tuple[int, int]:
        """Rows this layer needs from the slab above and below on equal slabs thicker than its reach."""
        return self.window.halo()


@dataclass(frozen=True)
class Transition:
    """The conv -> FC transition: gather ``words`` per sample (``C * H * W``) over MODEL (``h``: H, 0 if unknown)."""

    words: int
    name: str = ""
    params: int = 0
    h: int = 0


@dataclass(frozen=True)
class ReplicatedLayer:
    """Any other layer with ``params`` parameters, computed identically on every r."""

    params: int
    name: str = ""


@dataclass(frozen=True)
class UnsupportedLayer:
    """A layer that cannot run on slabs: only Pr = 1 is feasible."""

    reason: str
    name: str = ""
    params: int = 0


Layer = FCLayer | ConvLayer | BNLayer | PoolLayer | Transition | ReplicatedLayer | UnsupportedLayer


# ---------------------------------------------------------------------------- costs
def _lg(p: int) -> int:
    return ceil(log2(p)) if p > 1 else 0


@dataclass
class Cost:
    """Messages and words per process, by kind of communication."""

    terms: dict[str, list[float]] = field(default_factory=dict)

    def add(self, kind: str, messages: float, words: float) -> None:
        if messages or words:
            term = self.terms.setdefault(kind, [0.0, 0.0])
            term[0] += messages
            term[1] += words

    def all_gather(self, kind: str, n: float, p: int) -> None:
        if n:
            self.add(kind, _lg(p), (p - 1) / p * n)

    def all_reduce(self, kind: str, n: float, p: int) -> None:
        if n:
            self.add(kind, 2 * _lg(p), 2 * (p - 1) / p * n)

    def merge(self, other: Cost) -> None:
        for kind, (m, w) in other.terms.items():
            self.add(kind, m, w)

    @property
    def messages(self) -> float:
        return sum(t[0] for t in self.terms.values())

    @property
    def words(self) -> float:
        return sum(t[1] for t in self.terms.values())

    def words_by_kind(self) -> dict[str, float]:
        return {k: t[1] for k, t in self.terms.items()}

    def time(self, links: Link | Links) -> float:
        """Predicted seconds: ``alpha * messages + beta * words`` with each kind's group link."""
        ls = links if isinstance(links, Links) else Links.uniform(links)
        total = 0.0
        for kind, (m, w) in self.terms.items():
            link: Link = getattr(ls, KIND_GROUP.get(kind, "grid"))
            total += link.alpha * m + link.beta * w
        return total


def layer_cost(layer: Layer, pr: int, pc: int, batch: float, input_grad: bool, rank: int | None = None) -> Cost:
    """Communication of one layer per training step on a ``pr x pc`` grid, global batch ``batch``.

    Args:
        layer: The layer.
        pr: MODEL size of the grid.
        pc: BATCH size of the grid.
        batch: Global batch size B (each batch block has ``B / pc`` samples).
        input_grad: Whether the layer's input needs a gradient (false for the network's first).
        rank: ``None`` for the paper's convention, else the MODEL coordinate r for exact counts.
    """
    cost, b, p = Cost(), batch / pc, pr * pc
    if isinstance(layer, FCLayer):
        if layer.d_out < pr:  # too narrow to shard: replicated
            cost.all_reduce("grad_batch", layer.params, pc)
            return cost
        rows = ceil(layer.d_out / pr)
        cost.all_gather("fc_gather", b * (layer.d_out if rank is None else rows * pr), pr)
        if input_grad:
            cost.all_reduce("fc_dx", b * layer.d_in, pr)
        if rank is None:
            shard: float = layer.params / pr
        else:
            shard = (layer.d_out // pr + (rank < layer.d_out % pr)) * (layer.d_in + layer.bias)
        cost.all_reduce("grad_batch", shard, pc)
    elif isinstance(layer, ConvLayer | PoolLayer):
        if pr > 1:
            _halo(cost, layer, pr, b, input_grad, rank)
        if pr > 1 and isinstance(layer, ConvLayer) and layer.splits_input and input_grad:
            _slab_gather(cost, "input_split", b * layer.c_in * layer.w, layer.h, pr, rank)
        cost.all_reduce("grad_grid", layer.params, p)
    elif isinstance(layer, BNLayer):
        if pr > 1:
            cost.all_reduce("bn_stats", 2 * layer.c, pr)
            if input_grad:
                cost.all_reduce("bn_stats", 2 * layer.c, pr)
        cost.all_reduce("grad_grid", layer.params, p)
    elif isinstance(layer, Transition):
        if layer.h:
            _slab_gather(cost, "transition", b * layer.words / layer.h, layer.h, pr, rank)
        else:
            cost.all_gather("transition", b * layer.words, pr)
    elif isinstance(layer, ReplicatedLayer):
        cost.all_reduce("grad_batch", layer.params, pc)
    return cost


def _halo(cost: Cost, layer: ConvLayer | PoolLayer, pr: int, b: float, input_grad: bool, rank: int | None) -> None:
    row = b * layer.channels * layer.w  # words of one image row of the batch block
    if rank is None:
        # the paper's convention: two neighbours per slab; a convolution's halo is floor(k/2)
        # rows, a pooling's the rows its windows read across a boundary of equal slabs
        top, bottom = (layer.k // 2,) * 2 if isinstance(layer, ConvLayer) else layer.halo_rows()
        sides = [n for n in (top, bottom) if n] * (2 if input_grad else 1)
        cost.add("halo", len(sides), row * sum(sides))
        return
    plan = slab_plan(layer.window, layer.h, pr, rank)
    pieces = list(plan.send) + (list(plan.recv) if input_grad else [])  # forward: rows sent; backward: their grads
    cost.add("halo", len(pieces), row * sum(stop - start for _, start, stop in pieces))


def _slab_gather(cost: Cost, kind: str, row: float, h: int, pr: int, rank: int | None) -> None:
    """An all-gather of ``h`` rows of ``row`` words split over MODEL (padded to the largest slab when exact)."""
    cost.all_gather(kind, row * (h if rank is None else ceil(h / pr) * pr), pr)


def network_cost(
    layers: list[Layer], pr: int, pc: int, batch: float, first_input_grad: bool = False, rank: int | None = None
) -> Cost:
    """Sum of :func:`layer_cost` over the network (the input needs a gradient after any parameter)."""
    total, grad = Cost(), first_input_grad
    for layer in layers:
        total.merge(layer_cost(layer, pr, pc, batch, grad, rank))
        grad = grad or layer.params > 0
    return total


TRAINING_ONLY = ("grad_batch", "grad_grid", "bn_stats")
"""Kinds a forward pass in evaluation mode does not send: gradient reductions and batch statistics
(BatchNorm normalises with its running statistics)."""


def inference_cost(layers: list[Layer], pr: int, pc: int, batch: float, rank: int | None = None) -> Cost:
    """One forward pass without gradients (validation) of a global batch ``batch``: the layers' forward terms.

    Each layer as :func:`layer_cost` with no input gradient, less :data:`TRAINING_ONLY`: what is
    left are the FC all-gathers, the halos' forward rows and the transition's gather.
    """
    total = Cost()
    for layer in layers:
        cost = layer_cost(layer, pr, pc, batch, False, rank)
        total.merge(Cost({k: t for k, t in cost.terms.items() if k not in TRAINING_ONLY}))
    return total


def memory_bytes(layers: list[Layer], pr: int, pc: int, batch: float, word_bytes: int = 4, copies: int = 3) -> float:
    """Rough per-process memory: ``copies`` x parameters (weights, gradients, optimizer state) + saved inputs."""
    b, params, acts = batch / pc, 0.0, 0.0
    for layer in layers:
        if isinstance(layer, FCLayer):
            params += layer.params / pr if layer.d_out >= pr else layer.params
            acts += b * (layer.d_in + layer.d_out)
        elif isinstance(layer, ConvLayer | BNLayer):
            params += layer.params
            acts += b * (layer.c_in if isinstance(layer, ConvLayer) else layer.c) * layer.h * layer.w / pr
        else:
            params += layer.params
            acts += b * layer.words if isinstance(layer, Transition) else 0.0
    return word_bytes * (copies * params + acts)


def grid_problems(layers: list[Layer], pr: int) -> list[str]:
    """Why the implementation cannot split these layers over ``pr`` MODEL ranks (empty when it can).

    The layers run on any height and Pr (uneven, thin and empty slabs); what remains are layers
    that cannot run on slabs at all, decided by the checks the layers themselves raise.
    """
    if pr == 1:
        return []
    out: list[str] = []
    for layer in layers:
        label = f"layer {layer.name}" if layer.name else type(layer).__name__
        if isinstance(layer, UnsupportedLayer):
            out.append(f"{label}: {layer.reason}")
        elif isinstance(layer, ConvLayer | PoolLayer):
            out += [f"{label}: {problem}" for problem in layer.problems()]
    return out


def thin_slabs(layers: list[Layer], pr: int) -> list[str]:
    """Convolutions whose slabs would be thinner than their kernel on ``pr`` ranks (an efficiency rule, not a limit)."""
    return [
        f"layer {layer.name or 'ConvLayer'}: slabs of {layer.h // pr} rows are thinner than the kernel ({layer.k})"
        for layer in layers
        if pr > 1 and isinstance(layer, ConvLayer) and layer.h // pr < layer.k
    ]
