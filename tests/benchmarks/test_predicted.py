"""The benchmark report's predictions (benchmarks/predicted.py) against the recorded results.

The recorded Local SGD run counted its payload with CommStats; the simulator, calibrated on that
invocation's no-comm run and given the model's parameter count, must predict it byte for byte.
"""

import copy
import json
import math
from pathlib import Path

import pytest

from benchmarks.fit_model import with_whole_windows
from benchmarks.predicted import forward_share, predict_run, predicted_bytes, predicted_table
from lightning_hier.models.networks import mlp, small_cnn
from lightning_hier.planner import Link
from lightning_hier.simulator import Cluster, Workload, predict
from lightning_hier.simulator.__main__ import PRESETS

RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "results.json"
SIMULATOR = RESULTS.parent / "simulator"  # the current measurements beside the simulator's predictions
OLDER = RESULTS.parents[1] / "notes" / "runs"  # older invocations, cited by the dated notes
# a fixed invocation (4 epochs, before runs recorded the model's size) that these tests are written against
MLP_RUN = OLDER / "hpsgd_mlp_100mbit-4epochs.json"


def _mlp_result() -> dict:
    result = copy.deepcopy(json.loads(MLP_RUN.read_text())["workloads"]["hpsgd_mlp_100mbit"])
    net = mlp((3, 32, 32), 10, hidden=(1024, 1024, 1024))  # the workload's model (recipes/hpsgd)
    model = {"parameters": sum(p.numel() for p in net.parameters()), "float_buffers": 0, "tensors": 8}
    for run in result["runs"].values():
        run["model"] = model
    return result


def test_local_sgd_payload_is_predicted_byte_for_byte():
    result = _mlp_result()
    run = result["runs"]["localsgd"]
    p = predict_run("localsgd", run, result, world=2)
    assert p is not None and p.args["tau"] == 4
    assert p.payload_bytes * run["steps"] == run["payload_bytes"][0]


def test_the_table_predicts_every_modelled_run_and_marks_the_others():
    table = predicted_table(_mlp_result(), world=2)
    rows = {line.split(" | ")[0].lstrip("| "): line for line in table.splitlines()[2:]}
    assert "calibration" in rows["no-comm"]
    for label in ("ddp", "hpsgd", "hpsgd-w4", "localsgd"):
        assert rows[label].count(" - |") <= 3, rows[label]  # DDP: no CommStats payload error; no load recorded
    assert rows["ddp+powersgd"].count(" - |") == 9  # nor its load: recorded before runs measured it


def test_no_prediction_without_the_model_size():
    result = json.loads(MLP_RUN.read_text())["workloads"]["hpsgd_mlp_100mbit"]
    assert predict_run("localsgd", result["runs"]["localsgd"], result, world=2) is None


def test_the_no_comm_runs_jitter_slows_ddp_by_the_expected_wait_for_the_slower_rank():
    result = _mlp_result()
    ddp = result["runs"]["ddp"]
    still = predict_run("ddp", ddp, result, world=2)
    result["runs"]["no-comm"]["step_jitter_s"] = 0.1
    jittery = predict_run("ddp", ddp, result, world=2)
    assert still is not None and jittery is not None
    assert jittery.step_s - still.step_s == pytest.approx(0.1 / math.sqrt(math.pi))
    no_comm = result["runs"]["no-comm"]
    assert predict_run("no-comm", no_comm, result, 2).step_s == pytest.approx(
        predict_run("no-comm", no_comm, _mlp_result(), 2).step_s
    )


def test_the_calibration_leaves_out_the_no_comm_runs_own_rounds():
    result = _mlp_result()  # 100 Mbit/s: each epoch's 21 MB consensus of the no-comm run takes ~1.8 s
    reference = result["runs"]["no-comm"]
    p = predict_run("no-comm", reference, result, world=2)
    per_epoch = reference["payload_bytes"][0] / reference["epochs"]
    all_reduce_s = 2 * 50e-6 + per_epoch * 8 / (0.944 * 100e6)  # ring, 2 ranks: 2 alpha + n / bandwidth
    compute = (reference["train_s"] - reference["epochs"] * all_reduce_s) / reference["steps"]
    assert p is not None and p.step_s == pytest.approx(compute, rel=1e-9)


def test_the_table_prints_each_runs_share_of_time_queued_for_its_core():
    result = _mlp_result()
    result["runs"]["ddp"]["queued_share"] = 0.314
    rows = {line.split(" | ")[0].lstrip("| "): line for line in predicted_table(result, world=2).splitlines()[2:]}
    assert rows["ddp"].endswith("| 31% |") and rows["localsgd"].endswith("| - |")


def _dbs_result(steps: int) -> dict:
    """A 2-rank DBS run with rank 1 at half speed, ``steps`` steps of 128 samples per rank."""
    model = {"parameters": 545_194, "float_buffers": 192, "tensors": 10}
    run = {"steps": steps, "epochs": 1, "samples": steps * 256, "train_s": steps * 0.5, "model": model}
    config = {"rebalance_every": 20, "warmup_steps": 5, "initial_sizes": None}
    return {
        "link": "unlimited",
        "straggler": {"ranks": [1], "factor": 2.0},
        "runs": {"no-comm": dict(run), "dbs": {**run, "strategy": "dbs", "strategy_config": config}},
    }


def test_dbs_keeps_equal_sizes_until_its_first_rebalance():
    """DBS rebalances first after warmup_steps + rebalance_every = 25 steps: a 48-step fit runs 25
    at equal sizes (paced by the straggler) and 23 at the speed-proportional shares."""
    short, long = _dbs_result(20), _dbs_result(48)
    before = predict_run("dbs", short["runs"]["dbs"], short, world=2)
    fit = predict_run("dbs", long["runs"]["dbs"], long, world=2)
    assert before is not None and fit is not None
    assert before.step_s == pytest.approx(before.detail["initial_step_s"])  # never rebalanced
    initial, steady = fit.detail["initial_step_s"], fit.detail["steady_step_s"]
    assert steady < initial and fit.step_s == pytest.approx((25 * initial + 23 * steady) / 48)


def _shared_dbs_async(steps: int) -> dict:
    """:func:`_dbs_result` as ``dbs_async`` with ``sampler='shared'``."""
    result = _dbs_result(steps)
    config = {**result["runs"]["dbs"]["strategy_config"], "sampler": "shared"}
    result["runs"]["dbs_async"] = {**result["runs"].pop("dbs"), "strategy": "dbs_async", "strategy_config": config}
    return result


def test_dbs_async_with_the_shared_queue_keeps_equal_claims_until_the_slowest_worker_measures():
    """Each worker sizes its claims after its own first 25: the straggler's 25 take 25 of its cycles at
    the initial size, during which the fast worker claims more. A fit shorter than that never rebalances
    (the whole fit at the initial rate and bytes); a long one spends that time, then runs steady."""
    short = _shared_dbs_async(16)
    never = predict_run("dbs_async", short["runs"]["dbs_async"], short, world=2)
    assert never is not None and never.detail["initial_samples_share"] == 1.0
    # the one validation's consensus of the parameter server is on the training clock too (1 epoch)
    assert never.step_s - never.detail["consensus_s"] / 16 == pytest.approx(never.detail["initial_step_s"])
    long = _shared_dbs_async(2000)
    fit = predict_run("dbs_async", long["runs"]["dbs_async"], long, world=2)
    assert fit is not None
    initial_s, steady_s = fit.detail["initial_step_s"], fit.detail["steady_step_s"]
    share = fit.detail["initial_samples_share"]
    # the warm-up's samples: 25 straggler cycles at the initial rate (256 samples per step either way)
    cycle = max(fit.detail["initial_cycle_s"])  # the straggler's, at the initial (equal) sizes
    assert cycle > max(fit.detail["cycle_s"])  # slower than at its steady (smaller) share
    assert share == pytest.approx(25 * cycle * (256 / initial_s) / (2000 * 256))
    training_s = fit.step_s - fit.detail["consensus_s"] / 2000
    assert training_s == pytest.approx(share * initial_s + (1 - share) * steady_s)
    assert 0 < share < 1  # (with the queue every worker is busy either way: the two rates are close)


def _structured_result(net, strategy: str, config: dict, batch: int) -> dict:
    """A 2-rank run of ``strategy`` (``batch`` samples per step) beside its no-comm run (128 per rank and step)."""
    words = [p.numel() for p in net.parameters()]
    model = {"parameters": sum(words), "float_buffers": 0, "tensors": len(words), "tensor_words": words}
    reference = {
        "steps": 24,
        "epochs": 1,
        "samples": 24 * 256,
        "train_s": 24 * 0.3,
        "model": model,
        "samples_per_s": 1.0,
    }
    run = {**reference, "samples": 24 * batch, "strategy": strategy, "strategy_config": config}
    return {"link": "1gbit", "runs": {"no-comm": reference, strategy: run}}


def test_the_pipeline_is_predicted_from_the_presets_blocks_over_its_epoch_drain_included():
    result = _structured_result(small_cnn((3, 32, 32), 10), "decoupled", {"stages": 2, "schedule": "fdg"}, 256)
    p = predict_run("decoupled", result["runs"]["decoupled"], result, world=2)
    assert p is not None and p.args["pipe"] == 2  # one replica of 2 stages
    # the epoch: 24 batches of 256 and a drain of 2 (K - 1) = 2 iterations; the fill's and the
    # drain's iterations hold fewer batches than a steady one, so they take less than its time
    assert p.detail["drain"] == 2 and p.steps_per_epoch == 26
    assert p.samples_per_step * p.steps_per_epoch == pytest.approx(24 * 256)
    assert 24 * max(p.detail["stage_s"]) < p.epoch_s < 26 * max(p.detail["stage_s"])
    run = result["runs"]["decoupled"]
    run.update(bytes_per_epoch=1.0, payload_bytes=[26 * p.payload_bytes] * 2, samples_per_s=1.0)
    row = next(line for line in predicted_table(result, world=2).splitlines() if line.startswith("| decoupled |"))
    assert row.split(" | ")[9] == "+0%"  # one activation and one gradient per batch


def test_a_pipeline_over_other_blocks_of_the_presets_network_is_not_predicted():
    # model.layer_blocks=true: the preset's tensors, cut into 12 blocks instead of its 4
    result = _structured_result(small_cnn((3, 32, 32), 10), "decoupled", {"stages": 2, "schedule": "fdg"}, 256)
    run = result["runs"]["decoupled"]
    run["overrides"] = ["data.batch_size=256", "model.layer_blocks=true"]
    assert predict_run("decoupled", run, result, world=2) is None
    run["overrides"] = ["data.batch_size=256"]
    assert predict_run("decoupled", run, result, world=2) is not None


def test_the_grid_is_predicted_from_the_presets_layer_list_and_other_networks_are_not():
    result = _structured_result(mlp((3, 32, 32), 10, hidden=(2048,) * 3), "grid2d", {"grid": [2, 1]}, 256)
    shards = [3145728, 1024, 2097152, 1024, 2097152, 1024, 10240, 5]  # what a grid run records: its own shards
    result["runs"]["grid2d"]["model"] = {**result["runs"]["grid2d"]["model"], "tensor_words": shards}
    p = predict_run("grid2d", result["runs"]["grid2d"], result, world=2)
    assert p is not None and p.args["grid"] == (2, 1) and p.samples_per_step == 256
    other = _structured_result(mlp((3, 32, 32), 10, hidden=(512,)), "grid2d", {"grid": [2, 1]}, 256)
    assert predict_run("grid2d", other["runs"]["grid2d"], other, world=2) is None  # no preset of that network


def test_each_validations_wait_for_the_window_in_flight_is_on_the_training_clock():
    """HPSGD validates S plus the window in flight: it sends nothing more but waits for that
    window's reduction, at most one all-reduce of the 21 MB MLP: at 100 Mbit/s 2 alpha +
    21 MB * 8 / 94.4 Mbit/s = 1.78 s per epoch, spread over the epoch's steps. Local SGD with
    tau = 4 ends its epochs on a round and needs none."""
    result = _mlp_result()
    run = result["runs"]["hpsgd-w4"]
    p = predict_run("hpsgd-w4", run, result, world=2)
    assert p is not None
    model_bytes = 4 * run["model"]["parameters"]
    assert p.detail["consensus_s"] == pytest.approx(2 * 50e-6 + model_bytes * 8 / (0.944 * 100e6), rel=1e-6)
    local = predict_run("localsgd", result["runs"]["localsgd"], result, world=2)
    assert local is not None and "consensus_s" not in local.detail


def test_hpsgds_fit_sends_the_first_steps_change_every_window_and_the_drain():
    """hpsgd-w4, 4 epochs of 48 steps: launches at steps 1, 5, ..., 189 and a drain of steps 190-192,
    1 + ceil(191 / 4) = 49 reductions of the model where the steady state counts 192 / 4 = 48;
    CommStats counted the payload of exactly those."""
    result = _mlp_result()
    run = result["runs"]["hpsgd-w4"]
    p = predict_run("hpsgd-w4", run, result, world=2)
    assert p is not None
    _, payload = predicted_bytes(p, run, result)
    model_bytes = 4 * run["model"]["parameters"]
    assert run["steps"] == 192 and payload == pytest.approx(49 * model_bytes, rel=1e-9)
    assert payload == pytest.approx(run["payload_bytes"][0], rel=0.005)


def test_easgds_end_of_fit_catch_up_is_one_more_model_of_payload():
    """grawa_cnn at 1 Gbit/s (an older invocation, benchmarks/notes/runs/sim18c/grawa_1g.json): EASGD,
    tau 4, 32 steps, CommStats counted 9 models (8 rounds and the center's catch-up at the end of the fit)."""
    result = json.loads((OLDER / "sim18c" / "grawa_1g.json").read_text())["workloads"]["grawa_cnn"]
    run = result["runs"]["easgd"]
    p = predict_run("easgd", run, result, world=2)
    assert p is not None
    _, payload = predicted_bytes(p, run, result)
    assert payload == pytest.approx(run["payload_bytes"][0], rel=0.005)
    assert payload == pytest.approx(9 * 4 * run["model"]["parameters"], rel=0.005)


def _workload(path: Path, workload: str) -> dict:
    return json.loads(path.read_text())["workloads"][workload]


def test_a_fit_shorter_than_tau_completes_no_round_and_sends_only_its_final_one():
    """grawa_cnn at 1 Gbit/s (simulator/grawa_cnn-1gbit-grawa.json): MGRAWA and LGRAWA with tau 32 over a
    24-step fit complete no round; CommStats counted one model (the final round, with the buffers
    and the score table), as the no-comm run's end of fit."""
    result = _workload(SIMULATOR / "grawa_cnn-1gbit-grawa.json", "grawa_cnn")
    for label in ("mgrawa", "lgrawa"):
        run = result["runs"][label]
        p = predict_run(label, run, result, world=2)
        assert p is not None and p.detail["rounds_share"] == 0.0
        wire, payload = predicted_bytes(p, run, result)
        assert payload == pytest.approx(run["payload_bytes"][0], rel=0.001)
        assert wire == pytest.approx(run["bytes_per_epoch"], rel=0.01)


def test_asynchronous_grawa_counts_each_remote_workers_final_partial_report():
    """dbs_straggler with the shared queue (simulator/dbs_straggler-*-asynchronous.json): the straggler
    (rank 1) took about 40 of the 128 steps, one full period of tau = 32 and a partial one, so it
    crossed the link twice, report and reply each time, not 40 / 32 times."""
    for link in ("1gbit", "100mbit", "unlimited"):
        result = _workload(SIMULATOR / f"dbs_straggler-{link}-asynchronous.json", "dbs_straggler")
        run = result["runs"]["mgrawa-async-shared"]
        p = predict_run("mgrawa-async-shared", run, result, world=2)
        assert p is not None and p.detail["remote_round_trips"] == 2
        wire, _ = predicted_bytes(p, run, result)
        assert wire == pytest.approx(run["bytes_per_epoch"], rel=0.02)


def test_the_grids_validation_forwards_are_predicted_byte_for_byte():
    """grid2d_mlp on a 2 x 1 grid (older invocations, notes/runs/sim18d/grid_*.json): besides its
    training steps, CommStats counted the validation's forwards, each sample's activations gathered
    across the 2 MODEL rows. Those runs validated 4 batches of 500 (``limit_val_batches=4``, the
    CIFAR-10 data's ``val_batch_size``) before ``val_samples`` was recorded."""
    for link in ("100m", "1g", "unl"):
        result = _workload(OLDER / "sim18d" / f"grid_{link}.json", "grid2d_mlp")
        run = {**result["runs"]["grid2d"], "val_samples": 4 * 500}
        p = predict_run("grid2d", run, result, world=2)
        assert p is not None
        wire, payload = predicted_bytes(p, run, result)
        assert payload == run["payload_bytes"][0]
        assert wire == pytest.approx(run["bytes_per_epoch"], rel=0.01)


def test_four_ranks_bytes_leave_out_the_calibrations_ring_consensus():
    """hpsgd_mlp on 4 ranks at 1 Gbit/s (simulator/hpsgd_mlp-1gbit-4ranks.json): the no-comm run's end-of-fit
    all-reduce sends 2 (p - 1) / p = 1.5 times its payload at 4 ranks; the rest of its bytes (the
    rendezvous, the metrics) is what every run adds. Leaving out only 1x the payload over-predicted
    every run by half the 21 MB model (+4 to +17 %)."""
    result = _workload(SIMULATOR / "hpsgd_mlp-1gbit-4ranks.json", "hpsgd_mlp")
    for label, run in result["runs"].items():
        if label == "no-comm":
            continue
        p = predict_run(label, run, result, world=4)
        assert p is not None, label
        wire, _ = predicted_bytes(p, run, result)
        assert wire == pytest.approx(run["bytes_per_epoch"], rel=0.01), label


def test_ddps_exposed_forward_is_the_presets_measured_share_of_the_compute():
    # 100 Mbit/s: the first bucket (2.1 MB, ~0.18 s) outlasts the backward, so a step is the forward
    # and the buckets, and the forward is the preset's measured share of the compute (60 % for the
    # small CNN), not the third a backward of two forwards would leave it
    result = _structured_result(small_cnn((3, 32, 32), 10), "ddp", {}, 256)
    result["link"] = "100mbit"
    p = predict_run("ddp", result["runs"]["ddp"], result, world=2)
    preset = Workload.load(PRESETS / "cnn.json")
    share = preset.forward_s / preset.sample_s
    assert p is not None and share > 0.5
    compute = 0.3  # the no-comm run's step: 24 steps in 7.2 s
    assert p.step_s - p.detail["allreduce_s"] == pytest.approx(share * compute, rel=1e-6)
    assert forward_share(None) == pytest.approx(1 / 3)  # a network without a preset: a backward of two forwards


def test_dilocos_fit_counts_each_fragments_syncs_and_its_last_partial_one():
    """96 steps, window 16, 4 fragments at offsets 4, 8, 12, 0: 6 syncs each, and one more at the
    end for the three whose last sync (84, 88, 92) was before step 96: 27 quarters of the model,
    where the steady state counts 96 / 16 = 6 models. Window 8, one fragment: 12 syncs, no more."""
    workload = Workload("w", 1000, 8, 8 * 48, forward_s=1e-3, backward_s=2e-3, tensors=8)
    cluster = Cluster(2, Link(alpha=1e-5, beta=4e-9))
    streaming = with_whole_windows(predict("diloco", workload, cluster, window=16, fragments=4), {"steps": 96})
    assert streaming.detail["reductions_share"] == pytest.approx(27 / 4 / 6)
    plain = with_whole_windows(predict("diloco", workload, cluster, window=8), {"steps": 96})
    assert plain.detail["reductions_share"] == pytest.approx(1.0)


@pytest.mark.parametrize("label", ["ddp+postlocalsgd", "ddp+powersgd", "ddp+fp16"])
def test_torchs_hooks_are_predicted_within_the_issue_bounds_on_the_committed_slow_link_run(label):
    """The committed 100 Mbit/s run (it records its tensors' words; PowerSGD's shapes are the
    preset's): bytes per epoch within 2 %, samples/s within 15 % (from recorded numbers, no timing)."""
    result = json.loads(RESULTS.read_text())["workloads"]["hpsgd_mlp_100mbit"]
    run = result["runs"][label]
    p = predict_run(label, run, result, world=2)
    assert p is not None and p.strategy == run["strategy"]
    wire, _ = predicted_bytes(p, run, result)
    assert wire == pytest.approx(run["bytes_per_epoch"], rel=0.02)
    assert p.samples_per_s == pytest.approx(run["samples_per_s"], rel=0.15)
