"""Every conf/ option composes and instantiates; strategy configs mirror constructor arguments."""

import inspect
from pathlib import Path

import pytest
import yaml
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate
from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.strategies import StrategyRegistry

from lightning_hier import DDPCommHookStrategy, HierStrategy
from lightning_hier.callbacks import SampleThroughput, Straggler
from lightning_hier.train import build_module, build_strategy, build_trainer, conf_dir, resolve_start_method

CONF = conf_dir()
GROUPS = ["strategy", "model", "data", "trainer", "logger", "callbacks", "experiment"]
LIGHTNING_PLUMBING = {"accelerator", "parallel_devices", "cluster_environment", "checkpoint_io", "precision_plugin"}


def options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF / group).glob("*.yaml"))


def compose_cfg(*overrides: str):
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose("train", overrides=list(overrides))


@pytest.mark.parametrize("group", GROUPS)
def test_every_group_has_options(group):
    assert options(group), f"conf/{group} is empty"


@pytest.mark.parametrize("option", options("strategy"))
def test_strategy_options_instantiate_with_every_start_method(option):
    for multirun in (False, True):
        strategy = build_strategy(compose_cfg(f"strategy={option}"), multirun=multirun)
        assert strategy._start_method == ("fork" if multirun else "popen")


@pytest.mark.parametrize("option", options("model"))
def test_model_options_build_a_classifier_for_their_data(option, tmp_path):
    cfg = compose_cfg(f"model={option}", "data=synthetic", "data.input_shape=[3,32,32]")
    module = build_module(cfg, instantiate(cfg.data))
    assert sum(p.numel() for p in module.parameters()) > 0


@pytest.mark.parametrize("option", options("data"))
def test_data_options_instantiate(option):
    dm = instantiate(compose_cfg(f"data={option}").data)
    assert dm.batch_size >= 1 and dm.num_classes == 10


@pytest.mark.parametrize("option", options("trainer"))
def test_trainer_options_instantiate(option, tmp_path):
    cfg = compose_cfg(f"trainer={option}")
    # the GPU preset is checked on this CPU machine by overriding only the accelerator
    extra = {"accelerator": "cpu", "devices": 2, "precision": "32-true"} if cfg.trainer.accelerator == "gpu" else {}
    t = build_trainer(cfg, build_strategy(cfg), str(tmp_path), **extra)
    assert t.num_devices == 2


@pytest.mark.parametrize("option", options("experiment"))
def test_experiment_presets_compose(option):
    cfg = compose_cfg(f"experiment={option}")
    instantiate(cfg.data)
    assert cfg.trainer.max_epochs >= 1


OBJECTS = {"sync", "allocation"}  # the adapter's objects, which a registered strategy builds from its arguments


def _constructor_args(cls: type) -> set[str]:
    names: set[str] = set()
    for klass in cls.__mro__:
        if klass.__module__.startswith("lightning."):  # stop at Lightning's ParallelStrategy / DDPStrategy
            break
        if "__init__" in vars(klass):
            params = inspect.signature(klass.__init__).parameters.values()
            names |= {p.name for p in params if p.kind is p.KEYWORD_ONLY or p.kind is p.POSITIONAL_OR_KEYWORD}
    return names - {"self"} - LIGHTNING_PLUMBING - OBJECTS


def _our_registry_names() -> dict[str, type]:
    out = {}
    for name, entry in StrategyRegistry.items():
        cls = entry["strategy"]
        ours = isinstance(cls, type) and issubclass(cls, HierStrategy | DDPCommHookStrategy)
        if ours and not name.endswith(("_spawn", "_fork")):
            out[name] = cls
    return out


@pytest.mark.parametrize(("name", "cls"), sorted(_our_registry_names().items()))
def test_each_registered_name_has_a_config_whose_keys_are_the_constructor_arguments(name, cls):
    path = CONF / "strategy" / f"{name}.yaml"
    assert path.is_file(), f"registered strategy '{name}' has no conf/strategy/{name}.yaml"
    keys = set(yaml.safe_load(path.read_text())) - {"_target_"}
    init_params = StrategyRegistry[name]["init_params"]
    assert keys | set(init_params) == _constructor_args(cls), f"conf/strategy/{name}.yaml"


def test_ddp_baseline_is_available():
    assert "ddp" in options("strategy")


def test_start_method_resolution():
    assert resolve_start_method("auto", multirun=False) == "popen"
    assert resolve_start_method("auto", multirun=True) == "fork"
    assert resolve_start_method("spawn", multirun=True) == "spawn"


def test_conf_dir_is_the_repository_conf_in_a_checkout():
    assert Path(__file__).resolve().parents[2] / "conf" == CONF


# ---------------------------------------------------------------- logger and callbacks groups
def _built(tmp_path, *overrides: str):
    cfg = compose_cfg(*overrides)
    return build_trainer(cfg, build_strategy(cfg), str(tmp_path))


def test_default_run_logs_csv_into_the_output_dir_with_throughput_and_checkpoints(tmp_path):
    t = _built(tmp_path)
    assert [type(lg) for lg in t.loggers] == [CSVLogger]
    assert t.loggers[0].log_dir == str(tmp_path / "logs" / "version_0")
    kinds = {type(cb) for cb in t.callbacks}
    assert {SampleThroughput, ModelCheckpoint} <= kinds
    checkpoint = next(cb for cb in t.callbacks if isinstance(cb, ModelCheckpoint))
    assert "=" not in checkpoint.filename and checkpoint.save_last == "link"  # Hydra-friendly ckpt_path


@pytest.mark.parametrize("override", ["logger=none", "~logger", "+trainer.logger=false"])
def test_every_way_of_turning_the_logger_off(override, tmp_path):
    assert _built(tmp_path, override).loggers == []


def test_tensorboard_logger_alone_and_with_csv(tmp_path):
    pytest.importorskip("tensorboard")
    from lightning.pytorch.loggers import TensorBoardLogger

    assert [type(lg) for lg in _built(tmp_path / "a", "logger=tensorboard").loggers] == [TensorBoardLogger]
    both = _built(tmp_path / "b", "logger=[csv,tensorboard]").loggers
    assert [type(lg) for lg in both] == [CSVLogger, TensorBoardLogger]
    assert both[1].log_dir == str(tmp_path / "b" / "tensorboard" / "version_0")


def test_callbacks_group_lists_and_none(tmp_path):
    picked = {type(cb) for cb in _built(tmp_path, "callbacks=[default,early_stopping,straggler]").callbacks}
    assert {SampleThroughput, ModelCheckpoint, EarlyStopping, Straggler} <= picked
    assert not {SampleThroughput, EarlyStopping} & {type(cb) for cb in _built(tmp_path, "callbacks=none").callbacks}


def test_disabled_checkpointing_drops_the_groups_model_checkpoint(tmp_path):
    t = _built(tmp_path, "trainer.enable_checkpointing=false")
    assert not any(isinstance(cb, ModelCheckpoint) for cb in t.callbacks)


def test_explicit_trainer_arguments_win_over_the_groups(tmp_path):
    cfg = compose_cfg()
    t = build_trainer(cfg, build_strategy(cfg), str(tmp_path), logger=False, callbacks=[])
    assert t.loggers == [] and not any(isinstance(cb, SampleThroughput) for cb in t.callbacks)
