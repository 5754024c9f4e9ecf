"""The shared queue of samples (pure, scripted): disjoint claims covering each epoch once, server-side shares."""

import pytest
import torch

from lightning_hier.algorithms.claim_sampler import ClaimBatchSampler, ClaimQueue, ServerShares, claim_payload
from lightning_hier.algorithms.param_server import CLAIM, PUSH, Request, ServerCore
from lightning_hier.algorithms.ps_rules import AsgdHandler, FlatModel
from lightning_hier.algorithms.ps_service import Worker

N = 103  # not a multiple of any batch size below: the last claim gets a remainder


def _samplers(queue: ClaimQueue, sizes: list[int], drop_last: bool = False) -> list[ClaimBatchSampler]:
    def claim_of(worker: int):
        return lambda epoch, n, num: queue.claim(worker, epoch, n, num)

    return [
        ClaimBatchSampler(N, b, claim_of(w), shuffle=True, seed=7, drop_last=drop_last) for w, b in enumerate(sizes)
    ]


def _run_epoch(samplers: list[ClaimBatchSampler], script: list[int], epoch: int) -> list[list[int]]:
    """Draw batches in the scripted order of ranks (cycled) until every rank's epoch has ended."""
    for s in samplers:
        s.set_epoch(epoch)
    iters = [iter(s) for s in samplers]
    drawn: list[list[int]] = [[] for _ in samplers]
    live = set(range(len(samplers)))
    k = 0
    while live:
        r = script[k % len(script)]
        k += 1
        if r not in live:
            continue
        batch = next(iters[r], None)
        if batch is None:
            live.discard(r)
        else:
            drawn[r].extend(batch)
    return drawn


def test_claims_are_disjoint_and_cover_each_epoch_once():
    queue = ClaimQueue()
    samplers = _samplers(queue, [5, 5, 3])
    script = [0, 0, 0, 1, 1, 0, 2]  # rank 0 fastest, rank 2 slowest
    for epoch in range(3):
        drawn = _run_epoch(samplers, script, epoch)
        merged = [i for d in drawn for i in d]
        assert sorted(merged) == list(range(N)), epoch  # every sample exactly once across the ranks
        assert len(drawn[0]) > len(drawn[1]) > len(drawn[2])  # the scripted speeds decide who trains what
        order = torch.randperm(N, generator=torch.Generator().manual_seed(7 + epoch)).tolist()
        assert sorted(merged, key=order.index) == order  # the same per-epoch permutation as DistributedSampler's


def test_drop_last_skips_only_the_short_remainder():
    queue = ClaimQueue()
    drawn = _run_epoch(_samplers(queue, [10, 10], drop_last=True), [0, 1], 0)
    merged = [i for d in drawn for i in d]
    assert len(merged) == 100 and len(set(merged)) == 100  # 10 full claims; the last 3 samples skipped


def test_a_resumed_epoch_that_the_server_used_up_goes_on_with_the_next():
    queue = ClaimQueue()
    (sampler,) = _samplers(queue, [10])
    assert len(_run_epoch([sampler], [0], 0)[0]) == N
    sampler.resume_at(0, 11)  # a checkpoint written at the end of epoch 0
    batches = list(sampler)
    assert sum(len(b) for b in batches) == N and queue.cursors[1] == N and sampler.epoch == 1


def test_an_epoch_claimed_with_two_dataset_sizes_is_an_error():
    queue = ClaimQueue()
    queue.claim(0, 0, 4, N)
    with pytest.raises(ValueError, match="same dataset"):
        queue.claim(1, 0, 4, N + 1)
    with pytest.raises(ValueError, match="n >= 1"):
        queue.claim(1, 0, 0, N)  # n = 0 asks for the server's share: this queue has none


def test_server_shares_follow_the_reported_speeds():
    shares = ServerShares(global_batch=120, workers=[0, 1, 2], min_batch_size=2)
    queue = ClaimQueue(shares)

    def size(worker: int, speed: float) -> int:
        (reply,) = queue.answer(Request(worker, CLAIM, (claim_payload(0, 0, 10**6, speed),)))
        return int(reply[1])

    assert [size(w, 0.0) for w in range(3)] == [40, 40, 40]  # nothing measured: the equal split
    assert size(0, 400.0) == 40 and size(1, 400.0) == 40  # not every worker has reported yet
    assert size(2, 100.0) == 13  # 120 * 100 / 900, largest remainder
    assert [size(w, 0.0) for w in range(3)] == [54, 53, 13]  # 0 keeps the last speed reported
    assert size(2, 1.0) == 2  # the lower bound
    assert shares.sizes == [59, 59, 2] and shares.rebalances == 2


def test_a_claim_changes_neither_the_version_nor_the_staleness_of_the_next_push():
    model = FlatModel([torch.zeros(3)], lr=1.0)
    core = ServerCore(AsgdHandler(model), workers=[0, 1], claims=ClaimQueue())

    class Direct:
        def request(self, request):
            return core.serve(request)[request.worker]

    w0, w1 = Worker(0, Direct()), Worker(1, Direct())
    w0.pull(), w1.pull()
    w0.call(PUSH, [torch.ones(3)])  # version 1
    (reply,) = w1.claim([claim_payload(0, 4, N)])
    assert reply.tolist() == [0, 4] and w1.version == 0 and core.version == 1
    w1.call(PUSH, [torch.ones(3)])
    assert core.trace is None and core.stats.histogram == {0: 1, 1: 1}  # w1's push is 1 update stale
    assert core.state_dict()["claims"]["cursors"] == {0: 4}
