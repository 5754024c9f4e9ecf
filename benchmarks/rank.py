"""What one benchmark rank does: compose the run's config, fit, and measure.

The ``Trainer(num_nodes=W / R, devices=R)`` built here *joins* the job started by the runner,
as on a real cluster of ``W / R`` nodes of ``R`` ranks (by default ``R = 1``: every rank its own
node). The config is composed from ``conf/`` and the
recipe's experiment exactly as ``python -m lightning_hier.train`` would, and built with the same
helpers. A :class:`Recorder` keeps the validation accuracy against training time.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from hydra import compose, initialize_config_dir
from lightning.pytorch.callbacks import Callback
from omegaconf import OmegaConf
from typing_extensions import override

from benchmarks.schedstat import thread_schedstat
from lightning_hier.train import build_datamodule, build_module, build_strategy, build_trainer, conf_dir

# What every benchmark rank needs regardless of the workload: no progress bars, checkpoints or
# sanity checks (they would be timed), popen start method (under torchrun-style env: join).
RUN_OVERRIDES = (
    "start_method=popen",
    "trainer.enable_progress_bar=false",
    "trainer.enable_checkpointing=false",
    "trainer.enable_model_summary=false",
    "trainer.num_sanity_val_steps=0",
)


class Recorder(Callback):
    """Validation accuracy against *training* time (wall time minus time spent validating).

    Validation time runs from the first validation batch, not from ``on_validation_start``:
    strategies that build their consensus model when validation starts (an all-reduce of the
    replicas, HPSGD's look-ahead merge) do so after the callbacks' hook, and that communication
    is a cost of training with them, so it stays on the training clock.

    Attributes:
        timeline: One entry per validation: ``epoch``, ``step``, ``train_s``, ``wall_s``,
            ``samples`` (this rank's, so far) and ``val_acc``.
        samples: Training samples this rank processed.
        val_samples: Samples this rank validated (sanity checks left out): the grid's validation
            forwards communicate (benchmarks/fit_model.py).
        train_s: Training time of the fit (set at the end).
        step_s: Seconds between consecutive training batches' ends, leaving out each epoch's first
            and last batch (the last holds the end-of-epoch and end-of-fit rounds of the averaging
            strategies, ``no-comm``'s too) and every interval that holds a validation (the
            simulator's jitter calibration).
        cpu_s: Seconds the training thread ran on a CPU during the fit (``schedstat``).
        queued_s: Seconds it was runnable but waited for its core during the fit: other processes
            held it (load on a shared machine; benchmarks/predicted.py prints it beside each run).
    """

    def __init__(
        self, clock: Any = time.perf_counter, sched: Callable[[], tuple[float, float]] = thread_schedstat
    ) -> None:
        self.clock = clock
        self.sched = sched
        self.cpu_s = 0.0
        self.queued_s = 0.0
        self._sched0 = (0.0, 0.0)
        self.timeline: list[dict[str, float]] = []
        self.samples = 0
        self.val_samples = 0
        self.train_s = 0.0
        self.wall_s = 0.0
        self.step_s: list[float] = []
        self._epoch_steps: list[float] = []
        self._last_batch_end: float | None = None
        self._t0 = 0.0
        self._val_s = 0.0
        self._val_start = 0.0
        self._first_batch = False

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._t0, self._val_s, self.samples, self.val_samples, self.timeline = self.clock(), 0.0, 0, 0, []
        self._sched0 = self.sched()
        self.step_s, self._epoch_steps, self._last_batch_end = [], [], None

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self.samples += len(batch[0])
        now = self.clock()
        if self._last_batch_end is not None:
            self._epoch_steps.append(now - self._last_batch_end)
        self._last_batch_end = now

    @override
    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._epoch_steps, self._last_batch_end = [], None

    @override
    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.step_s += self._epoch_steps[:-1]  # the epoch's last step holds its rounds, if any

    @override
    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._last_batch_end = None  # the next batch's interval holds this validation: not a step
        self._val_start = self.clock()  # replaced at the first batch (kept if there is none)
        self._first_batch = True

    @override
    def on_validation_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        if self._first_batch:
            self._val_start, self._first_batch = self.clock(), False

    @override
    def on_validation_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        if not trainer.sanity_checking:
            self.val_samples += len(batch[0])

    @override
    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.sanity_checking:
            return
        now = self.clock()
        acc = trainer.callback_metrics.get("val/acc")
        self.timeline.append(
            {
                "epoch": trainer.current_epoch,
                "step": trainer.global_step,
                "train_s": self._val_start - self._t0 - self._val_s,
                "wall_s": now - self._t0,
                "samples": self.samples,
                "val_acc": float("nan") if acc is None else float(acc),
            }
        )
        self._val_s += now - self._val_start

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.wall_s = self.clock() - self._t0
        self.train_s = self.wall_s - self._val_s
        cpu, queued = self.sched()
        self.cpu_s, self.queued_s = cpu - self._sched0[0], queued - self._sched0[1]


def layout_overrides(ranks: int, ranks_per_node: int = 1) -> list[str]:
    """The Trainer's layout on an emulated cluster of ``ranks`` ranks, ``ranks_per_node`` per node."""
    return [f"trainer.devices={ranks_per_node}", f"trainer.num_nodes={ranks // ranks_per_node}"]


def compose_config(overrides: list[str], searchpath: str | None) -> Any:
    """The config ``python -m lightning_hier.train <overrides>`` would build (plus the recipe path)."""
    extra = [f"hydra.searchpath=[file://{searchpath}]"] if searchpath else []
    with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3"):
        return compose("train", overrides=[*extra, *overrides])


def peak_rss_mb() -> float:
    """This process's peak resident memory (``VmHWM``), in MiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def run_rank(spec: dict[str, Any], callbacks: list[Callback] | None = None) -> dict[str, Any]:
    """Fit the spec's run on this rank and return its measurements.

    Args:
        spec: ``overrides`` (Hydra overrides), ``searchpath`` (recipe folder or None), ``ranks``
            (world size), ``ranks_per_node`` (default 1) and ``out_dir`` (the trainer's root directory).
        callbacks: Extra callbacks (e.g. a delay-mode straggler on the slow rank).
    """
    torch.set_num_threads(1)
    layout = layout_overrides(int(spec["ranks"]), int(spec.get("ranks_per_node", 1)))
    cfg = compose_config([*spec["overrides"], *RUN_OVERRIDES, *layout], spec.get("searchpath"))
    pl.seed_everything(cfg.seed, workers=True, verbose=False)
    recorder = Recorder()
    all_callbacks: list[Callback] = [recorder, *(callbacks or [])]
    datamodule = build_datamodule(cfg)  # data=synthetic takes the shape the model asks for
    module = build_module(cfg, datamodule)
    trainer = build_trainer(cfg, build_strategy(cfg), spec["out_dir"], callbacks=all_callbacks, logger=False)
    trainer.fit(module, datamodule=datamodule)
    return _measurements(trainer, recorder, cfg, all_callbacks)


def _measurements(trainer: pl.Trainer, recorder: Recorder, cfg: Any, callbacks: list[Callback]) -> dict[str, Any]:
    stats = getattr(trainer.strategy, "comm_stats", None)
    slept = sum(float(getattr(cb, "delay_s", 0.0)) for cb in callbacks)  # the delay-mode straggler's stall
    words = [p.numel() for p in trainer.lightning_module.parameters()]  # per tensor, in order
    return {
        "rank": trainer.global_rank,
        "world_size": trainer.world_size,
        # where the rank ran: its node as Lightning sees it, and its network namespace (the emulated node)
        "node_rank": trainer.node_rank,
        "local_rank": trainer.local_rank,
        "num_nodes": trainer.num_nodes,
        "net_namespace": os.stat("/proc/self/ns/net").st_ino,
        "replicas": int(_sampler_kwargs(trainer).get("num_replicas", trainer.world_size)),
        "epochs": trainer.current_epoch,
        "steps": trainer.global_step,
        "samples": recorder.samples,
        "val_samples": recorder.val_samples,
        "train_s": recorder.train_s,
        "wall_s": recorder.wall_s,
        "timeline": recorder.timeline,
        "step_s": recorder.step_s,
        "cpu_s": recorder.cpu_s,
        "queued_s": recorder.queued_s,
        "comm": None if stats is None else stats.state_dict(),
        # the library skips the start-up broadcast when the ranks already agree; DDP always sends it
        "start_broadcast": bool(getattr(trainer.strategy, "start_broadcast", True)),
        "strategy_metrics": dict(getattr(trainer.strategy, "last_metrics", {}) or {}),
        "straggler_slept_s": slept,
        "peak_rss_mb": peak_rss_mb(),
        "strategy_config": OmegaConf.to_container(cfg.strategy, resolve=True),
        "parameters": sum(words),
        # the simulator's inputs (benchmarks/predicted.py): BatchNorm statistics travel with the parameters
        "float_buffers": sum(b.numel() for b in trainer.lightning_module.buffers() if b.is_floating_point()),
        "tensors": len(words),
        "tensor_words": words,  # DDP's buckets
        "tensor_shapes": [list(p.shape) for p in trainer.lightning_module.parameters()],  # PowerSGD's matrices
    }


def _sampler_kwargs(trainer: pl.Trainer) -> dict[str, Any]:
    return dict(getattr(trainer.strategy, "distributed_sampler_kwargs", None) or {})
