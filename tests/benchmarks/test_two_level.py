"""The two-level emulated cluster (issue 20): nodes of several ranks, loopback inside, shaped links between.

The layout arithmetic, the ranks' environment and the runner's checks run anywhere; the namespaces,
their links and a real Lightning job on 2 nodes x 2 ranks need root (skipped elsewhere).
"""

import argparse
import fcntl
import os

import pytest

from benchmarks import run
from benchmarks.launch import rank_env, run_job
from benchmarks.netns import RANK_IF, EmulatedCluster, Link, list_namespaces, run_cmd
from benchmarks.rank import layout_overrides
from benchmarks.report import workload_table
from benchmarks.scenarios import WORKLOADS, plan
from tests.benchmarks.conftest import send_between

MiB = 2**20
TAG = f"{os.getpid()}-net2t"  # the process id first (cleanup reads it), then a label of these tests


def test_ranks_of_a_node_share_its_namespace_and_address():
    cluster = EmulatedCluster(4, Link("100mbit"), tag=TAG, ranks_per_node=2)
    assert (cluster.nodes, [cluster.node_of(r) for r in range(4)]) == (2, [0, 0, 1, 1])
    assert cluster.namespace(0) == cluster.namespace(1) == f"lhb-{TAG}-0" != cluster.namespace(2)
    assert [cluster.address(r) for r in range(4)] == ["10.213.0.1", "10.213.0.1", "10.213.0.2", "10.213.0.2"]
    flat = EmulatedCluster(2, Link("1gbit"), tag=TAG)  # the default: every rank its own node
    assert flat.nodes == 2 and flat.namespace(1) == f"lhb-{TAG}-1" and flat.address(1) == "10.213.0.2"
    with pytest.raises(ValueError, match=r"`ranks_per_node` must be >= 1 and divide ranks=4, got 3"):
        EmulatedCluster(4, Link("1gbit"), ranks_per_node=3)


def test_ranks_see_the_layout_lightnings_launcher_would_give_them():
    cluster = EmulatedCluster(4, Link("100mbit"), tag=TAG, ranks_per_node=2)
    envs = [rank_env(cluster, r, port=29999, run_id="x") for r in range(4)]
    assert [(e["RANK"], e["NODE_RANK"], e["LOCAL_RANK"], e["GROUP_RANK"]) for e in envs] == [
        ("0", "0", "0", "0"),
        ("1", "0", "1", "0"),
        ("2", "1", "0", "1"),
        ("3", "1", "1", "1"),
    ]
    for e in envs:
        assert (e["WORLD_SIZE"], e["LOCAL_WORLD_SIZE"], e["MASTER_ADDR"]) == ("4", "2", "10.213.0.1")
        assert e["GLOO_SOCKET_IFNAME"] == RANK_IF and "TORCHELASTIC_USE_AGENT_STORE" not in e
    assert layout_overrides(4, 2) == ["trainer.devices=2", "trainer.num_nodes=2"]
    assert layout_overrides(2) == ["trainer.devices=1", "trainer.num_nodes=2"]


def test_two_level_workloads_ask_for_a_two_level_cluster():
    the_plan = plan({"ddp", "hpsgd"}, workloads=["two_level_mlp"])
    flat = argparse.Namespace(ranks=4, ranks_per_node=1)
    problem = run.layout_problem(flat, the_plan)
    assert (
        problem is not None and "two_level_mlp need a two-level cluster" in problem and "--ranks-per-node 2" in problem
    )
    assert run.layout_problem(argparse.Namespace(ranks=2, ranks_per_node=2), the_plan) is not None  # one node
    assert run.layout_problem(argparse.Namespace(ranks=4, ranks_per_node=2), the_plan) is None
    with pytest.raises(SystemExit):
        run.parse_args(["--ranks", "4", "--ranks-per-node", "3"])
    with pytest.raises(SystemExit):
        run.parse_args(["--name", "Bad-Name"])  # goes into namespace names


def test_the_two_level_scenarios_build_their_strategies_on_two_nodes():
    """What the runner checks before it starts: each run composes and constructs on 2 nodes x 2 ranks."""
    args = argparse.Namespace(quick=True, epochs=None, extra=[], ranks=4, ranks_per_node=2, straggler_mode="delay")
    args.straggler_callback = run.DEFAULT_DELAY_CALLBACK
    the_plan = plan({"ddp", "hpsgd", "dbs", "dbs_hpsgd"}, workloads=["two_level_mlp", "two_level_dbs"])
    assert "hpsgd-2level" in [s.label for s in the_plan.runs["two_level_mlp"]]
    assert "dbs_hpsgd" in [s.label for s in the_plan.runs["two_level_dbs"]]
    run.validate(args, the_plan, run.data_overrides(argparse.Namespace(synthetic=True)))


def test_slow_node_slows_every_rank_of_that_node():
    spec = WORKLOADS["two_level_dbs"].straggler_spec("delay", "m:f", ranks_per_node=2)
    assert spec is not None and spec.ranks == (2, 3) and spec.factor == 2.0


def test_a_job_holds_the_lock_exclusively(tmp_path):
    lock = tmp_path / "bench.lock"
    with run.exclusive(lock), open(lock) as other, pytest.raises(BlockingIOError):
        fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
    with open(lock) as other:
        fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)  # released after the job


def test_two_level_table_shows_bytes_inside_and_between_nodes():
    w = WORKLOADS["two_level_mlp"]
    run_ = {
        "args": {},
        "samples_per_s": 100.0,
        "epoch_s": 10.0,
        "final_acc": 0.5,
        "bytes_per_epoch": 3 * MiB,
        "intra_bytes_per_epoch": 7 * MiB,
        "blocked_s": None,
        "peak_rss_mb": 500.0,
    }
    row = dict.fromkeys(("samples_per_s_ratio", "epoch_s_ratio", "bytes_per_epoch_ratio"), 1.0)
    row |= {"time_to_target_s": 5.0, "final_acc_delta": 0.0, "acc_at_equal_time": 0.5}
    result = {"runs": {"ddp": run_}, "comparison": {"equal_time_s": 30.0, "rows": {"ddp": row}}}
    head, _, line = workload_table(w, result, two_level=True).splitlines()
    assert "| MB/epoch/rank | x DDP | intra MB/epoch/rank |" in head
    assert "| 3.0 | 1.000 | 7.0 |" in line
    assert "intra" not in workload_table(w, result)


# ------------------------------------------------------------------------------------- root only
def _mine() -> list[str]:
    return [n for n in list_namespaces() if n.startswith(f"lhb-{TAG}-")]


def test_inside_a_node_is_loopback_between_nodes_the_shaped_link(emulation):
    with EmulatedCluster(4, Link("100mbit"), tag=TAG, ranks_per_node=2) as cluster:
        assert _mine() == [cluster.namespace(0), cluster.namespace(2), cluster.hub]  # 2 nodes and the bridge
        for node in range(2):
            assert "rate 100Mbit" in cluster.qdisc(node) and "tbf" not in cluster.qdisc(node, dev="lo")
            assert "rate 100Mbit" in run_cmd("tc", "-n", cluster.hub, "qdisc", "show", "dev", f"lhbr{node}")
        before = [cluster.counters(n) for n in range(2)]
        send_between(cluster, 0, 1, MiB, port=5990 + 1)  # two ranks of node 0
        inside = [cluster.counters(n) for n in range(2)]
        assert inside[0]["intra_tx"] - before[0]["intra_tx"] >= MiB
        # no link crossed (a few hundred bytes of IPv6 neighbour discovery aside)
        assert inside[0]["tx"] - before[0]["tx"] < MiB // 4 and inside[1]["rx"] - before[1]["rx"] < MiB // 4
        send_between(cluster, 1, 2, MiB, port=5990 + 2)  # node 0 to node 1
        between = [cluster.counters(n) for n in range(2)]
        assert between[0]["tx"] - inside[0]["tx"] >= MiB and between[1]["rx"] - inside[1]["rx"] >= MiB
        assert between[0]["intra_tx"] - inside[0]["intra_tx"] < MiB // 4
    assert _mine() == []


def test_a_lightning_job_on_two_nodes_of_two_ranks(emulation, tmp_path):
    """Four ranks, two per namespace: Lightning sees 2 nodes, and the bytes split by level."""
    tiny = ["data=synthetic", "data.train_size=256", "data.val_size=64", "data.batch_size=32", "model=mlp"]
    tiny += ["model.hidden=[64]", "trainer.max_epochs=1", "strategy=ddp", "strategy.timeout.seconds=60"]
    with EmulatedCluster(4, Link("1gbit"), tag=TAG, ranks_per_node=2) as cluster:
        job = run_job(cluster, {"searchpath": None, "overrides": tiny}, tmp_path, port=29393, timeout_s=180)
    seen = [(r["rank"], r["node_rank"], r["local_rank"], r["num_nodes"], r["world_size"]) for r in job.ranks]
    assert seen == [(0, 0, 0, 2, 4), (1, 0, 1, 2, 4), (2, 1, 0, 2, 4), (3, 1, 1, 2, 4)]
    spaces = [r["net_namespace"] for r in job.ranks]
    assert spaces[0] == spaces[1] != spaces[2] == spaces[3] != os.stat("/proc/self/ns/net").st_ino
    # DDP's gradients cross both levels: a ring over 4 ranks has 2 hops inside nodes and 2 between
    assert len(job.tx_bytes) == len(job.intra_bytes) == 2 and job.ranks_per_node == 2
    assert min(job.tx_bytes) > 0 and min(job.intra_bytes) > 0
    assert _mine() == []
