"""Leftovers of killed benchmark runs are found by their owner's pid; the messages say `--cleanup` removes them."""

import os
import subprocess
import sys

import pytest

from benchmarks import leftovers, run
from benchmarks.leftovers import CLEANUP_COMMAND, Leftovers
from benchmarks.netns import list_namespaces, run_cmd
from benchmarks.straggler import cgroup_parent

DEAD = "999999997"  # beyond the kernel's largest pid (4194304): that run is gone


def test_names_of_dead_runs_only():
    mine = f"lhb-{os.getpid()}-0"
    names = [f"lhb-{DEAD}-0", f"lhb-{DEAD}-hub", mine, "lhb-x-0", "lhb-1", "other-999999999-0", f"lhb-{DEAD}-r1"]
    assert leftovers.of_dead_runs(names) == (f"lhb-{DEAD}-0", f"lhb-{DEAD}-hub", f"lhb-{DEAD}-r1")


def test_stale_cgroups_are_folders_of_dead_runs(tmp_path):
    for name in (f"lhb-{DEAD}-r1", f"lhb-{os.getpid()}-r1", "x"):
        (tmp_path / name).mkdir()
    (tmp_path / f"lhb-{DEAD}-file").write_text("")
    assert leftovers.stale_cgroups(tmp_path) == (f"lhb-{DEAD}-r1",)
    assert leftovers.stale_cgroups(None) == () and leftovers.stale_cgroups(tmp_path / "missing") == ()


def test_the_error_output_for_leftovers_names_them_and_says_cleanup_removes_them(tmp_path):
    (tmp_path / f"lhb-{DEAD}-r1").mkdir()
    left = leftovers.find([f"lhb-{DEAD}-0", f"lhb-{DEAD}-1", f"lhb-{DEAD}-hub"], tmp_path)
    assert left == Leftovers((f"lhb-{DEAD}-0", f"lhb-{DEAD}-1", f"lhb-{DEAD}-hub"), (f"lhb-{DEAD}-r1",))
    message = leftovers.remaining_message(left)
    assert message.startswith("benchmarks: leftovers of a killed run: network namespace(s) lhb-999999997-0, ")
    assert "and cgroup(s) lhb-999999997-r1." in message
    assert "`python -m benchmarks.run --cleanup` removes them" in message
    assert not leftovers.find([f"lhb-{os.getpid()}-0"], None)  # a live run's: nothing to report


def test_a_run_says_up_front_how_to_remove_its_own_if_it_is_killed():
    notice = leftovers.killed_run_notice("4242")
    assert "lhb-4242-*" in notice
    assert "if it is killed (SIGKILL), `python -m benchmarks.run --cleanup` removes them" in notice


def test_the_named_command_is_the_runners_cleanup_option():
    module, *options = CLEANUP_COMMAND.split()[2:]
    assert module == "benchmarks.run" and run.parse_args(options).cleanup


def test_a_run_removes_dead_runs_leftovers_and_reports_those_it_cannot(emulation, capsys):
    """For real (root): a killed run's namespace is removed; its cgroup, still holding a process, is reported."""
    parent = cgroup_parent()
    if parent is None:
        pytest.skip("no cgroup CPU controller")
    namespace, cgroup = f"lhb-{DEAD}-0", parent / f"lhb-{DEAD}-r1"
    run_cmd("ip", "netns", "add", namespace)
    cgroup.mkdir()
    orphan = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])  # a rank that outlived its run
    try:
        (cgroup / "cgroup.procs").write_text(f"{orphan.pid}\n")
        run.clear_leftovers()
        out, err = capsys.readouterr()
        assert f"[bench] removed leftovers of killed runs: {namespace}" in out
        assert namespace not in list_namespaces()
        assert f"benchmarks: leftovers of a killed run: cgroup(s) lhb-{DEAD}-r1." in err
        assert f"`{CLEANUP_COMMAND}` removes them" in err
        assert f"lhb-{os.getpid()}-*" in err  # this run's own notice
    finally:
        orphan.kill()
        orphan.wait()
        for name in list_namespaces():
            if name == namespace:
                run_cmd("ip", "netns", "delete", name)
        cgroup.rmdir()
