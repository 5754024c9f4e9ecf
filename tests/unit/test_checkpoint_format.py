import pytest
import torch

from lightning_hier.strategies import _checkpoint as ckpt

TOPO = {"world_size": 2, "data": 2, "pipe": 1, "model": 1, "num_nodes": 1}


def section(**overrides):
    s = ckpt.strategy_section("localsgd", TOPO, [{"model": {"w": torch.ones(1)}}, {"model": {"w": torch.zeros(1)}}])
    s.update(overrides)
    return {ckpt.STATE_KEY: s}


def test_selects_own_rank():
    assert torch.equal(ckpt.select_rank_state(section(), "p", "localsgd", TOPO, 1)["model"]["w"], torch.zeros(1))


def test_rejects_other_strategy_layout_format_and_foreign_checkpoints():
    with pytest.raises(ValueError, match=r"written by strategy 'hpsgd'.*uses 'localsgd'"):
        ckpt.select_rank_state(section(strategy="hpsgd"), "p", "localsgd", TOPO, 0)
    with pytest.raises(ValueError, match="layout"):
        ckpt.select_rank_state(section(), "p", "localsgd", {**TOPO, "world_size": 4, "data": 4}, 0)
    with pytest.raises(ValueError, match="format"):
        ckpt.select_rank_state(section(format=99), "p", "localsgd", TOPO, 0)
    with pytest.raises(ValueError, match="no lightning-hier strategy state"):
        ckpt.select_rank_state({"state_dict": {}}, "p", "localsgd", TOPO, 0)


def test_other_node_count_with_the_same_ranks_is_accepted():
    ckpt.select_rank_state(section(), "p", "localsgd", {**TOPO, "num_nodes": 2}, 0)


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
    ckpt.atomic_save({"v": torch.ones(3)}, path)
    with pytest.raises(RuntimeError, match="disk full"):
        ckpt.atomic_save({"v": _Unpicklable()}, path)
    assert torch.equal(torch.load(path, weights_only=True)["v"], torch.ones(3))
    assert [p.name for p in tmp_path.iterdir()] == ["last.ckpt"]  # no temporary file left behind


def test_atomic_save_writes_files_with_the_mode_of_a_plain_open(tmp_path):
    import os
    import stat

    path = tmp_path / "a.ckpt"
    ckpt.atomic_save({"v": torch.ones(1)}, path)
    plain = tmp_path / "plain"
    plain.write_bytes(b"")  # what Lightning's own checkpoint writes get: 0666 less the umask
    assert stat.S_IMODE(os.stat(path).st_mode) == stat.S_IMODE(os.stat(plain).st_mode)
