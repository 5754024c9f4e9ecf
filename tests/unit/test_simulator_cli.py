"""The simulator's command line: calibrate a real model, then predict, plot and recommend from its JSON."""

import json

import pytest

from lightning_hier.simulator import Workload
from lightning_hier.simulator.__main__ import build_model, load_workload, main


@pytest.fixture
def workload_file(tmp_path):
    out = tmp_path / "tiny.json"
    args = ["calibrate", "--model", "mlp", "--model-args", '{"hidden": [16]}', "--input-shape", "1", "8", "8"]
    assert main([*args, "--batch-size", "8", "--samples-per-epoch", "64", "--repeats", "2", "--out", str(out)]) == 0
    return out


def test_calibrate_counts_the_model_and_times_every_block(workload_file):
    w = Workload.load(workload_file)
    assert w.params == 64 * 16 + 16 + 16 * 10 + 10  # Linear(64, 16) and Linear(16, 10)
    assert w.tensors == 4 and w.buffers == 0 and w.batch_size == 8
    assert [b.params for b in w.blocks] == [64 * 16 + 16, 16 * 10 + 10]
    assert [b.out_words for b in w.blocks] == [16, 10]
    assert w.sample_s > 0 and sum(b.compute_s for b in w.blocks) == pytest.approx(w.sample_s)
    assert json.loads(workload_file.read_text())["model"]["spec"] == "mlp"


def test_predict_prints_the_table_plots_and_recommends(workload_file, tmp_path, capsys):
    plot = tmp_path / "curve.png"
    args = [
        "predict",
        "--workload",
        str(workload_file),
        "--link",
        "10gbit",
        "--workers",
        "8",
        "64",
        "--plot",
        str(plot),
    ]
    assert main([*args, "--stragglers", "straggler:2"]) == 0
    out = capsys.readouterr().out
    rows = ("ddp", "hpsgd", "localsgd", "easgd", "lsgd", "mgrawa", "lgrawa", "dbs", "decoupled", "grid2d", "asgd")
    for name in (*rows, "softsync", "dbs_async", "mgrawa-async", "lgrawa-async", "asgd-shared", "mgrawa-async-shared"):
        assert f"| {name} |" in out
    assert "| W=8 | W=64 |" in out
    assert "Recommended at W=64:" in out
    assert plot.stat().st_size > 1000


def test_predict_rejects_a_bad_distribution(workload_file):
    with pytest.raises(ValueError, match="stragglers 'slow'"):
        main(["predict", "--workload", str(workload_file), "--stragglers", "slow", "--workers", "8"])


def test_predict_with_jitter_slows_ddp_and_refuses_a_negative_one(capsys):
    rows = {}
    for jitter in ("0", "0.05"):
        assert main(["predict", "--workload", "cnn", "--strategies", "ddp", "--workers", "8", "--jitter", jitter]) == 0
        row = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("| ddp |"))
        rows[jitter] = float(row.split("|")[2].replace(",", ""))
    assert rows["0.05"] < rows["0"]
    with pytest.raises(SystemExit, match=r"`--jitter` must be >= 0 seconds, got -1.0"):
        main(["predict", "--workload", "cnn", "--jitter", "-1"])


@pytest.mark.parametrize("preset", ["cnn", "mlp"])
def test_presets_carry_their_models_tensor_sizes(preset):
    """DDP's bucket model needs every tensor's size: the presets' must be their own network's, in order."""
    w = load_workload(preset)
    model = build_model(w.model)
    assert w.tensor_words == tuple(p.numel() for p in model.parameters() if p.requires_grad)
    assert sum(w.tensor_words) == w.params and len(w.tensor_words) == w.tensors
