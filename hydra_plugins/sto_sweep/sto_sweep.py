"""Hydra plugins that submit a whole sweep from one process (``hydra/launcher=sto``).

Hydra instantiates launchers and sweepers only from the ``hydra_plugins`` namespace
package, so the two classes live here; the work is in ``launcher.sweep``.
``conf/config.yaml`` selects both by default (``conf/hydra/{launcher,sweeper}/sto.yaml``).

- ``StoLauncher`` gets every point of the sweep at once: it composes, checks and writes
  all points, then submits points with identical sbatch parameters as one job array.
  Hydra's ``BasicLauncher`` instead runs the task function once per point, so each point
  paid its own composition, Slurm checks and sbatch.
- ``StoSweeper`` is Hydra's ``BasicSweeper`` (same cartesian product, job numbers,
  ``multirun.yaml``) without its up-front composition of every point when the launcher
  checks every point itself: that validation composed each point a second time, and
  a bad point would stop the whole sweep instead of being skipped with its reason.

Hydra's scanner may execute this module twice: it holds definitions only.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, List, Optional, Sequence

from hydra.core.utils import JobReturn, JobStatus
from hydra.plugins.launcher import Launcher
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig

from launcher.compat import basic_sweeper

BasicSweeper = basic_sweeper()  # Hydra's, private to it: launcher/compat.py says why


class StoLauncher(Launcher):
    # Read by StoSweeper: this launcher composes and validates every point itself.
    validates_every_point = True

    def __init__(self) -> None:
        self.config: Optional[DictConfig] = None
        self.hydra_context: Optional[HydraContext] = None
        self.session = None

    def setup(self, *, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig) -> None:
        # task_function is not called per point; it carries the CLI's session (launcher.__main__)
        self.config, self.hydra_context = config, hydra_context
        self.session = getattr(task_function, "session", None)

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        from launcher import sweep  # lazy: plugin discovery stays fast for every Hydra command

        if self.config is None or self.hydra_context is None:
            raise RuntimeError("StoLauncher.launch() before setup()")
        if self.session is None:  # a task function that is not launcher's: a session of its own
            from launcher.launch import Session

            self.session = Session(multirun=True)
        points = sweep.launch(self.session, self.config, self.hydra_context.config_loader, job_overrides,
                              initial_job_idx)
        return [JobReturn(overrides=list(p.overrides), working_dir=str(p.run_dir), task_name="launcher",
                          status=JobStatus.COMPLETED, _return_value=p.code) for p in points]


class StoSweeper(BasicSweeper):
    def __init__(self, max_batch_size: Optional[int] = None, params: Optional[dict] = None) -> None:
        super().__init__(max_batch_size=max_batch_size, params=params)

    def validate_batch_is_legal(self, batch: Sequence[Sequence[str]]) -> None:
        if getattr(self.launcher, "validates_every_point", False):
            return
        super().validate_batch_is_legal(batch)  # another launcher (e.g. submitit_slurm): Hydra's check


    def sweep(self, arguments: List[str]) -> Any:
        """Hydra's sweep; the launcher's session learns whether this invocation made the
        sweep directory, so a sweep refused whole leaves none behind (launcher.__main__)."""
        from launcher.provenance import outermost_missing

        # runs/multirun/... made anew
        made = outermost_missing(Path(str(self.config.hydra.sweep.dir))) if self.config is not None else None
        try:
            return super().sweep(arguments)
        finally:
            session = getattr(self.launcher, "session", None)
            if made is not None and session is not None:
                session.fresh_sweep_dir = made
