"""Damaged and unreadable checkpoints stop a resume with an error naming the file and the problem.

Before checksums, a checkpoint with 2,000 bytes flipped in the middle loaded (``weights_only=True``)
and the run resumed from a wrong model with exit code 0; an empty file gave a bare ``EOFError`` and
a short ``ranks`` list a bare ``IndexError``.
"""

from pathlib import Path

import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_hier import CheckpointError, LocalSGDStrategy
from lightning_hier.strategies._checkpoint import STATE_KEY
from lightning_hier.testing import WorkerFailed, run_workers
from tests.helpers import digits, digits_classifier, trainer


def _fit(ckpt_dir: str, resume: str | None, epochs: int) -> str:
    """Fit (or resume); the error message of a failed fit, so that every rank's can be compared."""
    torch.manual_seed(0)
    checkpoint = ModelCheckpoint(dirpath=ckpt_dir, filename="last")
    t = trainer(
        strategy=LocalSGDStrategy(tau=3, timeout=30),
        max_epochs=epochs,
        callbacks=[checkpoint],
        enable_checkpointing=True,
    )
    try:
        t.fit(digits_classifier(hidden=(64,)), datamodule=digits(batch_size=64), ckpt_path=resume)
    except CheckpointError as exc:
        return f"CheckpointError: {exc}"
    return "ok"


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("integrity")
    assert run_workers(_fit, str(path), None, 1, devices=2) == ["ok", "ok"]
    return path / "last.ckpt"


def _resume(path: Path, tmp_path: Path) -> list[str]:
    return run_workers(_fit, str(tmp_path / "resumed"), str(path), 2, devices=2)


def test_an_intact_checkpoint_resumes(saved, tmp_path):
    assert _resume(saved, tmp_path) == ["ok", "ok"]


def test_flipped_bytes_in_the_middle_of_the_file_stop_the_resume_on_every_rank(saved, tmp_path):
    data = bytearray(saved.read_bytes())
    middle = len(data) // 2
    data[middle : middle + 2000] = bytes(b ^ 0xFF for b in data[middle : middle + 2000])
    damaged = tmp_path / "damaged.ckpt"
    damaged.write_bytes(bytes(data))
    torch.load(damaged, weights_only=True)  # still unpickles: only the checksums can tell
    errors = _resume(damaged, tmp_path)
    assert errors[0] == errors[1]
    assert f"Cannot resume 'localsgd' from {damaged}: " in errors[0]
    assert "does not match the SHA-256 checksum written with it" in errors[0]


def test_the_error_names_the_rank_whose_state_is_damaged(saved, tmp_path):
    checkpoint = torch.load(saved, weights_only=True)
    weight = checkpoint[STATE_KEY]["ranks"][1]["model"]["net.0.1.weight"]
    weight[0, 0] += 1e-3
    damaged = tmp_path / "rank1.ckpt"
    torch.save(checkpoint, damaged)
    errors = _resume(damaged, tmp_path)
    # rank 0's own state is intact, yet it stops too, with the same message naming rank 1
    assert errors[0] == errors[1] and "rank 1's saved state does not match" in errors[0]


def test_a_short_ranks_list_names_the_file_and_both_counts(saved, tmp_path):
    checkpoint = torch.load(saved, weights_only=True)
    checkpoint[STATE_KEY]["ranks"] = checkpoint[STATE_KEY]["ranks"][:1]
    short = tmp_path / "short.ckpt"
    torch.save(checkpoint, short)
    errors = _resume(short, tmp_path)
    assert errors[0] == errors[1] and f"{short}: it holds the states of 1 rank(s), but its world size is 2" in errors[0]


@pytest.mark.parametrize(
    ("name", "cut", "message"),
    [
        ("empty", 0, "the file is empty (0 bytes)"),
        ("truncated", 0.5, "the file is a truncated or damaged torch checkpoint"),
    ],
)
def test_an_empty_or_truncated_file_names_the_file(saved, tmp_path, name, cut, message):
    data = saved.read_bytes()
    bad = tmp_path / f"{name}.ckpt"
    bad.write_bytes(data[: int(len(data) * cut)])
    errors = _resume(bad, tmp_path)
    assert errors[0] == errors[1] and f"Cannot load checkpoint {bad}: {message}" in errors[0]


def test_validating_from_a_damaged_checkpoint_fails_on_its_state_dict(saved, tmp_path):
    checkpoint = torch.load(saved, weights_only=True)
    checkpoint["state_dict"]["net.0.1.bias"][0] += 1.0
    damaged = tmp_path / "consensus.ckpt"
    torch.save(checkpoint, damaged)

    def validate() -> None:
        t = trainer(strategy=LocalSGDStrategy(tau=3, timeout=30))
        t.validate(digits_classifier(hidden=(64,)), datamodule=digits(batch_size=64), ckpt_path=str(damaged))

    with pytest.raises(WorkerFailed, match=r"Cannot load the model from .*consensus\.ckpt: its 'state_dict' does not"):
        run_workers(validate, devices=2)


def test_a_checkpoint_of_the_previous_format_without_checksums_still_resumes(saved, tmp_path):
    checkpoint = torch.load(saved, weights_only=True)
    section = checkpoint[STATE_KEY]
    section["format"] = 1
    del section["checksums"]
    for rank in section["ranks"]:
        del rank["data"]  # format 1 had no data position either
    legacy = tmp_path / "format1.ckpt"
    torch.save(checkpoint, legacy)
    assert _resume(legacy, tmp_path) == ["ok", "ok"]
