r"""``python -m lightning_hier.simulator``: calibrate a workload, measure a link, predict every strategy.

::

    # 1. the user's model on one worker (a builtin name or package.module:factory(input_shape, classes, **args))
    python -m lightning_hier.simulator calibrate --model mlp --model-args '{"hidden": [1024, 1024, 1024]}' \\
        --batch-size 512 --samples-per-epoch 50000 --out mlp.json
    # 2. (optional) the link, under the launcher of the real cluster
    torchrun --nproc-per-node 2 -m lightning_hier.simulator link --out link.json
    # 3. table, plot and recommendation for 8 .. 1024 workers
    python -m lightning_hier.simulator predict --workload mlp.json --link 1gbit --stragglers lognormal:0.1 \\
        --plot mlp_1gbit.png
"""

from __future__ import annotations

import argparse
import importlib
import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from torch import nn

from lightning_hier.planner.cost import Layer, Link
from lightning_hier.simulator.inputs import ALGORITHMS, Cluster, Workload, parse_link, parse_speeds
from lightning_hier.simulator.sweep import ROWS, format_detail, format_sweep, plot_sweep, recommend, sweep

WORKERS = [8, 16, 32, 64, 128, 256, 512, 1024]
PRESETS = Path(__file__).with_name("presets")


def build_model(spec: dict[str, Any]) -> nn.Module:
    """The network of a :attr:`Workload.model` spec: a builtin name or ``package.module:factory``."""
    from lightning_hier.models import networks

    name = str(spec["spec"])
    factory: Callable[..., nn.Module]
    if ":" in name:
        module, _, attr = name.partition(":")
        factory = getattr(importlib.import_module(module), attr)
    else:
        builtins: dict[str, Callable[..., nn.Module]] = {
            "mlp": networks.mlp,
            "small_cnn": networks.small_cnn,
            "resnet20": networks.resnet20,
        }
        if name not in builtins:
            raise ValueError(
                f"simulator: `--model` must be one of {sorted(builtins)} or package.module:factory, got {name!r}."
            )
        factory = builtins[name]
    return factory(tuple(spec["input_shape"]), int(spec["classes"]), **spec.get("args", {}))


def workload_layers(workload: Workload) -> list[Layer]:
    """The grid's layer list of the workload's network (empty: the workload has no model spec)."""
    if workload.model is None:
        return []
    from lightning_hier.planner.networks import model_layers

    return model_layers(build_model(workload.model), workload.model["input_shape"])


def load_workload(text: str) -> Workload:
    """A workload JSON file, or the name of a preset (``mlp``, ``cnn``: measured on the benchmark machine)."""
    path = Path(text) if Path(text).exists() else PRESETS / f"{text}.json"
    if not path.exists():
        presets = sorted(p.stem for p in PRESETS.glob("*.json"))
        raise ValueError(f"simulator: `--workload` must be a JSON file or one of {presets}, got {text!r}.")
    return Workload.load(path)


def _calibrate(args: argparse.Namespace) -> int:
    import torch

    from lightning_hier.simulator.calibrate import measure_workload

    torch.set_num_threads(args.threads)  # one worker's cores (the benchmark pins each rank to one)
    spec = {
        "spec": args.model,
        "input_shape": args.input_shape,
        "classes": args.classes,
        "args": json.loads(args.model_args),
    }
    workload = measure_workload(
        args.name or Path(args.out).stem, build_model(spec), args.input_shape, args.batch_size,
        args.samples_per_epoch, args.classes, args.repeats, spec,
    )  # fmt: skip
    Path(args.out).write_text(workload.to_json())
    per_sample = f"{1e6 * workload.sample_s:.1f} us/sample, step {1e3 * workload.step_s:.2f} ms"
    print(f"{args.out}: {workload.params:,} parameters, {per_sample}")
    return 0


def _link(args: argparse.Namespace) -> int:
    import torch.distributed as dist

    from lightning_hier.planner.measure import measure_link

    dist.init_process_group(args.backend)
    link = measure_link()
    if dist.get_rank() == 0:
        Path(args.out).write_text(json.dumps({"alpha": link.alpha, "beta": link.beta}))
        print(f"{args.out}: alpha {link.alpha:.3g} s, beta {link.beta:.3g} s/word ({32 / link.beta / 1e9:.2f} Gbit/s)")
    dist.destroy_process_group()
    return 0


def _cluster(args: argparse.Namespace) -> Cluster:
    if args.link_json:
        link = Link(**json.loads(Path(args.link_json).read_text()))
    else:
        link = parse_link(args.link, alpha=args.alpha, efficiency=args.efficiency)
    if args.jitter < 0:
        raise SystemExit(f"simulator: `--jitter` must be >= 0 seconds, got {args.jitter!r}.")
    return Cluster(
        2,
        link,
        args.algorithm,
        cpu_s_per_byte=args.cpu_s_per_byte,
        jitter_s=args.jitter,
        collective_s_per_byte=args.collective_s_per_byte,
    )


def _predict(args: argparse.Namespace) -> int:
    workload = load_workload(args.workload)
    if args.batch_size:
        workload = workload.with_batch(args.batch_size)
    cluster = _cluster(args)
    unknown = sorted(set(args.strategies) - set(ROWS))
    if unknown:
        raise SystemExit(f"simulator: unknown `--strategies` {unknown}; known: {sorted(ROWS)}")
    parse_speeds(args.stragglers, 2)  # a bad distribution fails before the sweep
    results = sweep(
        args.strategies,
        workload,
        cluster,
        args.workers,
        lambda w: parse_speeds(args.stragglers, w),
        workload_layers(workload),
    )
    rate = 32 / cluster.link.beta / 1e9
    title = (
        f"{workload.name}: batch {workload.batch_size}/worker, link {rate:.3g} Gbit/s "
        f"(alpha {cluster.link.alpha:.3g} s), "
        f"{cluster.algorithm} all-reduce, stragglers {args.stragglers}: predicted samples/s"
    )
    print(format_sweep(results, title))
    largest = max(args.workers)
    print("\n" + format_detail(results[largest], largest))
    pick = recommend(results[largest])
    print(f"\nRecommended at W={largest}: {pick.strategy} {pick.args} ({pick.samples_per_s:,.0f} samples/s)")
    if args.plot:
        plot_sweep(results, title, args.plot)
        print(f"plot: {args.plot}")
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m lightning_hier.simulator", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    sub = parser.add_subparsers(dest="command", required=True)
    cal = sub.add_parser("calibrate", help="time the model on this machine; write a workload JSON")
    cal.add_argument("--model", required=True, help="mlp, small_cnn, resnet20 or package.module:factory")
    cal.add_argument("--model-args", default="{}", help="JSON keyword arguments of the factory")
    cal.add_argument("--input-shape", type=int, nargs="+", default=[3, 32, 32])
    cal.add_argument("--classes", type=int, default=10)
    cal.add_argument("--batch-size", type=int, required=True, help="samples per worker per step")
    cal.add_argument("--samples-per-epoch", type=int, default=50000)
    cal.add_argument("--repeats", type=int, default=5)
    cal.add_argument("--threads", type=int, default=1, help="CPU threads of the timed worker")
    cal.add_argument("--name", default=None)
    cal.add_argument("--out", required=True)
    link = sub.add_parser("link", help="measure alpha and beta on the launched group (torchrun); rank 0 writes JSON")
    link.add_argument("--backend", default="gloo")
    link.add_argument("--out", default="link.json")
    pred = sub.add_parser("predict", help="table, plot and recommendation for a range of worker counts")
    pred.add_argument("--workload", required=True, help="a calibrate JSON or a preset (mlp, cnn)")
    pred.add_argument("--batch-size", type=int, default=None, help="override the workload's per-worker batch")
    pred.add_argument("--link", default="1gbit", help="100mbit, 1gbit, 10gbit, 2.5gbit, ...")
    pred.add_argument("--link-json", default=None, help="alpha/beta measured by `link`")
    pred.add_argument("--alpha", type=float, default=50e-6, help="seconds per message with --link")
    pred.add_argument("--efficiency", type=float, default=1.0, help="fraction of the nominal rate reached")
    pred.add_argument("--algorithm", choices=ALGORITHMS, default="ring")
    pred.add_argument("--cpu-s-per-byte", type=float, default=0.0, help="compute lost per byte sent while computing")
    pred.add_argument(
        "--collective-s-per-byte", type=float, default=0.0, help="a collective's own CPU time per byte sent (a floor)"
    )
    pred.add_argument(
        "--jitter",
        type=float,
        default=0.0,
        help="std of a worker's step time, s: each synchronisation waits for the slowest",
    )
    pred.add_argument("--stragglers", default="none", help="none, straggler:F or lognormal:SIGMA")
    pred.add_argument("--workers", type=int, nargs="+", default=WORKERS)
    pred.add_argument("--strategies", nargs="+", default=list(ROWS), help="rows: models, mgrawa-async, lgrawa-async")
    pred.add_argument("--plot", default=None, help="PNG path")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Parse ``argv`` and run the sub-command; returns the exit code."""
    args = _parser().parse_args(argv)
    command = {"calibrate": _calibrate, "link": _link, "predict": _predict}[args.command]
    return command(args)


if __name__ == "__main__":
    raise SystemExit(main())
