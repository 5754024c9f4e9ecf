import os
import time

import pytest
import torch
import torch.distributed as dist

from lightning_hier.testing import WorkerFailed, WorkerTimeout, run_workers


def _all_reduce_rank() -> tuple[int, float]:
    dist.init_process_group("gloo")
    t = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(t)
    return dist.get_rank(), t.item()


def test_results_come_back_by_rank():
    assert run_workers(_all_reduce_rank, devices=3) == [(0, 3.0), (1, 3.0), (2, 3.0)]


def test_env_of_a_simulated_two_node_job():
    def env():
        return {k: os.environ[k] for k in ("RANK", "LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE")}

    out = run_workers(env, devices=2, num_nodes=2)
    assert [(e["RANK"], e["LOCAL_RANK"], e["NODE_RANK"]) for e in out] == [
        ("0", "0", "0"),
        ("1", "1", "0"),
        ("2", "0", "1"),
        ("3", "1", "1"),
    ]
    assert "RANK" not in os.environ  # nothing leaks into the parent


def _raise_on_rank_one() -> None:
    dist.init_process_group("gloo")
    if dist.get_rank() == 1:
        raise ValueError("bad batch on rank one")
    dist.barrier()


def test_first_error_is_reraised_with_rank_and_traceback():
    with pytest.raises(WorkerFailed) as info:
        run_workers(_raise_on_rank_one, devices=2, timeout=30)
    assert info.value.rank == 1
    assert "rank 1 raised ValueError: bad batch on rank one" in str(info.value)
    assert "_raise_on_rank_one" in info.value.details  # the worker's own traceback


def test_a_dead_worker_is_reported_with_its_exit_code():
    def die():
        os._exit(3)

    with pytest.raises(WorkerFailed, match="rank 0 died with exit code 3"):
        run_workers(die, devices=1, timeout=30)


def test_a_hung_worker_fails_within_the_deadline():
    def hang():
        if os.environ["RANK"] == "1":
            time.sleep(600)
        return 1

    start = time.monotonic()
    with pytest.raises(WorkerTimeout, match=r"rank\(s\) \[1\] did not finish within 3 s"):
        run_workers(hang, devices=2, timeout=3)
    assert time.monotonic() - start < 20


def test_unpicklable_results_are_an_error_not_a_hang():
    with pytest.raises(WorkerFailed, match="could not send the result"):
        run_workers(lambda: lambda: 0, devices=1, timeout=30)
