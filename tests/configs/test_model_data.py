"""Every model x data option of conf/ fits together; a misfit fails first, naming both."""

import pytest
import torch
from hydra import compose, initialize_config_dir
from torch import nn

from lightning_hier.data import SyntheticDataModule
from lightning_hier.models import mlp, small_cnn
from lightning_hier.models.inputs import check_input
from lightning_hier.train import build_datamodule, build_module, conf_dir, run

CONF = conf_dir()
MODELS = sorted(p.stem for p in (CONF / "model").glob("*.yaml"))
DATA = sorted(p.stem for p in (CONF / "data").glob("*.yaml"))
IN_MEMORY = {"digits", "synthetic"}  # cifar10 and mnist read files: checked on their declared shape


def compose_cfg(*overrides: str):
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose("train", overrides=list(overrides))


@pytest.mark.parametrize("data", DATA)
@pytest.mark.parametrize("model", MODELS)
def test_every_model_runs_on_every_data_option(model, data):
    torch.manual_seed(0)
    cfg = compose_cfg(f"model={model}", f"data={data}")
    dm = build_datamodule(cfg)
    module = build_module(cfg, dm)  # checks one batch of zeros
    if data not in IN_MEMORY:
        return
    dm.setup("fit")
    x, y = dm.on_after_batch_transfer(next(iter(dm.train_dataloader())), 0)  # normalised as in training
    x, y = x[:4], y[:4]  # a few samples suffice (a ResNet-56 forward is slow on a shared CPU)
    module.eval()
    with torch.no_grad():
        logits = module(x)
    assert logits.shape == (len(y), dm.num_classes) and torch.isfinite(logits).all()


@pytest.mark.parametrize(("model", "shape"), [("mlp", (32,)), ("small_cnn", (3, 32, 32)), ("resnet20", (3, 32, 32))])
def test_synthetic_data_takes_the_shape_the_model_asks_for(model, shape):
    assert build_datamodule(compose_cfg(f"model={model}", "data=synthetic")).input_shape == shape
    cfg = compose_cfg(f"model={model}", "data=synthetic", "data.input_shape=[3,16,16]")
    assert build_datamodule(cfg).input_shape == (3, 16, 16)  # an explicit shape is kept


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        (
            ["model=small_cnn", "data=synthetic", "data.input_shape=[32]"],
            r"model=small_cnn needs image input \(C, H, W\); data=synthetic gives \(32,\)\. "
            r"Set data.input_shape=\[3, 32, 32\] \(or leave it null",
        ),
        (
            ["model=resnet56", "data=synthetic", "data.input_shape=[4,8]"],
            r"resnet56 needs image input .* gives \(4, 8\)",
        ),
        (
            ["model=small_cnn", "data=synthetic", "data.input_shape=[3,2,2]"],
            r"data=synthetic gives \(3, 2, 2\), for which it cannot be built: ValueError: small_cnn: input "
            r"\(3, 2, 2\) is too small for 2 pooling blocks",
        ),
        (["model=small_cnn", "model.channels=[8,8,8,8]", "data=digits"], r"data=digits gives \(1, 8, 8\), for which"),
    ],
)
def test_a_model_that_does_not_fit_its_data_fails_naming_both(overrides, match):
    cfg = compose_cfg(*overrides)
    with pytest.raises(ValueError, match=match):
        build_module(cfg, build_datamodule(cfg))


def test_networks_outside_the_table_are_checked_by_running_them():
    def wrong_head(input_shape, num_classes):  # forgets the classes: 5 outputs
        return nn.Sequential(nn.Flatten(), nn.Linear(32, 5))

    with pytest.raises(ValueError, match=r"model=mine on data=synthetic \(input \(32,\)\) gives output \(2, 5\)"):
        check_input(wrong_head, (32,), 10, "mine", "synthetic")

    def fixed_width(input_shape, num_classes):
        return nn.Sequential(nn.Flatten(), nn.Linear(64, num_classes))

    with pytest.raises(
        ValueError, match=r"model=mine needs an input it can take; data=x gives \(32,\), on which it fails"
    ):
        check_input(fixed_width, (32,), 10, "mine", "x")
    net = check_input(mlp, (1, 8, 8), 10, "mlp", "digits")
    assert net.training  # handed back in training mode
    bn = check_input(small_cnn, (3, 8, 8), 10, "small_cnn", "synthetic")[0][1]
    assert int(bn.num_batches_tracked) == 0  # the check did not touch BatchNorm statistics


@pytest.mark.parametrize("shape", [[], [3, 0], ["a"], "32", [2.5]])
def test_synthetic_input_shape_is_checked(shape):
    with pytest.raises(ValueError, match="argument `input_shape` must be a non-empty list of positive integers"):
        SyntheticDataModule(input_shape=shape)


def test_the_reported_command_trains(tmp_path):
    """`python -m lightning_hier.train model=small_cnn data=synthetic trainer.max_epochs=1`, small and forked."""
    cfg = compose_cfg(
        "model=small_cnn",
        "model.channels=[4,8]",
        "model.hidden=16",
        "data=synthetic",
        "data.train_size=256",
        "data.val_size=64",
        "trainer.max_epochs=1",
        "trainer.enable_progress_bar=false",
        "trainer.enable_model_summary=false",
        "trainer.enable_checkpointing=false",
        "start_method=fork",
    )
    summary = run(cfg, str(tmp_path))
    assert summary.epochs == 1 and summary.val_acc is not None


@pytest.mark.parametrize(("experiment", "shape"), [("grid2d_alexnet", (3, 227, 227)), ("grid2d_vgg16", (3, 224, 224))])
def test_the_papers_whole_networks_in_the_grid2d_recipe_fit_their_data(experiment, shape):
    """recipes/grid2d: whole AlexNet and VGG-16 (reduced width) on synthetic images of the paper's size, Pr = 2."""
    recipes = CONF.parent / "recipes" / "grid2d"
    cfg = compose_cfg(f"hydra.searchpath=[file://{recipes}]", f"experiment={experiment}")
    assert tuple(cfg.strategy.grid) == (2, 1) and cfg.trainer.devices == 2
    dm = build_datamodule(cfg)
    assert dm.input_shape == shape
    build_module(cfg, dm)  # builds the network and checks one batch of zeros


def test_small_cnn_layer_blocks_are_the_same_network_cut_finer():
    torch.manual_seed(0)
    stages = small_cnn((3, 32, 32), 10)
    cfg = compose_cfg("model=small_cnn", "model.layer_blocks=true", "data=synthetic", "data.input_shape=[3,32,32]")
    torch.manual_seed(0)
    layers = build_module(cfg, build_datamodule(cfg)).net
    assert [len(stages), len(layers)] == [4, 12]
    assert all(not isinstance(block, nn.Sequential) for block in layers)
    x = torch.randn(2, 3, 32, 32)
    stages.eval(), layers.eval()
    torch.testing.assert_close(layers(x), stages(x), rtol=0, atol=0)


class _Stream(torch.utils.data.IterableDataset):
    """Samples with no length: the Trainer cannot count the steps of the fit."""

    def __iter__(self):
        g = torch.Generator().manual_seed(0)
        for _ in range(8):
            yield torch.randn(1, 8, 8, generator=g), torch.randint(0, 10, (), generator=g)


def test_a_cosine_over_a_fit_of_unknown_length_is_rejected_naming_the_scheduler():
    import lightning.pytorch as pl

    from lightning_hier.models import Classifier

    loader = torch.utils.data.DataLoader(_Stream(), batch_size=4)
    kwargs = {"accelerator": "cpu", "max_epochs": 1, "logger": False, "enable_checkpointing": False}
    warm = Classifier(mlp((1, 8, 8), 10, hidden=(8,)), 10, lr=0.1, warmup_steps=4)
    pl.Trainer(**kwargs, enable_progress_bar=False).fit(warm, loader)  # a warm-up alone needs no length
    cosine = Classifier(mlp((1, 8, 8), 10, hidden=(8,)), 10, scheduler="cosine")
    with pytest.raises(ValueError, match=r"Classifier: scheduler='cosine'.*estimated_stepping_batches is -1"):
        pl.Trainer(**kwargs, enable_progress_bar=False).fit(cosine, loader)
