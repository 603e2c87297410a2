"""The callable submitit pickles and every srun task runs.

Kept free of torch imports at module level so the launcher can build it cheaply.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class TrainJob:
    run_dir: str

    def __call__(self) -> int:
        from train.main import run

        return run(self.run_dir)
