"""The decoupled pipeline engine under real gloo groups, against single-process references.

Plain torch (no Lightning): each rank runs its stage of an N x K grid; every stage's parameters
after every iteration are compared with :mod:`tests.pipeline_reference`.
"""

import pytest
import torch
import torch.distributed as dist
from torch import nn

from lightning_hier.algorithms.decoupled import DecoupledPipeline, stage_ranges
from lightning_hier.testing import run_workers
from lightning_hier.topology import Topology
from tests.pipeline_reference import flat, forward_lag, simulate, staleness, update_lag

ROWS = 4
SPLITS = {1: [], 2: [2], 3: [1, 3], 4: [1, 2, 3]}


def _blocks(batchnorm: bool = False) -> list[nn.Module]:
    torch.manual_seed(0)
    # autograd saves BatchNorm's running statistics, which later forwards update in place
    norm = [nn.BatchNorm1d(8)] if batchnorm else []
    return [
        nn.Sequential(nn.Flatten(), nn.Linear(6, 8), nn.ReLU()),
        nn.Sequential(nn.Linear(8, 8), *norm, nn.ReLU()),
        nn.Sequential(nn.Linear(8, 8), nn.Tanh()),
        nn.Linear(8, 3),
    ]


def _stages(num_stages: int, batchnorm: bool = False) -> list[nn.Module]:
    blocks = _blocks(batchnorm)
    return [nn.Sequential(*[blocks[i] for i in r]) for r in stage_ranges(SPLITS[num_stages], len(blocks))]


def _optimizer(module: nn.Module) -> torch.optim.Optimizer:
    # weight decay and momentum would move weights if a stage stepped before its first gradient
    return torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.9, weight_decay=0.01)


def _epochs(replica: int, batches: tuple[int, ...]) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    g = torch.Generator().manual_seed(10 + replica)
    return [
        [(torch.randn(ROWS, 2, 3, generator=g), torch.randint(0, 3, (ROWS,), generator=g)) for _ in range(t)]
        for t in batches
    ]


def _concatenated(replicas: int, batches: tuple[int, ...]) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    shards = [_epochs(d, batches) for d in range(replicas)]
    return [
        [(torch.cat([s[e][i][0] for s in shards]), torch.cat([s[e][i][1] for s in shards])) for i in range(t)]
        for e, t in enumerate(batches)
    ]


def _run_stage(
    num_stages: int,
    schedule: str,
    weights: str,
    beta: float,
    batches: tuple[int, ...],
    batchnorm: bool = False,
    order: str = "forward_first",
    wire_dtype: torch.dtype | None = None,
    two_groups: bool = False,
) -> dict:
    dist.init_process_group("gloo")
    topo = Topology(dist.get_world_size(), pipe=num_stages)
    rank = dist.get_rank()
    groups = topo.build(rank)
    # as the strategy does: the gradients on a second group, a TCP connection per direction
    pipe_group = (groups.pipe, topo.build_second_group("pipe", rank)) if two_groups else groups.pipe
    k, d = topo.coords(rank).pipe, topo.coords(rank).data
    stage = _stages(num_stages, batchnorm)[k]
    optimizer = _optimizer(stage)
    pipe = DecoupledPipeline(
        stage,
        stage_index=k,
        stage_ranks=topo.group_ranks("pipe", rank),
        pipe_group=pipe_group,
        data_group=groups.data,
        schedule=schedule,
        weights=weights,
        beta=beta,
        order=order,
        wire_dtype=wire_dtype,
    )
    reports: list = []
    offset = 0  # iterations of the epochs before this one (the engine counts from 0 in each)
    updated = {-1: flat(stage)}  # parameters change only in apply(): record them by iteration

    def apply() -> None:
        optimizer.step()
        updated[offset + pipe.iteration] = flat(stage)

    for batches_of_epoch in _epochs(d, batches):
        reports += [pipe.step(batch, apply) for batch in batches_of_epoch]
        reports += pipe.drain(apply)
        assert not pipe.fifo and not pipe.in_flight
        offset = len(reports)
    params = [updated[max(i for i in updated if i <= t)] for t in range(len(reports))]
    connections = len({id(mail.group) for mail in pipe.mailboxes})
    return {"stage": k, "params": params, "reports": reports, "bytes": pipe.stats.bytes, "connections": connections}


CASES = [
    # (K, N, schedule, weights, beta, batches per epoch); sync and more N x K grids run under Lightning
    (2, 1, "fdg", "stash", 1.0, (5, 3)),
    (4, 1, "fdg", "stash", 0.5, (7,)),
    (4, 1, "ddg", "stash", 1.0, (7,)),
    (3, 1, "fdg", "recompute", 1.0, (5,)),
    (2, 2, "ddg", "recompute", 0.7, (3,)),
]


@pytest.mark.parametrize(("num_stages", "replicas", "schedule", "weights", "beta", "batches"), CASES)
def test_every_stage_follows_the_stale_gradient_rule(num_stages, replicas, schedule, weights, beta, batches):
    bn = replicas == 1  # with replicas, BatchNorm's batch statistics differ from the concatenated batch's
    out = run_workers(_run_stage, num_stages, schedule, weights, beta, batches, bn, devices=num_stages * replicas)
    # N replicas = one replica on the concatenated batch (the mean of the replicas' gradients)
    stages = _stages(num_stages, bn)
    expected = simulate(stages, _concatenated(replicas, batches), schedule, _optimizer, weights, beta)
    for rank, o in enumerate(out):
        k = o["stage"]
        assert len(o["params"]) == len(expected[k])
        for t, (got, want) in enumerate(zip(o["params"], expected[k], strict=True)):
            torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5, msg=f"rank {rank} stage {k} iteration {t}")


TWO_GROUPS = [("fdg", "forward_first"), ("fdg", "backward_first"), ("sync", "forward_first")]


@pytest.mark.parametrize(("schedule", "order"), TWO_GROUPS)
def test_activations_and_gradients_on_two_groups_follow_the_same_rule(schedule, order):
    out = run_workers(_run_stage, 3, schedule, "stash", 1.0, (5,), False, order, None, True, devices=3)
    expected = simulate(_stages(3), _concatenated(1, (5,)), schedule, _optimizer, "stash", 1.0, order=order)
    for o in out:
        assert o["connections"] == 2
        for t, (got, want) in enumerate(zip(o["params"], expected[o["stage"]], strict=True)):
            torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5, msg=f"stage {o['stage']} iteration {t}")


@pytest.mark.parametrize("num_stages", [3])  # K = 2 and 4: under Lightning
def test_sync_schedule_equals_plain_backprop(num_stages):
    from tests.pipeline_reference import plain_backprop

    out = run_workers(_run_stage, num_stages, "sync", "legacy", 1.0, (6,), devices=num_stages)
    whole = nn.Sequential(*_blocks())
    reference = plain_backprop(whole, _epochs(0, (6,)), _optimizer)
    for t, want in enumerate(reference):
        got = torch.cat([o["params"][t] for o in out])
        assert torch.equal(got, want), f"step {t}"


@pytest.mark.parametrize(("num_stages", "schedule"), [(4, "fdg"), (3, "ddg")])
def test_index_invariants(num_stages, schedule):
    epochs = (7, 5)  # not divisible by K; each epoch drains
    out = run_workers(_run_stage, num_stages, schedule, "stash", 1.0, epochs, devices=num_stages)
    drain = update_lag(schedule, 0, num_stages)
    for o in out:
        k = o["stage"]
        lag, tau = forward_lag(schedule, k), staleness(schedule, k, num_stages)
        reports = iter(o["reports"])
        for batches in epochs:
            for t in range(batches + drain):
                r = next(reports)
                assert r.iteration == t
                fwd, applied = t - lag, t - lag - tau
                assert r.forwarded == (fwd if 0 <= fwd < batches else None), (k, t)
                # stage k applies at iteration t the gradient of batch t - lag - tau_k
                assert r.applied == (applied if 0 <= applied < batches else None), (k, t)
                # FIFO: forwarded but not yet applied (the last stage applies at once)
                assert r.in_flight == max(0, min(fwd + 1, batches)) - max(0, min(applied + 1, batches)), (k, t)
            first_gradient = lag + tau
            assert o["reports"][first_gradient].applied == 0  # no update before the first gradient
            assert r.in_flight == 0  # empty after the drain
        assert next(reports, None) is None


def test_staleness_table():
    # fdg 2(K-1-k), ddg K-1-k, sync 0 (the spec's table), here via the engine's own schedule object
    from lightning_hier.algorithms.decoupled import Schedule

    for k in range(4):
        assert Schedule("fdg", 4).staleness(k) == 2 * (3 - k)
        assert Schedule("ddg", 4).staleness(k) == 3 - k
        assert Schedule("sync", 4).staleness(k) == 0
    assert Schedule("fdg", 4).drain_iterations == 6
    assert Schedule("ddg", 4).drain_iterations == 3


def _beta_scaling(beta: float) -> dict:
    """One sync step with plain SGD: the update of stage k is -lr * beta^(K-1-k) * grad."""
    dist.init_process_group("gloo")
    k = dist.get_rank()
    stage = _stages(4)[k]
    before = flat(stage)
    optimizer = torch.optim.SGD(stage.parameters(), lr=1.0)
    pipe = DecoupledPipeline(
        stage, stage_index=k, stage_ranks=[0, 1, 2, 3], pipe_group=dist.group.WORLD, schedule="sync", beta=beta
    )
    pipe.step(_epochs(0, (1,))[0][0], optimizer.step)
    return {"stage": k, "update": before - flat(stage)}


def test_beta_scales_stage_k_by_beta_to_the_k_to_last_hops():
    beta = 0.5
    out = run_workers(_beta_scaling, beta, devices=4)
    whole = nn.Sequential(*_blocks())
    x, y = _epochs(0, (1,))[0][0]
    torch.nn.functional.cross_entropy(whole(x), y).backward()
    stages = [list(range(0, 1)), [1], [2], [3]]
    for o in out:
        k = o["stage"]
        grad = torch.cat([p.grad.reshape(-1) for i in stages[k] for p in whole[i].parameters()])
        torch.testing.assert_close(o["update"], beta ** (3 - k) * grad, atol=1e-7, rtol=1e-6)


def _eval_forward() -> dict:
    dist.init_process_group("gloo")
    k = dist.get_rank()
    stage = _stages(2, batchnorm=True)[k]
    pipe = DecoupledPipeline(stage, stage_index=k, stage_ranks=[0, 1], pipe_group=dist.group.WORLD)
    x = torch.randn(5, 2, 3, generator=torch.Generator().manual_seed(3))
    stage.eval()
    with torch.inference_mode():
        a = pipe.forward_eval(x)
        b = pipe.forward_eval(x[:2])  # another shape reuses/grows the buffers
    return {"a": a, "b": b, "fifo": len(pipe.fifo), "iteration": pipe.iteration}


def test_evaluation_forward_gives_every_stage_the_whole_models_output():
    out = run_workers(_eval_forward, devices=2)
    whole = nn.Sequential(*_blocks(batchnorm=True)).eval()
    x = torch.randn(5, 2, 3, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = whole(x)
    for o in out:
        torch.testing.assert_close(o["a"], want)
        torch.testing.assert_close(o["b"], want[:2])
        assert o["fifo"] == 0 and o["iteration"] == 0  # no state change


@pytest.mark.parametrize(("num_stages", "beta", "batches"), [(2, 1.0, (5, 3)), (3, 0.5, (6,))])
def test_fdg_order_follows_the_fdg_codes_loop(num_stages, beta, batches):
    """order='backward_first': every stage's parameters after every iteration, as FDG's training loop gives them."""
    from tests.pipeline_reference import fdg_loop

    out = run_workers(_run_stage, num_stages, "fdg", "stash", beta, batches, order="backward_first", devices=num_stages)
    expected = fdg_loop(_stages(num_stages), _epochs(0, batches), _optimizer, beta)
    for o in out:
        k = o["stage"]
        assert len(o["params"]) == len(expected[k])
        for t, (got, want) in enumerate(zip(o["params"], expected[k], strict=True)):
            torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5, msg=f"stage {k} iteration {t}")


def test_bf16_on_the_wire_rounds_only_what_crosses_a_cut_and_halves_its_bytes():
    batches = (5,)
    plain = run_workers(_run_stage, 2, "fdg", "stash", 1.0, batches, devices=2)
    bf16 = run_workers(_run_stage, 2, "fdg", "stash", 1.0, batches, wire_dtype=torch.bfloat16, devices=2)
    # the stages compute in float32 on bf16-rounded activations and activation gradients
    expected = simulate(_stages(2), _epochs(0, batches), "fdg", _optimizer, wire="bf16")
    unrounded = simulate(_stages(2), _epochs(0, batches), "fdg", _optimizer)
    for o in bf16:
        k = o["stage"]
        for t, (got, want) in enumerate(zip(o["params"], expected[k], strict=True)):
            torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5, msg=f"stage {k} iteration {t}")
    assert not torch.allclose(bf16[0]["params"][-1], unrounded[0][-1], atol=1e-6, rtol=1e-5)
    # one message per batch and direction (none in the fill's and the drain's iterations without one),
    # of the link's buffer size; its 4 x 8 floats take 2 bytes, not 4
    assert len(plain[0]["reports"]) == sum(batches) + 2
    assert plain[0]["bytes"] - bf16[0]["bytes"] == sum(batches) * ROWS * 8 * 2  # activations
    assert plain[1]["bytes"] - bf16[1]["bytes"] == sum(batches) * ROWS * 8 * 2  # gradients


def test_wire_dtype_other_than_bf16_is_rejected():
    with pytest.raises(ValueError, match=r"`wire_dtype` must be one of None, torch\.bfloat16, got torch\.float16"):
        DecoupledPipeline(nn.Linear(2, 2), stage_index=0, stage_ranks=[0], wire_dtype=torch.float16)


def _eval_mid_epoch() -> dict:
    """Evaluation forwards between training iterations, while training's receives are posted."""
    dist.init_process_group("gloo")
    k = dist.get_rank()
    stage = _stages(2)[k]
    optimizer = _optimizer(stage)
    pipe = DecoupledPipeline(stage, stage_index=k, stage_ranks=[0, 1], pipe_group=dist.group.WORLD)
    x = torch.randn(5, 2, 3, generator=torch.Generator().manual_seed(3))
    evals, weights = [], []
    for batch in _epochs(0, (5,))[0]:
        pipe.step(batch, optimizer.step)
        with torch.no_grad():
            evals.append(pipe.forward_eval(x))
        weights.append({n: p.detach().clone() for n, p in stage.named_parameters()})
    pipe.drain(optimizer.step)
    return {"stage": k, "evals": evals, "weights": weights, "final": flat(stage)}


def test_evaluation_between_iterations_sees_the_current_stages_and_leaves_training_exact():
    out = run_workers(_eval_mid_epoch, devices=2)
    expected = simulate(_stages(2), _epochs(0, (5,)), "fdg", _optimizer)
    stages = _stages(2)
    x = torch.randn(5, 2, 3, generator=torch.Generator().manual_seed(3))
    for t in range(5):
        with torch.no_grad():
            hidden = torch.func.functional_call(stages[0], out[0]["weights"][t], (x,))
            want = torch.func.functional_call(stages[1], out[1]["weights"][t], (hidden,))
        for o in out:
            torch.testing.assert_close(o["evals"][t], want, msg=f"iteration {t}")
    for o in out:
        torch.testing.assert_close(o["final"], expected[o["stage"]][-1], atol=1e-6, rtol=1e-5)
