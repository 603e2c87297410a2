"""Every call of a Slurm command the project makes from Python (sbatch, squeue, sacct,
scontrol, scancel, sinfo), batched where many jobs are asked about at once. srun, and
every call about a job from inside it (requeue, exclusion, cancel, its time limit), run
only in the batch scripts that submitit renders (:mod:`slurm.submitit_adapter`,
:mod:`slurm.request`): a job's tasks call no Slurm client.

Every call goes through :func:`_run`, so tests can count (or fake) the Slurm commands
a reader issues by replacing that one function.
"""
from __future__ import annotations

import os
import shutil
import subprocess
from typing import Dict, Iterable, List, Optional

SACCT_FIELDS = ("JobID", "State", "NNodes", "NodeList", "ExitCode", "Partition", "Elapsed")
# What status and report need from every segment of a job (one row per requeue with -D);
# JobName and Submit tell our job from a later job that got the same id.
HISTORY_FIELDS = ("JobID", "JobName", "State", "Submit", "Start", "End", "ExitCode", "NNodes", "NodeList",
                  "Partition", "Reason")
# squeue -o codes of the same fields (Submit is the last (re)queue time).
SQUEUE_FIELDS = (("JobID", "%i"), ("State", "%T"), ("JobName", "%j"), ("Submit", "%V"), ("NNodes", "%D"),
                 ("Reason", "%r"))


class SlurmUnavailable(RuntimeError):
    pass


def _run(cmd: List[str], env: Optional[Dict[str, str]] = None, timeout: float = 30) -> str:
    if shutil.which(cmd[0]) is None:
        raise SlurmUnavailable(f"{cmd[0]} not found on PATH")
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        raise SlurmUnavailable(f"{' '.join(cmd[:2])} did not answer within {timeout:.0f} s") from None
    if proc.returncode != 0:
        raise SlurmUnavailable(f"{' '.join(cmd[:2])} failed: {(proc.stderr or proc.stdout).strip()[:300]}")
    return proc.stdout


def ping(env: Optional[Dict[str, str]] = None, timeout: float = 10) -> None:
    """Raise SlurmUnavailable unless a controller answers."""
    out = _run(["scontrol", "ping"], env=env, timeout=timeout)
    if "UP" not in out:
        raise SlurmUnavailable(out.strip() or "scontrol ping: no controller is UP")


def sacct(job_ids: Iterable[str], env: Optional[Dict[str, str]] = None) -> Dict[str, Dict[str, str]]:
    """Allocation-level accounting rows (``-X``) keyed by job id, in one call."""
    ids = [str(j) for j in job_ids]
    if not ids:
        return {}
    rows: Dict[str, Dict[str, str]] = {}
    for row in _sacct_rows(ids, SACCT_FIELDS, env):
        rows[row["JobID"]] = row  # -D lists every requeue; the last row is the newest
    return rows


def sacct_history(job_ids: Iterable[str], env: Optional[Dict[str, str]] = None) -> Dict[str, List[Dict[str, str]]]:
    """Every accounting row of many jobs (one per segment: ``-D`` keeps requeued ones), oldest first.

    A requeued segment's row carries the requeue time as Submit; the first row keeps the
    original submission time. Rows of an older job that had the same id come first too.
    """
    ids = sorted({str(j) for j in job_ids})
    if not ids:
        return {}
    rows: Dict[str, List[Dict[str, str]]] = {}
    for row in _sacct_rows(ids, HISTORY_FIELDS, env):
        rows.setdefault(row["JobID"], []).append(row)
    for segments in rows.values():
        segments.sort(key=lambda r: r["Submit"])  # ISO timestamps sort as text
    return rows


ACCOUNTING_FIELDS = ("JobID", "State", "Elapsed", "ExitCode", "MaxRSS", "NNodes", "NodeList")


def job_accounting(job_id: str, env: Optional[Dict[str, str]] = None) -> Dict[str, str]:
    """One job's end as sacct tells it (empty when unknown): the newest segment's state,
    elapsed time, exit code, nodes, the largest MaxRSS of its steps (MaxRSS is kept per
    step, so this asks without ``-X``) and how many segments (requeues + 1) it ran."""
    out = _run(["sacct", "-n", "-P", "-D", "-j", str(job_id), "-o", ",".join(ACCOUNTING_FIELDS)], env=env)
    rows = [dict(zip(ACCOUNTING_FIELDS, line.split("|"))) for line in out.splitlines()
            if len(line.split("|")) == len(ACCOUNTING_FIELDS)]
    jobs = [r for r in rows if r["JobID"] == str(job_id)]
    if not jobs:
        return {}
    result = dict(jobs[-1], segments=str(len(jobs)))
    rss = [_bytes(r["MaxRSS"]) for r in rows if r["MaxRSS"]]
    result["MaxRSS"] = max(rss, key=lambda pair: pair[0])[1] if rss else ""
    return result


def _bytes(text: str) -> tuple:
    """("512K" -> (524288, "512K")): sacct's sizes, comparable."""
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
    number = text.rstrip("KMGT")
    try:
        return float(number) * scale.get(text[-1:], 1), text
    except ValueError:
        return 0.0, text


def _sacct_rows(ids: List[str], fields: Iterable[str], env: Optional[Dict[str, str]]):
    fields = tuple(fields)
    out = _run(["sacct", "-X", "-n", "-P", "-D", "-j", ",".join(ids), "-o", ",".join(fields)], env=env)
    for line in out.splitlines():
        parts = line.split("|")
        if len(parts) == len(fields):
            yield dict(zip(fields, parts))


def squeue_jobs(job_ids: Iterable[str], env: Optional[Dict[str, str]] = None) -> Dict[str, Dict[str, str]]:
    """Job id -> {State, JobName, Submit, NNodes, Reason} for jobs still in the queue, in one call.

    ``-r`` lists array tasks one per line. A list of only finished ids is no error here:
    squeue exits 1 with "Invalid job id specified" for it, which means "none queued".
    """
    ids = sorted({str(j) for j in job_ids})
    if not ids:
        return {}
    fmt = "|".join(code for _, code in SQUEUE_FIELDS)
    try:
        out = _run(["squeue", "-h", "-r", "-j", ",".join(ids), "-o", fmt], env=env)
    except SlurmUnavailable as exc:
        if "Invalid job id" in str(exc):
            return {}
        raise
    jobs: Dict[str, Dict[str, str]] = {}
    for line in out.splitlines():
        parts = line.strip().split("|")
        if len(parts) == len(SQUEUE_FIELDS):
            row = dict(zip((name for name, _ in SQUEUE_FIELDS), parts))
            jobs[row["JobID"]] = row
    return jobs


def squeue(job_ids: Iterable[str], env: Optional[Dict[str, str]] = None) -> Dict[str, str]:
    """Job id -> state for the jobs still known to the controller, in one call."""
    return {job: row["State"] for job, row in squeue_jobs(job_ids, env).items()}


def scancel(job_ids: Iterable[str], env: Optional[Dict[str, str]] = None) -> None:
    """Cancel many jobs for good: one ``scontrol update Requeue=0`` and one scancel call.

    scancel's SIGTERM reaches the trainer's preemption path (train.harness.preempt), which saves
    and may have its batch script run ``scontrol requeue`` (slurm/request.py); Slurm requeues
    even a cancelled batch job, so without disabling requeue first a cancelled point would
    come back and run to the end.
    """
    ids = sorted({str(j) for j in job_ids})
    if not ids:
        return
    try:
        _run(["scontrol", "update", f"JobId={','.join(ids)}", "Requeue=0"], env=env)
    except SlurmUnavailable:
        pass  # e.g. one job just ended: cancelling the rest still matters more
    _run(["scancel", *ids], env=env)


def partition_nodes(partition: str, env: Optional[Dict[str, str]] = None) -> int:
    """Number of nodes in a partition (one sinfo call); SlurmUnavailable if it does not exist."""
    out = _run(["sinfo", "-h", "-p", partition, "-o", "%D"], env=env).split()
    if not out:
        raise SlurmUnavailable(f"partition {partition!r} does not exist")
    return sum(int(x) for x in out if x.isdigit())


def sbatch(script: str, env: Optional[Dict[str, str]] = None) -> str:
    """Submit a batch script file; the job id (an array's id for a job array)."""
    return _run(["sbatch", "--parsable", script], env=env).strip().split(";")[0]


def job_fields(job_id: str, env: Optional[Dict[str, str]] = None) -> Dict[str, str]:
    """``scontrol show job -o JOB``'s plain fields (JobState, NumNodes, NodeList, ...);
    SlurmUnavailable when Slurm does not know the job."""
    return parse_job_fields(_run(["scontrol", "show", "job", "-o", str(job_id)], env=env))


def slurm_env(slurm_conf: Optional[str]) -> Dict[str, str]:
    env = dict(os.environ)
    if slurm_conf:
        env["SLURM_CONF"] = slurm_conf
    return env


# Node states (sinfo %t) a requeued job cannot be placed on.
UNUSABLE_STATES = ("down", "drain", "drng", "fail", "maint", "futr", "inval", "npc", "pow")


def parse_job_fields(out: str) -> Dict[str, str]:
    """``scontrol show job -o``'s KEY=VALUE fields of one job (the first of each key).
    Values with spaces (Command, Reason) may be cut: read plain fields only. Pure."""
    fields: Dict[str, str] = {}
    for token in out.split():
        key, sep, value = token.partition("=")
        if sep and key not in fields:
            fields[key] = value
    return fields


def parse_usable_nodes(out: str) -> Dict[str, str]:
    """Node -> its features from ``sinfo -h -N -o '%N|%t|%f'`` lines (other lines
    ignored), for the nodes whose state lets a job run there (not down, drained,
    failed...). Pure."""
    nodes: Dict[str, str] = {}
    for line in out.splitlines():
        parts = line.strip().split("|")
        if len(parts) == 3 and not parts[1].rstrip("*~#!%$@^-").startswith(UNUSABLE_STATES):
            nodes[parts[0]] = parts[2]
    return nodes


def unresponsive_nodes(nodes: Iterable[str], env: Optional[Dict[str, str]] = None) -> List[str]:
    """Those of ``nodes`` whose slurmd Slurm sees as down or not responding (sinfo's
    ``*`` suffix), or that are failing or drained; empty when Slurm does not answer (or a
    task has no sinfo: this is a refinement, train.harness.outcome.slurmd_down)."""
    names = sorted(set(nodes))
    if not names:
        return []
    try:
        out = _run(["sinfo", "-h", "-N", "-n", ",".join(names), "-o", "%N|%t"], env=env, timeout=15)
    except (SlurmUnavailable, OSError):
        return []
    bad = set()
    for line in out.splitlines():
        name, _, state = line.strip().partition("|")
        if state.endswith("*") or state.startswith(("down", "fail", "drain", "drng")):
            bad.add(name)
    return sorted(bad)
