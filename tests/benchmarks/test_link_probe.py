"""benchmarks.link_probe: one-way, two-way and all-reduce transfers through the emulated link."""

import pytest

from benchmarks.link_probe import main, parse_args, report


def test_report_counts_the_crossings_slower_than_one_and_a_half_one_way_medians():
    times = {"one way": [0.10, 0.12, 0.11], "both ways": [0.11, 0.22, 0.16, 0.17], "all-reduce": [0.2]}
    text = report(times, mb=1.0)
    assert "one way: median   110.0 ms (    73 Mbit/s each way); rounds: 100 120 110" in text
    assert text.splitlines()[-1].endswith("(the directions took turns): 2 of 4 rounds")  # 0.22, 0.17 > 0.165
    assert "all-reduce: median   200.0 ms" in text


@pytest.mark.parametrize(("argv", "message"), [(["--mb", "0"], "--mb must be > 0"), (["--link", "fast"], "--link")])
def test_bad_arguments_are_refused_naming_them(argv, message, capsys):
    with pytest.raises(SystemExit):
        parse_args(argv)
    assert message in capsys.readouterr().err


def test_the_probe_runs_two_ranks_through_the_emulated_link(emulation, capfd):
    assert main(["--link", "unlimited", "--mb", "0.1", "--rounds", "2", "--gap", "0"]) == 0
    out = capfd.readouterr().out
    for mode in ("one way", "both ways", "all-reduce"):
        assert f"{mode}: median" in out
    assert "of 2 rounds" in out
