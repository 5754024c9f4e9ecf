"""HPSGD in one process: the recurrence for one worker, checkpoints, consensus, arguments, registry."""

import lightning.pytorch as pl
import pytest
import torch
from torch import nn

from lightning_hier import HPSGDStrategy
from lightning_hier.algorithms import HPSGD, float_buffers
from lightning_hier.algorithms.hpsgd import auto_delay
from tests.hpsgd_reference import Reference, fixed_merge_steps, params_of

STEPS = 10


@pytest.fixture(autouse=True)
def _one_thread():
    # tiny tensors: on a loaded machine a thread pool only adds contention (20x slower here)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.Tanh(), nn.Linear(6, 2))


def _batch(worker: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(8, 4, generator=g), torch.randn(8, 2, generator=g)


def _loss(module: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return nn.functional.mse_loss(module(batch[0]), batch[1])


def _opt(module: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.9)


def _train_step(net: nn.Module, opt: torch.optim.Optimizer, step: int) -> None:
    opt.zero_grad()
    _loss(net, _batch(0, step)).backward()
    opt.step()


def _algo(net: nn.Module, opt: torch.optim.Optimizer, window: int = 3, **kw) -> HPSGD:
    return HPSGD(net.parameters(), None, window, buffers=float_buffers(net), bucket_bytes=64, optimizer=opt, **kw)


VARIANTS = [
    {"merge": "paper"},
    {"merge": "eager"},
    {"merge": "eager", "outer_lr": 0.7, "outer_momentum": 0.9},
    {"merge": "paper", "outer_lr": 0.5},
    {"merge": "eager", "compression": "bf16"},
    {"merge": "paper", "compression": "bf16", "outer_momentum": 0.5},
]


def _reference_args(variant: dict) -> dict:
    out = {k: v for k, v in variant.items() if k != "compression"}
    return {**out, "bf16": variant.get("compression") == "bf16"}


def _history(window: int, **variant: object) -> list[torch.Tensor]:
    """One worker's S after every merge, then its parameters after finalize."""
    net = _net()
    opt = _opt(net)
    algo = _algo(net, opt, window, **variant)
    history = []
    for step in range(STEPS):
        _train_step(net, opt, step)
        if algo.step() is not None:
            history.append(torch.cat([t.reshape(-1) for t in algo.global_tensors()]).clone())
    algo.finalize()
    return [*history, params_of(net)]


def _assert_same_history(history: list[torch.Tensor], expected: list[torch.Tensor]) -> None:
    assert len(history) == len(expected)
    for a, b in zip(history, expected, strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0)


@pytest.mark.parametrize("window", [1, 3])
@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: "-".join(f"{k}={x}" for k, x in v.items()))
def test_single_worker_follows_the_recurrence(window, variant):
    reference = Reference(_net, _opt, _loss, 1, **_reference_args(variant))
    expected = reference.run(_batch, STEPS, fixed_merge_steps(window, STEPS))
    _assert_same_history(_history(window, **variant), expected)


def _run(stop: int | None = None, state: dict | None = None, inside_consensus: bool = False, **variant) -> tuple:
    """Train STEPS steps; optionally snapshot everything after ``stop`` steps, or start from ``state``."""
    net = _net()
    opt = _opt(net)
    algo = _algo(net, opt, **variant)
    first = 0
    if state is not None:
        net.load_state_dict(state["net"])
        opt.load_state_dict(state["opt"])
        algo.load_state_dict(state["algo"])
        first = state["step"]
    for step in range(first, STEPS):
        _train_step(net, opt, step)
        algo.step()
        if step + 1 == stop:
            with algo.consensus() if inside_consensus else _nothing():
                snapshot = {
                    "net": {k: v.clone() for k, v in net.state_dict().items()},
                    "opt": _clone(opt.state_dict()),
                    "algo": _clone(algo.state_dict()),
                    "step": stop,
                }
            return snapshot, None
    algo.finalize()
    return None, [t.clone() for t in net.state_dict().values()]


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *args: object) -> None:
        return None


def _clone(state):
    if isinstance(state, torch.Tensor):
        return state.clone()
    if isinstance(state, dict):
        return {k: _clone(v) for k, v in state.items()}
    if isinstance(state, list):
        return [_clone(v) for v in state]
    return state


@pytest.mark.parametrize("stop", range(1, STEPS))  # the first window, a merge step (k = 0), mid-window
@pytest.mark.parametrize("inside_consensus", [False, True])
def test_state_dict_round_trip_continues_bit_identically(stop, inside_consensus):
    _, straight = _run(merge="paper")
    snapshot, _ = _run(stop=stop, inside_consensus=inside_consensus, merge="paper")
    _, resumed = _run(state=snapshot, merge="paper")
    assert all(torch.equal(a, b) for a, b in zip(straight, resumed, strict=True))
    assert ("window_start" in snapshot["algo"]) == (stop < 4)  # V differs from S only in the first window
    assert ("replica" in snapshot["algo"]) == inside_consensus


@pytest.mark.parametrize("stop", [1, 4, 6])
@pytest.mark.parametrize("variant", VARIANTS[1:], ids=lambda v: "-".join(f"{k}={x}" for k, x in v.items()))
def test_round_trip_keeps_window_start_outer_momentum_and_residual(stop, variant):
    _, straight = _run(**variant)
    snapshot, _ = _run(stop=stop, **variant)
    _, resumed = _run(state=snapshot, **variant)
    assert all(torch.equal(a, b) for a, b in zip(straight, resumed, strict=True))
    assert ("outer_momentum" in snapshot["algo"]) == (variant.get("outer_momentum", 0) > 0 and stop >= 4)
    assert ("residual" in snapshot["algo"]) == (variant.get("compression") == "bf16")


def test_a_checkpoint_of_another_merge_rule_is_rejected():
    snapshot, _ = _run(stop=5, merge="paper")
    with pytest.raises(ValueError, match="written with merge='paper', this run uses merge='eager'"):
        _run(state=snapshot, merge="eager")


@pytest.mark.parametrize("steps", [0, 1, 3, 4, 5])  # before training, first window, mid-window, at a merge
@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: "-".join(f"{k}={x}" for k, x in v.items()))
def test_consensus_holds_the_global_model_of_the_next_merge_and_restores_everything(steps, variant):
    # the window in flight after ``steps`` steps is what the next merge (window 3: steps 4, 7,
    # 10) adds to S, so the consensus then equals S right after that merge, buffers included
    net = _net()
    opt = _opt(net)
    algo = _algo(net, opt, **variant)
    for step in range(steps):
        _train_step(net, opt, step)
        algo.step()
    before = [t.clone() for t in net.state_dict().values()]
    state = algo.state_dict()
    with algo.consensus():
        seen = [t.clone() for t in net.state_dict().values()]
        seen_model = [t.detach().clone() for t in [*net.parameters(), *float_buffers(net)]]
        with algo.consensus():  # nested: still the same model
            assert all(torch.equal(a, b) for a, b in zip(net.state_dict().values(), seen, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(net.state_dict().values(), before, strict=True))
    after = algo.state_dict()  # looking ahead changed no state
    for key, value in state.items():
        if isinstance(value, list):
            assert all(torch.equal(a, b) for a, b in zip(value, after[key], strict=True)), key
        else:
            assert value == after[key], key
    if steps == 0:  # nothing launched yet: the initial model
        assert all(torch.equal(a, b) for a, b in zip(seen, before, strict=True))
        return
    step = steps
    while True:  # train on to the next merge
        _train_step(net, opt, step)
        step += 1
        if algo.step() is not None:
            break
    expected = [*algo.global_tensors(), *algo.flat_buffers.split(algo.global_buffers)]
    for a, b in zip(seen_model, expected, strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0)


def test_parameters_become_views_of_a_few_buckets():
    net = _net()
    algo = HPSGD(net.parameters(), None, bucket_bytes=64)
    assert len(algo.flat.buckets) > 1 and algo.flat.is_aliased()
    one = HPSGD(_net().parameters(), None)
    assert len(one.flat.buckets) == 1


def test_reset_optimizer_state_clears_momentum_at_every_merge():
    net = _net()
    opt = _opt(net)
    algo = _algo(net, opt, window=2, reset_optimizer_state=True)
    for step in range(5):
        _train_step(net, opt, step)
        merged = algo.step() is not None
        assert (len(opt.state) == 0) == merged, step  # merges at steps 3 and 5
    net = _net()
    opt = _opt(net)
    algo = _algo(net, opt, window=2)  # the default keeps momentum across windows
    for step in range(3):
        _train_step(net, opt, step)
        algo.step()
    assert algo.merges == 1 and len(opt.state) > 0


def test_loading_a_state_of_another_model_or_buffer_policy_is_rejected():
    net = _net()
    opt = _opt(net)
    algo = _algo(net, opt)
    _train_step(net, opt, 0)
    algo.step()
    state = algo.state_dict()
    other = HPSGD(nn.Linear(4, 2).parameters(), None)
    with pytest.raises(ValueError, match="`global_model` does not match"):
        other.load_state_dict(state)
    no_buffers = HPSGD(_net().parameters(), None)
    with pytest.raises(ValueError, match="checkpoint averaged buffers"):
        no_buffers.load_state_dict(state)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"window": 0}, "argument `window` must be an integer >= 1, got 0"),
        ({"window": 2.5}, "argument `window` must be an integer >= 1, got 2.5"),
        ({"mode": "adaptive"}, "argument `mode` must be one of 'fixed', 'poll', got 'adaptive'"),
        ({"merge": "late"}, "argument `merge` must be one of 'eager', 'paper', got 'late'"),
        ({"compression": "int2"}, "argument `compression` must be one of 'none', 'bf16', 'int8', 'int4', got 'int2'"),
        ({"outer_lr": float("inf")}, r"argument `outer_lr` must be a finite number > 0.0, got inf"),
        ({"outer_momentum": 1.0}, r"argument `outer_momentum` must be a finite number in \[0.0, 1.0\), got 1.0"),
        ({"sync_buffers": "yes"}, "argument `sync_buffers` must be True or False, got 'yes'"),
        ({"reset_optimizer_state": 1}, "argument `reset_optimizer_state` must be True or False, got 1"),
        ({"bucket_size_mb": 0}, r"argument `bucket_size_mb` must be a finite number >= 0.001, got 0"),
        ({"timeout": -1}, "argument `timeout` must be a finite number in"),
        ({"delay": "soon"}, r"argument `delay` must be an integer in \[1, window=2\] or 'auto', got 'soon'"),
        ({"delay": 3}, r"argument `delay` must be an integer in \[1, window=2\] or 'auto', got 3"),
        (
            {"delay": "auto", "merge": "paper"},
            r"argument `delay`='auto' \(it may choose one below window=2\) needs merge='eager', got merge='paper'",
        ),
    ],
)
def test_bad_arguments_fail_at_construction_naming_argument_and_value(kwargs, message):
    with pytest.raises(ValueError, match=rf"HPSGDStrategy: {message}"):
        HPSGDStrategy(**kwargs)


def test_algorithm_arguments_are_checked_too():
    params = list(nn.Linear(2, 2).parameters())
    with pytest.raises(ValueError, match="`window` must be an integer >= 1, got 0"):
        HPSGD(params, None, window=0)
    with pytest.raises(ValueError, match="`mode` must be one of"):
        HPSGD(params, None, mode="sometimes")
    with pytest.raises(ValueError, match="`reset_optimizer_state=True` needs the inner `optimizer`"):
        HPSGD(params, None, reset_optimizer_state=True)
    with pytest.raises(ValueError, match=r"`merge` must be one of .*got 'lazy'"):
        HPSGD(params, None, merge="lazy")
    with pytest.raises(ValueError, match=r"`compression` must be one of .*got 'fp8'"):
        HPSGD(params, None, compression="fp8")
    with pytest.raises(ValueError, match=r"`momentum` must be in \[0, 1\), got 1.0"):
        HPSGD(params, None, outer_momentum=1.0)
    with pytest.raises(ValueError, match=r"`lr` must be a finite number > 0, got 0\.0"):
        HPSGD(params, None, outer_lr=0.0)


@pytest.mark.parametrize(("name", "method"), [("hpsgd", "popen"), ("hpsgd_spawn", "spawn"), ("hpsgd_fork", "fork")])
def test_registered_names_build_the_strategy(name, method):
    t = pl.Trainer(strategy=name, accelerator="cpu", devices=2, logger=False, enable_progress_bar=False)
    assert isinstance(t.strategy, HPSGDStrategy)
    assert t.strategy._start_method == method and t.strategy.sync.window == 2 and t.strategy.sync.mode == "fixed"


@pytest.mark.parametrize("delay", [1, 2, 3])
def test_a_shorter_delay_follows_the_delayed_recurrence_on_one_worker(delay):
    expected = Reference(_net, _opt, _loss, 1, merge="eager").run_delayed(_batch, STEPS, 4, delay)
    _assert_same_history(_history(4, merge="eager", delay=delay), expected)


def test_an_automatic_delay_on_one_worker_merges_from_the_third_window_one_step_after_its_launch():
    # the first two windows merge at their end (the second is timed); one worker waits for nothing
    reference = Reference(_net, _opt, _loss, 1, merge="eager")
    expected = reference.run_delayed(_batch, STEPS, 4, 1, first_delay=4, first_windows=2)
    _assert_same_history(_history(4, merge="eager", delay="auto"), expected)


@pytest.mark.parametrize(
    ("phases", "step", "window", "expected"),
    [
        ([0.0], 0.01, 4, 1),
        ([0.012], 0.01, 4, 1),  # waits 2 ms of a 10 ms step at delay 1: within a quarter step
        ([0.013], 0.01, 4, 2),  # 3 ms at delay 1: too long; none at 2
        ([1.0], 0.01, 8, 8),  # nothing short enough hides it: the window
        ([0.001, 0.001], 0.01, 4, 1),  # quantized, delay 1: the gather starts at the merge and takes 1 ms
        ([0.002, 0.004], 0.01, 4, 2),  # 4 ms of gather at delay 1; the gather from step 1 is hidden at 2
        ([0.025, 0.025], 0.01, 8, 6),  # delay 5 starts the gather at step 3 and waits 5 ms for it
        ([0.035, 0.001], 0.01, 8, 7),  # a slow exchange: at delay 6 the gather, at step 3, waits 5 ms for it
        ([0.0], 0.0, 4, 1),
        ([0.1], 0.0, 4, 4),
    ],
)
def test_the_automatic_delay_is_the_smallest_that_waits_at_most_a_quarter_step(phases, step, window, expected):
    assert auto_delay(phases, step, window) == expected


@pytest.mark.parametrize("stop", range(1, STEPS))
def test_an_automatic_delay_round_trips_bit_identically_before_and_after_it_is_chosen(stop):
    variant = {"window": 4, "delay": "auto", "merge": "eager"}
    _, straight = _run(**variant)
    snapshot, _ = _run(stop=stop, **variant)
    _, resumed = _run(state=snapshot, **variant)
    assert all(torch.equal(a, b) for a, b in zip(straight, resumed, strict=True))
    assert snapshot["algo"]["delay_chosen"] == (stop >= 9) and snapshot["algo"]["delay"] == (1 if stop >= 9 else 4)


@pytest.mark.parametrize("stop", range(1, STEPS))  # in flight, merged and waiting for the next launch
def test_a_delayed_schedule_round_trips_bit_identically(stop):
    # launches at 1 and 7, merged 2 steps later; a stop at 9 or after ends the fit with nothing in flight
    variant = {"window": 6, "delay": 2, "merge": "eager", "compression": "bf16"}
    _, straight = _run(**variant)
    snapshot, _ = _run(stop=stop, **variant)
    _, resumed = _run(state=snapshot, **variant)
    assert all(torch.equal(a, b) for a, b in zip(straight, resumed, strict=True))
    assert snapshot["algo"]["pending"] == ((stop - 1) % 6 < 2)
