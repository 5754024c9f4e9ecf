"""The step counter of periodic averaging: fires a round every ``tau`` optimizer steps."""

from __future__ import annotations


class PeriodicSchedule:
    """Counts optimizer steps and fires every ``tau`` of them.

    Args:
        tau: Period in optimizer steps (>= 1). May be changed between rounds (a pull schedule).
    """

    def __init__(self, tau: int) -> None:
        if tau < 1:
            raise ValueError(f"PeriodicSchedule: `tau` must be >= 1, got {tau}.")
        self.tau = tau
        self.steps = 0
        self.since_sync = 0
        self.rounds = 0

    def step(self) -> bool:
        """Count one optimizer step; True when a synchronisation round is due."""
        self.steps += 1
        self.since_sync += 1
        return self.since_sync >= self.tau

    def synced(self) -> None:
        self.since_sync = 0
        self.rounds += 1

    def state_dict(self) -> dict[str, int]:
        return {"tau": self.tau, "steps": self.steps, "since_sync": self.since_sync, "rounds": self.rounds}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.steps, self.since_sync, self.rounds = state["steps"], state["since_sync"], state["rounds"]
