"""DBS's batch shares inside a window rule: each rank's change weighted by the samples it processed.

The rule and why samples are the right weights: :mod:`lightning_hier.algorithms.dbs_compose`
(``delta = sum_i n_i delta_i / N``). :class:`SampleWeights` counts the window's samples from the
allocation that splits the batches (:class:`~lightning_hier.sync.dbs.SpeedShares`) and gives the
rule this rank's factor ``W n_i / N`` before every step; HPSGD scales the change it sends by it,
Local SGD its replica (:class:`~lightning_hier.algorithms.dbs_compose.SampleWeightedCenter`).
"""

from __future__ import annotations

from typing import Any, Protocol

from lightning_hier.algorithms.dbs_compose import SampleWindow

WINDOW_KEY = "samples"
"""Where the window's counts sit beside the rule's own state in a checkpoint."""
RULE_KEY = "sync"


class Counted(Protocol):
    """What :class:`SampleWeights` reads from the allocation."""

    @property
    def world(self) -> int:
        """Ranks sharing the global batch."""

    @property
    def step_samples(self) -> tuple[int, int]:
        """``(n_i, N)`` of the current step."""


class SampleWeights:
    """The samples of the current window and this rank's factor ``W n_i / N`` (see the module docstring).

    Args:
        shares: The allocation whose split gives each step's samples.
    """

    def __init__(self, shares: Counted) -> None:
        self.shares = shares
        self.window = SampleWindow()

    def add_step(self) -> float:
        """Count the step about to be taken (its micro-batches have all begun); this rank's factor."""
        self.window.add(*self.shares.step_samples)
        return self.window.weight(self.shares.world)

    def reset(self) -> None:
        """The window was sent or merged (or a new run starts): count anew."""
        self.window.reset()

    def wrap(self, rule_state: dict[str, Any]) -> dict[str, Any]:
        """The rule's checkpoint state with the window's counts beside it."""
        return {RULE_KEY: rule_state, WINDOW_KEY: self.window.state_dict()}

    def unwrap(self, state: dict[str, Any]) -> dict[str, Any]:
        """Restore the counts of :meth:`wrap`'s state; the rule's own state."""
        self.window.load_state_dict(state[WINDOW_KEY])
        return dict(state[RULE_KEY])
