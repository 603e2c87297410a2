"""Runs inside an allocation the user already holds: ``cluster.allocation=auto``.

Launched from inside ``salloc`` (or with ``salloc --no-shell``'s job id exported as
``SLURM_JOB_ID``) or from a user's own sbatch script, outside any job step, the run
submits no job: the batch script a submission would have used (the same rendering, with
the step loop told ``STO_ALLOCATION``) runs on this host, in the background, and its srun
steps run in the allocation (srun finds it through ``SLURM_JOB_ID``), each asked for the
run's nodes and tasks explicitly (``--nodes``/``--ntasks``: srun would take the whole
allocation). What the tasks see, the run directory, its logs (``slurm/JOB_*_log.*``, JOB
the allocation's id), run.json, in-job restarts and ``launcher.status`` are a submitted
job's. An allocation is not requeued by the toolkit: a preemption's or a time limit's
checkpoint ends the run ``preempted``/``timeout`` and ``python -m launcher.resume RUN_DIR``
starts it again (in an allocation or as a job of its own); a task's request to cancel
ends the run's step, never the user's allocation. The nodes asked must fit the allocation
(checked before anything is written: one line naming both). Two runs fit side by side
when their nodes do: Slurm gives each step its own CPUs.
"""
from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Mapping, Optional, Tuple

from launcher import submit
from launcher.snapshot import Frozen
from slurm import query, submitit_adapter
from spec.config import ConfigError, RunConfig
from spec.layout import Layout


def held(env: Optional[Mapping[str, str]] = None) -> Optional[str]:
    """The id of the allocation this process runs in (``SLURM_JOB_ID`` outside any job
    step), None outside one."""
    env = os.environ if env is None else env
    job = env.get("SLURM_JOB_ID") or None
    return None if job is None or env.get("SLURM_STEP_ID") not in (None, "") else job


def in_use(cfg: RunConfig, env: Optional[Mapping[str, str]] = None) -> Optional[str]:
    """The allocation the run goes into: with cluster.allocation=auto on a Slurm profile, inside one."""
    c = cfg.cluster
    return held(env) if c.allocation == "auto" and c.backend == "slurm" else None


def check_fits(cfg: RunConfig, slurm_conf: Optional[str]) -> None:
    """Refuse, in one line, a run whose nodes the allocation cannot hold (or an allocation
    Slurm does not know, or that is not running)."""
    job = in_use(cfg)
    if job is None:
        return
    try:
        fields = query.job_fields(job, query.slurm_env(slurm_conf))
    except query.SlurmUnavailable as exc:
        raise ConfigError(f"cluster.allocation=auto: SLURM_JOB_ID={job} is not a job Slurm knows "
                          f"({str(exc).splitlines()[0][:160]}); unset SLURM_JOB_ID or use cluster.allocation=never")
    if fields.get("JobState") != "RUNNING":
        raise ConfigError(f"cluster.allocation=auto: allocation {job} is {fields.get('JobState', 'unknown')}, not "
                          "RUNNING; wait for it, or use cluster.allocation=never")
    have = int((fields.get("NumNodes") or "0").split("-")[0] or 0)
    c = cfg.cluster
    asked = c.nodes + c.spare_nodes
    if asked > have:
        what = f"cluster.nodes={c.nodes}" + (f" + cluster.spare_nodes={c.spare_nodes}" if c.spare_nodes else "")
        raise ConfigError(f"{what} does not fit allocation {job}, which holds {have} node(s) "
                          f"({fields.get('NodeList', '?')}); ask at most {have}, or submit a job of its own with "
                          "cluster.allocation=never")
    cpus, need = int((fields.get("NumCPUs") or "0").split("-")[0] or 0), asked * c.gpus_per_node * c.task_cpus()
    if cpus and need > cpus:
        raise ConfigError(f"cluster.nodes={c.nodes} x {c.gpus_per_node} ranks x cluster.cpus_per_task="
                          f"{c.task_cpus()} = {need} CPUs do not fit allocation {job}, which holds {cpus}; ask the "
                          f"allocation for {c.gpus_per_node * c.task_cpus()} CPUs a node (salloc --ntasks-per-node=1 "
                          f"--cpus-per-task={c.gpus_per_node * c.task_cpus()}) or fewer CPUs here")


def start(cfg: RunConfig, layout: Layout, run_dir: Path, slurm_conf: Optional[str],
          code: Optional[Frozen]) -> Tuple[str, subprocess.Popen]:
    """Run the batch script in the allocation, in the background: (allocation id, its process)."""
    job = in_use(cfg)
    assert job is not None  # noqa: S101 - callers ask in_use first
    script = submit.render_script(cfg, layout, run_dir, code=code, allocation=True)
    (run_dir / "sbatch.sh").write_text(script)
    folder = run_dir / "slurm"
    folder.mkdir(parents=True, exist_ok=True)
    submitit_adapter.dump_delayed(submit.task_call(run_dir), folder / f"{job}_submitted.pkl", cfg.cluster.time_min,
                                  cfg.cluster.max_requeues)
    env = {**query.slurm_env(slurm_conf), "SLURM_OPEN_MODE": "append"}  # srun's files, as sbatch's --open-mode
    with open(folder / f"{job}_0_log.out", "ab") as out, open(folder / f"{job}_0_log.err", "ab") as err:
        proc = subprocess.Popen(["bash", str(run_dir / "sbatch.sh")], stdin=subprocess.DEVNULL, stdout=out,
                                stderr=err, env=env, cwd=run_dir, start_new_session=True)
    return job, proc
