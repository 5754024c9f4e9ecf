"""The Trainer every study builds: CPU ranks, no logger, progress bar, summary or checkpoints."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl


def quiet_trainer(**kwargs: Any) -> pl.Trainer:
    """A CPU :class:`~lightning.pytorch.Trainer` that prints and writes nothing but what a study reads.

    Studies time fits and read metrics themselves, so Lightning's logger, progress bar, model
    summary, checkpoints and sanity validation would only add noise (and files) to the runs.

    Args:
        **kwargs: Any ``Trainer`` argument (``strategy``, ``devices``, ``max_epochs``,
            ``callbacks``...); each overrides the quiet default of the same name.
    """
    quiet: dict[str, Any] = {
        "accelerator": "cpu",
        "logger": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "enable_checkpointing": False,
        "num_sanity_val_steps": 0,
    }
    return pl.Trainer(**{**quiet, **kwargs})
