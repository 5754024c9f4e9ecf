"""Summaries, ratios against DDP, targets and rendering, on hand-made rank reports."""

import json
import math

import pytest

from benchmarks import publish
from benchmarks.launch import JobResult
from benchmarks.report import (
    acc_at,
    check_target,
    compare,
    diagnosis,
    median_run,
    meta_line,
    replace_between,
    summarize,
    time_to,
    workload_table,
)
from benchmarks.run import cpu_busy_fraction
from benchmarks.scenarios import BASELINE, NO_COMM, ONE_PROCESS, WORKLOADS, Scenario, Target

W = WORKLOADS["grawa_cnn"]  # target accuracy 0.55


def _rank(rank, train_s, samples, accs, comm=None, replicas=2, rss=100.0):
    per_epoch = train_s / len(accs)
    timeline = [
        {"epoch": e, "step": 10 * (e + 1), "train_s": per_epoch * (e + 1), "wall_s": 0.0, "samples": 0, "val_acc": a}
        for e, a in enumerate(accs)
    ]
    return {
        "rank": rank,
        "epochs": len(accs),
        "steps": 10 * len(accs),
        "samples": samples,
        "train_s": train_s,
        "wall_s": train_s + 1,
        "timeline": timeline,
        "comm": comm,
        "replicas": replicas,
        "peak_rss_mb": rss + rank,
        "strategy_config": {},
    }


def _job(train_s, accs, tx, comm=None, replicas=2):
    ranks = [_rank(r, train_s - r, 1000, accs, comm and comm[r], replicas) for r in range(2)]
    return JobResult(ranks=ranks, tx_bytes=tx, rx_bytes=tx[::-1], launch_s=train_s + 10, cores=[0, 1])


def _runs():
    ddp = summarize(Scenario("grawa_cnn", BASELINE), _job(40.0, [0.4, 0.5, 0.6, 0.62], [800, 800]))
    ref = summarize(Scenario("grawa_cnn", "localsgd", label=NO_COMM), _job(10.0, [0.3, 0.4, 0.5, 0.55], [0, 0]))
    comm = [{"bytes": 100, "calls": 1, "blocked_s": 2.0}, {"bytes": 100, "calls": 1, "blocked_s": 3.0}]
    local = summarize(
        Scenario("grawa_cnn", "localsgd", {"tau": 8}), _job(20.0, [0.45, 0.56, 0.58, 0.6], [90, 110], comm)
    )
    return {BASELINE: ddp, NO_COMM: ref, "localsgd": local}


def test_summary_of_one_run():
    s = _runs()["localsgd"]
    # 2 ranks x 1000 samples over the slowest rank's 20 s; 4 epochs; mean bytes over ranks per epoch
    assert s["samples_per_s"] == 100.0 and s["epoch_s"] == 5.0 and s["bytes_per_epoch"] == 25.0
    assert s["blocked_s"] == 3.0 and s["payload_bytes"] == [100, 100] and s["peak_rss_mb"] == 101.0
    assert s["final_acc"] == 0.6 and s["args"] == {"tau": 8}
    # a pipeline of 2 stages is one replica: its ranks' samples count once
    pipe = summarize(Scenario("decoupled_cnn", "decoupled"), _job(20.0, [0.5], [1, 1], replicas=1))
    assert pipe["samples_per_s"] == 50.0


def test_accuracy_at_a_time_and_time_to_target():
    timeline = [{"train_s": 10.0, "val_acc": 0.3}, {"train_s": 20.0, "val_acc": 0.6}, {"train_s": 30.0, "val_acc": 0.5}]
    assert math.isnan(acc_at(timeline, 9.9)) and acc_at(timeline, 10.0) == 0.3 and acc_at(timeline, 29.0) == 0.6
    assert time_to(timeline, 0.55) == 20.0 and time_to(timeline, 0.7) is None


def test_comparison_against_ddp():
    runs = _runs()
    comp = compare(W, runs)
    assert comp["equal_time_s"] == 20.0  # the fastest run, the no-communication reference excluded
    row = comp["rows"]["localsgd"]
    assert row["samples_per_s_ratio"] == pytest.approx(2.0) and row["epoch_s_ratio"] == pytest.approx(0.5)
    assert row["bytes_per_epoch_ratio"] == pytest.approx(0.125) and row["final_acc_delta"] == pytest.approx(-0.02)
    assert row["time_to_target_s"] == 10.0 and row["acc_at_equal_time"] == 0.6
    assert comp["rows"][BASELINE]["acc_at_equal_time"] == 0.5  # DDP had done 2 of 4 epochs by then
    # DDP exposes no blocked time: estimated against the no-communication reference (40 - 10 s)
    assert runs[BASELINE]["blocked_s"] == 30.0 and runs[BASELINE]["blocked_estimated"]
    assert runs["localsgd"]["blocked_s"] == 3.0 and not runs["localsgd"]["blocked_estimated"]  # measured


def test_ddp_peers_blocked_time_is_estimated_like_ddps():
    runs = _runs()
    runs["ddp+fp16"] = summarize(Scenario("grawa_cnn", "ddp_fp16", label="ddp+fp16"), _job(25.0, [0.6], [400, 400]))
    compare(W, runs)
    assert runs["ddp+fp16"]["blocked_s"] == 15.0 and runs["ddp+fp16"]["blocked_estimated"]
    del runs[NO_COMM]
    runs["ddp+fp16"]["blocked_s"] = None
    compare(W, runs)
    assert runs["ddp+fp16"]["blocked_s"] is None  # no reference run: nothing to estimate from


def test_targets_met_missed_pending_failed():
    runs = _runs()
    result = {"runs": runs, "comparison": compare(W, runs)}
    local = Scenario("grawa_cnn", "localsgd", {"tau": 8})
    assert check_target(local, Target("bytes_per_epoch", "~", 1 / 8), result)["status"] == "met"
    missed = check_target(local, Target("samples_per_s", ">=", 2.5), result)
    assert missed["status"] == "missed" and missed["note"].startswith("missed by 20%")
    pending = check_target(Scenario("grawa_cnn", "mgrawa"), Target("epoch_s", "<=", 1.0), result)
    assert pending["status"] == "pending"
    result["runs"]["localsgd"] = {"label": "localsgd", "error": "rank 1 exited with code 1.\nTraceback"}
    assert check_target(local, Target("epoch_s", "<=", 1.0), result)["status"] == "failed"


def test_targets_on_time_to_accuracy_and_against_a_peer():
    runs = _runs()
    result = {"runs": runs, "comparison": compare(W, runs)}
    local = Scenario("grawa_cnn", "localsgd", {"tau": 8})
    # localsgd reaches 0.55 after 10 s, DDP after 30 s: 1/3 of DDP's time
    check = check_target(local, Target("time_to_target_s", "<=", 0.5), result)
    assert check["status"] == "met" and check["ratio"] == pytest.approx(1 / 3)
    # at the equal time (20 s) localsgd has 0.6, the no-communication run 0.55
    versus = check_target(local, Target("acc_at_equal_time", ">=", 1.0, versus=NO_COMM), result)
    assert versus["status"] == "met" and versus["target"] == ">= 1 x no-comm"
    assert check_target(local, Target("epoch_s", "<=", 1.0, versus="powersgd"), result)["status"] == "n/a"
    runs["localsgd"]["timeline"] = [{"train_s": 20.0, "val_acc": 0.5}]  # never reaches the target
    result = {"runs": runs, "comparison": compare(W, runs)}
    never = check_target(local, Target("time_to_target_s", "<=", 0.5), result)
    assert never["status"] == "missed" and "this run never reached" in never["note"]
    assert Scenario("grawa_cnn", "localsgd", target=(Target("epoch_s", "<=", 1), Target("final_acc", ">=", 1))).targets


def test_diagnosis_breaks_the_step_time_down():
    runs = _runs()
    compare(W, runs)
    text = diagnosis({"runs": runs}, "localsgd")
    assert text == ("localsgd 500 ms/step (blocked 75 ms); ddp 1000 ms/step (est. blocked 750 ms); no-comm 250 ms/step")


def test_replace_between_markers():
    text = "a\n<!-- bench:x:start -->\nold\n<!-- bench:x:end -->\nb\n"
    assert (
        replace_between(text, "x", "new $1 \\1") == "a\n<!-- bench:x:start -->\nnew $1 \\1\n<!-- bench:x:end -->\nb\n"
    )
    with pytest.raises(ValueError, match="markers"):
        replace_between(text, "y", "z")


def test_outputs_json_markdown_and_plots(tmp_path):
    pytest.importorskip("matplotlib")
    runs = _runs()
    runs["mgrawa"] = {"label": "mgrawa", "strategy": "mgrawa", "error": "rank 0 exited with code 1.\nboom"}
    meta = {"date": "d", "commit": "c", "host_cpus": 2, "load_avg": [0.5, 0, 0], "torch": "t", "lightning": "l"}
    meta |= {"ranks": 2, "quick": False}
    results = {
        "meta": meta,
        "workloads": {"grawa_cnn": {"link": "1gbit", "runs": runs, "comparison": compare(W, runs)}},
        "skipped": [{"workload": "hpsgd_mlp", "label": "hpsgd", "reason": "not registered"}],
    }
    publish.write_outputs(results, tmp_path, update_readme=False)
    assert json.loads((tmp_path / "results.json").read_text())["workloads"]["grawa_cnn"]["runs"]["ddp"]["epochs"] == 4
    assert (tmp_path / "grawa_cnn.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    md = (tmp_path / "results.md").read_text()
    assert "| localsgd | tau=8 | 100 | 2.00 | 5.0 | 0.50 | 10 | 0.600 | -0.020 | 0.600 |" in md
    assert "| mgrawa | failed: rank 0 exited with code 1. |" in md
    assert "| ddp | defaults |" in md and "30.0 (est.)" in md and "![grawa_cnn](grawa_cnn.png)" in md
    assert "| localsgd bytes_per_epoch | grawa_cnn | 0.125 | ~ 0.125 x ddp | met |" in md
    assert "| hpsgd samples_per_s | hpsgd_mlp | - | >= 1.5 x ddp | pending |" in md
    assert "Not run: hpsgd_mlp / hpsgd (not registered)." in md


def test_runs_on_a_busy_machine_are_labelled_preliminary():
    meta = {"date": "d", "commit": "c", "host_cpus": 2, "torch": "t", "lightning": "l", "argv": ["--epochs", "2"]}
    quiet = meta_line({**meta, "load_avg": [0.4, 0, 0]})
    assert quiet.startswith("_full run d") and "arguments `--epochs 2`" in quiet
    assert meta_line({**meta, "load_avg": [4.0, 0, 0]}).startswith("**Preliminary: the machine was busy (load 4.0")
    # the CPU share measured at start, when present, decides (the load average lags behind earlier runs)
    assert not meta_line({**meta, "load_avg": [4.0, 0, 0], "cpu_busy": 0.02}).startswith("**Preliminary")
    assert meta_line({**meta, "load_avg": [0.1, 0, 0], "cpu_busy": 0.6}).startswith(
        "**Preliminary: the machine was busy (60% of the CPU in use)"
    )


def test_cpu_busy_fraction_is_a_share():
    share = cpu_busy_fraction(0.2)
    assert share is None or 0.0 <= share <= 1.0


def test_repeats_report_the_median_run_and_the_range():
    runs = [{"train_s": t, "samples_per_s": 1000 / t, "epochs": 1} for t in (12.0, 10.0, 20.0)]
    median = median_run(runs)
    assert median["train_s"] == 12.0 and median["repeats"] == pytest.approx([1000 / 12, 100.0, 50.0])
    assert median_run(runs[:2])["train_s"] == 10.0  # even count: the lower middle
    rows = _runs()
    rows["localsgd"]["repeats"] = [90.0, 100.0, 120.0]
    result = {"runs": rows, "comparison": compare(W, rows)}
    assert "| localsgd | tau=8 | 100 (90-120) | 2.00 |" in workload_table(W, result)


def test_a_partial_invocation_keeps_the_other_workloads_of_the_last_one():
    old_meta, new_meta = {"date": "old"}, {"date": "new"}
    previous = {
        "meta": old_meta,
        "workloads": {"grawa_cnn": {"runs": {"ddp": 1}}, "hpsgd_mlp": {"runs": {"ddp": 2}}, "gone": {"runs": {}}},
        "skipped": [{"workload": "decoupled_cnn", "label": "decoupled"}, {"workload": "hpsgd_mlp", "label": "x"}],
    }
    new = {"meta": new_meta, "workloads": {"hpsgd_mlp": {"meta": new_meta, "runs": {"ddp": 3}}}, "skipped": []}
    merged = publish.carry_over(new, previous)
    assert merged["workloads"]["hpsgd_mlp"]["runs"] == {"ddp": 3}  # refreshed
    assert merged["workloads"]["grawa_cnn"] == {"meta": old_meta, "runs": {"ddp": 1}}  # kept, with its provenance
    assert "gone" not in merged["workloads"]  # no longer a workload
    assert merged["skipped"] == [{"workload": "decoupled_cnn", "label": "decoupled"}]


def test_recorder_keeps_the_consensus_communication_on_the_training_clock():
    from types import SimpleNamespace

    from benchmarks.rank import Recorder

    ticks = iter([0.0, 10.0, 12.0, 15.0, 20.0])  # train start, validation start, first batch, end, fit end
    rec = Recorder(clock=lambda: next(ticks))
    trainer = SimpleNamespace(sanity_checking=False, current_epoch=0, global_step=5, callback_metrics={"val/acc": 0.5})
    rec.on_train_start(trainer, None)
    rec.on_validation_start(trainer, None)  # the strategy builds its consensus after this hook: 2 s
    rec.on_validation_batch_start(trainer, None, None, 0)
    rec.on_validation_batch_start(trainer, None, None, 1)  # later batches do not move the mark
    rec.on_validation_end(trainer, None)
    rec.on_train_end(trainer, None)
    assert rec.timeline[0]["train_s"] == 12.0 and rec.timeline[0]["wall_s"] == 15.0
    assert rec.train_s == 17.0  # 20 s of fit minus the 3 s spent on validation batches


def test_the_table_divides_by_the_single_process_run_of_the_same_invocation():
    runs = _runs()
    one = _job(80.0, [0.5, 0.55, 0.6, 0.62], [0, 0], replicas=1)
    one.ranks = one.ranks[:1]  # one rank: 1000 samples in 80 s
    runs[ONE_PROCESS] = summarize(Scenario("grawa_cnn", BASELINE, label=ONE_PROCESS, ranks=1), one)
    comp = compare(W, runs)
    assert runs[ONE_PROCESS]["samples_per_s"] == 12.5
    assert comp["rows"]["localsgd"]["samples_per_s_vs_one_process"] == pytest.approx(8.0)  # 100 / 12.5
    assert runs[ONE_PROCESS]["blocked_s"] is None  # no link to block on: no estimate against no-comm
    table = workload_table(W, {"runs": runs, "comparison": comp})
    assert "| run | arguments | samples/s | x DDP | x one process | epoch s |" in table
    assert "| localsgd | tau=8 | 100 | 2.00 | 8.00 | 5.0 | 0.50 |" in table
    assert table.splitlines()[1] == "|" + "---|" * 15
    # without that run the column is not there
    del runs[ONE_PROCESS]
    assert "x one process" not in workload_table(W, {"runs": runs, "comparison": compare(W, runs)})


def test_summary_keeps_the_ranks_mean_share_of_the_fit_queued_for_their_cores():
    job = _job(20.0, [0.5], [1, 1])
    assert summarize(Scenario("grawa_cnn", BASELINE), job)["queued_share"] is None  # not recorded
    for rank, queued in zip(job.ranks, (2.0, 9.0), strict=True):
        rank["queued_s"], rank["wall_s"] = queued, 20.0
    assert summarize(Scenario("grawa_cnn", BASELINE), job)["queued_share"] == pytest.approx(0.275)
