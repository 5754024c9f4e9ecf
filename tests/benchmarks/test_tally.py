"""The tally of predicted against measured over several invocations (benchmarks/tally.py), on recorded runs."""

import json
from pathlib import Path

import pytest

from benchmarks.tally import cells, main, tally_table

SIM18B = Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "sim18b"


def test_every_predicted_run_is_a_cell_and_the_calibration_is_not():
    rows = cells("mlp_100m", json.loads((SIM18B / "mlp_100m.json").read_text()))
    assert [(c.workload, c.link, c.label) for c in rows] == [
        ("hpsgd_mlp_100mbit", "100mbit", "ddp"),
        ("hpsgd_mlp_100mbit", "100mbit", "localsgd"),
    ]
    ddp = rows[0]
    assert ddp.rate == pytest.approx(514.37, abs=0.01) and ddp.rate_error == pytest.approx(0.06, abs=0.01)
    assert abs(ddp.bytes_error) < 0.005


def test_the_summary_counts_the_cells_within_the_tolerance(capsys):
    assert main([str(SIM18B / "mlp_100m.json"), str(SIM18B / "hpsgd_cnn_unl.json")]) == 0
    out = capsys.readouterr().out
    assert "| hpsgd_cnn | unlimited | 2 | ddp | hpsgd_cnn_unl | 1114 | 576 | -48% |" in out
    # mlp_100m: +6 % and -0 %; hpsgd_cnn_unl: -48, -35 and -31 %; every byte count within 1 %
    assert out.rstrip().endswith("Within 15 %: samples/s 2 of 5, bytes per epoch 5 of 5.")
    rows = cells("x", json.loads((SIM18B / "hpsgd_cnn_unl.json").read_text()))
    assert tally_table(rows, tolerance=0.5).endswith("samples/s 3 of 3, bytes per epoch 3 of 3.")


def test_latest_counts_a_cell_measured_again_once_at_its_newest_measurement(tmp_path, capsys):
    again = tmp_path / "again.json"
    again.write_text((SIM18B / "mlp_100m.json").read_text())
    files = [str(SIM18B / "mlp_100m.json"), str(SIM18B / "hpsgd_cnn_unl.json"), str(again)]
    assert main(files) == 0
    assert capsys.readouterr().out.rstrip().endswith("samples/s 4 of 7, bytes per epoch 7 of 7.")
    assert main([*files, "--latest"]) == 0
    out = capsys.readouterr().out
    assert out.rstrip().endswith("samples/s 2 of 5, bytes per epoch 5 of 5.")
    assert "| ddp | again |" in out and "| ddp | mlp_100m |" not in out  # the later file's row, in its place
