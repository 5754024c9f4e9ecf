"""Lightning's DDP with one of torch's DDP communication hooks, registered on every device.

These are what a Lightning user would pick instead of this library's algorithms, so the
benchmarks run them as peers:

- ``post_local_sgd``: post-local SGD (Lin et al., "Don't Use Large Mini-Batches, Use Local SGD",
  ICLR 2020): no gradient all-reduce after ``warmup_steps``; a ``PeriodicModelAverager``
  averages the parameters every ``model_averaging_period`` optimizer steps.
- ``powersgd``: PowerSGD (Vogels, Karimireddy and Jaggi, NeurIPS 2019): gradients compressed to
  rank-``powersgd_rank`` factors with error feedback, after ``warmup_steps`` plain all-reduces.
- ``fp16``: gradients cast to float16 for the all-reduce (half the bytes).

Lightning's ``DDPStrategy`` registers ``ddp_comm_hook`` only when the device is CUDA: on CPU the
hook is silently ignored (every step all-reduces fp32 gradients), while a ``PostLocalSGDState``
still switches the model averager on. :class:`DDPCommHookStrategy` registers the hook on any
device and sets what gloo needs:

- PostLocalSGD runs with ``post_local_gradient_allreduce=False``: torch's default (``True``)
  all-reduces gradients inside each node over ``dist.new_subgroups()``, which needs CUDA.
- PowerSGD chains a second all-reduce in a callback of the first; with several DDP buckets the
  callbacks run in a different order on different ranks, which gloo aborts on ("collective
  mismatch"). Without NCCL the model goes into one bucket (``bucket_cap_mb`` sized to it).
- Only fp16 is offered: torch's ``bf16_compress_hook`` refuses gloo.

One addition to torch's behaviour: post-local SGD leaves the replicas apart for up to
``model_averaging_period - 1`` steps, so at the end of fit they are averaged once more (right
after the last optimizer step, like the averaging strategies of this package). User
``on_train_end`` hooks, checkpoints after fit and the model ``fit()`` returns are then one model,
the same on every rank.

Failures are handled as in every strategy of this package
(:mod:`lightning_hier.strategies._failure`): the failing rank is named, a watchdog ends ranks left
hanging or orphaned, the fork / spawn launcher forwards SIGINT and SIGTERM to the ranks, and the
rendezvous store listens on ``MASTER_ADDR`` only.
"""

from __future__ import annotations

import math
import os
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Literal

import torch
import torch.distributed as dist
from lightning.fabric.strategies import _StrategyRegistry
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.strategies.launchers import _MultiProcessingLauncher
from lightning.pytorch.trainer.states import TrainerFn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, post_localSGD_hook, powerSGD_hook
from torch.nn import Module
from torch.nn.parallel import DistributedDataParallel
from typing_extensions import override

from lightning_hier import _validate as v
from lightning_hier.comm import all_reduce_mean_
from lightning_hier.comm.rendezvous import init_default_group
from lightning_hier.strategies import _finish
from lightning_hier.strategies._failure import FailureGuard
from lightning_hier.strategies._finite import FiniteGuard, loss_of
from lightning_hier.strategies._registry import register_family
from lightning_hier.strategies.adapter import BACKENDS, DEFAULT_INIT_TIMEOUT_S, DEFAULT_TIMEOUT_S, check_timeout
from lightning_hier.sync.buckets import check_bucket_mb

if TYPE_CHECKING:
    from collections.abc import Callable

    import lightning.pytorch as pl

HOOKS = ("post_local_sgd", "powersgd", "fp16")
REGISTRY_NAMES = {"ddp_post_local_sgd": "post_local_sgd", "ddp_powersgd": "powersgd", "ddp_fp16": "fp16"}
START_METHODS = ("popen", "spawn", "fork", "forkserver")
DEFAULT_PERIOD = 8  # as LocalSGDStrategy's default tau
DEFAULT_POWERSGD_RANK = 4
# PowerSGD can start compressing at the third step at the earliest (DDP rebuilds its buckets
# after the first); post-local SGD may start at once (as LocalSGDStrategy does).
MIN_WARMUP = {"post_local_sgd": 0, "powersgd": 2}
# DDPStrategy's own arguments that the hook choice sets.
_SET_BY_HOOK = ("ddp_comm_state", "ddp_comm_hook", "ddp_comm_wrapper")


class DDPCommHookStrategy(DDPStrategy):
    """Lightning's DDP with a torch communication hook (PostLocalSGD, PowerSGD or fp16), on any device.

    Args:
        hook: ``'post_local_sgd'``, ``'powersgd'`` or ``'fp16'`` (see the module docstring).
        model_averaging_period: ``post_local_sgd`` only: average the parameters every this many
            optimizer steps (default 8).
        powersgd_rank: ``powersgd`` only: rank of the low-rank gradient factors (default 4).
        warmup_steps: Steps of plain gradient all-reduce before the hook's method starts
            (``post_local_sgd``: default 0; ``powersgd``: at least 2, default 2; ``fp16``: none).
        bucket_cap_mb: DDP's bucket size in MiB, >= 0.001 (``None``: DDP's default, 25). For ``powersgd``
            without NCCL, ``None`` sizes one bucket to hold the whole model, and a smaller value
            fails when the model is wrapped.
        timeout: Seconds (or a ``timedelta``) a collective may wait before the run fails. The
            start-up rendezvous waits at least the default ``init_timeout`` of the other
            strategies (600 s): ranks start seconds apart (a popen rank imports Lightning first).
        start_method: ``'popen'`` (Lightning's default; torchrun/SLURM), ``'spawn'``, ``'fork'``
            or ``'forkserver'``.
        process_group_backend: ``None`` (gloo on CPU, NCCL on GPU), ``'gloo'``, ``'nccl'`` or ``'mpi'``.
        check_finite: Stop the run when this rank's loss (before the gradient all-reduce) or
            parameters are NaN/inf, naming the rank and step (as in every strategy here).
        **kwargs: Further arguments of ``DistributedDataParallel`` (e.g. ``find_unused_parameters``).

    Raises:
        ValueError: An argument is out of range, or set for a hook that does not use it.

    Example::

        trainer = pl.Trainer(strategy=DDPCommHookStrategy("powersgd", powersgd_rank=4), accelerator="cpu", devices=2)
        trainer = pl.Trainer(strategy="ddp_post_local_sgd", accelerator="cpu", devices=2)  # period 8
    """

    def __init__(
        self,
        hook: str,
        model_averaging_period: int | None = None,
        powersgd_rank: int | None = None,
        warmup_steps: int | None = None,
        bucket_cap_mb: float | None = None,
        timeout: float | timedelta = DEFAULT_TIMEOUT_S,
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
        process_group_backend: str | None = None,
        check_finite: bool = False,
        **kwargs: Any,
    ) -> None:
        owner = type(self).__name__
        self.finite = FiniteGuard(v.check_bool(owner, "check_finite", check_finite), owner)
        self.hook = v.check_choice(owner, "hook", hook, HOOKS)
        self.model_averaging_period = _only_for(
            owner, hook, "post_local_sgd", "model_averaging_period", model_averaging_period, DEFAULT_PERIOD
        )
        self.powersgd_rank = _only_for(owner, hook, "powersgd", "powersgd_rank", powersgd_rank, DEFAULT_POWERSGD_RANK)
        self.warmup_steps = _check_warmup(owner, hook, warmup_steps)
        self.bucket_cap_mb = None if bucket_cap_mb is None else check_bucket_mb(owner, "bucket_cap_mb", bucket_cap_mb)
        for name in _SET_BY_HOOK:
            if name in kwargs:
                raise ValueError(f"{owner}: argument `{name}` is set by `hook`; pass the hook's own arguments instead.")
        v.check_choice(owner, "start_method", start_method, START_METHODS)
        v.check_choice(owner, "process_group_backend", process_group_backend, BACKENDS)
        if self.bucket_cap_mb is not None:
            kwargs["bucket_cap_mb"] = self.bucket_cap_mb
        super().__init__(
            ddp_comm_hook=_HOOK_FUNCTIONS[hook],
            model_averaging_period=self.model_averaging_period,
            timeout=check_timeout(owner, "timeout", timeout),
            start_method=start_method,
            process_group_backend=process_group_backend,
            **kwargs,
        )
        self.guard = FailureGuard(self._timeout)
        self._finish = _finish.Finish()

    @property
    def check_finite(self) -> bool:
        """Whether the non-finite guard is on."""
        return self.finite.enabled

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        """Register ``ddp_post_local_sgd``, ``ddp_powersgd``, ``ddp_fp16`` and their ``_spawn`` / ``_fork`` names."""
        for name, hook in REGISTRY_NAMES.items():
            register_family(
                strategy_registry, cls, name, f"DDP with torch's {hook} communication hook, on any device", hook=hook
            )

    # ------------------------------------------------------------------ processes and failures
    @override
    def _configure_launcher(self) -> None:
        super()._configure_launcher()
        if isinstance(self._launcher, _MultiProcessingLauncher):
            self._launcher = self.guard.launcher(self, self._start_method)

    @override
    def setup_distributed(self) -> None:
        if not dist.is_initialized():  # Lightning's own set-up then finds the group and only adds its settings
            self.set_world_ranks()
            env = self.cluster_environment
            assert env is not None
            os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = env.main_address, str(env.main_port)
            timeout = self._timeout or timedelta(seconds=DEFAULT_TIMEOUT_S)
            init_default_group(  # its store listens on MASTER_ADDR only, not on every interface
                self._get_process_group_backend(),
                rank=self.global_rank,
                world_size=self.world_size,
                address=env.main_address,
                port=env.main_port,
                timeout=max(timeout, timedelta(seconds=DEFAULT_INIT_TIMEOUT_S)),
                multi_node=self.num_nodes > 1,
            )
            dist.distributed_c10d._set_pg_timeout(timeout, dist.group.WORLD)  # start-up is over
        super().setup_distributed()

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        self.guard.start(self)

    @override
    def teardown(self) -> None:
        self.guard.stop()
        super().teardown()

    @override
    def on_exception(self, exception: BaseException) -> None:
        super().on_exception(exception)
        self.guard.on_exception(exception, self.launcher)

    # ------------------------------------------------------------------ the non-finite guard
    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        output = super().training_step(*args, **kwargs)
        self.finite.check_loss(self, loss_of(output))  # before backward: DDP's hooks reduce during it
        return output

    @override
    def backward(self, closure_loss: torch.Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        output: torch.Tensor = super().backward(closure_loss, optimizer, *args, **kwargs)
        self.finite.check_gradients(self)
        return output

    @override
    def optimizer_step(self, optimizer: Any, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        output = super().optimizer_step(optimizer, closure, model, **kwargs)
        self.finite.check_parameters(self)
        return output

    # ------------------------------------------------------------------ the DDP wrapper and its hook
    @override
    def _setup_model(self, model: Module) -> DistributedDataParallel:
        if self.hook == "powersgd" and dist.get_backend() != "nccl":
            self._ddp_kwargs["bucket_cap_mb"] = self._one_bucket_mb(model)
        return super()._setup_model(model)

    def _one_bucket_mb(self, model: Module) -> float:
        """A bucket size (MiB) that holds every trainable parameter of ``model``."""
        size_mb = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad) / 2**20
        if self.bucket_cap_mb is None:
            return float(math.floor(size_mb) + 1)
        if self.bucket_cap_mb < size_mb:
            raise ValueError(
                f"{type(self).__name__}: argument `bucket_cap_mb` must be None or >= {size_mb:.2f} (the model's "
                f"trainable parameters, MiB) for hook 'powersgd' without NCCL, got {self.bucket_cap_mb!r}: with "
                "several buckets PowerSGD's chained all-reduces run in a different order on each rank over gloo."
            )
        return self.bucket_cap_mb

    @override
    def _register_ddp_hooks(self) -> None:
        # Lightning registers the hook only on CUDA; a fresh state per fit (PowerSGD keeps error
        # feedback and step counters in it, post-local SGD its step counter).
        assert isinstance(self.model, DistributedDataParallel)
        self._ddp_comm_state = self._new_state()
        hook: Callable[..., Any] = self._ddp_comm_hook  # type: ignore[assignment]
        self.model.register_comm_hook(self._ddp_comm_state, hook)

    def _new_state(self) -> object:
        if self.hook == "post_local_sgd":
            return post_localSGD_hook.PostLocalSGDState(
                process_group=None,
                subgroup=None,
                start_localSGD_iter=self.warmup_steps,
                post_local_gradient_allreduce=False,
            )
        if self.hook == "powersgd":
            return powerSGD_hook.PowerSGDState(
                process_group=None,
                matrix_approximation_rank=self.powersgd_rank,
                start_powerSGD_iter=self.warmup_steps,
            )
        return None  # fp16: the state is the process group (None: the world)

    # ------------------------------------------------------------------ end of fit (post_local_sgd)
    @override
    def setup(self, trainer: pl.Trainer) -> None:
        super().setup(trainer)
        if self.hook == "post_local_sgd" and trainer.state.fn == TrainerFn.FITTING:
            _finish.install(trainer)

    def finish_training(self) -> None:
        """Average the post-local SGD replicas once, after the last optimizer step (a collective)."""
        self._finish(self._average_replicas)

    def _average_replicas(self) -> None:
        if self.hook == "post_local_sgd" and self.lightning_module is not None:
            with torch.no_grad():
                all_reduce_mean_([p.data for p in self.lightning_module.parameters()], dist.group.WORLD)

    @override
    def on_train_start(self) -> None:
        super().on_train_start()
        self._finish.rearm()

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        super().on_train_batch_start(batch, batch_idx)
        self._finish.rearm()  # training goes on: the replicas may differ again

    @override
    def on_train_end(self) -> None:
        self.finish_training()  # a no-op unless a stop came that FinishFit did not predict
        super().on_train_end()


_HOOK_FUNCTIONS: dict[str, Callable[..., torch.futures.Future[torch.Tensor]]] = {
    "post_local_sgd": post_localSGD_hook.post_localSGD_hook,
    "powersgd": powerSGD_hook.powerSGD_hook,
    "fp16": default_hooks.fp16_compress_hook,
}


def _only_for(owner: str, hook: str, user: str, name: str, value: int | None, default: int) -> int | None:
    """A positive integer that only hook ``user`` takes (``None``: ``default``); other hooks require ``None``."""
    if hook != user:
        if value is not None:
            raise ValueError(
                f"{owner}: argument `{name}` must be None for hook {hook!r} (only {user!r} uses it), got {value!r}."
            )
        return None
    return v.check_int(owner, name, default if value is None else value, minimum=1)


def _check_warmup(owner: str, hook: str, value: int | None) -> int:
    if hook not in MIN_WARMUP:
        if value is not None and v.as_int(value) != 0:  # not `value in (None, 0)`: False == 0
            raise ValueError(f"{owner}: argument `warmup_steps` must be None or 0 for hook {hook!r}, got {value!r}.")
        return 0
    least = MIN_WARMUP[hook]
    return v.check_int(owner, "warmup_steps", least if value is None else value, minimum=least)
