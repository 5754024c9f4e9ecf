"""The emulated cluster for real (root): shaped links, byte counters, cleanup, failing ranks, cgroups."""

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from benchmarks.launch import JobFailed, run_job
from benchmarks.netns import (
    EmulatedCluster,
    Link,
    cleanup,
    interrupts_deferred,
    list_namespaces,
    parse_rate,
    run_cmd,
)
from benchmarks.straggler import CpuQuota, cgroup_flavour
from tests.benchmarks.conftest import processes_mentioning, send_between

MiB = 2**20


def test_rates():
    assert parse_rate("100mbit") == 1e8 and parse_rate("1gbit") == 1e9 and parse_rate("1.5kbit") == 1500.0
    assert parse_rate("unlimited") is None and Link("unlimited").tbf_args() is None
    assert Link("1gbit").tbf_args() == ["tbf", "rate", "1gbit", "burst", "256kb", "latency", "100ms"]
    for bad in ("1gbps", "fast", "0mbit", "-1gbit"):
        with pytest.raises(ValueError, match="link rate must be"):
            Link(bad)


def test_interrupts_wait_for_the_end_of_a_deferred_block():
    got: list[int] = []
    old = signal.signal(signal.SIGHUP, lambda signum, frame: got.append(signum))
    try:
        with interrupts_deferred():
            os.kill(os.getpid(), signal.SIGHUP)
            time.sleep(0.1)  # room for the handler to run, were the signal not held
            assert got == []
        assert got == [signal.SIGHUP]
    finally:
        signal.signal(signal.SIGHUP, old)


def _mine() -> list[str]:
    return [n for n in list_namespaces() if n.startswith(f"lhb-{os.getpid()}-")]


def test_cluster_shapes_both_ends_counts_bytes_and_cleans_up(emulation):
    with EmulatedCluster(2, Link("100mbit")) as cluster:
        assert _mine() == [cluster.namespace(0), cluster.namespace(1), cluster.hub]
        assert "tbf" in cluster.qdisc(0) and "rate 100Mbit" in cluster.qdisc(1)
        hub_side = run_cmd("tc", "-n", cluster.hub, "qdisc", "show", "dev", "lhbr1")
        assert "tbf" in hub_side and "rate 100Mbit" in hub_side
        assert run_cmd("ip", "link", "show").count("lhb") == 0  # nothing in the host's namespace
        before = [cluster.counters(r) for r in range(2)]
        send_between(cluster, 0, 1, MiB)
        after = [cluster.counters(r) for r in range(2)]
        assert after[0]["tx"] - before[0]["tx"] >= MiB and after[1]["rx"] - before[1]["rx"] >= MiB
        assert after[1]["tx"] - before[1]["tx"] < MiB // 4  # acknowledgements only
        cluster.set_link(Link("unlimited"))
        assert "tbf" not in cluster.qdisc(0)
    assert _mine() == []
    with pytest.raises(RuntimeError, match="inside"), EmulatedCluster(2, Link("1gbit")):
        raise RuntimeError("inside")
    assert _mine() == []


def test_cleanup_removes_namespaces_of_dead_runs_only(emulation):
    dead = "lhb-999999999-0"  # beyond pid_max: that run is gone
    run_cmd("ip", "netns", "add", dead)
    try:
        with EmulatedCluster(1, Link("1gbit")) as cluster:
            removed = cleanup(stale_only=True)
            # other dead runs' namespaces may be swept too (a benchmark killed on this machine);
            # what matters is that this one went and no live run's did
            assert dead in removed
            assert not [n for n in removed if n.startswith(f"lhb-{os.getpid()}-")]
            assert cluster.namespace(0) in list_namespaces() and cluster.hub in list_namespaces()
    finally:
        cleanup(stale_only=True)
    assert dead not in list_namespaces()


def test_a_failing_rank_ends_the_job_and_its_peers(emulation, tmp_path):
    # rank 1 fails at once (its delay callback raises), while rank 0 goes on to wait for it in the
    # rendezvous: the runner must end rank 0 and report rank 1's error
    spec = {"ranks": 2, "searchpath": None, "overrides": ["data=synthetic", "strategy=ddp"]}
    spec["delay"] = {"ranks": [1], "factor": 2.0, "callback": "tests.benchmarks.failing_callback:factory"}
    with EmulatedCluster(2, Link("1gbit")) as cluster, pytest.raises(JobFailed) as info:
        run_job(cluster, spec, tmp_path, port=29391, timeout_s=120)
    assert "rank 1 exited with code 1" in str(info.value) and "rank 1 fails on purpose" in str(info.value)
    assert processes_mentioning(str(tmp_path)) == []
    assert _mine() == []


def test_cgroup_quota_holds_the_rank_process(emulation):
    if cgroup_flavour() is None:
        pytest.skip("no cgroup CPU controller on this host")
    quota = CpuQuota(f"lhb-{os.getpid()}-rtest", 2.0)
    try:
        with subprocess.Popen(["sleep", "30"], preexec_fn=quota.join) as proc:
            try:
                assert f"/lhb-{os.getpid()}-rtest" in Path(f"/proc/{proc.pid}/cgroup").read_text()
            finally:
                proc.kill()
    finally:
        quota.remove()
    assert not quota.path.exists()


def test_a_job_on_one_rank_of_the_cluster_is_one_process(emulation, tmp_path):
    """The single-process baseline (issue 19): one rank starts, a world of one, nothing on the links."""
    tiny = ["data=synthetic", "data.train_size=64", "data.val_size=32", "strategy=ddp", "trainer.max_epochs=1"]
    spec = {"searchpath": None, "overrides": tiny}
    with EmulatedCluster(2, Link("1gbit")) as cluster:
        job = run_job(cluster, spec, tmp_path, port=29394, timeout_s=120, ranks=1)
        with pytest.raises(ValueError, match=r"`ranks` must be in \[1, 2\]"):
            run_job(cluster, spec, tmp_path, port=29395, timeout_s=120, ranks=3)
    assert [(r["rank"], r["world_size"], r["num_nodes"]) for r in job.ranks] == [(0, 1, 1)]
    assert job.cores == job.cores[:1] and len(job.cores) == 1
    assert sum(job.tx_bytes) < 64 * 1024  # no training traffic: at most the namespaces' own chatter
    assert not (tmp_path / "rank1.log").exists()
