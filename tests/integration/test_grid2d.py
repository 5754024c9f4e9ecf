"""Grid2DStrategy under a real Trainer: accuracy against DDP, checkpoints, resume, launchers, grid='auto'."""

import os

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_hier import Grid2DStrategy
from lightning_hier.layers import GridLinear, full_state_dict
from lightning_hier.models import Classifier, mlp, small_cnn
from lightning_hier.planner import Link, best_grid, model_layers
from lightning_hier.testing import WorkerFailed, run_workers
from tests.helpers import ParamRecorder, assert_resumed_run_matches, digits, flat_params, trainer

EPOCHS, LR = 5, 0.05


def _mlp() -> Classifier:
    torch.manual_seed(0)
    return Classifier(mlp((1, 8, 8), 10, hidden=(64,)), 10, lr=LR)


def _cnn() -> Classifier:
    torch.manual_seed(0)
    return Classifier(small_cnn((1, 8, 8), 10, channels=(8, 16), hidden=32), 10, lr=LR)


def _ceil_cnn() -> Classifier:
    net = small_cnn((1, 8, 8), 10, channels=(8, 16), hidden=32)
    net[1][3].ceil_mode = True  # 4 rows -> 2 either way, but a partial last window is not supported on slabs
    return Classifier(net, 10, lr=LR)


def _accuracies(strategy: object, devices: int) -> list[float]:
    out = []
    for make in (_mlp, _cnn):
        module = make()
        t = trainer(strategy=strategy() if callable(strategy) else strategy, devices=devices, max_epochs=EPOCHS)
        dm = digits(batch_size=64)
        t.fit(module, datamodule=dm)
        out.append(t.validate(module, datamodule=dm, verbose=False)[0]["val/acc"])
    return out


def test_grid_2x2_trains_mlp_and_cnn_on_digits_within_one_point_of_ddp():
    # Same global batch (128) and the same batch per replica (64, so BatchNorm sees the same samples):
    # DDP runs 2 replicas of 64; the grid splits each replica's work over Pr = 2 ranks.
    ddp = run_workers(_accuracies, "ddp", 2, devices=2)[0]
    grid = run_workers(_accuracies, lambda: Grid2DStrategy(grid=(2, 2), timeout=30), 4, devices=4)[0]
    for name, a, b in zip(("mlp", "small_cnn"), grid, ddp, strict=True):
        assert a > 0.9, f"{name} did not train: {a}"
        assert abs(a - b) <= 0.01, f"{name}: grid {a:.4f} vs DDP {b:.4f}"


class _InputRecorder(Callback):
    """Sums of each (augmented) training batch, to check that a MODEL group sees identical batches."""

    def __init__(self) -> None:
        self.sums: list[float] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.sums.append(float(batch[0].double().sum()))


def _fit_with_checkpoints(ckpt_dir: str, resume: str | None, epochs: int = 3) -> dict:
    rec, inputs = ParamRecorder(), _InputRecorder()
    module = _cnn()
    torch.manual_seed(int(os.environ["RANK"]))  # unrelated streams: the strategy must align each MODEL group
    callbacks = [rec, inputs, ModelCheckpoint(dirpath=ckpt_dir, save_top_k=-1, filename="{epoch}")]
    strategy = Grid2DStrategy(grid=(2, 2), timeout=30)
    t = trainer(strategy=strategy, devices=4, max_epochs=epochs, callbacks=callbacks, enable_checkpointing=True)
    t.fit(module, datamodule=digits(batch_size=64, augment=True), ckpt_path=resume)  # augmentation uses the RNG
    return {"steps": rec.steps, "params": rec.params, "inputs": inputs.sums, "full": full_state_dict(module)}


@pytest.fixture(scope="module")
def checkpointed_run(tmp_path_factory):
    path = tmp_path_factory.mktemp("grid2d")
    return path, run_workers(_fit_with_checkpoints, str(path / "a"), None, devices=4)


def test_ranks_of_a_model_group_see_the_same_augmented_batches(checkpointed_run):
    _, out = checkpointed_run
    assert out[0]["inputs"] == out[1]["inputs"] and out[2]["inputs"] == out[3]["inputs"]  # (r=0,1) at c=0, c=1
    assert out[0]["inputs"] != out[2]["inputs"]  # BATCH blocks differ


def test_checkpoint_state_dict_is_the_ordinary_model(checkpointed_run):
    path, out = checkpointed_run
    ckpt = torch.load(path / "a" / "epoch=2.ckpt", weights_only=True)
    fresh = _cnn()
    fresh.load_state_dict(ckpt["state_dict"], strict=True)  # loads into the unsharded network
    for key, value in out[0]["full"].items():
        assert torch.equal(ckpt["state_dict"][key], value), key
    assert ckpt["lightning_hier"]["topology"]["model"] == 2 and len(ckpt["lightning_hier"]["ranks"]) == 4
    assert isinstance(fresh.net[2][1], nn.Linear)


def test_resume_continues_bit_identically(checkpointed_run, tmp_path):
    path, full = checkpointed_run
    resumed = run_workers(_fit_with_checkpoints, str(tmp_path), str(path / "a" / "epoch=0.ckpt"), devices=4)
    first = full[0]["steps"][len(full[0]["steps"]) // 3 - 1]  # the last step of epoch 0
    assert_resumed_run_matches(full, resumed, after_step=first)


def test_validate_from_an_ordinary_checkpoint_shards_it(checkpointed_run):
    path, _ = checkpointed_run

    def validate(ckpt: str) -> float:
        t = trainer(strategy=Grid2DStrategy(grid=(2, 2), timeout=30), devices=4)
        return t.validate(_cnn(), datamodule=digits(batch_size=64), ckpt_path=ckpt, verbose=False)[0]["val/acc"]

    def validate_unsharded(ckpt: str) -> float:
        module = _cnn()
        module.load_state_dict(torch.load(ckpt, weights_only=True)["state_dict"])
        return trainer(strategy="ddp", devices=2).validate(module, datamodule=digits(batch_size=64), verbose=False)[0][
            "val/acc"
        ]

    ckpt = str(path / "a" / "epoch=2.ckpt")
    assert run_workers(validate, ckpt, devices=4)[0] == pytest.approx(run_workers(validate_unsharded, ckpt)[0])


def test_fork_launcher_returns_the_ordinary_trained_weights():
    module = _mlp()
    before = flat_params(module)
    t = trainer(strategy=Grid2DStrategy(grid=(2, 1), start_method="fork", timeout=30), max_epochs=1)
    t.fit(module, datamodule=digits(batch_size=64))
    assert not any(isinstance(m, GridLinear) for m in module.modules())
    assert module.net[0][1].weight.shape == (64, 64)
    assert not torch.equal(flat_params(module), before)


def _wide_mlp() -> Classifier:
    torch.manual_seed(0)
    return Classifier(mlp((1, 8, 8), 10, hidden=(2048,)), 10, lr=LR)


def test_auto_grid_follows_the_planner():
    # bandwidth-only links, a wide layer and a small batch: sharding the weights beats pure batch
    def fit_auto() -> tuple[int, int]:
        strategy = Grid2DStrategy(grid="auto", alpha=0.0, beta=4e-10, timeout=30)
        trainer(strategy=strategy, devices=4, max_steps=1).fit(_wide_mlp(), datamodule=digits(batch_size=8))
        return strategy.grid

    layers = model_layers(_wide_mlp(), (1, 8, 8))
    expected = best_grid(layers, 8, 4, links=Link(0.0, 4e-10), batch_scope="replica").grid
    assert expected[0] > 1
    assert run_workers(fit_auto, devices=4) == [expected] * 4


def test_unsupported_settings_fail_with_the_reason():
    def fit(grid: tuple[int, int], make, **overrides) -> None:
        strategy = Grid2DStrategy(grid=grid, timeout=30)
        trainer(strategy=strategy, devices=4, max_steps=1, **overrides).fit(make(), datamodule=digits(batch_size=64))

    with pytest.raises(WorkerFailed, match=r"layer net\.1\.3: MaxPool2d\(kernel_size=2.*: ceil_mode=True"):
        run_workers(fit, (4, 1), _ceil_cnn, devices=4)
    with pytest.raises(WorkerFailed, match="gradient clipping by norm"):
        run_workers(fit, (2, 2), _mlp, gradient_clip_val=1.0, devices=4)

    def fit_auto_on_text(module: Classifier) -> None:
        loader = DataLoader([{"text": "a b"}, {"text": "c"}], batch_size=2)
        trainer(strategy=Grid2DStrategy(timeout=30), max_steps=1).fit(module, loader)

    with pytest.raises(WorkerFailed, match=r"the first training batch is a dict of \('text': list\), with no input"):
        run_workers(fit_auto_on_text, _mlp())


def test_auto_grid_takes_batch_size_and_input_shape_from_the_first_batch():
    def fit_auto_on_plain_loader() -> tuple[int, int]:
        data = TensorDataset(torch.randn(64, 1, 8, 8), torch.randint(0, 10, (64,)))
        strategy = Grid2DStrategy(grid="auto", alpha=0.0, beta=4e-10, timeout=30)
        trainer(strategy=strategy, max_steps=1).fit(_wide_mlp(), DataLoader(data, batch_size=8))
        return strategy.grid

    expected = best_grid(model_layers(_wide_mlp(), (1, 8, 8)), 8, 2, links=Link(0.0, 4e-10), batch_scope="replica")
    assert expected.grid == (2, 1)  # not the pure batch grid: the groups are rebuilt for it
    assert run_workers(fit_auto_on_plain_loader) == [expected.grid] * 2


def test_gradient_accumulation_equals_ddp_on_the_larger_batch():
    # an independent reference (Lightning's DDP); the batch split (Pc = 2) needs the gradient reduction
    def fit(strategy: object, batch_size: int, accumulate: int) -> torch.Tensor:
        module = _mlp()
        t = trainer(strategy=strategy, max_steps=4, accumulate_grad_batches=accumulate)
        t.fit(module, datamodule=digits(batch_size=batch_size))
        return flat_params(module)

    ddp = run_workers(fit, "ddp", 64, 1)
    grid = run_workers(fit, Grid2DStrategy(grid=(1, 2), timeout=30), 32, 2)
    for a, b in zip(ddp, grid, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)


class _TinyLM(pl.LightningModule):
    """Tied embedding / output weights around a TransformerEncoderLayer: what to_grid used to break."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(16, 8)
        self.layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True)
        self.head = nn.Linear(8, 16, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.layer(self.emb(tokens)))

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        tokens = batch[0]
        return F.cross_entropy(self(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.5)


def test_tied_transformer_on_a_model_grid_equals_single_process_training():
    loader = DataLoader(TensorDataset(torch.randint(0, 16, (32, 6), generator=torch.Generator().manual_seed(1))), 8)
    reference = _TinyLM()
    opt = reference.configure_optimizers()
    for batch in loader:
        opt.zero_grad()
        reference.training_step(batch, 0).backward()
        opt.step()
    module = _TinyLM()
    strategy = Grid2DStrategy(grid=(2, 1), start_method="fork", timeout=30)
    trainer(strategy=strategy, use_distributed_sampler=False).fit(module, loader)
    assert module.head.weight is module.emb.weight
    torch.testing.assert_close(flat_params(module), flat_params(reference), atol=2e-6, rtol=0)
