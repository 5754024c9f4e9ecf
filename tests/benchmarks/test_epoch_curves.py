"""benchmarks.epoch_curves: accuracy per epoch from Lightning's CSV logs, as a table and a plot."""

from pathlib import Path

import pytest

from benchmarks.epoch_curves import accuracy_by_epoch, main


def _run(root: Path, version: int, accs: list[float]) -> Path:
    logs = root / "logs" / f"version_{version}"
    logs.mkdir(parents=True)
    lines = ["epoch,step,train/loss,val/acc"]
    for e, a in enumerate(accs):
        lines += [f"{e},{10 * e + 5},1.0,", f"{e},{10 * e + 9},,{a}"]  # a training row, then the validation row
    (logs / "metrics.csv").write_text("\n".join(lines) + "\n")
    return root


def test_the_latest_versions_validation_rows_in_epoch_order(tmp_path):
    run = _run(tmp_path / "a", 0, [0.1, 0.2])
    _run(run, 10, [0.3, 0.4, 0.5])  # version_10 sorts after version_2 by number, not by name
    _run(run, 2, [0.9])
    assert accuracy_by_epoch(run) == [0.3, 0.4, 0.5]
    with pytest.raises(FileNotFoundError, match="no logs/version_"):
        accuracy_by_epoch(tmp_path / "missing")


def test_main_prints_a_table_and_writes_the_plot(tmp_path, capsys):
    a, b = _run(tmp_path / "a", 0, [0.1, 0.2]), _run(tmp_path / "b", 0, [0.15, 0.25])
    png = tmp_path / "out.png"
    assert main([str(png), f"bp={a}", f"K=2={b}"]) == 0
    table = capsys.readouterr().out.splitlines()
    assert table[0] == "| run | 1 | 2 |"
    assert table[2:] == ["| bp | 0.100 | 0.200 |", "| K=2 | 0.150 | 0.250 |"]
    assert png.stat().st_size > 0
    assert main([str(png), "no-equals-sign"]) == 2


def test_a_label_with_several_seeds_prints_the_mean_and_range_over_the_epochs_all_reached(tmp_path, capsys):
    a = _run(tmp_path / "a", 0, [0.1, 0.4, 0.9])
    b = _run(tmp_path / "b", 0, [0.3, 0.2])  # stopped after 2 epochs: the third is left out
    one = _run(tmp_path / "c", 0, [0.5, 0.6])
    png = tmp_path / "out.png"
    assert main([str(png), f"K=2={a},{b}", f"bp={one}"]) == 0
    table = capsys.readouterr().out.splitlines()
    assert table[0] == "| run | 1 | 2 |"
    assert table[2:] == ["| K=2 | 0.200 (0.100-0.300) | 0.300 (0.200-0.400) |", "| bp | 0.500 | 0.600 |"]
    assert png.stat().st_size > 0
