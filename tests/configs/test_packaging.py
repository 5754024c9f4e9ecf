"""A non-editable install ships conf/ inside the package, so the entry point works anywhere."""

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def test_wheel_contains_conf_and_entry_point_composes_from_it(tmp_path):
    target = tmp_path / "site"
    build = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--quiet",
            "--no-deps",
            "--target",
            str(target),
            str(REPO),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert build.returncode == 0, build.stderr[-3000:]
    packaged = target / "lightning_hier" / "conf"
    assert (packaged / "train.yaml").is_file() and (packaged / "strategy" / "localsgd.yaml").is_file()
    # run from an unrelated directory with only the installed copy importable
    proc = subprocess.run(
        [sys.executable, "-c", "import lightning_hier.train as t; print(t.conf_dir())"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
        env={"PYTHONPATH": str(target), "PATH": ""},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert Path(proc.stdout.strip()) == packaged
    cfg = subprocess.run(
        [sys.executable, "-m", "lightning_hier.train", "--cfg", "job", "strategy=ddp"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
        env={"PYTHONPATH": str(target), "PATH": ""},
    )
    assert cfg.returncode == 0, cfg.stderr[-3000:]
    assert "DDPStrategy" in cfg.stdout


def test_every_subpackage_is_listed_for_packaging():
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11

    listed = set(tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {
        ".".join(p.parent.relative_to(REPO).parts)
        for p in (REPO / "lightning_hier").rglob("__init__.py")
        if "__pycache__" not in p.parts
    }
    assert found - listed == set(), "add these to [tool.setuptools] packages in pyproject.toml"


def test_no_extra_installs_torchvision():
    # from the default index torchvision pins a CUDA torch and replaces the installed one
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11

    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert {"cli", "tensorboard", "dev"} <= set(extras)
    offenders = {name: reqs for name, reqs in extras.items() if any("torchvision" in r for r in reqs)}
    assert not offenders
