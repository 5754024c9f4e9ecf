"""Per-rank cgroup CPU quotas on the real cgroup filesystem: quota files, membership of forked ranks, cleanup."""

import os
import threading
from pathlib import Path

import pytest

from benchmarks.rank_quotas import RankQuotas, rank_quotas, shares
from benchmarks.straggler import PERIOD_US, cgroup_parent
from lightning_hier.testing import run_workers
from lightning_hier.testing.harness import WorkerFailed

TAG = f"{os.getpid()}-test"


@pytest.fixture
def cgroups() -> Path:
    parent = cgroup_parent()
    if parent is None or os.geteuid() != 0:
        pytest.skip("needs root and a cgroup CPU controller (v1 cpu or v2 with cpu delegated)")
    return parent


def _cpu_cgroup(proc_file: str) -> str:
    """The cpu controller's cgroup path in ``/proc/.../cgroup`` (v1 ``N:cpu,...:/x``, v2 ``0::/x``)."""
    entries = [line.split(":", 2) for line in Path(proc_file).read_text().splitlines()]
    v1 = [path for _, controllers, path in entries if "cpu" in controllers.split(",")]
    return v1[0] if v1 else next(path for hierarchy, _, path in entries if hierarchy == "0")


def _member(quotas: RankQuotas) -> tuple[str, str]:
    """Join this rank's cgroup; where this process and a thread started afterwards (a server thread) are."""
    quotas.join(int(os.environ["RANK"]))
    seen: list[str] = []
    thread = threading.Thread(target=lambda: seen.append(_cpu_cgroup("/proc/thread-self/cgroup")))
    thread.start()
    thread.join()
    return _cpu_cgroup("/proc/self/cgroup"), seen[0]


def _quota_file(path: Path) -> str:
    if (path / "cpu.max").is_file():
        return (path / "cpu.max").read_text()
    return f"{(path / 'cpu.cfs_quota_us').read_text().strip()} {(path / 'cpu.cfs_period_us').read_text()}"


def test_every_rank_runs_in_its_own_quota_and_the_cgroups_are_removed(cgroups):
    with rank_quotas(3, 0.6, slow_rank=2, factor=4.0, tag=TAG) as quotas:
        paths = [q.path for q in quotas.quotas]
        assert [p.name for p in paths] == [f"lhb-{TAG}-rank{r}" for r in range(3)]
        assert [_quota_file(p) for p in paths] == [f"{q} {PERIOD_US}\n" for q in (12000, 12000, 3000)]
        where = run_workers(_member, quotas, devices=3, timeout=30)
    for r, (process, thread) in enumerate(where):
        assert process == thread == f"/lhb-{TAG}-rank{r}"
    assert not any(p.exists() for p in paths)


def _fail(quotas: RankQuotas) -> None:
    quotas.join(int(os.environ["RANK"]))
    raise RuntimeError("rank failed inside its cgroup")


def test_the_cgroups_are_removed_when_a_rank_fails(cgroups):
    paths: list[Path] = []
    with (
        pytest.raises(WorkerFailed, match="rank failed inside its cgroup"),
        rank_quotas(2, 0.5, slow_rank=1, factor=2.0, tag=TAG) as quotas,
    ):
        paths += [q.path for q in quotas.quotas]
        run_workers(_fail, quotas, devices=2, timeout=30)
    assert len(paths) == 2 and not any(p.exists() for p in paths)


def test_shares_are_checked():
    assert shares(3, 0.6, slow_rank=2, factor=2.0) == [0.6, 0.6, 0.3]
    for bad in ({"share": 0.0}, {"share": 1.5}, {"factor": 0.5}, {"slow_rank": 3}):
        kwargs = {"share": 0.6, "slow_rank": 2, "factor": 2.0} | bad
        with pytest.raises(ValueError, match="rank_quotas: need 0 < share <= 1"):
            shares(3, **kwargs)  # type: ignore[arg-type]
