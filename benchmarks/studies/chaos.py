"""Chaos run: a replica killed every few seconds, fault tolerance against kill-relaunch-resume, in one invocation.

Three fits of the same CIFAR-10 MLP with Local SGD on ``--replicas`` forked ranks, each in its own
subprocess (``python -m benchmarks.studies.chaos --fit MODE``):

- ``clean``: ``fault_tolerance`` on, nothing killed (the reference wall time and accuracy);
- ``tolerant``: ``fault_tolerance`` on; every ``--kill-every`` seconds one replica (round-robin,
  replica 0 included) gets SIGKILL; the launcher restarts it and it rejoins through a peer;
- ``relaunch``: today's path without the option: checkpoints every ``--checkpoint-every`` steps
  (``last.ckpt``); the same kills end the run (fail fast), and the driver starts it again from
  ``last.ckpt`` until it completes;
- ``torchrun_clean`` and ``torchrun``: as ``clean`` and ``tolerant``, but each replica is its own
  ``torchrun --max-restarts`` job of one process, meeting the others on
  ``python -m lightning_hier.coordinator``: torchrun restarts a killed replica (a new Python
  process), not the fork launcher. ``torchrun``'s loss per failure is against ``torchrun_clean``
  (every replica then imports Lightning and loads the data itself).

Each replica writes its PID to the run's directory when it starts (a callback), so the driver
kills replicas, never the launching process. Reported per run: wall time, kills, test accuracy of
the model the fit returned, and the wall time lost per failure against ``clean``. The defaults
(3 replicas, a kill every 20 s, 12 epochs of 50,000 images, a checkpoint every 100 steps) are the
committed result's; a shorter study::

    python -m benchmarks.studies.chaos --modes clean tolerant --epochs 4 --train-size 20000

Writes ``--out`` (JSON) and prints a table. CPU only; takes about five times the clean fit.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from typing_extensions import override

REPO = Path(__file__).resolve().parents[2]
MODES = ("clean", "tolerant", "relaunch", "torchrun_clean", "torchrun")
TOLERANT = ("tolerant", "torchrun")
CLEAN = {"tolerant": "clean", "relaunch": "clean", "torchrun": "torchrun_clean"}
"""The run without kills each run's loss per failure is measured against."""
BATCH = 64


# ---------------------------------------------------------------------------------- one fit (a subprocess)
def fit(args: argparse.Namespace) -> dict[str, Any] | None:
    """One fit of ``args.run`` in this process: its replicas are forked children, or it is one (torchrun)."""
    import lightning.pytorch as pl
    import torch
    from lightning.pytorch.callbacks import Callback, ModelCheckpoint

    from lightning_hier.data import CIFAR10DataModule
    from lightning_hier.models import Classifier, mlp
    from lightning_hier.strategies import FaultTolerance, LocalSGDStrategy

    workdir = Path(args.workdir)

    class PidFile(Callback):
        """Each replica's PID, written when it starts (a restarted one overwrites it)."""

        @override
        def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
            (workdir / f"replica{trainer.global_rank}.pid").write_text(str(os.getpid()))

    # the membership's log (who left, who rejoined, at which step), time-stamped, into the run's stderr
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(created).3f %(message)s"))
    logging.getLogger("lightning_hier").addHandler(handler)
    logging.getLogger("lightning_hier").setLevel(logging.INFO)

    pl.seed_everything(0, verbose=False)
    data = CIFAR10DataModule(root=str(args.data_root), train_size=args.train_size, batch_size=BATCH, augment=False)
    model = Classifier(mlp((3, 32, 32), 10, hidden=(512, 512)), 10, lr=0.05, momentum=0.9)
    tolerant, external = args.run != "relaunch", args.run.startswith("torchrun")
    fault = FaultTolerance(max_restarts=1000, dead_after_s=2.0) if tolerant else None
    if external:  # one replica of the job, started (and restarted) by torchrun
        identity = {"coordinator": args.coordinator, "replica": args.replica, "replicas": args.replicas}
        fault = FaultTolerance(max_restarts=1000, dead_after_s=2.0, **identity)
    start_method, devices = ("popen", 1) if external else ("fork", args.replicas)
    strategy = LocalSGDStrategy(tau=8, start_method=start_method, timeout=60, fault_tolerance=fault)
    callbacks: list[Callback] = [PidFile()]
    if not tolerant:
        callbacks.append(
            ModelCheckpoint(dirpath=workdir / "ckpt", every_n_train_steps=args.checkpoint_every, save_last=True)
        )
    trainer = pl.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=devices,
        max_epochs=args.epochs,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=not tolerant,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        callbacks=callbacks,
    )
    last = workdir / "ckpt" / "last.ckpt"
    trainer.fit(model, datamodule=data, ckpt_path=str(last) if last.exists() else None)
    if trainer.global_rank != 0:
        return None  # under torchrun every replica's fit returns; replica 0 reports
    data.setup("test")
    model.eval()
    correct = total = 0
    with torch.no_grad():
        for x, y in data.test_dataloader():
            x, y = data.on_after_batch_transfer((x, y), 0)  # normalised as in training
            correct += int((model(x).argmax(1) == y).sum())
            total += len(y)
    return {"accuracy": correct / total}


# ---------------------------------------------------------------------------------- the driver
class Killer:
    """Every ``every`` seconds, SIGKILL the next replica (round-robin) whose PID file names a live process."""

    def __init__(self, workdir: Path, replicas: int, every: float) -> None:
        self.workdir, self.replicas, self.every = workdir, replicas, every
        self.kills: list[dict[str, Any]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._next = 1

    def __enter__(self) -> Killer:
        self._started = time.monotonic()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _loop(self) -> None:
        while not self._stop.wait(self.every):
            for _ in range(self.replicas):
                replica, self._next = self._next, (self._next + 1) % self.replicas
                pid = _read_pid(self.workdir / f"replica{replica}.pid")
                if pid is not None and _alive(pid):
                    os.kill(pid, signal.SIGKILL)
                    at = round(time.monotonic() - self._started, 2)
                    self.kills.append({"replica": replica, "at_s": at, "at": time.time()})
                    break


def _read_pid(path: Path) -> int | None:
    try:
        return int(path.read_text())
    except (OSError, ValueError):
        return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except OSError:
        return False
    with open(f"/proc/{pid}/stat") as stat:  # a zombie (dead, not yet reaped) is not alive
        return stat.read().split(")")[-1].split()[0] != "Z"


def run_mode(mode: str, args: argparse.Namespace, root: Path) -> dict[str, Any]:
    workdir = root / mode
    shutil.rmtree(workdir, ignore_errors=True)  # never resume from another invocation's checkpoint
    workdir.mkdir(parents=True)
    command = [sys.executable, "-m", "benchmarks.studies.chaos", "--fit", mode, "--workdir", str(workdir)]
    command += _shared_args(args)
    started = time.monotonic()
    launches = 0
    result_file = workdir / "result.json"
    result_file.unlink(missing_ok=True)
    killer = Killer(workdir, args.replicas, args.kill_every)
    killing = mode in CLEAN
    with killer if killing else _Nothing():
        while True:
            launches += 1
            if mode.startswith("torchrun"):
                code = _torchrun(command, args.replicas, workdir / "stderr.log")
            else:
                code = subprocess.call(
                    command, cwd=REPO, stdout=subprocess.DEVNULL, stderr=workdir.joinpath("stderr.log").open("a")
                )
            if code == 0:
                break
            if mode != "relaunch" or launches > 100:
                raise SystemExit(f"chaos: the {mode} run failed (exit {code}); see {workdir / 'stderr.log'}")
    wall = time.monotonic() - started
    out = json.loads(result_file.read_text())
    kills = killer.kills if killing else []
    row = {"mode": mode, "wall_s": round(wall, 1), "launches": launches, "kills": kills, **out}
    if mode in TOLERANT:
        row.update(recovery(kills, workdir / "stderr.log"))
    return row


def _torchrun(command: list[str], replicas: int, log: Path) -> int:
    """Run ``command``'s fit as ``replicas`` torchrun jobs meeting on a coordinator; the worst exit status."""
    coordinator = subprocess.Popen(
        [sys.executable, "-m", "lightning_hier.coordinator", "--port", "0", "--linger-s", "1"],
        cwd=REPO,
        stdout=subprocess.PIPE,
        text=True,
    )
    jobs: list[subprocess.Popen[Any]] = []
    try:
        address = coordinator.stdout.readline().split()[-1]  # type: ignore[union-attr]  # "... listening on H:P"
        torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=1"]
        torchrun += ["--max-restarts=100", "--monitor-interval=0.1", "-m", "benchmarks.studies.chaos"]
        # the threads Lightning gives each forked replica (cores // replicas): torchrun sets none for a job
        # of one process, and replicas sharing this machine's cores would oversubscribe them
        threads = str(max(1, len(os.sched_getaffinity(0)) // replicas))
        env = {**os.environ, "OMP_NUM_THREADS": threads}
        for replica in range(replicas):
            argv = [*torchrun, *command[3:], "--coordinator", address, "--replica", str(replica)]
            jobs.append(subprocess.Popen(argv, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=log.open("a")))
        codes = [job.wait() for job in jobs]
        coordinator.wait(timeout=120)
        return max(codes, key=abs)
    finally:
        for process in [*jobs, coordinator]:
            if process.poll() is None:
                process.kill()


LEFT = re.compile(
    r"^(\d+\.\d+) lightning_hier: replica \d+: replica\(s\) \[([\d, ]+)\] left at step \S+; "
    r"their steps since step (\S+)"
)
REJOINED = re.compile(r"^(\d+\.\d+) lightning_hier: replica (\d+) rejoined at point \d+ \(step (\d+)\)")


def recovery(kills: list[dict[str, Any]], log: Path) -> dict[str, Any]:
    """Per kill, from the replicas' time-stamped log: seconds until the others went on without it, until it
    rejoined, and the training steps it lost (from the last round it took part in to the step it rejoined at)."""
    left: list[tuple[float, int, int | None]] = []
    back: list[tuple[float, int, int]] = []
    for line in log.read_text().splitlines():
        if m := LEFT.match(line):
            since = None if m.group(3) == "None" else int(m.group(3))
            left += [(float(m.group(1)), int(r), since) for r in m.group(2).split(",")]
        elif m := REJOINED.match(line):
            back.append((float(m.group(1)), int(m.group(2)), int(m.group(3))))
    detected, rejoined, lost = [], [], []
    for i, kill in enumerate(kills):
        r, t = kill["replica"], kill["at"]
        until = next((k["at"] for k in kills[i + 1 :] if k["replica"] == r), float("inf"))
        gone = [(at, since) for at, who, since in left if who == r and t <= at < until]
        came = [(at, step) for at, who, step in back if who == r and t <= at < until]
        detected.append(round(gone[0][0] - t, 2) if gone else None)
        rejoined.append(round(came[0][0] - t, 2) if came else None)
        since = gone[0][1] if gone else None
        lost.append(came[0][1] - since if came and since is not None else None)
    return {"detected_s": detected, "rejoined_s": rejoined, "lost_steps": lost}


def relative_paths(value: Any) -> Any:
    """The results' paths relative to the repository (:func:`benchmarks.publish.relative_paths`)."""
    from benchmarks.publish import relative_paths as relative

    return relative(value)


def _decode_once(args: argparse.Namespace) -> None:
    """Decode and cache the images before any timed run (the first run would pay for it alone)."""
    from lightning_hier.data import CIFAR10DataModule

    CIFAR10DataModule(root=str(args.data_root), train_size=args.train_size).prepare_data()


class _Nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def _shared_args(args: argparse.Namespace) -> list[str]:
    return [
        "--replicas", str(args.replicas),
        "--epochs", str(args.epochs),
        "--train-size", str(args.train_size),
        "--checkpoint-every", str(args.checkpoint_every),
        "--data-root", str(args.data_root),
    ]  # fmt: skip


def report(rows: list[dict[str, Any]], replica_steps: int | None = None) -> str:
    """The table: wall time and its loss per failure against its run without kills (:data:`CLEAN`); for
    the tolerant runs also the median seconds to go on without a killed replica and to take it back,
    and the training steps lost per failure (with ``replica_steps``, the steps of all replicas in a
    clean fit: their share)."""
    by_mode = {r["mode"]: r for r in rows}
    lines = [
        "| run | wall s | kills | launches | test accuracy | lost per failure (s) | detected (s) | rejoined (s) "
        "| steps lost per failure |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        kills = len(r["kills"])
        clean = by_mode.get(CLEAN.get(r["mode"], r["mode"]), by_mode["clean"])
        lost = (r["wall_s"] - clean["wall_s"]) / kills if kills else 0.0
        r["lost_per_failure_s"] = round(lost, 2)
        cells = [r["mode"], r["wall_s"], kills, r["launches"], f"{r['accuracy']:.4f}", f"{lost:.2f}"]
        cells += [_median(r.get("detected_s")), _median(r.get("rejoined_s"))]
        steps = [x for x in r.get("lost_steps", []) if x is not None]
        share = f" ({sum(steps) / replica_steps:.1%} of all)" if steps and replica_steps else ""
        cells.append(f"{statistics.mean(steps):.0f}{share}" if steps else "-")
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return "\n".join(lines)


def _median(values: list[float | None] | None) -> str:
    known = [x for x in values or [] if x is not None]
    return f"{statistics.median(known):.2f}" if known else "-"


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.studies.chaos", description=__doc__.splitlines()[0])
    parser.add_argument("--replicas", type=int, default=3)
    parser.add_argument("--kill-every", type=float, default=20.0, help="seconds between two kills")
    # the defaults are the committed result's (benchmarks/results/chaos/chaos.json)
    parser.add_argument("--epochs", type=int, default=12)
    parser.add_argument("--train-size", type=int, default=50000)
    parser.add_argument("--checkpoint-every", type=int, default=100, help="relaunch: steps between checkpoints")
    parser.add_argument("--data-root", type=Path, default=None, help="CIFAR-10 source (default: shared/datasets)")
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument("--out", type=Path, default=Path("/tmp/lightning-hier-chaos/chaos.json"))
    # one fit, in a subprocess (not "--run": torchrun, which parses the arguments too, has --run-path)
    parser.add_argument("--fit", dest="run", choices=MODES, help=argparse.SUPPRESS)
    parser.add_argument("--workdir", help=argparse.SUPPRESS)
    parser.add_argument("--coordinator", help=argparse.SUPPRESS)  # torchrun: the replica's coordinator
    parser.add_argument("--replica", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    for name in ("replicas", "epochs", "train_size", "checkpoint_every"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.kill_every <= 0:
        parser.error(f"--kill-every must be > 0 seconds, got {args.kill_every}")
    if args.data_root is None:
        from benchmarks.run import default_data_root

        args.data_root = default_data_root()
        if args.data_root is None:
            parser.error("CIFAR-10 not found in shared/datasets; pass --data-root")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    if args.run is not None:
        result = fit(args)
        if result is not None:
            Path(args.workdir, "result.json").write_text(json.dumps(result))
        return
    root = args.out.parent / "runs"
    _decode_once(args)
    rows = [run_mode(mode, args, root) for mode in args.modes]
    per_replica = math.ceil(math.ceil(args.train_size / args.replicas) / BATCH) * args.epochs
    table = report(rows, per_replica * args.replicas) if any(r["mode"] == "clean" for r in rows) else json.dumps(rows)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    hidden = ("run", "workdir", "out", "coordinator", "replica")
    document = {"args": {k: str(v) for k, v in vars(args).items() if k not in hidden}, "runs": rows}
    args.out.write_text(json.dumps(relative_paths(document), indent=1))  # committed: no path of this machine
    print(table)


if __name__ == "__main__":
    main()
