"""The tally of predicted against measured over several invocations (benchmarks/tally.py), on recorded runs."""

import json
from pathlib import Path

import pytest

from benchmarks.tally import cells, main, tally_table

REPO = Path(__file__).resolve().parents[2]
MLP_100M = REPO / "benchmarks" / "results" / "simulator" / "hpsgd_mlp_100mbit-100mbit.json"
CNN_UNL = REPO / "benchmarks" / "notes" / "runs" / "sim18b" / "hpsgd_cnn_unl.json"  # an older invocation


def test_every_predicted_run_is_a_cell_and_the_calibration_is_not():
    rows = cells("mlp_100m", json.loads(MLP_100M.read_text()))
    assert [(c.workload, c.link, c.label) for c in rows] == [
        ("hpsgd_mlp_100mbit", "100mbit", "ddp"),
        ("hpsgd_mlp_100mbit", "100mbit", "localsgd"),
    ]
    ddp = rows[0]
    assert ddp.rate == pytest.approx(514.37, abs=0.01) and ddp.rate_error == pytest.approx(0.06, abs=0.01)
    assert abs(ddp.bytes_error) < 0.005


def test_the_summary_counts_the_cells_within_the_tolerance(capsys):
    assert main([str(MLP_100M), str(CNN_UNL)]) == 0
    out = capsys.readouterr().out
    assert "| hpsgd_cnn | unlimited | 2 | ddp | hpsgd_cnn_unl | 1114 | 576 | -48% |" in out
    # mlp_100mbit: +6 % and -0 %; hpsgd_cnn_unl: -48, -35 and -31 %; every byte count within 1 %
    assert out.rstrip().endswith("Within 15 %: samples/s 2 of 5, bytes per epoch 5 of 5.")
    rows = cells("x", json.loads(CNN_UNL.read_text()))
    assert tally_table(rows, tolerance=0.5).endswith("samples/s 3 of 3, bytes per epoch 3 of 3.")


def test_latest_counts_a_cell_measured_again_once_at_its_newest_measurement(tmp_path, capsys):
    again = tmp_path / "again.json"
    again.write_text(MLP_100M.read_text())  # the same date as MLP_100M, given after it
    files = [str(MLP_100M), str(CNN_UNL), str(again)]
    assert main(files) == 0
    assert capsys.readouterr().out.rstrip().endswith("samples/s 4 of 7, bytes per epoch 7 of 7.")
    assert main([*files, "--latest"]) == 0
    out = capsys.readouterr().out
    assert out.rstrip().endswith("samples/s 2 of 5, bytes per epoch 5 of 5.")
    assert "| ddp | again |" in out and "| ddp | hpsgd_mlp_100mbit-100mbit |" not in out  # the later file's row
