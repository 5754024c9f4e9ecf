"""Multi-process test harness: test your own LightningModules under real process groups.

- :func:`run_workers` forks N ranks that join a real job (torchrun-style environment) and
  returns each rank's result, turning errors, deaths and hangs into exceptions.
- :func:`isolated_global_state` undoes what in-process launchers leave behind.
"""

from lightning_hier.testing.harness import WorkerFailed, WorkerTimeout, run_workers, worker_env
from lightning_hier.testing.isolation import isolated_global_state

__all__ = ["WorkerFailed", "WorkerTimeout", "isolated_global_state", "run_workers", "worker_env"]
