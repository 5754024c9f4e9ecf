"""One replica of the torchrun test in ``test_fault_tolerance.py``: torchrun runs it once per replica job."""

from __future__ import annotations

import argparse
from pathlib import Path

from tests.integration.test_fault_tolerance import REPLICAS, _fit


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--coordinator", required=True)
    parser.add_argument("--replica", type=int, required=True)
    parser.add_argument("--kill-after", type=int, required=True)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    identity = {"coordinator": args.coordinator, "replica": args.replica, "replicas": REPLICAS}
    # 0.5 s a step: torchrun's restart (Python, Lightning, the Trainer: about 5 s) comes back during training
    _fit(args.out, kill_after=args.kill_after, max_restarts=1, replica=identity, step_s=0.5)


if __name__ == "__main__":
    main()
