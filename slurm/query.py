"""Batched Slurm queries: one ``sacct`` / ``squeue`` call for many jobs."""
from __future__ import annotations

import os
import shutil
import subprocess
from typing import Dict, Iterable, List, Optional

SACCT_FIELDS = ("JobID", "State", "NNodes", "NodeList", "ExitCode", "Partition", "Elapsed")


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
    out = _run(["sacct", "-X", "-n", "-P", "-D", "-j", ",".join(ids), "-o", ",".join(SACCT_FIELDS)], env=env)
    rows: Dict[str, Dict[str, str]] = {}
    for line in out.splitlines():
        parts = line.split("|")
        if len(parts) != len(SACCT_FIELDS):
            continue
        row = dict(zip(SACCT_FIELDS, parts))
        rows[row["JobID"]] = row  # -D lists every requeue; the last row is the newest
    return rows


def squeue(job_ids: Iterable[str], env: Optional[Dict[str, str]] = None) -> Dict[str, str]:
    """Job id -> state for the jobs still known to the controller, in one call."""
    ids = [str(j) for j in job_ids]
    if not ids:
        return {}
    out = _run(["squeue", "-h", "-j", ",".join(ids), "-o", "%i|%T"], env=env)
    states = {}
    for line in out.splitlines():
        if "|" in line:
            job, state = line.strip().split("|", 1)
            states[job] = state
    return states


def slurm_env(slurm_conf: Optional[str]) -> Dict[str, str]:
    env = dict(os.environ)
    if slurm_conf:
        env["SLURM_CONF"] = slurm_conf
    return env
