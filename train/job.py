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
        from train.harness.agent import is_agent

        if is_agent():  # one task a node: it forks the node's ranks, each of which runs rank() below
            from train.harness.agent import run_agent
            from train.main import warm_imports

            code = run_agent(self.run_dir, lambda: self.rank(flag), warm_imports)
            if code or flag.is_set:  # a failure: srun's --kill-on-bad-exit ends the other nodes' agents;
                exit_now(code)       # a signal: the job is being requeued or ended, end at once
            return code
        return self.rank(flag)

    def rank(self, flag) -> int:
        """One rank of the job (an srun task, or a rank a node's agent forked)."""
        from train.harness.restart import requested
        from train.main import is_user_run, run

        try:
            code = run(self.run_dir, flag)
        except BaseException:
            if requested(self.run_dir) and not is_user_run(self.run_dir):
                # The job starts its ranks again (train.harness.restart): the failure is
                # recorded, so end at once and the next step starts seconds sooner.
                import traceback

                traceback.print_exc()
                exit_now(1)
            raise
        if flag.is_set and not is_user_run(self.run_dir):  # a user's code may rely on atexit
            exit_now(code)                                  # hooks and threads: its exit stays
        return code


def exit_now(code: int) -> None:
    """End an interrupted task of the built-in trainer (or a failed one whose job restarts
    it) at once. Its work is done
    (checkpoint committed, run.json written, the requeue asked, trackers closed, the
    process group gone), and Slurm ends the step as it requeues: an interpreter's teardown after torch took 3-4 s on this
    machine, outliving Slurm's SIGTERM until KillWait's SIGKILL, inside the requeue's wait
    (bench/goodput.py). Logs are flushed first; submitit's result file is not written (a
    requeued job's is never read)."""
    import logging
    import os
    import sys

    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


def main(run_dir: str) -> int:
    """What every task of a submitted job runs (``slurm.submitit_adapter.TaskCall``)."""
    return TrainJob(run_dir)()
