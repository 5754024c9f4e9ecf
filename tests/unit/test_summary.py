"""Run summaries round-trip through the output directory; the sweep table keeps what differs."""

from lightning_hier.summary import SUMMARY_JSON, Summary, collect_sweep, sweep_table, write_sweep_table


def _summary(out: str, strategy: str, overrides: list[str], acc: float | None = 0.9) -> Summary:
    return Summary(strategy, 2, 1, 3, acc, 1234.5, 12.34, out, overrides)


def test_summary_round_trips_through_json_and_text(tmp_path):
    s = _summary(str(tmp_path), "hpsgd", ["strategy=hpsgd", "strategy.window=4"])
    s.write(tmp_path)
    assert Summary.read(tmp_path / SUMMARY_JSON) == s
    text = (tmp_path / "summary.txt").read_text()
    assert "val accuracy  0.9000" in text and "1,234" in text


def test_sweep_table_keeps_per_job_arguments_and_lifts_common_ones():
    jobs = [
        _summary("/s/0_localsgd", "localsgd", ["strategy=localsgd", "strategy.tau=2", "trainer.max_epochs=1"]),
        _summary("/s/1_localsgd", "localsgd", ["strategy=localsgd", "strategy.tau=4", "trainer.max_epochs=1"], None),
    ]
    table = sweep_table(jobs)
    assert table.common == ["trainer.max_epochs=1"]
    assert table.header == ["job", "strategy", "arguments", "val acc", "samples/s", "time (s)", "output dir"]
    assert table.rows == [
        ["0", "localsgd", "strategy.tau=2", "0.9000", "1234", "12.3", "0_localsgd"],
        ["1", "localsgd", "strategy.tau=4", "n/a", "1234", "12.3", "1_localsgd"],
    ]
    md = table.markdown().splitlines()
    assert md[0] == "common overrides: `trainer.max_epochs=1`"
    assert md[-1] == "| 1 | localsgd | strategy.tau=4 | n/a | 1234 | 12.3 | 1_localsgd |"
    assert table.csv().splitlines()[1] == "0,localsgd,strategy.tau=2,0.9000,1234,12.3,0_localsgd"


def test_sweep_files_are_collected_in_job_order(tmp_path):
    for i in (10, 2, 1):  # job 10 sorts after job 2 (numbers, not strings)
        _summary(str(tmp_path / f"{i}_ddp"), "ddp", ["strategy=ddp", f"seed={i}"]).write(tmp_path / f"{i}_ddp")
    assert [s.overrides[1] for s in collect_sweep(tmp_path)] == ["seed=1", "seed=2", "seed=10"]
    table = write_sweep_table(tmp_path)
    assert table is not None and [row[2] for row in table.rows] == ["seed=1", "seed=2", "seed=10"]
    assert (tmp_path / "summary.md").is_file() and (tmp_path / "summary.csv").is_file()
    assert write_sweep_table(tmp_path / "empty") is None
