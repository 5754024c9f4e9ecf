"""Asynchronous GRAWA in one process: the server's center by hand, and rounds against the replay."""

import threading

import pytest
import torch

from lightning_hier.algorithms.grawa_async import (
    REPORT,
    GrawaServerHandler,
    pack,
    unpack_into_,
)
from lightning_hier.algorithms.param_server import PULL, Request, ServerCore
from lightning_hier.comm import FlatTensors
from tests import grawa_async_reference as ref


def _meta(scores, lam, norm=1.0):
    return torch.tensor([*scores, lam, norm], dtype=torch.float64)


def test_pack_and_unpack_keep_every_bucket_and_dtype():
    buckets = [torch.arange(3.0), torch.arange(2, dtype=torch.float64), torch.arange(4.0) + 10]
    packed = pack(buckets)
    assert [t.dtype for t in packed] == [torch.float32, torch.float64] and packed[0].numel() == 7
    out = [torch.zeros_like(b) for b in buckets]
    unpack_into_(out, packed)
    assert all(torch.equal(a, b) for a, b in zip(out, buckets, strict=True))


def test_server_weights_the_reporters_and_records_each_pull():
    template = FlatTensors([torch.zeros(2), torch.zeros(1)])
    core = ServerCore(GrawaServerHandler(template, [0, 1, 2], "layer"), workers=[0, 1, 2], trace=True)
    x0, x1 = torch.tensor([1.0, 2.0, 3.0]), torch.tensor([5.0, 6.0, 7.0])
    # worker 0 alone: the center is its replica; its recorded replica is pulled toward it (no change)
    reply = core.serve(Request(0, REPORT, (_meta([1.0, 4.0], 0.5), x0), version=0))[0]
    assert torch.equal(reply.tensors[1], x0)
    # worker 1 (scores 3, 1 per tensor): weight tensor 0 = 1 / (1 + 3), tensor 1 = 4 / (4 + 1)
    reply = core.serve(Request(1, REPORT, (_meta([3.0, 1.0], 0.5, 2.0), x1), version=0))[1]
    expected = torch.tensor([0.25 * 1 + 0.75 * 5, 0.25 * 2 + 0.75 * 6, 0.8 * 3 + 0.2 * 7])
    torch.testing.assert_close(reply.tensors[1], expected, rtol=0, atol=1e-6)
    weights = reply.tensors[0][:6].reshape(3, 2)
    torch.testing.assert_close(weights, torch.tensor([[0.25, 0.8], [0.75, 0.2], [0.0, 0.0]], dtype=torch.float64))
    assert reply.tensors[0][6:].tolist() == [1.0, 2.0, 0.0]  # every worker's latest model norm
    # the server holds worker 1 as pulled: x1 + 0.5 (c - x1); a PULL changes nothing
    torch.testing.assert_close(core.handler.replicas[1][0], x1 + 0.5 * (expected - x1))
    pulled = core.serve(Request(2, PULL, (), version=0))[2]
    assert core.stats.applied == 2 and pulled.version == 2
    # worker 0 pulled at version 1: one report (worker 1's) came since, so its next one is 1 stale
    core.serve(Request(0, REPORT, (_meta([1.0, 4.0], 0.5), x0), version=1))
    assert core.trace == [(0, 0), (1, 1), (0, 1)]


def _simulate(order: list[int], workers: int, tau: int, steps: int, variant: str):
    """The library's pieces in one process: LibraryWorkers calling an in-process ServerCore."""
    ws = [ref.LibraryWorker(w, variant, tau) for w in range(workers)]
    core = ServerCore(GrawaServerHandler(ws[0].algo.flat, list(range(workers)), variant), list(range(workers)))
    lock, barrier = threading.Lock(), threading.Barrier(workers)
    versions = [0] * workers
    seen = []

    def link(w: int):
        def call(kind: int, payload):
            with lock:
                reply = core.serve(Request(w, kind, tuple(payload), versions[w]))[w]
            versions[w] = reply.version
            return reply.tensors

        return call

    for w in ws:
        w.policy.connect(link(w.worker), lambda: barrier.wait(timeout=10))
    for w in order:
        reports = [ws[w].step() for _ in range(tau)]
        assert reports[-1] is not None and all(r is None for r in reports[:-1])
        seen.append(reports[-1].weights)
    for w in ws:
        while w.done < steps:
            assert w.step() is None
    replicas = [w.replica() for w in ws]
    threads = [threading.Thread(target=w.algo.finalize) for w in ws]  # finalizing is collective: a barrier
    [t.start() for t in threads]
    [t.join(30) for t in threads]
    return {"replicas": replicas, "consensus": [w.replica() for w in ws], "weights": seen}


@pytest.mark.parametrize("variant", ["model", "layer"])
def test_in_process_rounds_match_the_hand_replay_of_the_same_order(variant):
    order = [0, 1, 0, 2, 2, 1, 0, 1, 2]
    got = _simulate(order, workers=3, tau=2, steps=7, variant=variant)
    want = ref.replay(order, workers=3, tau=2, steps=7, variant=variant)
    for a, b in zip(got["weights"], want["weights"][: len(order)], strict=True):  # then the final reports
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12)
    for mine, theirs in zip(got["replicas"], want["replicas"], strict=True):
        torch.testing.assert_close(mine, theirs, rtol=1e-9, atol=1e-12)
    for final in got["consensus"]:  # every worker ends with the server's center of the final replicas
        torch.testing.assert_close(final, want["consensus"], rtol=1e-9, atol=1e-12)
    # the arrival order matters (otherwise this test could not tell a wrong order from a right one)
    other = ref.replay([1, 0, 0, 2, 2, 1, 0, 1, 2], workers=3, tau=2, steps=7, variant=variant)
    assert not torch.allclose(other["consensus"][0], want["consensus"][0], rtol=1e-6)
