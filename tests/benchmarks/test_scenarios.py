"""The scenario table: every workload composes, plans skip what is not registered, targets judge ratios."""

import argparse

import pytest

from benchmarks import run
from benchmarks.rank import RUN_OVERRIDES, compose_config
from benchmarks.scenarios import (
    BASELINE,
    NO_COMM,
    ONE_PROCESS,
    SCENARIOS,
    WORKLOADS,
    Plan,
    Scenario,
    Target,
    Workload,
    available_strategies,
    hydra_value,
    one_process_reference,
    plan,
)
from benchmarks.straggler import Straggler
from lightning_hier.train import conf_dir


def test_every_scenario_names_a_workload_and_labels_are_unique_per_workload():
    seen = set()
    for sc in SCENARIOS:
        assert sc.workload in WORKLOADS
        assert (sc.workload, sc.label) not in seen
        seen.add((sc.workload, sc.label))


@pytest.mark.parametrize("name", sorted(WORKLOADS))
def test_every_workload_experiment_composes_for_ddp_and_synthetic_data(name):
    w = WORKLOADS[name]
    assert (w.searchpath / "experiment" / f"{w.experiment}.yaml").is_file()
    cfg = compose_config([f"experiment={w.experiment}", "strategy=ddp", "data.root=/nowhere"], str(w.searchpath))
    assert cfg.data._target_.endswith("CIFAR10DataModule") and cfg.data.root == "/nowhere"
    synthetic = compose_config([f"experiment={w.experiment}", "data=synthetic", *w.quick], str(w.searchpath))
    assert synthetic.data._target_.endswith("SyntheticDataModule") and synthetic.trainer.max_epochs == 2


def test_registered_scenarios_arguments_are_valid_for_their_strategies():
    """What `python -m benchmarks.run` checks before it starts: each run's config builds its strategy."""
    args = argparse.Namespace(quick=True, epochs=None, extra=[], ranks=2, straggler_mode="cgroup")
    the_plan = plan(available_strategies(conf_dir()), reference=True)
    assert the_plan.runs, "at least localsgd and ddp are registered on main"
    run.validate(args, the_plan, run.data_overrides(argparse.Namespace(synthetic=True)))


def test_invalid_scenario_arguments_fail_before_anything_runs():
    args = argparse.Namespace(quick=True, epochs=None, extra=[], ranks=2, straggler_mode="cgroup")
    bad = [Scenario("grawa_cnn", "localsgd", {"tau": 0})]
    with pytest.raises(
        SystemExit, match=r"(?s)grawa_cnn, run localsgd: invalid configuration.*`tau` must be an integer >= 1, got 0"
    ):
        run.validate(args, plan({"localsgd"}, scenarios=bad), ["data=synthetic"])
    unknown = [Scenario("grawa_cnn", "localsgd", {"window": 4})]
    with pytest.raises(SystemExit, match=r"window"):
        run.validate(args, plan({"localsgd"}, scenarios=unknown), ["data=synthetic"])


def test_plan_runs_ddp_first_then_the_reference_and_skips_unregistered_strategies():
    table = [
        Scenario("grawa_cnn", "localsgd", {"tau": 8}),
        Scenario("grawa_cnn", "mgrawa", {"tau": 32}),
        Scenario("hpsgd_mlp", "hpsgd", {"window": 4}),
    ]
    p = plan({"localsgd", BASELINE}, reference=True, scenarios=table)
    assert [s.label for s in p.runs["grawa_cnn"]] == [BASELINE, NO_COMM, "localsgd"]
    assert "hpsgd_mlp" not in p.runs  # no registered strategy: not even its DDP run
    assert [(s.label, "not registered" in why) for s, why in p.skipped] == [("mgrawa", True), ("hpsgd", True)]
    only = plan({"localsgd"}, workloads=["grawa_cnn"], strategies=["mgrawa"], scenarios=table)
    assert only.runs == {} and [s.label for s, _ in only.skipped] == ["mgrawa"]
    with pytest.raises(ValueError, match="unknown workload"):
        plan({"localsgd"}, workloads=["nope"], scenarios=table)
    with pytest.raises(ValueError, match="unknown strategy"):
        plan({"localsgd"}, strategies=["nope"], scenarios=table)


def test_no_comm_reference_needs_localsgd():
    p = plan({"mgrawa"}, reference=True, scenarios=[Scenario("grawa_cnn", "mgrawa")])
    assert [s.label for s in p.runs["grawa_cnn"]] == [BASELINE, "mgrawa"]
    assert p.skipped[0][0].label == NO_COMM


def test_targets():
    assert Target("samples_per_s", ">=", 1.5).met(1.5) and not Target("samples_per_s", ">=", 1.5).met(1.49)
    assert Target("epoch_s", "<=", 0.75).met(0.7) and not Target("epoch_s", "<=", 0.75).met(0.8)
    about = Target("bytes_per_epoch", "~", 1 / 8)
    assert about.met(0.125 * 1.4) and about.met(0.125 / 1.4) and not about.met(0.125 * 1.6)
    with pytest.raises(ValueError, match="metric"):
        Target("speed", ">=", 1.0)
    with pytest.raises(ValueError, match="op"):
        Target("epoch_s", "<", 1.0)


def test_scenario_overrides_and_hydra_values():
    sc = Scenario("grid2d_mlp", "grid2d", {"grid": [2, 1], "sync": True, "mode": "fixed"}, overrides=("a.b=1",))
    assert sc.hydra_overrides() == [
        "strategy=grid2d",
        "++strategy.grid=[2,1]",
        "++strategy.sync=true",
        "++strategy.mode=fixed",
        "a.b=1",
    ]
    assert hydra_value(None) == "null" and hydra_value(0.5) == "0.5" and hydra_value("a b") == "'a b'"


def test_workload_straggler_spec():
    w = Workload("w", "dbs", "x", "d", 0.5, straggler=(1, 2.0))
    spec = w.straggler_spec("delay", "m:f")
    assert spec is not None and (spec.ranks, spec.factor, spec.mode, spec.callback) == ((1,), 2.0, "delay", "m:f")
    assert WORKLOADS["grawa_cnn"].straggler_spec("cgroup", "m:f") is None
    node = Workload("w", "dbs", "x", "d", 0.5, slow_node=(1, 3.0))
    assert node.straggler_spec("cgroup", "m:f", ranks_per_node=2) == Straggler((2, 3), 3.0, "cgroup", "m:f")
    assert node.straggler_spec("cgroup", "m:f") == Straggler((1,), 3.0, "cgroup", "m:f")  # one rank per node


def test_run_overrides_order_user_last():
    args = argparse.Namespace(quick=True, epochs=3, extra=["optim.lr=0.01"])
    w = WORKLOADS["grawa_cnn"]
    out = run.run_overrides(args, w, Scenario("grawa_cnn", "localsgd", {"tau": 8}), ["data=synthetic"])
    assert out[0] == "experiment=grawa_cifar10_cnn" and out[-1] == "optim.lr=0.01"
    assert out.index("data.train_size=4096") < out.index("strategy=localsgd") < out.index("trainer.max_epochs=3")
    assert "start_method=popen" in RUN_OVERRIDES


def test_a_straggler_without_cgroups_asks_for_delay_mode(monkeypatch):
    monkeypatch.setattr(run, "cgroup_flavour", lambda: None)
    slowed = plan({"localsgd"}, workloads=["dbs_straggler"], scenarios=SCENARIOS)
    args = argparse.Namespace(straggler_mode="cgroup")
    assert "use --straggler-mode delay" in run.straggler_problem(args, slowed)
    assert run.straggler_problem(argparse.Namespace(straggler_mode="delay"), slowed) is None
    assert run.straggler_problem(args, plan({"localsgd"}, workloads=["grawa_cnn"])) is None


def test_ddp_peers_run_beside_the_workloads_they_apply_to():
    def labels(workload):
        return {sc.label: sc for sc in SCENARIOS if sc.workload == workload}

    for name in ("hpsgd_mlp", "hpsgd_mlp_100mbit", "hpsgd_cnn"):
        assert {"ddp+postlocalsgd", "ddp+powersgd", "ddp+fp16"} <= set(labels(name)), name
    for name in ("hpsgd_mlp", "hpsgd_mlp_100mbit", "grawa_cnn"):  # PostLocalSGD's period is Local SGD's tau
        table = labels(name)
        assert table["ddp+postlocalsgd"].args["model_averaging_period"] == table["localsgd"].args["tau"], name
    assert labels("hpsgd_mlp")["ddp+powersgd"].args == {"powersgd_rank": 4}


def _epochs(args, workload, scenario):
    overrides = run.run_overrides(args, workload, scenario, ["data=synthetic"])
    return compose_config([*overrides, *RUN_OVERRIDES], str(workload.searchpath)).trainer.max_epochs


def test_workload_overrides_apply_to_every_run_and_yield_to_quick_and_epochs():
    w = WORKLOADS["hpsgd_mlp_100mbit"]
    assert w.link == "100mbit" and w.experiment == WORKLOADS["hpsgd_mlp"].experiment
    runs = [s for s in SCENARIOS if s.workload == w.name] + [Scenario(w.name, BASELINE)]
    full = argparse.Namespace(quick=False, epochs=None, extra=[])
    assert {_epochs(full, w, sc) for sc in runs} == {2}  # DDP and every scenario: the workload's 2 epochs
    assert _epochs(argparse.Namespace(quick=False, epochs=3, extra=[]), w, runs[0]) == 3  # --epochs: every run
    assert _epochs(argparse.Namespace(quick=True, epochs=None, extra=[]), w, runs[0]) == 2
    assert _epochs(full, WORKLOADS["hpsgd_mlp"], Scenario("hpsgd_mlp", BASELINE)) == 6  # others keep the recipe's


def test_the_pipeline_workload_runs_single_process_backprop_beside_ddp_in_every_invocation():
    """Issue 19: "x one process" divides by a run of the same invocation, even when only the
    pipeline's scenarios are selected."""
    table = [Scenario("decoupled_cnn", "decoupled", {}), Scenario("grawa_cnn", "localsgd", {"tau": 8})]
    p = plan({"decoupled", "localsgd", BASELINE}, strategies=["decoupled", "localsgd"], reference=True, scenarios=table)
    assert [s.label for s in p.runs["decoupled_cnn"]] == [BASELINE, ONE_PROCESS, NO_COMM, "decoupled"]
    assert [s.label for s in p.runs["grawa_cnn"]] == [BASELINE, NO_COMM, "localsgd"]  # no single-process run
    one = p.runs["decoupled_cnn"][1]
    assert (one.strategy, one.ranks) == (BASELINE, 1)
    # the pipeline's global batch, which one process then takes in one step
    assert one.hydra_overrides() == ["strategy=ddp", "data.batch_size=256"]
    assert one_process_reference("grawa_cnn") is None
    # the runner composes it as one rank of one node, whatever the cluster
    args = argparse.Namespace(quick=True, epochs=None, extra=[], ranks=2, ranks_per_node=2, straggler_mode="cgroup")
    cfg = compose_config(
        [*run.run_overrides(args, WORKLOADS["decoupled_cnn"], one, ["data=synthetic"]), *RUN_OVERRIDES],
        str(WORKLOADS["decoupled_cnn"].searchpath),
    )
    assert cfg.data.batch_size == 256
    run.validate(args, Plan({"decoupled_cnn": [one]}, []), ["data=synthetic"])
    with pytest.raises(ValueError, match=r"`ranks` must be >= 1 or None, got 0"):
        Scenario("decoupled_cnn", BASELINE, ranks=0)
