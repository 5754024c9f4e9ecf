"""The simulator's prediction beside every measured run: samples/s, bytes per epoch, payload.

``python -m benchmarks.predicted [results.json] [--logs-root DIR]`` prints the table of every
workload; :func:`predicted_table` is what the report appends to each workload's section.

Calibration, all from the same invocation (nothing is fitted to the run being predicted):

- compute per step: the ``no-comm`` run's training time per step (same model, data, batch and
  straggler; the straggler's factor divides it back to the nominal worker), less the modelled
  time of its own rounds (:func:`_reference_rounds_s`: its payload, one all-reduce per epoch, which
  on a slow link is most of a short run: 1.8 s of 5 at 100 Mbit/s on ``hpsgd_mlp``); forward : backward
  is the simulator's preset of the same network's measured one (:func:`forward_share`; 1 : 2 for a
  network without a preset; it only matters for DDP's overlap);
- link: the tc rate times :data:`EFFICIENCY` (944 Mbit/s measured by a socket test through the
  1 Gbit/s tbf link, docs/lightning.md section 10); ``unlimited``: the 7.9 Gbit/s measured there;
- jitter: the ``no-comm`` run's spread of a step's time (``step_jitter_s``: each rank's Gini
  estimate of the standard deviation, :func:`~lightning_hier.simulator.jitter.gini_sigma`, averaged
  over the ranks; the straggler's factor divides it back too). On a shared machine other processes
  take the ranks' cores now and then, and every synchronous strategy waits for the slower rank at
  each synchronisation; results recorded before it was measured predict with none;
- :data:`CPU_S_PER_BYTE`: what gloo's reduction and copies take from the compute they overlap on
  the rank's one core, fitted once on ``hpsgd_mlp`` (HPSGD, window 4, 1 Gbit/s) and kept for every
  run; :data:`COLLECTIVE_S_PER_BYTE`: a blocking collective's own CPU time per byte, measured with
  the link probe (a floor that no benchmark link reaches);
- each codec's CPU time per byte it compresses (bf16, int8, int4, PowerSGD): the preset's of the
  same network (:func:`~lightning_hier.simulator.calibrate.codec_seconds` on the benchmark machine);
- each epoch's validation consensus (HPSGD, the averaging family when the epoch does not end on a
  round, the parameter servers) is on the training clock, so its time joins the fit's
  (:func:`with_consensus`);
- DBS (``dbs``, ``dbs_async``) over the run's fit: its first ``warmup_steps + rebalance_every``
  steps keep the initial (equal) batch sizes, the rest the speed-proportional shares
  (:func:`with_warmup`; a short benchmark run spends half its steps before the first rebalance);
  with the shared queue each worker sizes its claims after its *own* first steps, so the initial
  sizes last the slowest worker's first claims (:func:`with_claimed_warmup`);
- bytes per epoch: the model's wire bytes plus :data:`HEADERS` (TCP/IP framing), plus the
  ``no-comm`` run's bytes per epoch that were neither its validation consensus nor its start-up
  broadcast (rendezvous store, metric syncs), plus the start-up broadcast where the run sent one
  (DDP and its peers always; the library's strategies only when the ranks' weights differed),
  plus the consensus each epoch's validation needs (:func:`validation_bytes`: HPSGD always, the
  averaging family when an epoch does not end on a round, GRAWA's asynchronous rounds and the
  parameter-server strategies always); the payload column (what ``CommStats``
  counted over the fit) includes that consensus where ``CommStats`` counts it.

The pipeline and the grid need the network's structure: per-block costs (their shares from the
simulator's preset of the same network, found by its tensor sizes, rescaled to the calibrated
compute) and the layer list (built from the preset's model spec); PowerSGD needs the tensors'
shapes (recorded by the run, else the preset's). The pipeline's prediction covers its epoch, fill
and drain included (:func:`~lightning_hier.simulator.pipeline.epoch_time`). torch's DDP hooks are
predicted with their plain warm-up steps (:func:`~benchmarks.fit_model.with_hook_warmup`); their
runs have no ``CommStats`` payload to compare. Runs the model does not cover print ``-``: pipeline
or grid runs of a network without a preset, PowerSGD without the tensors' shapes.
"""

from __future__ import annotations

import argparse
import inspect
import json
import math
from dataclasses import replace
from pathlib import Path
from typing import Any

from benchmarks.fit_model import (
    REBALANCED,
    mean_steps,
    validation_bytes,
    validation_forward_bytes,
    with_consensus,
    with_final_reports,
    with_hook_warmup,
    with_warmup,
    with_whole_rounds,
    with_whole_windows,
)
from lightning_hier.simulator import Cluster, Prediction, Workload, all_reduce, one_straggler, parse_link, predict
from lightning_hier.simulator.__main__ import PRESETS, workload_layers
from lightning_hier.simulator.inputs import FORWARD_SHARE, Block
from lightning_hier.simulator.prediction import compute_s
from lightning_hier.simulator.registry import MODELS

EFFICIENCY = 0.944
UNLIMITED_BITS = 7.9e9
CPU_S_PER_BYTE = 3e-9
COLLECTIVE_S_PER_BYTE = 0.85e-9
"""A blocking all-reduce alone, per byte sent: 26.2 MB in 20.7-24.2 ms on 2026-11-28 (``python -m
benchmarks.link_probe --link unlimited --mb 26.2``, and a plain-torch loop's 25 MiB all-reduce);
below the unlimited link's 1.0 ns, so no benchmark collective is bound by it."""
HEADERS = 0.002  # TCP/IP headers: veth offloads segmentation, so segments are ~64 KB
NO_COMM = "no-comm"


def _cluster(link: str, world: int, straggler: dict[str, Any] | None, jitter_s: float) -> Cluster:
    rate = parse_link(link, efficiency=EFFICIENCY) if link != "unlimited" else parse_link(f"{UNLIMITED_BITS / 1e9}gbit")
    speeds = one_straggler(world, float(straggler["factor"])) if straggler else ()
    return Cluster(
        world,
        rate,
        "ring",
        speeds,
        cpu_s_per_byte=CPU_S_PER_BYTE,
        jitter_s=jitter_s,
        collective_s_per_byte=COLLECTIVE_S_PER_BYTE,
    )


def _reference_rounds_s(reference: dict[str, Any], cluster: Cluster) -> float:
    """Seconds of the ``no-comm`` run's own rounds: one all-reduce of its payload per epoch (the consensus
    of each validation and the end of the fit, on the training clock) -- communication, not compute."""
    if not reference.get("payload_bytes") or not reference.get("epochs"):
        return 0.0
    epochs = int(reference["epochs"])
    return epochs * all_reduce(reference["payload_bytes"][0] / epochs, cluster.workers, cluster).time_s


def _workload(
    name: str,
    run: dict[str, Any],
    reference: dict[str, Any],
    world: int,
    factor: float,
    rounds_s: float,
    replicas: int | None = None,
) -> Workload | None:
    """The run's workload, its compute calibrated per sample on the ``no-comm`` run.

    ``replicas``: data-parallel replicas of the run (the pipeline's: ranks / stages; default all
    ranks), which sets its per-replica batch. Blocks (the pipeline's per-block costs) and the model's
    spec (the grid's layer list) come from the simulator's preset of the same network
    (:func:`_preset`), the blocks' times rescaled to the calibrated per-sample time.
    """
    model = run.get("model") or reference.get("model") or {}
    if not model.get("parameters") or not run.get("steps") or not reference.get("steps"):
        return None
    batch = round(run["samples"] / mean_steps(run) / (replicas or world))
    reference_batch = reference["samples"] / reference["steps"] / world
    sample_s = (reference["train_s"] - rounds_s) / reference["steps"] / factor / reference_batch
    tensor_words = tuple(int(n) for n in model.get("tensor_words") or ())
    # the no-comm run trains the whole network on every rank (a grid run records its own shards)
    preset = _preset(tuple(int(n) for n in (reference.get("model") or {}).get("tensor_words") or ()))
    same = preset if preset is not None and preset.tensor_words == tensor_words else None
    # runs recorded before their tensors' shapes take the same network's; its codec costs too
    shapes = tuple(tuple(int(n) for n in shape) for shape in model.get("tensor_shapes") or ())
    shapes = shapes or (same.tensor_shapes if same is not None else ())
    codecs = dict(same.codec_s_per_byte) if same is not None else {}
    if _model_overrides(run) != _model_overrides(reference):
        # e.g. model.layer_blocks=true: the same tensors in other blocks, which the preset does not
        # describe, so no blocks (no pipeline prediction) and no layer list (no grid prediction)
        preset = None
    blocks: tuple[Block, ...] = ()
    if preset is not None and preset.blocks:
        scale = sample_s / preset.sample_s
        blocks = tuple(replace(b, compute_s=b.compute_s * scale) for b in preset.blocks)
    forward = forward_share(preset)
    return Workload(
        name,
        params=int(model["parameters"]),
        batch_size=batch,
        samples_per_epoch=round(run["samples"] / run["epochs"]),
        forward_s=forward * sample_s,
        backward_s=(1 - forward) * sample_s,
        buffers=int(model.get("float_buffers") or 0),
        tensors=int(model.get("tensors") or 1),
        tensor_words=tensor_words,
        tensor_shapes=shapes,
        codec_s_per_byte=codecs,
        blocks=blocks,
        model=preset.model if preset is not None else None,
    )


def forward_share(preset: Workload | None) -> float:
    """The forward's share of a sample's compute: the preset's measured one, else 1/3 (backward = 2 forwards).

    It sets how much of DDP's step its buckets can hide behind. The small CNN's forward is 60 % of
    its compute (its first convolution needs no input gradient), not a third: with 1/3, DDP on a
    100 Mbit/s link was predicted 16-22 % faster than it ran, its exposed forward under-counted.
    """
    return preset.forward_share if preset is not None else FORWARD_SHARE


def _model_overrides(run: dict[str, Any]) -> set[str]:
    """The run's Hydra overrides of the network's options (``model.*``)."""
    return {o for o in run.get("overrides") or () if o.lstrip("+").startswith("model.")}


def _preset(tensor_words: tuple[int, ...]) -> Workload | None:
    """The simulator's preset of the same network: the one with exactly these tensor sizes (None: none)."""
    if not tensor_words:
        return None
    presets = (Workload.load(path) for path in sorted(PRESETS.glob("*.json")))
    return next((w for w in presets if w.tensor_words == tensor_words), None)


def _structure_args(strategy: str, config: dict[str, Any], workload: Workload, world: int) -> dict[str, Any] | None:
    """The pipeline's stages and the grid's shape and layer list (None: the run cannot be predicted,
    as PowerSGD without the tensors' shapes)."""
    if strategy == "decoupled":
        stages = config.get("stages", "auto")
        # `auto` picks one stage per rank of a node; the benchmark's nodes are one rank each, up to the world
        pipe = int(stages) if isinstance(stages, int) else world
        return {"pipe": pipe} if workload.blocks else None
    if strategy == "grid2d":
        layers = workload_layers(workload)
        grid = config.get("grid")
        return {"layers": layers, "grid": tuple(grid) if isinstance(grid, list) else None} if layers else None
    if strategy == "ddp_powersgd":
        return {} if workload.tensor_shapes else None
    return {}


def _arguments(strategy: str, config: dict[str, Any] | None) -> dict[str, Any]:
    accepted = set(inspect.signature(MODELS[strategy]).parameters) - {"workload", "cluster"}
    return {k: v for k, v in (config or {}).items() if k in accepted}


def predict_run(label: str, run: dict[str, Any], result: dict[str, Any], world: int) -> Prediction | None:
    """The simulator's prediction of one measured run (None: not modelled, or no calibration)."""
    reference = result["runs"].get(NO_COMM)
    strategy = "no-comm" if label == NO_COMM else run.get("strategy", "")
    if reference is None or "error" in reference or "error" in run or strategy not in MODELS:
        return None
    if int(run.get("ranks", world)) != world:  # a run on part of the cluster (the single-process baseline)
        return None
    straggler = result.get("straggler")
    factor = float(straggler["factor"]) if straggler else 1.0
    jitter = float(reference.get("step_jitter_s") or 0.0) / factor
    cluster = _cluster(str(result.get("link", "1gbit")), world, straggler, jitter)
    config = run.get("strategy_config") or {}
    stages = config.get("stages") if strategy == "decoupled" else 1
    replicas = world // (int(stages) if isinstance(stages, int) else world)
    workload = _workload(label, run, reference, world, factor, _reference_rounds_s(reference, cluster), replicas)
    if workload is None:
        return None
    structure = _structure_args(strategy, config, workload, world)
    if structure is None:
        return None
    args = {} if strategy == "no-comm" else {**_arguments(strategy, config), **structure}
    steady = predict(strategy, workload, cluster, **args)
    if strategy == "decoupled":  # the model plays the run's epoch, its fill and drain included
        return steady
    fit = with_warmup(steady, workload, cluster, run) if strategy in REBALANCED else steady
    fit = with_final_reports(with_whole_rounds(fit, max(compute_s(workload, cluster)), run), run)
    fit = with_hook_warmup(with_whole_windows(fit, run), run)
    return fit if strategy == "no-comm" else with_consensus(fit, cluster, run)


def _fixed_bytes_per_epoch(reference: dict[str, Any]) -> float:
    """The ``no-comm`` run's bytes per epoch that are neither training, its validation consensus nor its start."""
    if not reference.get("bytes_per_epoch"):
        return 0.0
    payload = reference["payload_bytes"][0] / reference["epochs"] if reference.get("payload_bytes") else 0.0
    ranks = int(reference.get("ranks") or 2)
    consensus = 2 * (ranks - 1) / ranks * payload  # a ring all-reduce sends 2 (p - 1) / p of its payload
    return max(0.0, float(reference["bytes_per_epoch"]) - consensus - _start_bytes_per_epoch(reference))


def _start_bytes_per_epoch(run: dict[str, Any], reference: dict[str, Any] | None = None) -> float:
    """Wire bytes per epoch and rank of the run's start-up broadcast of rank 0's float32 model (0: skipped).

    DDP's constructor always sends it; the library's strategies skip it when every rank already
    holds rank 0's weights (runs recorded before they could skip it have no ``start_broadcast``).
    The model is the ``reference`` run's (default: ``run``'s): the grid broadcasts the whole
    network before it shards it, and records its shard.
    """
    if not run.get("start_broadcast", True) or not run.get("epochs"):
        return 0.0
    model = (reference or run).get("model") or {}
    words = float(model.get("parameters") or 0) + float(model.get("float_buffers") or 0)
    ranks = int(run.get("ranks") or 2)
    return (ranks - 1) / ranks * 4 * words * (1 + HEADERS) / float(run["epochs"])  # a broadcast: (p - 1) / p n


def _error(predicted: float, measured: float | None) -> str:
    if measured is None or not measured or math.isnan(measured):
        return "-"
    return f"{100 * (predicted - measured) / measured:+.0f}%"


def _queued(run: dict[str, Any]) -> str:
    """The share of the run its training threads waited for their cores (load; ``-``: not recorded)."""
    share = run.get("queued_share")
    return "-" if share is None else f"{100 * share:.0f}%"


def predicted_table(result: dict[str, Any], world: int) -> str:
    """Markdown: measured and predicted samples/s, MB/epoch/rank and payload per run, with the errors.

    The last column is the share of each run that its ranks' training threads spent runnable but
    waiting for their cores (other processes held them): the calibration assumes the ``no-comm``
    run's share of the cores, so a run under more load than its calibration is slower than predicted.
    """
    lines = [
        "| run | samples/s | predicted | error | MB/epoch/rank | predicted | error | payload MB/rank | predicted "
        "| error | queued |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for label, run in result["runs"].items():
        p = predict_run(label, run, result, world)
        if p is None:
            lines.append(f"| {label} | {run.get('samples_per_s', math.nan):.0f} |" + " - |" * 8 + f" {_queued(run)} |")
            continue
        if label == NO_COMM:  # the calibration run itself
            lines.append(f"| {label} | {run['samples_per_s']:.0f} | calibration |" + " - |" * 7 + f" {_queued(run)} |")
            continue
        wire, payload = predicted_bytes(p, run, result)
        measured_payload = run["payload_bytes"][0] if run.get("payload_bytes") else None
        rate = run["samples_per_s"]
        lines.append(
            f"| {label} | {rate:.0f} | {p.samples_per_s:.0f} | {_error(p.samples_per_s, rate)} "
            f"| {run['bytes_per_epoch'] / 1e6:.1f} | {wire / 1e6:.1f} | {_error(wire, run['bytes_per_epoch'])} "
            f"| {'-' if measured_payload is None else f'{measured_payload / 1e6:.1f}'} | {payload / 1e6:.1f} "
            f"| {_error(payload, measured_payload)} | {_queued(run)} |"
        )
    return "\n".join(lines)


def predicted_bytes(p: Prediction, run: dict[str, Any], result: dict[str, Any]) -> tuple[float, float]:
    """``(wire bytes per epoch and rank, payload bytes per rank over the fit)`` predicted for ``run``."""
    reference = result["runs"].get(NO_COMM, {})
    overhead = _fixed_bytes_per_epoch(reference)
    validation, validation_wire = validation_bytes(p, run)
    # EASGD's center catches up with the replicas at the end of the fit: one all-reduce of the model
    catch_up = 4 * float((run.get("model") or {}).get("parameters") or 0) if p.strategy == "easgd" else 0.0
    share = (p.workers - 1) / p.workers
    forward = validation_forward_bytes(p, run)
    wire = (p.wire_bytes_per_epoch + validation_wire + forward + 2 * share * catch_up / run["epochs"]) * (1 + HEADERS)
    drain = p.detail.get("drain", 0) * run["epochs"]  # the pipeline's drain iterations send too
    payload = p.payload_bytes * (run["steps"] + drain) + (validation + forward) * run["epochs"] + catch_up
    return wire + overhead + _start_bytes_per_epoch(run, reference), payload


def _fill_models(results: dict[str, Any], logs_root: Path) -> None:
    """Results written before runs recorded their model: read the counts from the rank logs."""
    for name, result in results["workloads"].items():
        logs = result.get("meta", results["meta"]).get("logs")
        for label, run in result["runs"].items():
            rank0 = logs_root / str(logs) / name / f"{label}-0" / "rank0.json"
            if not run.get("model") and logs and rank0.exists():
                data = json.loads(rank0.read_text())
                run["model"] = {k: data.get(k) for k in ("parameters", "float_buffers", "tensors")}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.predicted", description=__doc__)
    parser.add_argument("results", nargs="?", default="benchmarks/results/results.json")
    parser.add_argument("--logs-root", default=".", help="where the results' `logs` paths start (older results)")
    args = parser.parse_args(argv)
    results = json.loads(Path(args.results).read_text())
    _fill_models(results, Path(args.logs_root))
    for name, result in results["workloads"].items():
        world = int(result.get("meta", results["meta"]).get("ranks", 2))
        print(f"\n### {name}: {world} ranks, {result.get('link')} links\n\n{predicted_table(result, world)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
