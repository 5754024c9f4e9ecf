"""The Hydra entry point as a user runs it: a subprocess, single run (popen ranks) and a multirun."""

import json
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _train(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "lightning_hier.train", *args], capture_output=True, text=True, timeout=300, cwd=cwd
    )


def _summary_value(output: str, key: str) -> str:
    match = re.search(rf"^\s+{key}\s+(.+)$", output, re.MULTILINE)
    assert match, output[-3000:]
    return match.group(1).strip()


def test_default_run_trains_digits_on_two_processes(tmp_path):
    proc = _train(f"hydra.run.dir={tmp_path}/run", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert _summary_value(out, "strategy") == "hpsgd"
    assert _summary_value(out, "world size").startswith("2 ")
    assert _summary_value(out, "epochs") == "10"
    assert float(_summary_value(out, "val accuracy")) >= 0.90
    assert float(_summary_value(out, "samples/s").split()[0].replace(",", "")) > 0
    assert "Epoch 9" in proc.stdout + proc.stderr  # the progress bar
    # one log per rank in the run's own directory (popen re-runs the entry point for rank 1)
    run = tmp_path / "run"
    assert (run / "train.log").is_file() and (run / "train_ddp_process_1.log").is_file()
    assert (run / "logs" / "version_0" / "metrics.csv").is_file()
    # the summary also lands in the run directory: for programs, for people, and in Hydra's log
    summary = json.loads((run / "summary.json").read_text())
    assert summary["strategy"] == "hpsgd" and summary["epochs"] == 10 and summary["val_acc"] >= 0.90
    assert "lightning-hier run summary" in (run / "summary.txt").read_text()
    assert "lightning-hier run summary" in (run / "train.log").read_text()

    # resume from the Hydra command line: the checkpoint names need no quoting
    last = run / "logs" / "version_0" / "checkpoints" / "last.ckpt"
    assert last.is_file()
    resumed = _train(
        f"ckpt_path={last}",
        "trainer.max_epochs=11",
        "trainer.enable_progress_bar=false",
        f"hydra.run.dir={tmp_path}/resumed",
        cwd=tmp_path,
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert _summary_value(resumed.stdout, "epochs") == "11"


def test_multirun_sweep_runs_each_job_in_its_own_directory(tmp_path):
    proc = _train(
        "-m",
        "strategy=ddp,localsgd",
        "trainer.max_epochs=1",
        "trainer.enable_progress_bar=false",
        f"hydra.sweep.dir={tmp_path}/sweep",
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [m for m in re.findall(r"^\s+strategy\s+(\S+)", proc.stdout, re.MULTILINE)] == ["ddp", "localsgd"]
    jobs = sorted(p.name for p in (tmp_path / "sweep").iterdir() if p.is_dir())
    assert jobs == ["0_ddp", "1_localsgd"]
    for job in jobs:
        assert (tmp_path / "sweep" / job / "logs" / "version_0" / "metrics.csv").is_file()
        assert (tmp_path / "sweep" / job / "summary.json").is_file()
    # the sweep ends with a table of its jobs, printed and saved
    table = (tmp_path / "sweep" / "summary.md").read_text()
    assert table in proc.stdout
    # (Hydra writes a sweep job's booleans capitalised)
    assert "common overrides: `trainer.max_epochs=1` `trainer.enable_progress_bar=false`" in table.lower()
    rows = [line.split(" | ") for line in table.splitlines() if re.match(r"\| \d", line)]
    assert [(r[0], r[1]) for r in rows] == [("| 0", "ddp"), ("| 1", "localsgd")]
    assert all(0.0 <= float(r[3]) <= 1.0 and float(r[4]) > 0 and float(r[5]) > 0 for r in rows)
    assert (tmp_path / "sweep" / "summary.csv").read_text().startswith("job,strategy,arguments,val acc")


def test_bad_strategy_argument_fails_before_training(tmp_path):
    proc = _train("strategy.window=0", f"hydra.run.dir={tmp_path}/run", cwd=tmp_path)
    assert proc.returncode != 0
    assert "argument `window` must be an integer >= 1, got 0" in proc.stderr
    assert "Epoch 0" not in proc.stderr
