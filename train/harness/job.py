"""The callable submitit pickles and every srun task runs.

Kept free of torch imports at module level so the launcher can build it cheaply.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class TrainJob:
    run_dir: str

    def __call__(self) -> int:
        from train.harness.preempt import PreemptionFlag

        # Before the slow imports (torch: seconds): a USR2 that comes now (Slurm may send
        # --signal's up to 60 s early, or the job is preempted as it starts) sets the flag,
        # rather than meeting submitit's handler ("timed-out and not checkpointable": the
        # job ended, never requeued) or, outside submitit, killing the process.
        flag = PreemptionFlag().install()
        from train.main import run

        return run(self.run_dir, flag)


def main(run_dir: str) -> int:
    """What every task of a submitted job runs (``slurm.submitit_adapter.TaskCall``)."""
    return TrainJob(run_dir)()
