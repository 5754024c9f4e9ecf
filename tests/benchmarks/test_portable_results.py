"""Committed results hold no path of the machine that produced them; the writer makes paths relative."""

import json
import re
import subprocess
from pathlib import Path

from benchmarks import publish
from benchmarks.scenarios import REPO

# an absolute path into a home, temporary or work directory: what a results file must not leak
MACHINE_PATH = re.compile(r"(?<![\w.~:/-])/(?:work|home|tmp|root)(?:/|\b)")
COMMITTED = ("benchmarks/results", "recipes", "benchmarks/README.md", "README.md")


def committed_text_files() -> list[Path]:
    listed = subprocess.run(["git", "ls-files", *COMMITTED], cwd=REPO, capture_output=True, text=True, check=False)
    if listed.returncode == 0 and listed.stdout.strip():
        names = listed.stdout.split()
    else:  # not a git checkout (an sdist): every file there, but the ignored run logs
        names = [str(p.relative_to(REPO)) for c in COMMITTED for p in (REPO / c).rglob("*") if "tmp" not in p.parts]
        names += [c for c in COMMITTED if (REPO / c).is_file()]
    return [REPO / n for n in names if (REPO / n).is_file() and (REPO / n).suffix in {".json", ".md", ".yaml", ".csv"}]


def test_no_committed_result_or_recipe_holds_an_absolute_machine_path():
    files = committed_text_files()
    assert any(f.name == "results.json" for f in files)
    leaks = [
        f"{f.relative_to(REPO)}:{n}: {line.strip()[:120]}"
        for f in files
        for n, line in enumerate(f.read_text().splitlines(), 1)
        if MACHINE_PATH.search(line)
    ]
    assert not leaks, "absolute paths in committed results:\n" + "\n".join(leaks)


def test_the_writer_makes_every_path_relative_to_the_repository(tmp_path):
    root = tmp_path / "checkout"
    results = {
        "meta": {
            "argv": ["--epochs", "4", "--data-root", str(tmp_path / "shared" / "cifar.tar.gz")],
            "logs": str(root / "benchmarks" / "results" / "tmp" / "runs-1"),
            "date": "2026-11-23T22:49:49",
        },
        "workloads": {
            "w": {
                "runs": {
                    "ddp": {
                        "error": f"rank 1 exited with code 1.\n--- last lines of {root}/benchmarks/rank1.log ---\nboom",
                        "overrides": [f"data.root={tmp_path}/shared/cifar.tar.gz", "trainer.max_epochs=4"],
                        "label": "ddp+postlocalsgd",
                        "note": "1 Gbit/s, 240 ms/step, see https://example.org/a/b and ./x/y",
                        "timeline": [{"val_acc": 0.5}],
                    }
                }
            }
        },
    }
    got = publish.relative_paths(results, root)
    assert got["meta"]["argv"] == ["--epochs", "4", "--data-root", "../shared/cifar.tar.gz"]
    assert got["meta"]["logs"] == "benchmarks/results/tmp/runs-1"
    run = got["workloads"]["w"]["runs"]["ddp"]
    assert run["error"] == "rank 1 exited with code 1.\n--- last lines of benchmarks/rank1.log ---\nboom"
    assert run["overrides"] == ["data.root=../shared/cifar.tar.gz", "trainer.max_epochs=4"]
    assert run["label"] == "ddp+postlocalsgd" and run["note"] == results["workloads"]["w"]["runs"]["ddp"]["note"]
    assert run["timeline"] == [{"val_acc": 0.5}] and got["meta"]["date"] == results["meta"]["date"]
    assert not MACHINE_PATH.search(json.dumps(got))


def test_write_outputs_stores_repository_relative_paths(tmp_path):
    meta = {"date": "2026-11-23T22:49:49", "commit": "abc1234", "host_cpus": 2, "load_avg": [0.1, 0.1, 0.1]}
    meta |= {"cpu_busy": 0.0, "torch": "2.13.0", "lightning": "2.6.6"}
    meta |= {"argv": ["--data-root", str(REPO.parent / "shared" / "c.tar.gz")], "logs": str(REPO / "benchmarks" / "x")}
    publish.write_outputs({"meta": meta, "workloads": {}, "skipped": []}, tmp_path, update_readme=False)
    written = json.loads((tmp_path / "results.json").read_text())["meta"]
    assert written["argv"] == ["--data-root", "../shared/c.tar.gz"] and written["logs"] == "benchmarks/x"
    assert "arguments `--data-root ../shared/c.tar.gz`" in (tmp_path / "results.md").read_text()
