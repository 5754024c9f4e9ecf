"""A SUM (or mean) all-reduce of int8 or 4-bit payloads whose bytes per rank do not grow with the ranks.

Blockwise absmax quantization, as in 8-bit optimizers and torchft's quantized all-reduce: every
block of ``B`` consecutive elements gets one float32 scale ``s = max |x| / qmax`` and its elements
become integers ``q = round(x / s)`` in ``[-qmax, qmax]`` (``qmax = 127`` for int8, ``7`` for 4 bits,
two to a byte); ``round`` is round-half-to-even (``torch.round``), so a quantization is a
deterministic function of its input and every rank computes the same numbers from the same data.

The reduction never moves every rank's whole payload to every rank (an all-gather would send
``W - 1`` payloads per rank): like a reduce-scatter followed by an all-gather, each rank owns one
``1 / W`` shard of the flat payload::

    1. every rank quantizes its payload, shard by shard (W contiguous shards, padded to whole blocks)
    2. all_to_all: shard j of every rank goes to rank j                  (W - 1) / W of a payload
    3. rank j dequantizes the W copies of its shard and sums them in rank order (mean: / W)
    4. rank j quantizes the reduced shard again
    5. all_gather of the reduced shards; every rank dequantizes the whole  (W - 1) / W of a payload

so a rank sends ``2 (W - 1) / W`` quantized payloads on the wire, less than two whatever ``W`` (the
lower bound of any all-reduce, at the quantized size): about ``n (bits / 8 + 4 / B)`` bytes at 2
ranks and ``1.5 n (bits / 8 + 4 / B)`` at 4 for ``n`` elements, where an all-gather of every
rank's payload would send ``W - 1`` payloads. :class:`~lightning_hier.comm.CommStats` counts the
payload handed to the two collectives (``n`` and ``n / W`` quantized elements), as it counts an
all-reduce's ``n``.

Error feedback (Seide et al., Interspeech 2014; Karimireddy et al., ICML 2019) is the caller's:
:class:`QuantizedErrorFeedback` quantizes ``x + e`` in step 1 and keeps ``e <- (x + e) - deq(q)``,
the part this rank's rounding left out, for its next payload. The rounding of step 4 is common
to every rank (each gets the same reduced shard), so the result is the same number on every rank.

Both collectives are launched in the background: :meth:`QuantizedWork.is_completed` advances the
steps as far as the finished communication allows (it may be called between training steps), and
:meth:`QuantizedWork.wait` finishes them. A rule that overlaps the reduction with training starts the
gather at a step fixed in advance (:func:`gather_step`, :func:`start_gathers`), the same on every
rank, so that the ranks issue their collectives in one order.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_hier.comm.clock import PhaseClock
from lightning_hier.comm.collectives import Group, group_size
from lightning_hier.comm.stats import CommStats

QUANTIZED = {"int8": 8, "int4": 4}
"""Payload formats: the name and its bits per element."""
DEFAULT_BLOCK = 64
"""Elements that share one float32 scale (about 0.5 bit of overhead per element at 64)."""


def qmax(bits: int) -> int:
    """The largest magnitude of a ``bits``-bit signed code (symmetric range, no -2**(bits-1))."""
    return 2 ** (bits - 1) - 1


def quantize(x: Tensor, bits: int, block: int) -> tuple[Tensor, Tensor]:
    """``(codes, scales)`` of a flat float tensor whose length is a multiple of ``block``.

    ``codes`` are uint8: int8 codes offset by 128, or two 4-bit codes offset by 8 to a byte
    (the first in the low nibble). A block of zeros gets scale 0 and codes 0.
    """
    top = qmax(bits)
    blocks = x.float().reshape(-1, block)
    scales = blocks.abs().amax(dim=1) / top
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    q = torch.round(blocks / safe[:, None]).clamp_(-top, top).to(torch.int16).reshape(-1)
    if bits == 8:
        return (q + 128).to(torch.uint8), scales
    nibbles = (q + 8).to(torch.uint8)
    return nibbles[0::2] | (nibbles[1::2] << 4), scales


def dequantize(codes: Tensor, scales: Tensor, bits: int, block: int) -> Tensor:
    """Inverse of :func:`quantize` (float32, the padded length)."""
    if bits == 8:
        q = codes.to(torch.int16) - 128
    else:
        q = torch.stack([(codes & 0x0F).to(torch.int16), (codes >> 4).to(torch.int16)], dim=1).reshape(-1) - 8
    return (q.to(torch.float32).reshape(-1, block) * scales[:, None]).reshape(-1)


def padded_length(numel: int, world: int, block: int) -> int:
    """The payload's length padded to ``world`` shards of whole blocks."""
    unit = world * block
    return -(-numel // unit) * unit


class QuantizedWork:
    """One quantized all-reduce in flight (see the module docstring); ``out`` gets the result.

    Args:
        codes: This rank's quantized payload (step 1), padded to :func:`padded_length` elements.
        scales: Its block scales.
        out: Flat tensors whose concatenation receives the result (the payload's first elements).
        group: The process group (``None``: one rank; nothing is sent).
        bits: 8 or 4.
        block: Elements per scale.
        mean: Divide the sum by the number of ranks.
        stats: Accounting of the bytes each collective sends.
    """

    def __init__(
        self,
        codes: Tensor,
        scales: Tensor,
        out: Sequence[Tensor],
        group: Group,
        bits: int,
        block: int,
        mean: bool,
        stats: CommStats,
    ) -> None:
        self.out, self.group, self.bits, self.block, self.mean, self.stats = list(out), group, bits, block, mean, stats
        self.world = group_size(group)
        self._received = (torch.empty_like(codes), torch.empty_like(scales))
        self._gathered: tuple[list[Tensor], list[Tensor]] | None = None
        self._done = False
        self.phases: list[PhaseClock] = []
        """The exchange's and (once started) the gather's timings; empty with one rank."""
        self._works = self._exchange(self._received, (codes, scales), dist.all_to_all_single)

    def _exchange(self, outputs: tuple[Any, Any], inputs: tuple[Tensor, Tensor], collective: Any) -> list[Any]:
        """Launch ``collective`` on the codes and the scales; with one rank, the input is the output."""
        if self.world == 1:
            for out, inp in zip(outputs, inputs, strict=True):
                (out[0] if isinstance(out, list) else out).copy_(inp)
            return []
        # the payload handed to the collective, as CommStats counts an all-reduce's; on the wire a
        # rank sends (W - 1) / W of an all_to_all's input and W - 1 copies of an all_gather's
        self.stats.add(sum(t.numel() * t.element_size() for t in inputs), calls=2)
        clock = PhaseClock()
        works = [collective(o, i, group=self.group, async_op=True) for o, i in zip(outputs, inputs, strict=True)]
        self.phases.append(clock.track(works, self.group))
        return works

    @property
    def gathering(self) -> bool:
        """Whether the gather (steps 3-5) has started."""
        return self._gathered is not None

    def start_gather(self) -> None:
        """Wait for the exchange (steps 1-2) if it is still running, then start the gather; else nothing."""
        if self._gathered is None and not self._done:
            for work in self._works:
                if work is not None:
                    work.wait()
            self._advance()

    def is_completed(self) -> bool:
        """Advance as far as the finished collectives allow; whether the result is in ``out``."""
        while not self._done and all(w is None or w.is_completed() for w in self._works):
            self._advance()
        return self._done

    def wait(self, timeout: timedelta | None = None) -> bool:
        """Finish every step (blocking); the result is then in ``out``."""
        while not self._done:
            for work in self._works:
                if work is not None:
                    work.wait() if timeout is None else work.wait(timeout)
            self._advance()
        return True

    def _advance(self) -> None:
        if self._gathered is None:  # steps 3-5: reduce this rank's shard, requantize, gather every shard
            codes, scales = quantize(self._reduce_shard(), self.bits, self.block)
            self._gathered = (
                [torch.empty_like(codes) for _ in range(self.world)],
                [torch.empty_like(scales) for _ in range(self.world)],
            )
            self._works = self._exchange(self._gathered, (codes, scales), dist.all_gather)
            return
        whole = dequantize(torch.cat(self._gathered[0]), torch.cat(self._gathered[1]), self.bits, self.block)
        offset = 0
        for t in self.out:
            t.copy_(whole[offset : offset + t.numel()].view_as(t))
            offset += t.numel()
        self._works, self._done = [], True

    def _reduce_shard(self) -> Tensor:
        codes, scales = (t.chunk(self.world) for t in self._received)
        total = dequantize(codes[0], scales[0], self.bits, self.block)
        for c, s in zip(codes[1:], scales[1:], strict=True):  # in rank order: the same sum on every rank
            total = total + dequantize(c, s, self.bits, self.block)
        return total / self.world if self.mean else total


def start_gathers(works: Sequence[Any]) -> None:
    """Start the gather of every quantized reduction in ``works`` (waiting for its exchange first).

    Call it at the same step on every rank: collectives on a group must be issued in one order,
    so a rank may not start a gather when *it* sees the exchange finished while another rank
    issues some other collective on the group meanwhile. Other works are left alone.
    """
    for work in works:
        if isinstance(work, QuantizedWork):
            work.start_gather()


def gather_step(delay: int) -> int:
    """Steps after its launch at which an overlapped quantized reduction starts its gather.

    Halfway to the step that waits for it (the exchange and the gather send the same bytes), so
    both halves hide behind compute; with ``delay = 1`` the wait itself starts it.
    """
    return max(1, -(-delay // 2))


class QuantizedErrorFeedback:
    """Step 1 with error feedback: quantize ``x + e``, keep ``e <- (x + e) - deq(q)`` (module docstring).

    Args:
        like: The float32 tensors whose values are reduced (their layout: one flat payload).
        bits: 8 or 4.
        world: Ranks of the group (the payload is padded to ``world`` shards of whole blocks).
        block: Elements per scale.
    """

    def __init__(self, like: Sequence[Tensor], bits: int, world: int, block: int = DEFAULT_BLOCK) -> None:
        if bits not in QUANTIZED.values():
            raise ValueError(f"QuantizedErrorFeedback: `bits` must be one of {sorted(QUANTIZED.values())}, got {bits}.")
        self.bits, self.block = bits, block
        numel = sum(t.numel() for t in like)
        device = like[0].device if like else torch.device("cpu")
        self.residual = torch.zeros(padded_length(numel, world, block), device=device)

    @torch.no_grad()
    def launch(
        self, values: Sequence[Tensor], out: Sequence[Tensor], group: Group, stats: CommStats, mean: bool = False
    ) -> QuantizedWork:
        """Quantize ``values + e`` (``values`` untouched), keep the new ``e``, launch the reduction into ``out``."""
        x = self.residual
        flat = torch.cat([v.reshape(-1).float() for v in values])
        x[: flat.numel()].add_(flat)
        codes, scales = quantize(x, self.bits, self.block)
        x.sub_(dequantize(codes, scales, self.bits, self.block))  # what this rank's rounding left out
        return QuantizedWork(codes, scales, out, group, self.bits, self.block, mean, stats)

    def state_dict(self) -> dict[str, Tensor]:
        return {"residual": self.residual.clone()}

    def load_state_dict(self, state: dict[str, Tensor]) -> None:
        self.residual.copy_(state["residual"])
