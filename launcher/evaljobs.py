"""Evaluation jobs: one Slurm job a chosen checkpoint (``eval.on_checkpoint``).

``python -m launcher.evaljobs submit RUN_DIR`` submits what ``RUN_DIR/evals/queue`` holds
(spec/evals.py says who writes what). The batch script's step loop runs it within a second
of a checkpoint's commit, from the job's first node and outside any container, where
Slurm's client is (slurm/step_loop.sh ``sto_evals``): the training's tasks call no Slurm
client, as a container's image may hold none. It needs no torch.

Each job: one node, one task, ``eval.gpus_per_node`` GPUs (null: 1 on a GPU cluster, none
on a CPU one), the CPUs of one GPU's share (``cluster.cpus_per_task``), ``eval.time_min``,
``eval.partition`` or the run's. A job preempted and requeued evaluates its step again
(its claim is its job id's); one that fails or runs out of time is recorded as failed
(``evals/step_N/result.json``): the training never depends on it. At most
``eval.max_pending`` run at once: a later one waits on an earlier one (``afterany``), so a
checkpoint is never skipped. The training job never waits on them: on a busy partition
they may run after it ends.
"""
from __future__ import annotations

import os
import shlex
import sys
from pathlib import Path
from typing import Dict, List, Optional, Sequence

from launcher import resources
from slurm import query, sbatch, states
from spec import evals
from spec.config import ConfigError, RunConfig, to_run_config
from spec.rundir import CONFIG

#: seconds before eval.time_min at which the job's own timeout ends the evaluation, so that
#: it records its failure before Slurm's kill.
MARGIN_S = 30
#: lm-eval, datasets and transformers read nothing from the network in an evaluation's job.
OFFLINE = "export HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1"


def check(cfg: RunConfig) -> None:
    """Refuse, in one line, evaluation settings that cannot run (before anything is written)."""
    e = cfg.eval
    if not e.on_checkpoint:
        return
    if cfg.entrypoint:
        raise ConfigError(f"eval.on_checkpoint=true with entrypoint={cfg.entrypoint!r}: a user's code writes no "
                          "checkpoint of the built-in trainer; evaluate its exports with launcher.then=[\"cmd:...\"]")
    if cfg.cluster.backend != "slurm":
        raise ConfigError("eval.on_checkpoint=true: evaluations are Slurm jobs of their own; use a Slurm profile "
                          "(+cluster=...) or, after a local run, python -m launcher.eval RUN_DIR on a Slurm cluster")
    check_tasks(cfg, "eval.on_checkpoint=true")


def check_tasks(cfg: RunConfig, what: str) -> None:
    """What any evaluation needs: tasks, sane resources, a tokenizer for lm-eval."""
    e = cfg.eval
    if not e.tasks:
        raise ConfigError(f"{what} with eval.tasks=[]: name lm-eval tasks or task YAML files, "
                          "e.g. eval.tasks=[hellaswag] or eval.tasks=[/path/my_task.yaml]")
    if (e.every_steps or 0) < 0 or e.max_pending < 1 or e.nodes != 1 or e.batch_size < 1 or e.time_min < 2:
        raise ConfigError(f"eval.every_steps={e.every_steps}, eval.max_pending={e.max_pending}, eval.nodes={e.nodes}, "
                          f"eval.batch_size={e.batch_size}, eval.time_min={e.time_min}: give every_steps >= 0, "
                          "max_pending >= 1, nodes=1 (lm-eval runs in one process), batch_size >= 1, time_min >= 2")
    for t in e.tasks:
        if t.endswith((".yaml", ".yml")) and not Path(t).is_file():
            raise ConfigError(f"eval.tasks: {t} is not a file; give the task YAML's path (absolute: the job runs "
                              "in the run directory)")
    if evals.tokenizer(cfg)[0] is None:
        raise ConfigError(f"{what}: lm-eval needs the model's tokenizer, and data.source={cfg.data.source} with "
                          f"model.hf_path={cfg.model.hf_path} has none; train on prepared data (data.source=tokens "
                          "or chat: python -m train.data.prepare) or from a Hugging Face directory with tokenizer.json")


def gpus(cfg: RunConfig) -> int:
    g = cfg.eval.gpus_per_node
    return int(g) if g is not None else (1 if cfg.cluster.accelerator == "gpu" else 0)


def script(cfg: RunConfig, run_dir: Path, step: int, python: str, after: Optional[str] = None,
           extra: Sequence[str] = ()) -> str:
    """The batch script evaluating the checkpoint of ``step`` (0: the newest committed one);
    ``extra``: more of train.eval_job's arguments (--config, --hf)."""
    c, e = cfg.cluster, cfg.eval
    n_gpus = gpus(cfg)
    name = f"step_{step:08d}" if step else "latest"
    options = {"job-name": f"sto-eval-{name}", "nodes": 1, "ntasks": 1,
               "cpus-per-task": c.task_cpus() * max(n_gpus, 1), "gpus-per-node": n_gpus or None,
               "time": e.time_min, "partition": e.partition or c.partition, "account": c.account, "qos": c.qos,
               "constraint": c.constraint, "dependency": f"afterany:{after}" if after else None,
               "output": str(run_dir / "slurm" / f"eval-{name}-%j.out")}
    root = Path(__file__).resolve().parents[1]  # this code's (the run's frozen copy, from the step loop)
    lines = sbatch.job_head({**options, "requeue": True}, c.setup, c.env)
    lines += [f"export PYTHONPATH={shlex.quote(str(root))}${{PYTHONPATH:+:$PYTHONPATH}}", OFFLINE,
              f"cd {shlex.quote(str(run_dir))}"]
    srun, inside = resources.in_image(cfg, run_dir, options["cpus-per-task"], n_gpus)  # with an image: run there, as the training's tasks
    job = " ".join([f"{srun}{inside or python} -m train.eval_job {shlex.quote(str(run_dir))} {step}",
                    *map(shlex.quote, extra)])
    lines += [f"timeout {max(e.time_min * 60 - MARGIN_S, 60)} {job}", "code=$?",
              f'[ "$code" -eq 0 ] || {job} --failed "$code"', 'exit "$code"']
    return "\n".join(lines) + "\n"


def submit_env() -> Dict[str, str]:
    """This environment without the training job's SLURM_* variables (a job submitted from
    inside another must not take its CPUs, nodes or task counts): SLURM_CONF stays."""
    return {k: v for k, v in os.environ.items() if not k.startswith("SLURM_") or k == "SLURM_CONF"}


def in_flight(run_dir: Path) -> List[str]:
    """Job ids of the submitted evaluations without a result, oldest step first."""
    return [e["job_id"] for e in evals.submitted(run_dir) if e["result"] is None]


def submit_step(cfg: RunConfig, run_dir: Path, step: int, tokens: int, python: str, env: Dict[str, str],
                extra: Sequence[str] = ()) -> str:
    """Submit one evaluation (a dependency on an earlier one beyond eval.max_pending); its job id."""
    running, cap = in_flight(run_dir), cfg.eval.max_pending
    if len(running) >= cap:  # only those still queued: one that ended without a result (a node
        queued = query.squeue(running, env)  # failure, scancel) may be purged, and sbatch refuses
        running = [j for j in running if j in queued]  # a dependency on a job it does not know
    after = running[-cap] if len(running) >= cap else None
    path = run_dir / "slurm" / f"eval-step_{step:08d}.sbatch"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(script(cfg, run_dir, step, python, after, extra))
    job = query.sbatch(str(path), env)
    d = evals.step_dir(run_dir, step)
    d.mkdir(parents=True, exist_ok=True)
    evals.write_json(d / "job.json", {"step": step, "tokens": tokens, "job_id": job, "after": after})
    return job


def submit_queue(run_dir: Path, python: str = sys.executable) -> List[str]:
    """Submit every queued step once (one already submitted is dropped from the queue)."""
    cfg = to_run_config(run_dir / CONFIG)
    env, jobs = submit_env(), []
    for entry in evals.queued(run_dir):
        step = int(entry["step"])
        if not (evals.step_dir(run_dir, step) / "job.json").exists():
            jobs.append(submit_step(cfg, run_dir, step, int(entry.get("tokens", 0)), python, env))
            print(f"evaluation of step {step}: job {jobs[-1]}", file=sys.stderr)
        evals.queue_file(run_dir, step).unlink(missing_ok=True)
    return jobs


def status_lines(run_dir: Path, env: Dict[str, str]) -> List[str]:
    """``launcher.status``'s lines: the newest scores, then the evaluations not ended (their
    Slurm state) and those that failed."""
    newest, jobs, queue = evals.newest_scores(run_dir), evals.submitted(run_dir), evals.queued(run_dir)
    if not (newest or jobs or queue):
        return []
    lines = []
    if newest:
        scores = "  ".join(f"{k} {v:.4g}" for k, v in sorted(newest["scores"].items()))
        lines.append(f"eval: step {newest['step']}: {scores}")
    waiting = [e for e in jobs if e["result"] is None]
    found: Dict[str, Dict[str, str]] = {}
    if waiting:
        try:
            found = query.sacct([e["job_id"] for e in waiting], env)
        except query.SlurmUnavailable:
            found = {}
    def state(e: Dict) -> str:
        now = (found.get(e["job_id"]) or {}).get("State", "unknown")
        return now if now == "unknown" or now.split()[0] in states.ACTIVE else f"{now}, ended without a result"
    pending = [f"step {e['step']} job {e['job_id']} {state(e)}" for e in waiting] + \
        [f"step {e['step']} queued" for e in queue]
    if pending:
        lines.append(f"eval: pending: {', '.join(pending)}")
    failed = [e for e in jobs if (e["result"] or {}).get("outcome") == "failed"]
    lines += [f"eval: step {e['step']} job {e['job_id']} failed: {e['result'].get('error')}" for e in failed]
    return lines


def main(argv: Optional[List[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2 or argv[0] != "submit":
        print("usage: python -m launcher.evaljobs submit RUN_DIR", file=sys.stderr)
        return 2
    try:
        submit_queue(Path(argv[1]).resolve())
    except query.SlurmUnavailable as exc:  # the queue stays: the next poll tries again
        print(f"evaluations not submitted yet: {str(exc).splitlines()[0]}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
