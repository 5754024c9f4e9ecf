"""A delay-callback factory for tests: rank 1 fails at once, other ranks get a harmless callback."""

import os
from typing import Any


def factory(ranks: list[int], factor: float) -> Any:
    if os.environ.get("RANK") == "1":
        raise RuntimeError("rank 1 fails on purpose")
    from lightning.pytorch.callbacks import Callback

    return Callback()
