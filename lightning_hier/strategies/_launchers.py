"""The launchers of :class:`~lightning_hier.strategies._base.HierStrategy` (``start_method`` spawn / fork).

``start_method="popen"`` uses Lightning's own ``_SubprocessScriptLauncher`` unchanged; the
multiprocessing start methods use :class:`_ReportingLauncher`, which adds failure reporting in
the child processes. Strategies with their own launcher subclass it (``grid2d``).
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch.strategies.launchers import _MultiProcessingLauncher
from typing_extensions import override


class _ReportingLauncher(_MultiProcessingLauncher):
    """Lightning's spawn/fork launcher, plus failure handling inside each child.

    Lightning calls ``strategy.on_exception`` only in the parent process; a child rank that
    raises (or whose collective times out) would die without reporting, so its peers could not
    name it. This wrapper runs the strategy's handler in the child before the error propagates.
    """

    @override
    def _wrapping_function(self, *args: Any, **kwargs: Any) -> None:
        try:
            super()._wrapping_function(*args, **kwargs)
        except BaseException as exc:
            self._strategy.on_exception(exc)
            raise
