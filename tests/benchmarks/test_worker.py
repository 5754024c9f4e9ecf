"""The benchmark rank under a real 2-"node" job (forked ranks, gloo): timeline, counters, delay straggler."""

import json

from benchmarks import worker
from lightning_hier.testing import run_workers

TINY = [
    "data=synthetic",
    "data.train_size=256",
    "data.val_size=128",
    "data.batch_size=32",
    "model=mlp",
    "model.hidden=[16]",
    "trainer.max_epochs=2",
]


def _run(tmp_path, overrides, delay=None):
    spec = {"ranks": 2, "searchpath": None, "overrides": overrides, "out_dir": str(tmp_path), "delay": delay}
    path = tmp_path / "spec.json"
    path.write_text(json.dumps(spec))
    run_workers(worker.main, [str(path)], devices=1, num_nodes=2, timeout=120)  # every rank is its own node
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]


def test_worker_records_timeline_samples_and_communication(tmp_path):
    delay = {"ranks": [1], "factor": 2.0, "callback": "lightning_hier.callbacks.straggler:Straggler"}
    reports = _run(tmp_path, [*TINY, "strategy=localsgd", "strategy.tau=2", "strategy.timeout=30"], delay)
    for r, rep in enumerate(reports):
        assert rep["rank"] == r and rep["world_size"] == 2 and rep["replicas"] == 2
        assert (rep["epochs"], rep["steps"], rep["samples"]) == (2, 8, 256)  # 128 samples / 32 per step per epoch
        assert [p["epoch"] for p in rep["timeline"]] == [0, 1] and [p["samples"] for p in rep["timeline"]] == [128, 256]
        assert 0 < rep["timeline"][0]["train_s"] < rep["timeline"][1]["train_s"] <= rep["train_s"] <= rep["wall_s"]
        assert 0.0 <= rep["timeline"][-1]["val_acc"] <= 1.0
        assert rep["comm"]["bytes"] > 0 and rep["comm"]["calls"] >= 4  # 4 rounds of averaging, at least
        assert rep["strategy_config"]["tau"] == 2 and rep["peak_rss_mb"] > 0
    # accuracy is a global metric: the same on every rank
    assert reports[0]["timeline"][-1]["val_acc"] == reports[1]["timeline"][-1]["val_acc"]
    assert reports[0]["straggler_slept_s"] == 0.0 and reports[1]["straggler_slept_s"] > 0.0


def test_worker_runs_lightning_ddp_as_the_baseline(tmp_path):
    reports = _run(tmp_path, [*TINY, "strategy=ddp", "strategy.timeout.seconds=30"])
    assert [r["comm"] for r in reports] == [None, None]  # DDP exposes no counters; the runner reads the links
    assert [r["samples"] for r in reports] == [256, 256] and reports[0]["strategy_config"]["_target_"].endswith(
        "DDPStrategy"
    )
