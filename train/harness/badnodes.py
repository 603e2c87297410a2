"""Automatic bad-node handling: requeue the job without the nodes a failure blames.

When a segment fails with a class that names nodes (run.json ``failure`` in
:data:`EXCLUDING_FAILURES`, the nodes in ``suspect_nodes``): a dead node (the surviving
ranks' heartbeats, :func:`train.harness.watchdog.classify_failure`), outlier or unhealthy
nodes in the preflight (``train.preflight_exclude=true``), or a crash whose own log names
a hardware fault of its node (:func:`train.harness.health.hardware_fault`), one rank of
the job (the first to claim it) requeues the job with those nodes excluded, while
requeues are left (``requeues_since_submit`` against ``cluster.max_requeues``, the same
count as preemptions) and enough usable nodes remain for the job:

1. ``config.yaml``'s ``cluster.exclude`` gets the nodes, so a later ``launcher.resume``
   (a new job) avoids them too;
2. run.json: ``status: requeued``, ``excluded_nodes`` (every node excluded so far),
   ``node_exclusions`` (one entry per automatic exclusion: nodes, reason, detail, job,
   segment, time), ``fault_requeues``; ``failure``, ``suspect_nodes`` and the rest of
   ``spec.rundir.SEGMENT_FAILURE`` stay until the next segment starts;
3. the request to the batch script (:func:`slurm.request.ask`, ``exclude``), which runs
   ``scontrol requeuehold``, ``update ExcNodeList``, ``release`` outside the task (Slurm
   changes ExcNodeList of pending jobs only; a container need not have Slurm's client)
   within a second, while a dead node's step still waits. The job keeps its id and run
   directory and resumes from its last committed checkpoint. A dead node holds the
   requeued job in COMPLETING until Slurm declares it DOWN (``SlurmdTimeout``): only then
   does it start. A requeue that fails there is written back to run.json (``failed``,
   ``requeue_error``).

Whether the job still fits without the nodes is read from what the batch script wrote
at the segment's start (``slurm_job.txt``: the job's node count and features, its
partition's usable nodes).

Otherwise the job ends as before (a dead node's job is cancelled so the survivors' nodes
are freed; ``python -m launcher.resume`` excludes the nodes) and run.json's
``auto_requeue`` says why it was not requeued.
"""
from __future__ import annotations

import dataclasses
import os
import re
import time
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, List, Optional

from slurm import request
from slurm.env import expand_hostlist
from spec.config import to_run_config, to_yaml
from spec.rundir import CONFIG, EXCLUDING_FAILURES, Status, read_run_json, update_run_json
from train.harness.node_facts import slurm_names

REQUEUED = "requeued"  # requeue_without_suspects: this rank requeued the job
ELSEWHERE = "elsewhere"  # another rank of this segment took it on


def plan_exclusion(info: Dict[str, Any], exclude: Optional[str], max_requeues: int) -> Optional[Dict[str, Any]]:
    """What an automatic requeue would exclude, from run.json ``info`` and the config's
    ``cluster.exclude``; None when the failure blames no node. Pure."""
    reason = EXCLUDING_FAILURES.get(info.get("failure") or "")
    bad = sorted(set(info.get("suspect_nodes") or []))
    if reason is None or not bad:
        return None
    excluded = set(expand_hostlist(exclude) if exclude else []) | set(info.get("excluded_nodes") or []) | set(bad)
    requeues = int(info.get("requeues_since_submit", 0) or 0) + 1
    return {"failure": info["failure"], "reason": reason, "nodes": bad, "excluded": sorted(excluded),
            "requeues": requeues, "capped": requeues > max_requeues}


def nodes_left(need: int, usable: Dict[str, str], excluded: Iterable[str], features: str = "") -> List[str]:
    """The usable nodes outside ``excluded`` that carry the job's feature (a plain
    ``--constraint`` word; anything more complex is not filtered on). Pure."""
    left = set(usable) - set(excluded)
    if features and features != "(null)" and re.fullmatch(r"[\w.-]+", features):
        left = {n for n in left if features in usable[n].split(",")}
    return sorted(left)


def shortfall(run_dir: Path, excluded: List[str]) -> Optional[str]:
    """Why the job could not run without ``excluded`` (too few usable nodes left in its
    partition, as the batch script saw them at the segment's start), None when it can or
    nothing says."""
    facts = request.job_facts(run_dir)
    if facts is None:
        return None
    need = int((facts.fields.get("NumNodes") or "0").split("-")[0] or 0)
    partition = facts.fields.get("Partition")
    if not need or not partition or not facts.usable:
        return None
    left = nodes_left(need, facts.usable, excluded, facts.fields.get("Features", ""))
    if len(left) >= need:
        return None
    return (f"only {len(left)} usable node(s) of partition {partition} left without {','.join(excluded)}; "
            f"the job needs {need}")


def claim(run_dir: Path, job: str) -> bool:
    """True for the first rank of this segment to ask (a file created exclusively)."""
    marks = Path(run_dir) / "heartbeat"
    marks.mkdir(parents=True, exist_ok=True)
    name = f".requeue-{job}-{os.environ.get('SLURM_RESTART_COUNT', '0') or '0'}"
    try:
        os.close(os.open(marks / name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))
    except FileExistsError:
        return False
    return True


def write_exclude(run_dir: Path, excluded: List[str]) -> None:
    """``cluster.exclude`` of the run's config.yaml := ``excluded`` (atomic)."""
    path = Path(run_dir) / CONFIG
    cfg = to_run_config(path)
    cfg = dataclasses.replace(cfg, cluster=dataclasses.replace(cfg.cluster, exclude=",".join(excluded)))
    tmp = path.with_name(f".{CONFIG}.{os.getpid()}.tmp")
    tmp.write_text(to_yaml(cfg))
    os.replace(tmp, path)


def requeue_without_suspects(run_dir: Path, log: Callable[[str], None], job: Optional[str]) -> Optional[str]:
    """After a failure was recorded: requeue ``job`` without the blamed nodes if the
    failure names some and the policy allows. :data:`REQUEUED`, :data:`ELSEWHERE`, else
    why not (None: the failure names no node, or not in a Slurm job)."""
    info = read_run_json(run_dir)
    if job is None or info.get("failure") not in EXCLUDING_FAILURES:
        return None
    cfg = to_run_config(Path(run_dir) / CONFIG)
    info["suspect_nodes"] = slurm_names(run_dir, info.get("suspect_nodes") or [])  # Slurm's names, not hostnames
    plan = plan_exclusion(info, cfg.cluster.exclude, cfg.cluster.max_requeues)
    if plan is None or cfg.cluster.backend != "slurm":
        return None
    if not claim(run_dir, job):
        return ELSEWHERE
    why = (f"requeue cap cluster.max_requeues={cfg.cluster.max_requeues} reached" if plan["capped"]
           else shortfall(run_dir, plan["excluded"]))
    if why:
        update_run_json(run_dir, auto_requeue=f"not requeued: {why}")
        log(f"{plan['reason']} on {', '.join(plan['nodes'])}: not requeued ({why})")
        return why
    write_exclude(run_dir, plan["excluded"])
    entry = {"nodes": plan["nodes"], "failure": plan["failure"], "reason": plan["reason"], "job_id": job,
             "segment": info.get("segments"), "time": time.time(), "error": info.get("error"),
             "detail": info.get("fault")}
    # run.json first: the batch script's requeue ends this process moments later.
    update_run_json(run_dir, status=Status.REQUEUED, excluded_nodes=plan["excluded"],
                    node_exclusions=list(info.get("node_exclusions") or []) + [entry],
                    requeues_since_submit=plan["requeues"], fault_requeues=int(info.get("fault_requeues", 0)) + 1,
                    last_interruption=plan["failure"], auto_requeue=f"requeued without {','.join(plan['nodes'])}")
    log(f"{plan['reason']} on {', '.join(plan['nodes'])}: requeueing job {job} without "
              f"{','.join(plan['excluded'])}")
    request.ask(run_dir, "exclude", f"{plan['reason']} on {','.join(plan['nodes'])}", plan["excluded"])
    return REQUEUED
