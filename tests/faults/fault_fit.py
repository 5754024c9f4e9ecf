"""A 2-rank digits fit with one injected fault (the fault-injection suite runs it as a subprocess).

usage: python fault_fit.py STRATEGY START_METHOD FAULT RUN_DIR TIMEOUT_S

``STRATEGY`` is a registry name without launcher suffix (``mgrawa``, ``ddp_post_local_sgd``, ...;
``mgrawa@async`` adds ``rounds='async'``),
``START_METHOD`` is ``popen`` or ``fork``. Run as a script, so the popen launcher can re-run it
for rank 1. Each rank writes its PID to ``RUN_DIR/pids/rank<r>``, the first process to
``RUN_DIR/pids/main``. Checkpoints go to ``RUN_DIR/ckpt`` every 2 steps (and ``last.ckpt``). When
the fault is injected (the start of step :data:`FAULT_STEP`), rank 0 first writes
``RUN_DIR/manifest.json``: the SHA-256 of every checkpoint file then on disk, which the fault must
not change. Faults (:data:`FAULTS`):

- ``raise``: rank 1 raises; ``hang``: rank 1 sleeps forever;
- ``kill0`` / ``kill1``: rank 0 / rank 1 gets SIGKILL;
- ``sigint`` / ``sigterm``: the main process gets the signal (sent by rank 0);
- ``kill_save``: rank 0 gets SIGKILL in the middle of writing the next checkpoint;
- ``kill0_hang1`` (not in the matrix): rank 1 hangs and rank 0 gets SIGKILL (with popen rank 1 is
  then an orphan that only its watchdog can end).

Training would go on for :data:`MAX_STEPS` steps (minutes), so a fault that does not end the run
shows as a time-out of the test, and a run that ends cleanly exits 0.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.strategies import StrategyRegistry

import lightning_hier  # noqa: F401  (registers the strategy names)
from lightning_hier.data import DigitsDataModule
from lightning_hier.models import Classifier, mlp

FAULTS = ("raise", "hang", "kill0", "kill1", "sigint", "sigterm", "kill_save")
CULPRIT = {"raise": 1, "hang": 1, "kill0": 0, "kill1": 1, "kill_save": 0, "kill0_hang1": 0}
"""The rank whose fault it is (the run's output must name it); signals to the main process have none."""
SIGNALS = ("sigint", "sigterm")
FAULT_STEP = 5
MAX_STEPS = 100_000
SUFFIX = {"popen": "", "fork": "_fork", "spawn": "_spawn"}


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def publish(path: Path, text: str) -> None:
    """Write ``path`` whole or not at all: the test polls these files while the run writes them."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")  # the test reads only the final names
    tmp.write_text(text)
    os.replace(tmp, path)


class _KillWhenPickled:
    """Put into a checkpoint: the writing process gets SIGKILL while the file is being written."""

    def __reduce__(self) -> Any:
        os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(60)  # SIGKILL is asynchronous
        raise AssertionError("not killed")


class InjectFault(Callback):
    """Records this rank's PID, then injects ``fault`` at the start of step :data:`FAULT_STEP`."""

    def __init__(self, fault: str, run_dir: Path, main_pid: int) -> None:
        self.fault = fault
        self.run_dir = run_dir
        self.main_pid = main_pid
        self.armed = False  # kill_save: the next checkpoint written by rank 0 kills it

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        pids = self.run_dir / "pids"
        pids.mkdir(exist_ok=True)
        publish(pids / f"rank{trainer.global_rank}", str(os.getpid()))

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, idx: int) -> None:
        if trainer.global_step != FAULT_STEP:
            return
        rank = trainer.global_rank
        if rank == 0:
            ckpts = sorted((self.run_dir / "ckpt").glob("*.ckpt"))
            manifest = {p.name: digest(p) for p in ckpts}
            publish(self.run_dir / "manifest.json", json.dumps(manifest))
        # when the fault was injected (the run must end within `timeout` + 30 s of it); not printed, so
        # the run's output names a rank only where the library does
        publish(self.run_dir / f"injected{rank}", repr(time.time()))
        if self.fault == "raise" and rank == 1:
            raise RuntimeError("injected fault")  # the library, not this message, must name the rank
        if self.fault in ("hang", "kill0_hang1") and rank == 1:
            while True:
                time.sleep(3600)
        if self.fault in ("kill0", "kill1", "kill0_hang1") and rank == int(self.fault[4]):
            os.kill(os.getpid(), signal.SIGKILL)
        if self.fault in SIGNALS and rank == 0:
            os.kill(self.main_pid, signal.SIGINT if self.fault == "sigint" else signal.SIGTERM)
        if self.fault == "kill_save" and rank == 0:
            self.armed = True

    def on_save_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict) -> None:
        if self.armed:
            checkpoint["injected_fault"] = _KillWhenPickled()


def main(strategy: str, start_method: str, fault: str, run_dir: Path, timeout: float) -> None:
    name, _, rounds = strategy.partition("@")  # `mgrawa@async`: the registered name with rounds='async'
    entry = StrategyRegistry[f"{name}{SUFFIX[start_method]}"]
    extra = {"rounds": rounds} if rounds else {}
    main_pid = int((run_dir / "pids" / "main").read_text())
    trainer = pl.Trainer(
        strategy=entry["strategy"](**{**entry["init_params"], **extra, "timeout": timeout}),
        accelerator="cpu",
        devices=2,
        max_steps=MAX_STEPS,
        max_epochs=-1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        callbacks=[
            ModelCheckpoint(
                dirpath=run_dir / "ckpt", filename="{step}", every_n_train_steps=2, save_top_k=-1, save_last=True
            ),
            InjectFault(fault, run_dir, main_pid),
        ],
    )
    model = Classifier(mlp((1, 8, 8), 10, hidden=(32,)), 10, lr=0.05)
    trainer.fit(model, DigitsDataModule(batch_size=16))


if __name__ == "__main__":
    name, method, fault_name, directory, timeout_s = sys.argv[1:6]
    run = Path(directory)
    if "LOCAL_RANK" not in os.environ:  # the process the test started (popen re-runs this for rank 1)
        (run / "pids").mkdir(parents=True, exist_ok=True)
        publish(run / "pids" / "main", str(os.getpid()))
        # as started from a terminal: a pytest run in the background (`&`) passes SIGINT on ignored
        signal.signal(signal.SIGINT, signal.default_int_handler)
    main(name, method, fault_name, run, float(timeout_s))
