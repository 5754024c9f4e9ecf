"""The GRAWA study's table: accuracy at the fastest wall time and the time to a target, from hand-made rows."""

from benchmarks.studies.grawa_flatness import _table


def _row(method: str, seed: int, timeline: list[tuple[float, float]]) -> dict:
    return {
        "factor": 4.0,
        "seed": seed,
        "method": method,
        "acc": timeline[-1][1],
        "wall_s": timeline[-1][0],
        "bytes": 1e6,
        "timeline": timeline,
        "bytes_timeline": [(1e6, timeline[-1][1])],
        "trace": 1.0,
        "eig": 1.0,
        "staleness": None,
    }


def test_time_to_target_is_the_mean_over_the_seeds_that_reached_it():
    rows = [
        _row("split", 0, [(4.0, 0.2), (8.0, 0.3), (12.0, 0.4)]),
        _row("split", 1, [(4.0, 0.2), (8.0, 0.25), (12.0, 0.28)]),  # never reaches 0.3
        _row("shared", 0, [(2.0, 0.25), (4.0, 0.31), (6.0, 0.35)]),
        _row("shared", 1, [(2.0, 0.3), (4.0, 0.32), (6.0, 0.36)]),
    ]
    lines = _table(rows, target=0.3).splitlines()
    assert lines[0].endswith("| staleness | s to 0.3 |")
    split = next(line for line in lines if "| split |" in line)
    shared = next(line for line in lines if "| shared |" in line)
    assert split.endswith("| 8.0 (1/2) |")  # seed 1 never got there
    assert shared.endswith("| 3.0 (2/2) |")  # 4 s and 2 s
    # t* is the faster method's mean wall time (6 s): the split runs' accuracy then is 0.2 in both seeds
    assert "t* = 6.0 s" in lines[-1] and "| 0.2000 |" in split.split("| 2 |")[1]
    assert "s to" not in _table(rows).splitlines()[0]
