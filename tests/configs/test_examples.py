"""The runnable examples of the docs run as a user runs them: a plain PyTorch loop and a Lightning Fabric loop."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[2] / "docs" / "examples"
LAUNCH_ENV = ("LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "PL_GLOBAL_SEED")


def _run(script: str, tmp_path: Path) -> str:
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_ENV}
    proc = subprocess.run(
        [sys.executable, str(EXAMPLES / script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def test_the_plain_loop_trains_grawa_on_two_processes_to_one_model(tmp_path):
    out = _run("plain_loop.py", tmp_path)
    accs = re.findall(r"rank \d: validation accuracy ([0-9.]+), (\d+) rounds", out)
    assert len(accs) == 2 and accs[0] == accs[1], out  # the same model, the same rounds on both ranks
    assert float(accs[0][0]) > 0.6 and int(accs[0][1]) > 0, out


@pytest.mark.parametrize("script", ["fabric_loop.py"])
def test_the_fabric_loop_trains_hpsgd_on_two_processes_to_one_model(script, tmp_path):
    out = _run(script, tmp_path)  # the script asserts that the ranks' models are equal
    match = re.search(r"validation accuracy ([0-9.]+), ([0-9.]+) MiB sent per rank", out)
    assert match and float(match.group(1)) > 0.6 and float(match.group(2)) > 0, out
