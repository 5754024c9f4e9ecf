"""The parameter server's core and update rules, request by request, against hand computations."""

import pytest
import torch

from lightning_hier.algorithms.param_server import DONE, PULL, PUSH, Request, ServerCore
from lightning_hier.algorithms.ps_rules import AsgdHandler, FlatModel, SoftsyncHandler

W0 = [torch.tensor([1.0, -2.0]), torch.tensor([[0.5]])]


def _push(worker: int, grad: list[float], version: int, batch: int = 0) -> Request:
    return Request(worker, PUSH, (torch.tensor(grad),), version=version, batch_size=batch)


def test_one_worker_asgd_is_plain_sgd_with_the_users_optimizer():
    def nesterov(ps):
        return torch.optim.SGD(ps, lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.01)

    core = ServerCore(AsgdHandler(FlatModel(W0, nesterov)), workers=[0])
    ref = [p.clone().requires_grad_(False) for p in W0]
    opt = nesterov(ref)
    for i in range(5):
        g = torch.tensor([0.3 * i, -1.0, 2.0 - i])
        reply = core.serve(_push(0, g.tolist(), version=core.version))[0]
        ref[0].grad, ref[1].grad = g[:2].clone(), g[2:].view(1, 1).clone()
        opt.step()
        assert torch.equal(reply.tensors[0], torch.cat([r.reshape(-1) for r in ref]))
        assert reply.version == i + 1
    assert core.stats.histogram == {0: 5}


def test_asgd_staleness_and_staleness_aware_lr():
    core = ServerCore(AsgdHandler(FlatModel([torch.zeros(1)], lr=1.0), staleness_lr=True), workers=[0, 1], trace=True)
    assert core.serve(Request(0, PULL))[0].tensors[0].item() == 0.0
    core.serve(Request(1, PULL))
    core.serve(_push(0, [1.0], version=0))  # staleness 0: full step, w = -1
    core.serve(_push(1, [1.0], version=0))  # staleness 1: full step (lr / max(1, s)), w = -2
    core.serve(_push(0, [1.0], version=1))  # staleness 1, w = -3
    out = core.serve(_push(1, [3.0], version=0))  # staleness 3: step 3 / 3, w = -4
    assert out[1].tensors[0].item() == pytest.approx(-4.0) and out[1].version == 4
    assert core.trace == [(0, 0), (1, 1), (0, 1), (1, 3)]
    assert core.stats.mean_staleness == pytest.approx(5 / 4) and core.stats.max_staleness == 3


def test_per_worker_staleness_of_a_scripted_arrival_order_with_one_slow_worker():
    # workers 0 and 1 push four times while the slow worker 2 pushes once (speeds 1, 1, 1/4)
    core = ServerCore(AsgdHandler(FlatModel([torch.zeros(1)], lr=1.0)), workers=[0, 1, 2], trace=True)
    pulled = {w: core.serve(Request(w, PULL))[w].version for w in range(3)}
    for w in [0, 1, 0, 1, 0, 1, 0, 1, 2]:
        pulled[w] = core.serve(_push(w, [1.0], pulled[w]))[w].version
    # by hand: w0 pulled v0, pushes at v0, v2, v4, v6 having pulled v0, v1, v3, v5: 0, 1, 1, 1;
    # w1 at v1, v3, v5, v7 having pulled v0, v2, v4, v6: 1, 1, 1, 1; w2 at v8 having pulled v0: 8
    assert core.trace == [(0, 0), (1, 1), (0, 1), (1, 1), (0, 1), (1, 1), (0, 1), (1, 1), (2, 8)]
    stats = core.stats
    assert [stats.workers[w].mean_staleness() for w in range(3)] == [0.75, 1.0, 8.0]
    assert stats.worker_mean_staleness == pytest.approx((0.75 + 1.0 + 8.0) / 3)  # 3.25
    assert stats.mean_staleness == pytest.approx(15 / 9)  # per gradient: the slow worker's one push weighs 1/9
    summary = stats.summary()
    assert summary["ps/staleness_worker_mean"] == pytest.approx(3.25) and summary["ps/worker2/staleness_mean"] == 8.0
    restored = ServerCore(AsgdHandler(FlatModel([torch.zeros(1)], lr=1.0)), workers=[0, 1, 2])
    restored.load_state_dict(core.state_dict())
    assert restored.stats.worker_mean_staleness == pytest.approx(3.25)


def test_softsync_n1_is_synchronous_sgd_on_the_concatenated_batches():
    workers = [0, 1, 2]
    core = ServerCore(SoftsyncHandler(FlatModel([torch.zeros(2)], lr=0.5), workers=3, n=1), workers)
    grads = {0: [1.0, 0.0], 1: [0.0, 3.0], 2: [2.0, 3.0]}
    sizes = {0: 2, 1: 1, 2: 1}  # the average weighs by batch size: the gradient of the concatenated batch
    assert core.serve(_push(0, grads[0], 0, sizes[0])) == {}
    assert core.serve(_push(1, grads[1], 0, sizes[1])) == {}
    replies = core.serve(_push(2, grads[2], 0, sizes[2]))
    mean = (2 * torch.tensor(grads[0]) + torch.tensor(grads[1]) + torch.tensor(grads[2])) / 4
    assert sorted(replies) == workers
    for r in replies.values():
        assert torch.equal(r.tensors[0], -0.5 * mean) and r.version == 1
    assert core.stats.histogram == {0: 3} and core.stats.updates == 1


def test_softsync_over_pre_weighted_gradients_takes_the_plain_mean_whatever_the_batch_sizes():
    # DBS-SGD on the n-softsync server: each push is already W * b / B times its rank's mean gradient
    core = ServerCore(
        SoftsyncHandler(FlatModel([torch.zeros(1)], lr=1.0), workers=3, n=2, by_batch_size=False), [0, 1, 2]
    )
    core.serve(_push(0, [3.0], 0, 90))
    core.serve(_push(1, [1.0], 0, 10))  # weighted by size it would be (270 + 10) / 100 = 2.8
    assert core.handler.model.flat.item() == pytest.approx(-2.0)  # type: ignore[attr-defined]


def test_softsync_groups_of_ceil_w_over_n_reply_at_once_and_the_last_group_is_flushed_at_the_end():
    core = ServerCore(SoftsyncHandler(FlatModel([torch.zeros(1)], lr=1.0), workers=3, n=2), [0, 1, 2], trace=True)
    first = core.serve(_push(0, [1.0], 0))
    assert first[0].tensors[0].item() == 0.0 and first[0].version == 0  # at once, not applied yet
    second = core.serve(_push(1, [3.0], 0))  # a group of ceil(3 / 2) = 2: the mean is applied
    assert second[1].tensors[0].item() == pytest.approx(-2.0) and second[1].version == 1
    assert core.serve(_push(2, [5.0], 0))[2].version == 1  # alone in its group: pending
    for w in (0, 1, 2):
        assert core.serve(Request(w, DONE)) == {}
    assert core.finished and core.version == 2 and core.stats.applied == 3
    assert core.handler.model.flat.item() == pytest.approx(-2.0 - 5.0)  # type: ignore[attr-defined]
    assert core.trace == [(0, 0), (1, 0), (2, 1)]


def test_blocking_softsync_flushes_when_every_worker_still_training_waits():
    core = ServerCore(SoftsyncHandler(FlatModel([torch.zeros(1)], lr=1.0), workers=3, n=1), [0, 1, 2])
    assert core.serve(_push(0, [1.0], 0)) == {}
    assert core.serve(_push(1, [3.0], 0)) == {}
    replies = core.serve(Request(2, DONE))  # worker 2 ends: 0 and 1 are all that train, and both wait
    assert sorted(replies) == [0, 1] and replies[0].tensors[0].item() == pytest.approx(-2.0)


def test_every_push_is_applied_exactly_once_and_counted():
    core = ServerCore(SoftsyncHandler(FlatModel([torch.zeros(1)], lr=1.0), workers=4, n=3), [0, 1, 2, 3])
    gen = torch.Generator().manual_seed(0)
    waiting: set[int] = set()
    pushes = dict.fromkeys(range(4), 0)
    total = 0.0
    while sum(pushes.values()) < 40:
        free = [w for w in range(4) if w not in waiting]
        w = free[int(torch.randint(len(free), (1,), generator=gen))]
        g = float(torch.randint(1, 10, (1,), generator=gen))
        total += g
        pushes[w] += 1
        waiting.add(w)
        waiting -= set(core.serve(_push(w, [g], core.version)))
    for w in range(4):
        waiting -= set(core.serve(Request(w, DONE)))
    assert not waiting and core.finished
    assert {w: s.applied for w, s in core.stats.workers.items()} == pushes
    assert {w: s.pushes for w, s in core.stats.workers.items()} == pushes
    # every gradient entered one average exactly once: the sum of steps is the weighted sum of gradients
    assert core.stats.applied == 40


def test_requests_out_of_protocol_are_rejected():
    core = ServerCore(SoftsyncHandler(FlatModel([torch.zeros(1)]), workers=2, n=1), [0, 1])
    core.serve(_push(0, [1.0], 0))
    with pytest.raises(ValueError, match="worker 0, which is waiting"):
        core.serve(_push(0, [1.0], 0))
    with pytest.raises(ValueError, match="worker 5, which is unknown"):
        core.serve(Request(5, PULL))
    with pytest.raises(ValueError, match="ServerCore: `workers`"):
        ServerCore(AsgdHandler(FlatModel([torch.zeros(1)])), [0, 0])
    with pytest.raises(ValueError, match=r"`n` must be in \[1, 2\].*got 3"):
        SoftsyncHandler(FlatModel([torch.zeros(1)]), workers=2, n=3)


def test_state_dict_round_trip():
    def adamw(ps):
        return torch.optim.AdamW(ps, lr=0.01)

    a = ServerCore(AsgdHandler(FlatModel(W0, adamw)), [0, 1])
    for i in range(3):
        a.serve(_push(i % 2, [1.0, 2.0, float(i)], version=max(0, a.version - 1)))
    b = ServerCore(AsgdHandler(FlatModel([torch.zeros(2), torch.zeros(1, 1)], adamw)), [0, 1])
    b.load_state_dict(a.state_dict())
    ra = a.serve(_push(0, [0.5, 0.5, 0.5], 3))[0]
    rb = b.serve(_push(0, [0.5, 0.5, 0.5], 3))[0]
    assert torch.equal(ra.tensors[0], rb.tensors[0]) and ra.version == rb.version == 4
    assert a.stats.histogram == b.stats.histogram


@pytest.mark.parametrize(
    "make",
    [
        lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, nesterov=True, weight_decay=1e-4),
        lambda ps: torch.optim.Adam(ps, lr=1e-3, betas=(0.8, 0.9)),
        lambda ps: torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.05),
        lambda ps: torch.optim.NAdam(ps, lr=2e-3, decoupled_weight_decay=True),
        lambda ps: torch.optim.RAdam(ps, lr=2e-3),
        lambda ps: torch.optim.RMSprop(ps, lr=1e-2, momentum=0.5),
        lambda ps: torch.optim.Adagrad(ps, lr=1e-2),
    ],
    ids=["sgd-nesterov", "adam", "adamw", "nadam", "radam", "rmsprop", "adagrad"],
)
def test_the_servers_copy_of_the_users_optimizer_has_its_class_and_hyperparameters(make):
    from lightning_hier.sync.ps_adapter import copy_optimizer

    module = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Linear(2, 1))
    first, second = list(module[0].parameters()), list(module[1].parameters())
    user = make([{"params": first}, {"params": second, "lr": 5e-4}])
    server_params = [torch.nn.Parameter(p.detach().clone()) for p in module.parameters()]
    copy = copy_optimizer(user, module)(server_params)
    assert type(copy) is type(user)
    for mine, theirs in zip(copy.param_groups, user.param_groups, strict=True):
        assert {k: v for k, v in mine.items() if k != "params"} == {k: v for k, v in theirs.items() if k != "params"}
    assert [[id(p) for p in g["params"]] for g in copy.param_groups] == [
        [id(p) for p in server_params[:2]],
        [id(p) for p in server_params[2:]],
    ]
