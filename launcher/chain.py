"""Jobs that run after a training job: ``launcher.then=[export, "cmd:COMMAND"]``.

Each item is a Slurm job of its own, submitted with the training job, that waits on the
one before it (``--dependency=afterok:JOB``, or ``afterany`` with
``launcher.then_dependency=afterany``) and has its own resources: one node, one task, the
CPUs of the training's node, no GPU, the run's partition, ``launcher.then_time_min``.

- ``export``: the run's newest committed checkpoint as a Hugging Face directory,
  ``RUN_DIR/export`` (``python -m launcher.export``, on the CPU; the run must save
  checkpoints: ``checkpoint.every_steps`` or ``every_minutes``).
- ``eval``: the newest committed checkpoint evaluated as ``eval.on_checkpoint`` evaluates
  each (launcher/evaljobs.py: lm-eval's ``eval.tasks``, the validation loss, rows in
  ``RUN_DIR/eval.jsonl``), with the evaluation's resources (``eval.gpus_per_node``, ...).
- ``cmd:COMMAND``: a shell command, with ``{run_dir}`` and ``{export_dir}`` replaced
  (shell-quoted), run in the run directory (e.g. ``cmd:python my_eval.py {export_dir}``).

A training job requeued after a preemption keeps its chain waiting (Slurm's dependency
follows the job id). When it ends otherwise than COMPLETED (failed, cancelled, a node
failure, its time limit without requeue), the dependency can never be met and Slurm
cancels the chain (``--kill-on-invalid-dep=yes``; without it Slurm would leave them
PENDING as DependencyNeverSatisfied unless the site sets ``kill_invalid_depend``): no
task of the training job needs to run for that. run.json's ``chain`` lists the jobs;
``launcher.status`` shows their states and why, ``launcher.cancel`` cancels them with the run.
Each job's output: ``RUN_DIR/slurm/then-KIND-JOB.out``.
"""
from __future__ import annotations

import shlex
from pathlib import Path
from typing import Dict, List, Optional

from launcher import allocation, evaljobs, resources
from launcher.snapshot import Frozen
from slurm import query, sbatch
from spec.config import ConfigError, RunConfig

KINDS = ("export", "eval")  # and "cmd:COMMAND"
EXPORT_DIR = "export"


def check(cfg: RunConfig) -> None:
    """Refuse, in one line, a chain that cannot run (before anything is written)."""
    then = cfg.launcher.then
    if not then:
        return
    if cfg.cluster.backend != "slurm":
        raise ConfigError(f"launcher.then={list(then)}: chains are Slurm jobs; use a Slurm profile (+cluster=...) "
                          "or run the steps by hand after a local run")
    held = allocation.in_use(cfg)
    if held:
        raise ConfigError(f"launcher.then={list(then)}: a chain waits on the training's own job, and inside "
                          f"allocation {held} there is none; drop launcher.then or use cluster.allocation=never")
    if cfg.launcher.then_dependency not in ("afterok", "afterany"):
        raise ConfigError(f"launcher.then_dependency={cfg.launcher.then_dependency!r} is not afterok or afterany")
    for i, item in enumerate(then):
        if item in KINDS or (item.startswith("cmd:") and item[4:].strip()):
            continue
        raise ConfigError(f"launcher.then[{i}]={item!r}: not a step of a chain; use export, eval or \"cmd:COMMAND\" "
                          "({run_dir} and {export_dir} are replaced)")
    if "eval" in then:
        evaljobs.check_tasks(cfg, "launcher.then=[eval]")
    if ("export" in then or "eval" in then) and (cfg.entrypoint or (cfg.checkpoint.every_steps is None and
                                                 cfg.checkpoint.every_minutes is None
                                                 and cfg.cluster.accelerator != "gpu")):
        why = "a user's entry point writes no checkpoint of the built-in trainer" if cfg.entrypoint else \
            "the run saves checkpoints only on a signal here"
        raise ConfigError(f"launcher.then={list(then)}: {why}, so there may be nothing to export or evaluate; "
                          "set checkpoint.every_steps (the last step is saved too) or drop export")


def command(item: str, run_dir: Path, python: str) -> str:
    """The shell line one step of the chain runs (in the run directory)."""
    export = run_dir / EXPORT_DIR
    if item == "export":
        return f"{python} -m launcher.export {shlex.quote(str(run_dir))} {shlex.quote(str(export))}"
    if item == "eval":
        return f"{python} -m train.eval_job {shlex.quote(str(run_dir))} 0"
    return item[4:].replace("{run_dir}", shlex.quote(str(run_dir))).replace("{export_dir}", shlex.quote(str(export)))


def script(cfg: RunConfig, item: str, run_dir: Path, after: str, python: str, code: Optional[Frozen]) -> str:
    """The batch script of one step: its resources, the site's setup, the run's code first on
    PYTHONPATH (as the training's tasks), then the step's command."""
    c, kind = cfg.cluster, item.split(":", 1)[0]
    gpus = evaljobs.gpus(cfg) if kind == "eval" else 0  # export and commands: no GPU
    options = {"job-name": f"sto-then-{kind}", "nodes": 1, "ntasks": 1, "gpus-per-node": gpus or None,
               "cpus-per-task": c.task_cpus() * (max(gpus, 1) if kind == "eval" else c.gpus_per_node),
               "time": cfg.launcher.then_time_min, "dependency": f"{cfg.launcher.then_dependency}:{after}",
               "kill-on-invalid-dep": "yes", "output": str(run_dir / "slurm" / f"then-{kind}-%j.out"),
               "partition": c.partition, "account": c.account, "qos": c.qos, "constraint": c.constraint}
    lines = sbatch.job_head(options, c.setup, c.env) + (code.setup_lines() if code is not None else [])
    if kind == "eval":
        lines.append(evaljobs.OFFLINE)
    srun, inside = resources.in_image(cfg, run_dir, options["cpus-per-task"], gpus, code)  # with an image: every step runs there, as the tasks
    line = command(item, run_dir, inside or python)
    line = f"{srun}bash -c {shlex.quote(line)}" if srun and kind == "cmd" else srun + line
    lines += [f"cd {shlex.quote(str(run_dir))}", f"exec {line}"]
    return "\n".join(lines) + "\n"


def submit(cfg: RunConfig, run_dir: Path, job: str, slurm_conf: Optional[str], python: str,
           code: Optional[Frozen]) -> List[Dict[str, str]]:
    """Submit the chain after training job ``job``: run.json's ``chain`` entries."""
    chain: List[Dict[str, str]] = []
    after = job
    env = query.slurm_env(slurm_conf)
    for i, item in enumerate(cfg.launcher.then):
        path = run_dir / "slurm" / f"then-{i}.sbatch"
        path.write_text(script(cfg, item, run_dir, after, python, code))
        after = query.sbatch(str(path), env)
        chain.append({"step": item, "job_id": after, "after": chain[-1]["job_id"] if chain else job})
    return chain


def status_lines(info: Dict, env: Dict[str, str]) -> List[str]:
    """One line a step of the run's chain: its job, Slurm's state and, when it will not run, why."""
    chain = info.get("chain") or []
    if not chain:
        return []
    try:
        states = query.sacct([e["job_id"] for e in chain], env)
    except query.SlurmUnavailable as exc:
        return [f"then: {len(chain)} job(s), accounting unavailable ({str(exc).splitlines()[0][:100]})"]
    lines = []
    for e in chain:
        state = (states.get(e["job_id"]) or {}).get("State", "unknown")
        why = ""
        if state.startswith("CANCELLED") and str(info.get("status")) in ("failed", "interrupted", "cancelled"):
            why = f" (the training ended {info.get('status')}: its dependency can never be met)"
        lines.append(f"then: {e['step']}: job {e['job_id']} {state}{why}")
    return lines
