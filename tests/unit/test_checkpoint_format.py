import multiprocessing
import os
import signal
import stat
import warnings

import pytest
import torch

from lightning_hier.strategies import _checkpoint as ckpt
from lightning_hier.strategies import _checkpoint_file as ckpt_file

TOPO = {"world_size": 2, "data": 2, "pipe": 1, "model": 1, "num_nodes": 1}


def _ranks() -> list[dict]:
    return [{"model": {"w": torch.ones(1)}, "rng": (3, (1, 2), None)}, {"model": {"w": torch.zeros(1)}}]


def section(**overrides):
    ranks = _ranks()
    s = ckpt.strategy_section("localsgd", TOPO, {"w": torch.ones(1)}, ranks, [ckpt.state_digest(r) for r in ranks])
    s.update(overrides)
    return {ckpt.STATE_KEY: s, "state_dict": {"w": torch.ones(1)}}


def test_selects_own_rank():
    assert torch.equal(ckpt.select_rank_state(section(), "p", "localsgd", TOPO, 1)["model"]["w"], torch.zeros(1))


def test_rejects_other_strategy_layout_format_and_foreign_checkpoints():
    with pytest.raises(ckpt.CheckpointError, match=r"written by strategy 'hpsgd'.*uses 'localsgd'"):
        ckpt.select_rank_state(section(strategy="hpsgd"), "p", "localsgd", TOPO, 0)
    with pytest.raises(ValueError, match="layout"):
        ckpt.select_rank_state(section(), "p", "localsgd", {**TOPO, "world_size": 4, "data": 4}, 0)
    with pytest.raises(ValueError, match="format"):
        ckpt.select_rank_state(section(format=99), "p", "localsgd", TOPO, 0)
    with pytest.raises(ValueError, match="no lightning-hier strategy state"):
        ckpt.select_rank_state({"state_dict": {}}, "p", "localsgd", TOPO, 0)


def test_other_node_count_with_the_same_ranks_is_accepted():
    ckpt.select_rank_state(section(), "p", "localsgd", {**TOPO, "num_nodes": 2}, 0)


def test_a_short_ranks_list_names_the_file_and_both_counts():
    short = section()
    short[ckpt.STATE_KEY]["ranks"] = short[ckpt.STATE_KEY]["ranks"][:1]  # was a bare IndexError on rank 1
    expected = r"/x/last\.ckpt: it holds the states of 1 rank\(s\), but its world size is 2"
    with pytest.raises(ckpt.CheckpointError, match=expected):
        ckpt.select_rank_state(short, "/x/last.ckpt", "localsgd", TOPO, 1)
    with pytest.raises(ckpt.CheckpointError, match="checksums of the 2 rank states are missing"):
        ckpt.select_rank_state(section(checksums={"state_dict": "x"}), "p", "localsgd", TOPO, 0)


def test_a_weights_only_checkpoint_is_refused_for_resume():
    weights = {ckpt.STATE_KEY: ckpt.strategy_section("localsgd", TOPO, {"w": torch.ones(1)}, None, None)}
    with pytest.raises(ckpt.CheckpointError, match="saved with weights only"):
        ckpt.select_rank_state(weights, "p", "localsgd", TOPO, 0)


def test_a_rank_state_that_differs_from_its_checksum_is_found():
    c = section()
    assert not ckpt.rank_state_damaged(c, 0) and not ckpt.rank_state_damaged(c, 1)
    c[ckpt.STATE_KEY]["ranks"][1]["model"]["w"][0] = 1e-30  # one changed number
    assert ckpt.rank_state_damaged(c, 1) and not ckpt.rank_state_damaged(c, 0)
    err = ckpt.damaged_ranks_error("/x/a.ckpt", "localsgd", [1])
    assert "/x/a.ckpt" in str(err) and "rank 1's saved state does not match" in str(err)


def test_the_state_dict_checksum_is_checked():
    c = section()
    ckpt.check_state_dict(c, "p")
    c["state_dict"]["w"] += 1
    with pytest.raises(ckpt.CheckpointError, match=r"Cannot load the model from p: its 'state_dict' does not match"):
        ckpt.check_state_dict(c, "p")


def test_format_1_checkpoints_load_with_a_warning_and_without_checks():
    legacy = {ckpt.STATE_KEY: {"format": 1, "strategy": "localsgd", "topology": TOPO, "ranks": _ranks()}}
    with pytest.warns(UserWarning, match=r"p was written in checkpoint format 1, without checksums"):
        state = ckpt.select_rank_state(legacy, "p", "localsgd", TOPO, 1)
    assert torch.equal(state["model"]["w"], torch.zeros(1)) and not ckpt.rank_state_damaged(legacy, 1)


def test_state_digest_survives_a_save_and_load_and_sees_every_kind_of_change(tmp_path):
    state = {
        "t": torch.arange(6, dtype=torch.float32).view(2, 3)[:, 1:],  # a non-contiguous view
        "bf16": torch.ones(3, dtype=torch.bfloat16),
        "scalar": torch.tensor(2.5),
        "rng": (3, tuple(range(5)), None),
        "groups": [{"lr": 0.1, "betas": (0.9, 0.99), "params": [0, 1], "foreach": None}],
        "n": 7,
    }
    digest = ckpt.state_digest(state)
    torch.save(state, tmp_path / "s.pt")
    assert ckpt.state_digest(torch.load(tmp_path / "s.pt", weights_only=True)) == digest
    changed = [
        {**state, "t": state["t"] + 1},
        {**state, "t": state["t"].reshape(-1)},  # same bytes, other shape
        {**state, "t": state["t"].double()},
        {**state, "n": 8},
        {**state, "rng": (3, tuple(range(5)), 0.0)},
        {**state, "groups": [{**state["groups"][0], "lr": 0.2}]},
    ]
    assert all(ckpt.state_digest(c) != digest for c in changed)


def test_detach_state_makes_compact_copies_of_views():
    big = torch.zeros(1000)
    state = ckpt.detach_state({"a": big[:2], "b": [big[2:3], (1, "x")]})
    assert state["a"].untyped_storage().nbytes() == 8
    assert state["b"][1] == (1, "x")


class _Unpicklable:
    def __reduce__(self):
        raise RuntimeError("disk full")


def test_atomic_save_never_corrupts_the_previous_file(tmp_path):
    path = tmp_path / "last.ckpt"
    ckpt_file.atomic_save({"v": torch.ones(3)}, path)
    with pytest.raises(RuntimeError, match="disk full"):
        ckpt_file.atomic_save({"v": _Unpicklable()}, path)
    assert torch.equal(torch.load(path, weights_only=True)["v"], torch.ones(3))
    assert [p.name for p in tmp_path.iterdir()] == ["last.ckpt"]  # no temporary file left behind


def test_atomic_save_writes_files_with_the_mode_of_a_plain_open(tmp_path):
    path = tmp_path / "a.ckpt"
    ckpt_file.atomic_save({"v": torch.ones(1)}, path)
    plain = tmp_path / "plain"
    plain.write_bytes(b"")  # what Lightning's own checkpoint writes get: 0666 less the umask
    assert stat.S_IMODE(os.stat(path).st_mode) == stat.S_IMODE(os.stat(plain).st_mode)
    old = os.umask(0o077)  # and it follows the umask, not a fixed mode
    try:
        ckpt_file.atomic_save({"v": torch.ones(1)}, tmp_path / "b.ckpt")
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(tmp_path / "b.ckpt").st_mode) == 0o600


class _KillDuringSave:
    """Pickled in the middle of a checkpoint: the writing process dies with SIGKILL during the save."""

    def __reduce__(self):
        os.kill(os.getpid(), signal.SIGKILL)


def _killed_writer(path: str) -> None:
    ckpt_file.atomic_save({"a": torch.ones(1000), "b": _KillDuringSave()}, path)


def test_the_next_save_removes_temporary_files_of_a_writer_killed_during_its_save(tmp_path):
    target = tmp_path / "epoch=0.ckpt"
    writer = multiprocessing.get_context("fork").Process(target=_killed_writer, args=(str(target),))
    writer.start()
    writer.join()
    assert writer.exitcode == -signal.SIGKILL
    left = [p.name for p in tmp_path.iterdir()]
    assert len(left) == 1 and left[0].startswith(".epoch=0.ckpt.lhtmp-") and left[0].endswith(".tmp")
    others = [".x.ckpt.abc.tmp", "notes.tmp", f".y.ckpt.lhtmp-{ckpt_file._host()}-{os.getpid()}-abcd1234.tmp"]
    for name in others:  # not ours, or a live writer's (this process): kept
        (tmp_path / name).write_bytes(b"")
    ckpt_file.atomic_save({"v": torch.ones(1)}, tmp_path / "epoch=1.ckpt")
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([*others, "epoch=1.ckpt"])


def _write(path, data: bytes):
    path.write_bytes(data)
    return str(path)


def _load(path):
    return ckpt_file.read_checkpoint(path, lambda: torch.load(path, weights_only=True))


def test_unreadable_files_give_errors_that_name_the_file_and_the_problem(tmp_path):
    good = tmp_path / "good.ckpt"
    torch.save({"state_dict": {"w": torch.randn(1000)}}, good)
    data = good.read_bytes()
    cases = {
        "empty": (b"", r"the file is empty \(0 bytes\)"),  # was a bare EOFError
        "truncated": (data[: len(data) // 2], "the file is a truncated or damaged torch checkpoint"),
        "text": (b"epoch: 3\nloss: 0.1\n", r"the file is not a torch checkpoint \(19 bytes, starting with b'epoc'\)"),
    }
    for name, (content, message) in cases.items():
        path = _write(tmp_path / f"{name}.ckpt", content)
        expected = rf"Cannot load checkpoint {path}: {message}.*torch\.load raised"
        with pytest.raises(ckpt.CheckpointError, match=expected):
            _load(path)
    tensor = tmp_path / "tensor.pt"
    torch.save(torch.ones(1), tensor)
    with pytest.raises(ckpt.CheckpointError, match="holding a Tensor, not a Lightning checkpoint"):
        _load(str(tensor))
    with pytest.raises(FileNotFoundError):  # file-system errors pass through: they name the file
        _load(str(tmp_path / "missing.ckpt"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert _load(str(good))["state_dict"]["w"].shape == (1000,)
