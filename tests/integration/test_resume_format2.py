"""Checkpoints written in format 2 (before the strategies' state was keyed by component) still resume exactly.

The files under ``tests/fixtures/format2`` were written by ``python -m tests.fixtures.format2.make``
on the version that wrote format 2: the checkpoint of step 16 of each case of
``test_resume_exact.py``, and every rank's parameters after the last step of that uninterrupted run.
The current code resumes each file and must reach the same parameters: bit for bit on a CPU like
the one that wrote them, and to ``ATOL`` on another (on an AMD EPYC the 8 resumed steps end 1-2
float32 ulps, 1.5e-8 to 3e-8, from the files' parameters: its kernels round differently). A piece
of state that were not restored (momentum, RNG, data position, a window in flight) changes the
steps themselves, far beyond rounding; bit-exact resume on one machine is ``test_resume_exact.py``'s.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lightning_hier.testing import run_workers
from tests.fixtures.format2.make import CASES

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "format2"
ATOL = 1e-6  # parameters of size ~0.2: about 60 float32 ulps


@pytest.mark.parametrize("name", list(CASES))
def test_a_format2_checkpoint_resumes_bit_identically(name, tmp_path):
    path = FIXTURES / f"{name}.ckpt"
    assert torch.load(path, weights_only=True)["lightning_hier"]["format"] == 2
    fit, head, tail, devices = CASES[name]
    resumed = run_workers(fit, *head, str(tmp_path), str(path), *tail, devices=devices)
    expected = torch.load(FIXTURES / f"{name}.expected.pt", weights_only=True)
    assert len(resumed) == len(expected)
    for rank, (got, want) in enumerate(zip(resumed, expected, strict=True)):
        assert got["steps"] == want["steps"], f"rank {rank} resumed at other steps"
        where = f"rank {rank} differs after step {want['steps'][-1]}"
        torch.testing.assert_close(got["params"][-1], want["final"], rtol=0, atol=ATOL, msg=where)
