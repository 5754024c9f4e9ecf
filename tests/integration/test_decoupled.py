"""DecoupledStrategy under a real Trainer: references step by step, accuracy, checkpoints, resume, errors."""

import os

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset

from lightning_hier import DecoupledStrategy
from lightning_hier.algorithms.decoupled import stage_ranges
from lightning_hier.data.augment import normalize
from lightning_hier.models import Classifier, mlp
from lightning_hier.testing import WorkerFailed, run_workers
from tests.helpers import ParamRecorder, assert_resumed_run_matches, digits, digits_classifier, flat_params, trainer
from tests.pipeline_reference import plain_backprop, simulate, update_lag
from tests.user_models import UserModule

SAMPLES, BATCH, EPOCHS = 56, 8, 2  # 7 batches per epoch: not divisible by 2 or 4
SPLITS = {2: [2], 4: [1, 2, 3]}


def _classifier() -> Classifier:
    torch.manual_seed(0)
    return Classifier(mlp((1, 8, 8), 10, hidden=(16, 16, 16)), 10, lr=0.05, momentum=0.9, weight_decay=1e-3)


def _optimizer(module: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(module.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-3)


def _shard(replica: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + replica)
    return torch.randn(SAMPLES, 1, 8, 8, generator=g), torch.randint(0, 10, (SAMPLES,), generator=g)


def _reference_epochs(replicas: int, steps: int = -1) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    """One replica on the concatenated batches of all replicas (the first ``steps`` batches, if given)."""
    shards = [_shard(d) for d in range(replicas)]
    batches = [
        (torch.cat([x[i : i + BATCH] for x, _ in shards]), torch.cat([y[i : i + BATCH] for _, y in shards]))
        for i in range(0, SAMPLES, BATCH)
    ]
    epochs = [batches] * EPOCHS
    if steps >= 0:
        epochs = [batches] * (steps // len(batches)) + (
            [batches[: steps % len(batches)]] if steps % len(batches) else []
        )
    return epochs


class _Reports(Callback):
    def __init__(self) -> None:
        self.reports: list = []

    def on_train_batch_end(self, trainer, *args) -> None:
        self.reports.append(list(trainer.strategy.last_reports))


def _fit_shards(
    stages: int, schedule: str, weights: str, beta: float, max_steps: int = -1, **options: str | None
) -> dict:
    rank = int(os.environ["RANK"])  # set by run_workers; the process group starts inside fit()
    x, y = _shard(rank // stages)  # every stage of replica d reads shard d
    recorder, reports = ParamRecorder(), _Reports()
    strategy = DecoupledStrategy(
        stages=stages, split=SPLITS[stages], schedule=schedule, weights=weights, beta=beta, timeout=30, **options
    )
    t = trainer(
        strategy=strategy,
        devices=int(os.environ["WORLD_SIZE"]),
        max_epochs=EPOCHS,
        max_steps=max_steps,
        use_distributed_sampler=False,
        callbacks=[recorder, reports],
    )
    module = _classifier()
    t.fit(module, DataLoader(TensorDataset(x, y), batch_size=BATCH, shuffle=False))
    stage = t.global_rank % stages
    return {"stage": stage, "params": recorder.params, "reports": reports.reports, "whole": flat_params(module)}


def _stage_slices(whole: torch.nn.Module, stages: int) -> list[slice]:
    sizes = [sum(p.numel() for i in r for p in whole[i].parameters()) for r in stage_ranges(SPLITS[stages], 4)]
    starts = [sum(sizes[:k]) for k in range(stages)]
    return [slice(a, a + n) for a, n in zip(starts, sizes, strict=True)]


@pytest.mark.parametrize(("devices", "stages"), [(2, 2), (4, 4), (4, 2)])
def test_sync_schedule_equals_single_process_backprop_step_by_step(devices, stages):
    out = run_workers(_fit_shards, stages, "sync", "stash", 1.0, devices=devices)
    replicas = devices // stages
    model = _classifier().net
    reference = plain_backprop(model, _reference_epochs(replicas), _optimizer)
    slices = _stage_slices(model, stages)
    for o in out:
        assert len(o["params"]) == len(reference)
        for step, (got, want) in enumerate(zip(o["params"], reference, strict=True)):
            # after the last step the fit is finished: every rank holds the whole model
            want = want if step == len(reference) - 1 else want[slices[o["stage"]]]
            if replicas == 1:
                assert torch.equal(got, want), f"stage {o['stage']} step {step}"
            else:  # the mean of two half-batch gradients rounds differently
                torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5, msg=f"stage {o['stage']} step {step}")
        torch.testing.assert_close(o["whole"], reference[-1], atol=1e-6, rtol=1e-5)  # whole model after fit


@pytest.mark.parametrize(
    ("devices", "stages", "schedule", "weights", "beta", "max_steps", "options"),
    [
        (2, 2, "fdg", "stash", 0.5, -1, {}),
        (4, 4, "ddg", "recompute", 1.0, -1, {}),
        (4, 2, "fdg", "stash", 1.0, 10, {}),  # stops 3 batches into the second epoch: drained there
        (2, 2, "fdg", "stash", 0.5, -1, {"order": "backward_first", "wire_dtype": "bf16"}),
    ],
)
def test_delayed_schedules_follow_the_stale_gradient_reference(
    devices, stages, schedule, weights, beta, max_steps, options
):
    out = run_workers(_fit_shards, stages, schedule, weights, beta, max_steps, **options, devices=devices)
    model = _classifier().net
    blocks = [torch.nn.Sequential(*[model[i] for i in r]) for r in stage_ranges(SPLITS[stages], 4)]
    epochs = _reference_epochs(devices // stages, max_steps)
    order, wire = options.get("order", "forward_first"), options.get("wire_dtype")
    history = simulate(blocks, epochs, schedule, _optimizer, weights, beta, order=order, wire=wire)
    drain = update_lag(schedule, 0, stages)
    # Lightning step -> reference iteration: the last step of an epoch also runs the drain
    iterations = []
    for e, batches in enumerate(epochs):
        start = sum(len(b) + drain for b in epochs[:e])
        iterations += [start + i + (drain if i == len(batches) - 1 else 0) for i in range(len(batches))]
    for o in out:
        k = o["stage"]
        assert len(o["params"]) == len(iterations)
        for step, (got, iteration) in enumerate(zip(o["params"], iterations, strict=True)):
            # after the last step the fit is finished: every rank holds the whole model (all stages)
            last = step == len(iterations) - 1
            want = torch.cat([h[iteration] for h in history]) if last else history[k][iteration]
            torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5, msg=f"stage {k} step {step}")
        steps = iter(o["reports"])
        for batches in epochs:
            reports = [r for _ in batches for r in next(steps)]
            assert len(reports) == len(batches) + drain and reports[-1].in_flight == 0
            assert sorted(r.applied for r in reports if r.applied is not None) == list(range(len(batches)))


def _fit_digits(strategy, devices: int, batch_size: int, epochs: int) -> float:
    torch.manual_seed(0)
    module = digits_classifier(hidden=(64,), lr=0.05, scheduler="cosine")  # settled final accuracies
    t = trainer(strategy=strategy, devices=devices, max_epochs=epochs, check_val_every_n_epoch=epochs)
    t.fit(module, datamodule=digits(batch_size=batch_size))
    return float(t.callback_metrics["val/acc"])


@pytest.mark.parametrize("devices", [2, 4])
def test_accuracy_is_within_one_point_of_ddp_at_equal_epochs_and_global_batch(devices):
    # decoupled: N = devices / 2 replicas of batch 32; DDP: `devices` replicas of batch 64 / devices
    epochs, global_batch = 6, 32 * (devices // 2)
    decoupled = run_workers(_fit_digits, DecoupledStrategy(timeout=30), devices, 32, epochs, devices=devices)
    ddp = run_workers(_fit_digits, "ddp", devices, global_batch // devices, epochs, devices=devices)
    assert decoupled[0] == decoupled[-1] and decoupled[0] > 0.9
    assert abs(decoupled[0] - ddp[0]) <= 0.01, (decoupled[0], ddp[0])


def _fit_with_checkpoints(ckpt_dir: str, resume: str | None, stages: int = 2) -> dict:
    torch.manual_seed(0)
    recorder = ParamRecorder()
    # 3 blocks: the split is timed on the first batch; a resumed run must take the saved one
    module = digits_classifier(hidden=(32, 32), dropout=0.2)  # dropout and augmentation consume the RNG
    callbacks = [recorder, ModelCheckpoint(dirpath=ckpt_dir, save_top_k=-1, filename="{epoch}")]
    strategy = DecoupledStrategy(stages=stages, timeout=30)
    t = trainer(strategy=strategy, max_epochs=4, callbacks=callbacks, enable_checkpointing=True)
    t.fit(module, datamodule=digits(batch_size=64, augment=True), ckpt_path=resume)
    return {"steps": recorder.steps, "params": recorder.params, "val": float(t.callback_metrics["val/acc"])}


def test_resume_continues_bit_identically_and_checkpoints_hold_the_whole_model(tmp_path):
    full = run_workers(_fit_with_checkpoints, str(tmp_path / "a"), None, devices=2)
    resumed = run_workers(_fit_with_checkpoints, str(tmp_path / "b"), str(tmp_path / "a" / "epoch=1.ckpt"), devices=2)
    assert_resumed_run_matches(full, resumed, after_step=44)  # 22 steps per epoch
    ckpt = torch.load(tmp_path / "a" / "epoch=1.ckpt", weights_only=True)
    section = ckpt["lightning_hier"]
    stage_keys = [set(r["model"]) for r in section["ranks"]]
    assert section["strategy"] == "decoupled" and not stage_keys[0] & stage_keys[1]
    whole = digits_classifier(hidden=(32, 32), dropout=0.2)
    whole.load_state_dict(ckpt["state_dict"])  # strict: the ordinary, unsharded model
    for rank_state in section["ranks"]:
        for key, value in rank_state["model"].items():
            assert torch.equal(ckpt["state_dict"][key], value)
    with pytest.raises(WorkerFailed, match=r"written with layout .*'pipe': 2.* this run has layout .*'pipe': 1"):
        run_workers(_fit_with_checkpoints, str(tmp_path / "c"), str(tmp_path / "a" / "epoch=1.ckpt"), 1, devices=2)


def test_fork_launcher_returns_the_whole_trained_model_and_validation_is_consistent():
    module = digits_classifier(hidden=(32, 32))
    module.example_input_array = torch.zeros(64, 1, 8, 8)  # times the blocks; hidden from the summary during fit
    dm = digits(batch_size=64)
    t = trainer(strategy="decoupled_fork", max_epochs=2, enable_model_summary=True)
    t.fit(module, datamodule=dm)
    staged_val = float(t.callback_metrics["val/acc"])  # staged forward over the stages, during fit
    dm.setup()
    x = normalize(dm.arrays.x_val, dm.arrays.mean, dm.arrays.std)
    y = dm.arrays.y_val
    with torch.no_grad():
        plain_val = float((module.eval()(x).argmax(1) == y).float().mean())
    assert staged_val == pytest.approx(plain_val, abs=1e-6)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"stages": 0}, r"`stages` must be 'auto' or an integer >= 1, got 0"),
        ({"stages": "two"}, r"`stages` must be 'auto' or an integer >= 1, got 'two'"),
        ({"stages": 2, "split": [2, 3]}, r"`split` must be None or 1 strictly increasing"),
        ({"stages": 3, "split": [3, 2]}, "`split` must be"),
        ({"split": [0]}, "`split` must be"),
        ({"schedule": "gpipe"}, r"`schedule` must be one of 'fdg', 'ddg', 'sync', got 'gpipe'"),
        ({"weights": "latest"}, r"`weights` must be one of 'stash', 'recompute', 'legacy'"),
        ({"beta": 0.0}, r"`beta` must be a finite number in \(0.0, 1.0\], got 0.0"),
        ({"beta": 1.5}, "`beta` must be"),
        ({"module_attr": ""}, r"`module_attr` must be None \(find the blocks\) or an attribute path"),
        ({"order": "sideways"}, r"`order` must be one of 'forward_first', 'backward_first', got 'sideways'"),
        (
            {"order": "backward_first", "schedule": "ddg"},
            r"order='backward_first' \(FDG's order\) needs schedule='fdg'",
        ),
        ({"wire_dtype": "fp16"}, r"`wire_dtype` must be one of None, 'bf16', got 'fp16'"),
        ({"link_gbps": 0}, r"`link_gbps` must be a finite number > 0.0, got 0"),
    ],
)
def test_bad_arguments_fail_at_construction(kwargs, match):
    with pytest.raises(ValueError, match=match):
        DecoupledStrategy(**kwargs)


def test_layout_and_precision_errors_come_before_any_process_starts():
    with pytest.raises(ValueError, match="world size 2 is not divisible by pipe x model = 3 x 1"):
        pl.Trainer(strategy=DecoupledStrategy(stages=3), accelerator="cpu", devices=2, logger=False)
    with pytest.raises(ValueError, match="precision plugin MixedPrecision is not supported"):
        pl.Trainer(strategy=DecoupledStrategy(), accelerator="cpu", devices=2, precision="bf16-mixed", logger=False)


class _Extra(Classifier):
    def __init__(self) -> None:
        super().__init__(mlp((1, 8, 8), 10, hidden=(8,)), 10)
        self.scale = torch.nn.Parameter(torch.ones(()))


class _Lbfgs(Classifier):
    def configure_optimizers(self):
        return torch.optim.LBFGS(self.parameters())


class _Flat(Classifier):
    def __init__(self) -> None:
        super().__init__(torch.nn.Linear(64, 10), 10)

    def forward(self, x):
        return self.net(x.flatten(1))


class _EncoderDecoder(UserModule):
    def __init__(self) -> None:
        super().__init__()
        self.encoder, self.decoder = self.model[:2], self.model[2:]
        del self.model


class _Twice(UserModule):
    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        return super().training_step(batch, batch_idx) + self.model(batch).abs().mean()


def _fit_bad(case: str) -> None:
    modules = {
        "stages": lambda: digits_classifier(hidden=()),  # one block
        "outside": _Extra,
        "lbfgs": lambda: _Lbfgs(mlp((1, 8, 8), 10, hidden=(8,)), 10),
        "uncuttable": _Flat,
        "accumulate": digits_classifier,
        "ambiguous": _EncoderDecoder,
        "twice": _Twice,
        "no input": lambda: digits_classifier(hidden=(32, 32)),  # 3 blocks on 2 stages: balanced on a sample
    }
    extra = {"accumulate_grad_batches": 2} if case == "accumulate" else {}
    strategy = DecoupledStrategy(stages=2 if case == "stages" else "auto", timeout=30)
    if case in ("ambiguous", "twice"):  # their own train_dataloader
        trainer(strategy=strategy, max_steps=2).fit(modules[case]())
    elif case == "no input":
        trainer(strategy=strategy).fit(modules[case](), DataLoader([{"text": "a b"}, {"text": "c"}], batch_size=2))
    else:
        trainer(strategy=strategy, **extra).fit(modules[case](), datamodule=digits(batch_size=64))


@pytest.mark.parametrize(
    ("case", "match"),
    [
        ("stages", "cannot cut 1 block"),
        ("outside", r"parameters outside `net` would never be trained by the pipeline: \['scale'\]"),
        ("lbfgs", "LBFGS re-evaluates its closure"),
        (
            "uncuttable",
            r"block 0 of `net` \(Linear\) cannot take the input of shape \[64, 1, 8, 8\] .* move input transforms",
        ),
        ("accumulate", "accumulate_grad_batches=2 is not supported"),
        (
            "ambiguous",
            r"cannot tell which submodule of _EncoderDecoder holds the blocks: several containers could be the "
            r"network: `encoder` \(Sequential\), `decoder` \(Sequential\)\. Set `module_attr`",
        ),
        ("twice", r"must call `model` exactly once, on the batch's input \(shape \[4, 32\]\), but called it 2 time"),
        (
            "no input",  # one prefix only: the helper's message is not wrapped twice
            r"raised ValueError: DecoupledStrategy: cannot find a sample input to balance the stages: the first "
            r"training batch is a dict of \('text': list\)",
        ),
    ],
)
def test_models_and_trainers_the_pipeline_cannot_run_are_rejected_clearly(case, match):
    with pytest.raises(WorkerFailed, match=match):
        run_workers(_fit_bad, case, devices=2)


def _fit_user_module_sync(batches: list[torch.Tensor]) -> torch.Tensor:
    torch.manual_seed(0)
    module = UserModule()
    strategy = DecoupledStrategy(schedule="sync", timeout=30)  # stages='auto': 2, blocks found in `model`
    trainer(strategy=strategy, use_distributed_sampler=False).fit(module, DataLoader(batches, batch_size=None))
    assert strategy.num_stages == 2 and strategy.module_attr is None
    return flat_params(module)


def test_loss_from_training_step_equals_single_process_backprop():
    batches = list(torch.randn(6, 4, 32, generator=torch.Generator().manual_seed(3)))
    torch.manual_seed(0)
    reference = UserModule()
    optimizer = reference.configure_optimizers()
    for i, batch in enumerate(batches):
        optimizer.zero_grad()
        reference.training_step(batch, i).backward()
        optimizer.step()
    for whole in run_workers(_fit_user_module_sync, batches, devices=2):
        torch.testing.assert_close(whole, flat_params(reference), atol=1e-6, rtol=0)
