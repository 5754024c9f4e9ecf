"""Straggler emulation: cgroup quota files (on a fake cgroup tree), the delay callback, validation."""

import pytest

from benchmarks.straggler import (
    DEFAULT_DELAY_CALLBACK,
    PERIOD_US,
    CpuQuota,
    Straggler,
    cgroup_flavour,
    load_factory,
    quota_us,
    remove_stale_cgroups,
)


def test_straggler_arguments_are_checked():
    with pytest.raises(ValueError, match="mode must be one of cgroup, delay, got 'slow'"):
        Straggler(ranks=(1,), factor=2.0, mode="slow")
    with pytest.raises(ValueError, match="factor must be in"):
        Straggler(ranks=(1,), factor=1.0)
    with pytest.raises(ValueError, match="ranks must be one or more ranks >= 0"):
        Straggler(ranks=(-1,), factor=2.0)
    with pytest.raises(ValueError, match="ranks must be one or more ranks >= 0"):
        Straggler(ranks=(), factor=2.0)


def test_quota_is_one_over_factor_of_a_core():
    assert quota_us(2.0) == PERIOD_US // 2 and quota_us(4.0) == PERIOD_US // 4
    assert quota_us(1000.0) == 1000  # never below the kernel's minimum
    assert quota_us(2.0, cores=2) == PERIOD_US  # a slow node of 2 ranks: half of 2 cores between them


def test_cgroup_v1_and_v2_quota_files(tmp_path):
    v1 = tmp_path / "v1"
    (v1 / "cpu").mkdir(parents=True)
    (v1 / "cpu" / "cpu.cfs_quota_us").write_text("-1\n")
    assert cgroup_flavour(v1) == ("v1", v1 / "cpu")
    q = CpuQuota("lhb-1-r1", 2.0, root=v1)
    assert (q.path / "cpu.cfs_period_us").read_text() == f"{PERIOD_US}\n"
    assert (q.path / "cpu.cfs_quota_us").read_text() == f"{PERIOD_US // 2}\n"
    (q.path / "cpu.stat").write_text("nr_periods 10\nnr_throttled 4\nthrottled_time 2500000000\n")
    assert q.throttled_s() == 2.5
    for f in q.path.iterdir():  # a real cgroup directory has no removable files; the fake one does
        f.unlink()
    q.remove()
    assert not q.path.exists()

    v2 = tmp_path / "v2"
    v2.mkdir()
    (v2 / "cgroup.controllers").write_text("cpu memory\n")
    (v2 / "cgroup.subtree_control").write_text("memory\n")
    assert cgroup_flavour(v2) is None  # cpu not delegated to children: unusable
    (v2 / "cgroup.subtree_control").write_text("cpu memory\n")
    q2 = CpuQuota("lhb-1-r0", 4.0, root=v2)
    assert (q2.path / "cpu.max").read_text() == f"{PERIOD_US // 4} {PERIOD_US}\n"
    (q2.path / "cpu.stat").write_text("usage_usec 9\nthrottled_usec 1500000\n")
    assert q2.throttled_s() == 1.5


def test_no_cgroup_controller_is_a_clear_error(tmp_path):
    with pytest.raises(RuntimeError, match="use --straggler-mode delay"):
        CpuQuota("lhb-1-r1", 2.0, root=tmp_path)


def test_stale_cgroups_of_dead_runs_are_removed(tmp_path):
    (tmp_path / "cpu").mkdir()
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("-1\n")
    dead, live, other = tmp_path / "cpu" / "lhb-999999999-r1", tmp_path / "cpu" / "lhb-1-r1", tmp_path / "cpu" / "x"
    for d in (dead, live, other):
        d.mkdir()
    assert remove_stale_cgroups(tmp_path) == ["lhb-999999999-r1"]  # pid 1 is alive; "x" is not ours
    assert live.exists() and other.exists() and not dead.exists()


def test_the_default_delay_callback_follows_the_protocol():
    callback = load_factory(DEFAULT_DELAY_CALLBACK)(ranks=[1], factor=2.0)
    assert callback.ranks == [1] and callback.factor == 2.0


def test_delay_callback_factory_is_pluggable():
    assert load_factory("benchmarks.straggler:Straggler") is Straggler
    for bad, msg in (
        ("nocolon", "module:attr"),
        ("benchmarks.straggler:Nope", "cannot be imported"),
        ("benchmarks.straggler:PERIOD_US", "not callable"),
    ):
        with pytest.raises(ValueError, match=msg):
            load_factory(bad)
