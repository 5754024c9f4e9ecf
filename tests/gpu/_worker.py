"""One rank of the CUDA smoke test (started by :mod:`tests.gpu._launch`; not a test module).

``python -m tests.gpu._worker --case JSON --accelerator gpu --result FILE --folder DIR``

- ``mode='fit'``: a user-style classifier is fitted for one short epoch under the case's
  strategy (stage ``fit``), a checkpoint is written and read back on the CPU (``checkpoint``),
  and a fresh module resumes from it for a second epoch (``resume``: restores optimizer, RNG and
  algorithm state on the device).
- ``mode='probe'``: which gloo operations accept tensors on the device (each on its own group,
  values checked), so that a strategy failing under gloo can be told apart from gloo's limits.

The report (JSON) is rewritten after every stage, so a rank that dies (a signal, the library's
watchdog) still leaves what it had done.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.fabric.plugins.environments import LightningEnvironment
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.strategies import Strategy, StrategyRegistry
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset
from typing_extensions import override

import lightning_hier  # noqa: F401  (registers the strategy names)
from lightning_hier.layers import full_state_dict
from tests.gpu._launch import Case
from tests.user_models import UserClassifier

TRAIN_BATCHES = 16  # per epoch and rank
VAL_BATCHES = 2
BATCH = 8
PROBE_TIMEOUT = timedelta(seconds=20)


class SmokeClassifier(UserClassifier):
    """The user's classifier (Nesterov SGD 0.9, ``(x, y)`` batches) with dropout and validation.

    256 training samples: ``TRAIN_BATCHES`` batches of ``BATCH`` per rank with 2 ranks, twice as
    many with one (where ``limit_train_batches`` cuts the epoch). Dropout draws from the device's
    generator, whose state checkpoints save and pipeline recomputation replays.
    """

    def __init__(self) -> None:
        super().__init__()
        self.model = nn.Sequential(
            nn.Linear(16, 32), nn.ReLU(), nn.Dropout(0.1), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4)
        )

    @override
    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        x, y = batch
        self.log("val_acc", (self.model(x).argmax(1) == y).float().mean(), sync_dist=True)

    @override
    def train_dataloader(self) -> DataLoader:
        return _loader(256, seed=0, shuffle=True)

    @override
    def val_dataloader(self) -> DataLoader:
        return _loader(64, seed=1, shuffle=False)


def _loader(n: int, seed: int, shuffle: bool) -> DataLoader:
    x = torch.randn(n, 16, generator=torch.Generator().manual_seed(seed))
    return DataLoader(TensorDataset(x, x[:, :4].argmax(1)), batch_size=BATCH, shuffle=shuffle)


def _flat(state: dict[str, Tensor]) -> Tensor:
    return torch.cat([t.detach().reshape(-1).double().cpu() for t in state.values() if t.is_floating_point()])


def _digest(flat: Tensor) -> str:
    return hashlib.sha256(flat.numpy().tobytes()).hexdigest()[:16]


class Consensus(Callback):
    """Where the model and optimizer state live, and the whole model, at ``on_train_end``.

    There every rank holds the consensus model (sharded weights are gathered) and everything is
    still on the device: after ``fit`` returns, Lightning's teardown has moved the module and the
    optimizer state to the CPU.
    """

    def __init__(self) -> None:
        self.start_step = -1
        self.seen: dict[str, Any] = {}

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.start_step = trainer.global_step  # a resumed fit starts at the checkpoint's step

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        params = list(pl_module.parameters())
        flat = _flat(full_state_dict(pl_module))
        self.seen = {
            "param_devices": _devices(params + list(pl_module.buffers())),
            "optimizer_devices": _devices(_optimizer_tensors(trainer)),
            "finite": all(bool(torch.isfinite(p.detach()).all()) for p in params if p.device.type != "meta"),
            "consensus": _digest(flat),
            "consensus_sum": float(flat.sum()),
        }


def build_strategy(case: Case) -> str | Strategy:
    """The bare name at default arguments, or the registry's class with the case's arguments."""
    if not case.kwargs and case.backend is None:
        return case.name
    entry = StrategyRegistry[case.name]
    kwargs = {**entry["init_params"], **case.kwargs}
    if case.backend is not None:
        kwargs["process_group_backend"] = case.backend
    strategy: Strategy = entry["strategy"](**kwargs)
    return strategy


def _trainer(case: Case, accelerator: str, epochs: int, consensus: Consensus) -> pl.Trainer:
    return pl.Trainer(
        accelerator=accelerator,
        devices=1,
        num_nodes=case.world,
        strategy=build_strategy(case),
        max_epochs=epochs,
        limit_train_batches=TRAIN_BATCHES,
        limit_val_batches=VAL_BATCHES,
        enable_progress_bar=False,
        enable_model_summary=False,
        logger=False,
        enable_checkpointing=False,
        callbacks=[consensus],
        # given, not detected: Lightning's detection imports mpi4py where it is installed, whose
        # MPI_Init aborts the process on a machine without an MPI launcher
        plugins=[LightningEnvironment()],
    )


def _devices(tensors: list[Tensor]) -> list[str]:
    return sorted({str(t.device) for t in tensors})


def _optimizer_tensors(trainer: pl.Trainer) -> list[Tensor]:
    return [v for opt in trainer.optimizers for s in opt.state.values() for v in s.values() if isinstance(v, Tensor)]


def _fit_report(trainer: pl.Trainer, module: pl.LightningModule, consensus: Consensus) -> dict[str, Any]:
    strategy = trainer.strategy
    return {
        "environment": type(getattr(strategy, "cluster_environment", None)).__name__,
        "rank": f"{trainer.global_rank}/{trainer.world_size}",
        "root_device": str(strategy.root_device),
        "backend": dist.get_backend() if dist.is_initialized() else None,
        "start_step": consensus.start_step,
        "steps": trainer.global_step,
        "param_devices": [],
        "optimizer_devices": [],
        "finite": False,
        "consensus": "",
        **consensus.seen,  # empty when on_train_end did not run
        "after_fit_devices": _devices(list(module.parameters())),  # Lightning's teardown: the CPU
        "val_acc": float(trainer.callback_metrics.get("val_acc", float("nan"))),
    }


def fit(case: Case, accelerator: str, folder: Path) -> dict[str, Any]:
    torch.manual_seed(0)
    module = SmokeClassifier()
    consensus = Consensus()
    trainer = _trainer(case, accelerator, epochs=1, consensus=consensus)
    initial = _digest(_flat(module.state_dict()))
    trainer.fit(module)
    report = _fit_report(trainer, module, consensus)
    report["initial"] = initial
    _State.trainer = trainer
    return report


def checkpoint(case: Case, accelerator: str, folder: Path) -> dict[str, Any]:
    """``save_checkpoint`` is a collective; rank 0 writes, and the file loads on the CPU as plain tensors."""
    assert _State.trainer is not None
    path = folder / "smoke.ckpt"
    _State.trainer.save_checkpoint(path)
    _State.trainer.strategy.barrier()
    loaded = torch.load(path, map_location="cpu", weights_only=True)
    return {"bytes": path.stat().st_size, "keys": sorted(loaded)}


def resume(case: Case, accelerator: str, folder: Path) -> dict[str, Any]:
    torch.manual_seed(1)  # other initial weights: the checkpoint must replace them
    module = SmokeClassifier()
    consensus = Consensus()
    trainer = _trainer(case, accelerator, epochs=2, consensus=consensus)
    trainer.fit(module, ckpt_path=folder / "smoke.ckpt")
    return _fit_report(trainer, module, consensus)


class _State:
    trainer: pl.Trainer | None = None


# ---------------------------------------------------------------------- gloo probe
def _full(value: float, device: torch.device, n: int = 4, dtype: torch.dtype = torch.float32) -> Tensor:
    return torch.full((n,), float(value), device=device, dtype=dtype)


def _expect(t: Tensor, value: float) -> None:
    if not torch.equal(t.float().cpu(), torch.full(t.shape, float(value))):
        raise AssertionError(f"wrong values {t.tolist()} (expected {value})")


def _all_reduce(dtype: torch.dtype) -> Callable[[int, torch.device, Any], None]:
    def op(rank: int, device: torch.device, group: Any) -> None:
        t = _full(rank + 1, device, dtype=dtype)
        dist.all_reduce(t, group=group)
        _expect(t, 3)

    return op


def _broadcast(rank: int, device: torch.device, group: Any) -> None:
    t = _full(7 if rank == 0 else 0, device)
    dist.broadcast(t, 0, group=group)
    _expect(t, 7)


def _all_gather(rank: int, device: torch.device, group: Any) -> None:
    out = [_full(0, device) for _ in range(2)]
    dist.all_gather(out, _full(rank, device), group=group)
    _expect(out[1], 1)


def _all_gather_into_tensor(rank: int, device: torch.device, group: Any) -> None:
    out = _full(0, device, n=8)
    dist.all_gather_into_tensor(out, _full(rank, device), group=group)
    _expect(out[4:], 1)


def _reduce(rank: int, device: torch.device, group: Any) -> None:
    t = _full(rank + 1, device)
    dist.reduce(t, 0, group=group)
    if rank == 0:
        _expect(t, 3)


def _gather(rank: int, device: torch.device, group: Any) -> None:
    out = [_full(0, device) for _ in range(2)] if rank == 0 else None
    dist.gather(_full(rank, device), out, 0, group=group)
    if out is not None:
        _expect(out[1], 1)


def _scatter(rank: int, device: torch.device, group: Any) -> None:
    t = _full(0, device)
    dist.scatter(t, [_full(i + 5, device) for i in range(2)] if rank == 0 else None, 0, group=group)
    _expect(t, rank + 5)


def _reduce_scatter(rank: int, device: torch.device, group: Any) -> None:
    t = _full(0, device)
    dist.reduce_scatter_tensor(t, _full(rank + 1, device, n=8), group=group)
    _expect(t, 3)


def _all_to_all(rank: int, device: torch.device, group: Any) -> None:
    out = _full(0, device)
    dist.all_to_all_single(out, _full(rank, device), group=group)
    if out[2:].tolist() != [1.0, 1.0]:
        raise AssertionError(f"wrong values {out.tolist()}")


def _barrier(rank: int, device: torch.device, group: Any) -> None:
    dist.barrier(group=group)


def _send_recv(rank: int, device: torch.device, group: Any) -> None:
    t = _full(9 if rank == 0 else 0, device)
    if rank == 0:
        dist.send(t, 1, group=group)
    else:
        dist.recv(t, 0, group=group)
        _expect(t, 9)


def _isend_irecv(rank: int, device: torch.device, group: Any) -> None:
    t = _full(9 if rank == 0 else 0, device)
    work = dist.isend(t, 1, group=group) if rank == 0 else dist.irecv(t, 0, group=group)
    assert work is not None
    work.wait(timeout=PROBE_TIMEOUT)
    if rank == 1:
        _expect(t, 9)


def _batch_isend_irecv(rank: int, device: torch.device, group: Any) -> None:
    peer, out = 1 - rank, _full(-1, device)
    ops = [dist.P2POp(dist.isend, _full(rank, device), peer, group), dist.P2POp(dist.irecv, out, peer, group)]
    for work in dist.batch_isend_irecv(ops):
        work.wait(timeout=PROBE_TIMEOUT)
    _expect(out, peer)


# point-to-point last: a gloo transport reading device memory could crash the process
PROBES: dict[str, Callable[[int, torch.device, Any], None]] = {
    "all_reduce": _all_reduce(torch.float32),
    "broadcast": _broadcast,
    "barrier": _barrier,
    "all_reduce_float16": _all_reduce(torch.float16),
    "all_reduce_bfloat16": _all_reduce(torch.bfloat16),
    "all_gather": _all_gather,
    "all_gather_into_tensor": _all_gather_into_tensor,
    "reduce": _reduce,
    "gather": _gather,
    "scatter": _scatter,
    "reduce_scatter_tensor": _reduce_scatter,
    "all_to_all_single": _all_to_all,
    "send_recv": _send_recv,
    "isend_irecv": _isend_irecv,
    "batch_isend_irecv": _batch_isend_irecv,
}


def probe(device: torch.device, report: dict[str, Any], save: Callable[[], None]) -> None:
    rank, world = int(os.environ["NODE_RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", init_method="env://", rank=rank, world_size=world, timeout=PROBE_TIMEOUT)
    ops: dict[str, str] = report.setdefault("probe", {})
    for name, op in PROBES.items():
        ops[name] = "started (the process ended inside this operation)"
        save()
        try:
            group = dist.new_group(backend="gloo", timeout=PROBE_TIMEOUT)  # a stuck operation stays in its group
            op(rank, device, group)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            ops[name] = "ok"
        except Exception as exc:
            ops[name] = f"{type(exc).__name__}: {_first_line(exc)}"
        save()


# ---------------------------------------------------------------------- the rank's main
STAGES: dict[str, Callable[[Case, str, Path], dict[str, Any]]] = {
    "fit": fit,
    "checkpoint": checkpoint,
    "resume": resume,
}


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0][:400] if text else repr(exc)


def _write(path: Path, report: dict[str, Any]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(report, indent=1, default=str))
    tmp.replace(path)


def run(case: Case, accelerator: str, result: Path, folder: Path) -> int:
    device = torch.device("cuda", 0) if accelerator in ("gpu", "cuda") else torch.device("cpu")
    report: dict[str, Any] = {"case": case.id, "pid": os.getpid(), "torch": torch.__version__, "stages": {}}
    if case.mode == "probe":
        probe(device, report, lambda: _write(result, report))
        return 0
    for name, stage in STAGES.items():
        start = time.monotonic()
        try:
            entry = {"ok": True, **stage(case, accelerator, folder)}
        except BaseException as exc:
            entry = {
                "ok": False,
                "type": type(exc).__name__,
                "error": f"{type(exc).__name__}: {_first_line(exc)}",
                "traceback": traceback.format_exc(),
            }
        entry["seconds"] = round(time.monotonic() - start, 2)
        report["stages"][name] = entry
        _write(result, report)
        if not entry["ok"]:
            return 1
    return 0


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--case", required=True, help="a Case as JSON")
    parser.add_argument("--accelerator", required=True)
    parser.add_argument("--result", required=True, type=Path)
    parser.add_argument("--folder", required=True, type=Path)
    args = parser.parse_args(argv)
    code = 1
    try:
        code = run(Case.from_json(args.case), args.accelerator, args.result, args.folder)
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        # no interpreter shutdown: process groups and the strategies' threads stay alive after fit
        os._exit(code)


if __name__ == "__main__":
    main(sys.argv[1:])
