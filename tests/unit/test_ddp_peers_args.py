"""DDPCommHookStrategy's arguments: defaults per hook, and messages naming argument, value and what is allowed."""

from datetime import timedelta

import pytest

from lightning_hier import DDPCommHookStrategy


def test_defaults_per_hook():
    post = DDPCommHookStrategy("post_local_sgd")
    assert (post.model_averaging_period, post.powersgd_rank, post.warmup_steps) == (8, None, 0)
    assert post._model_averaging_period == 8  # Lightning's DDPStrategy switches its averager on from this
    power = DDPCommHookStrategy("powersgd")
    assert (power.model_averaging_period, power.powersgd_rank, power.warmup_steps) == (None, 4, 2)
    assert power._model_averaging_period is None
    fp16 = DDPCommHookStrategy("fp16", timeout=timedelta(seconds=30))
    assert (fp16.model_averaging_period, fp16.powersgd_rank, fp16.warmup_steps) == (None, None, 0)
    assert fp16._timeout == timedelta(seconds=30) and fp16._start_method == "popen"


def test_ddp_keyword_arguments_reach_the_wrapper():
    s = DDPCommHookStrategy("fp16", bucket_cap_mb=4.0, find_unused_parameters=True)
    assert s._ddp_kwargs == {"bucket_cap_mb": 4.0, "find_unused_parameters": True}


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"hook": "bf16"}, r"`hook` must be one of 'post_local_sgd', 'powersgd', 'fp16', got 'bf16'"),
        ({"hook": "post_local_sgd", "model_averaging_period": 0}, r"`model_averaging_period` must be an integer >= 1"),
        ({"hook": "fp16", "model_averaging_period": 4}, r"`model_averaging_period` must be None for hook 'fp16'.* 4"),
        ({"hook": "powersgd", "powersgd_rank": 0}, r"`powersgd_rank` must be an integer >= 1, got 0"),
        ({"hook": "post_local_sgd", "powersgd_rank": 4}, r"`powersgd_rank` must be None for hook 'post_local_sgd'"),
        ({"hook": "powersgd", "warmup_steps": 1}, r"`warmup_steps` must be an integer >= 2, got 1"),
        ({"hook": "post_local_sgd", "warmup_steps": -1}, r"`warmup_steps` must be an integer >= 0, got -1"),
        ({"hook": "fp16", "warmup_steps": 10}, r"`warmup_steps` must be None or 0 for hook 'fp16', got 10"),
        ({"hook": "fp16", "bucket_cap_mb": 0}, r"`bucket_cap_mb` must be a finite number >= 0.001, got 0"),
        ({"hook": "fp16", "timeout": 0}, r"`timeout` must be a finite number in \[0.001, 604800.0\], got 0"),
        ({"hook": "fp16", "start_method": "thread"}, r"`start_method` must be one of 'popen'.*got 'thread'"),
        ({"hook": "fp16", "process_group_backend": "ucc"}, r"`process_group_backend` must be one of .*got 'ucc'"),
        ({"hook": "fp16", "ddp_comm_hook": print}, r"`ddp_comm_hook` is set by `hook`"),
    ],
)
def test_bad_arguments_are_named(kwargs, message):
    with pytest.raises(ValueError, match=rf"DDPCommHookStrategy: argument {message}"):
        DDPCommHookStrategy(**kwargs)
