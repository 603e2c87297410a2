"""A whole sweep in one process: compose every point, check them all, then submit.

Our Hydra launcher (``hydra_plugins/sto_sweep``, the default for ``-m``) hands every
point of the sweep here at once, instead of calling the task function once per point:

1. compose each point (``launcher.compose``: once per combination of config groups);
2. check each point as a single run is checked (``launch.checked``: schema, layout,
   strategy, Slurm reachable and partition large enough, asked once per process);
   an invalid point is skipped with its reason printed and recorded, the rest go on;
3. ask squeue once which earlier submissions of these points are still queued, then
   write each run directory (``launch.prepare``); dry runs and local runs go as before;
4. submit the Slurm points last, so that no job of this sweep competes for the CPU
   with its own submission: points whose sbatch parameters are identical (and same
   slurm.conf and requeue cap) become one job array, the others one job each;
5. with ``launcher.max_parallel=K``, Slurm itself holds the cap after the launcher exits
   (:func:`capped`): an array gets ``--array=...%K``, and jobs wait for earlier ones with
   ``--dependency=afterany:...`` so that no more than K points run at once.

Every submitted point prints ``submitted job <id> (<label>): ...`` and ``run_dir: ...``
and gets its registry line; an element of an array has the id ``ARRAY_TASK``.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

from launcher import submit
from launcher.launch import Point, Session, checked, dry_run, prepare, refuse, start, submitted
from launcher.compose import compose_points
from slurm import query
from slurm.states import ended, is_job_id
from spec.rundir import read_run_json, status_of


@dataclass
class Outcome:
    overrides: List[str]
    run_dir: Path
    code: int  # as the task function's: 0 submitted / nothing to do, 2 skipped, 1 failed


def launch(session: Session, master: Any, loader: Any, job_overrides: Sequence[Sequence[str]],
           first_num: int) -> List[Outcome]:
    dry = bool(master.launcher.dry_run)
    codes: Dict[int, int] = {}
    points: List[Tuple[int, Point]] = []
    composed = compose_points(master, loader, job_overrides, first_num)
    for c in composed:
        if c.error is not None:
            codes[c.num] = refuse(session, c.error, c.run_dir, c.label, c.overrides, record=not dry)
            continue
        p = checked(session, c.cfg, c.run_dir, c.label, c.overrides)
        if isinstance(p, int):
            codes[c.num] = p
        else:
            points.append((c.num, p))

    queued = _queued([p for _, p in points])
    to_submit: List[Tuple[int, Point]] = []
    dry_points: List[Tuple[int, Point]] = []
    for num, p in points:
        code = prepare(session, p, queued.get(p.slurm_conf, {}))
        if code is not None:
            codes[num] = code
        elif p.cfg.launcher.dry_run:
            codes[num] = dry_run(p)
            if p.cfg.cluster.backend == "slurm":
                dry_points.append((num, p))
        elif p.cfg.cluster.backend != "slurm":  # local runs block, one after the other, as before
            codes[num] = start(session, p, wait=False)
            p.note_submitted()
        else:
            to_submit.append((num, p))
    cap = int(master.launcher.max_parallel or 0)
    if dry and cap:
        print(cap_lines(_groups(dry_points), cap))
    groups = _groups(to_submit)
    stand_for: List[List[str]] = []  # per job: the job ids a later one waits for in its place
    for group, (waits, parallel) in zip(groups, capped([len(g) for g in groups], cap)):
        after = sorted({j for w in waits for j in stand_for[w]}, key=int)
        group_codes, ids = _submit_group(session, group, ":".join(after) or None, parallel)
        codes.update(group_codes)
        stand_for.append(sorted({j.split("_")[0] for j in ids}, key=int) or after)  # refused: what it waited for

    for c in composed:
        session.done(codes[c.num])
    return [Outcome(c.overrides, c.run_dir, codes[c.num]) for c in composed]


def _queued(points: List[Point]) -> Dict[Optional[str], Dict[str, str]]:
    """Per slurm.conf, squeue's answer (one call) for the points whose job may still be queued."""
    ids: Dict[Optional[str], List[str]] = {}
    for p in points:
        info = read_run_json(p.run_dir) if p.run_dir.is_dir() else {}
        job = str(info.get("job_id", ""))
        if p.cfg.cluster.backend == "slurm" and not ended(status_of(info)) and is_job_id(job):
            ids.setdefault(p.slurm_conf, []).append(job)  # as checks.already_done: requeued ones wait too
    answers: Dict[Optional[str], Dict[str, str]] = {}
    for conf, jobs in ids.items():
        try:
            answers[conf] = query.squeue(jobs, query.slurm_env(conf))
        except query.SlurmUnavailable:
            answers[conf] = {}  # as checks.already_done: when unsure, submit again
    return answers


def _groups(points: List[Tuple[int, Point]]) -> List[List[Tuple[int, Point]]]:
    """Points that can share one job array: the same sbatch script but for the folder."""
    groups: Dict[str, List[Tuple[int, Point]]] = {}
    for num, p in points:
        key = json.dumps([p.slurm_conf, p.cfg.cluster.max_requeues, submit.slurm_parameters(p.cfg, p.layout, p.frozen),
                          p.frozen.task_python() if p.frozen else None], sort_keys=True, default=str)
        groups.setdefault(key, []).append((num, p))
    return list(groups.values())


def capped(sizes: Sequence[int], cap: int) -> List[Tuple[List[int], Optional[int]]]:
    """For jobs of ``sizes`` points each (1: a job, more: an array), submitted in this
    order: the earlier jobs each waits for (``afterany``) and its arrays' ``%K``, so that
    Slurm runs at most ``cap`` points at once (0: no cap, nothing waits).

    K chains of jobs: a job takes the next chain in turn and waits for the chain's last
    job; an array takes every chain (it waits for the last job of each and runs up to
    ``cap`` elements at once), so the jobs after it wait for it."""
    if not cap:
        return [([], None) for _ in sizes]
    tails: List[Optional[int]] = [None] * cap
    turn = 0
    out: List[Tuple[List[int], Optional[int]]] = []
    for i, size in enumerate(sizes):
        if size == 1:
            slot = turn % cap
            turn += 1
            out.append(([tails[slot]] if tails[slot] is not None else [], None))
            tails[slot] = i
        else:
            out.append((sorted({t for t in tails if t is not None}), min(cap, size)))
            tails = [i] * cap
    return out


def cap_lines(groups: List[List[Tuple[int, Point]]], cap: int) -> str:
    """What the dry run shows of ``launcher.max_parallel``: each job (or array) of the
    sweep, its points and what it would wait for."""
    total = sum(len(g) for g in groups)
    lines = [f"launcher.max_parallel={cap}: at most {cap} of these {total} Slurm point(s) run at once"]
    for i, (group, (waits, parallel)) in enumerate(zip(groups, capped([len(g) for g in groups], cap))):
        points = ",".join(str(num) for num, _ in group)
        what = f"job array --array=0-{len(group) - 1}%{parallel}" if len(group) > 1 else "job"
        after = (" --dependency=afterany:" + ":".join(f"<job {j}>" for j in waits)) if waits else ""
        lines.append(f"  job {i}: point(s) {points}: {what}{after}")
    return "\n".join(lines)


def _submit_group(session: Session, group: List[Tuple[int, Point]], after: Optional[str] = None,
                  parallel: Optional[int] = None) -> Tuple[Dict[int, int], List[str]]:
    first = group[0][1]
    try:
        if len(group) == 1:
            job = submit.submit(first.cfg, first.layout, first.run_dir, first.slurm_conf, after=after,
                                code=first.frozen)
            ids = [str(job.job_id)]
        else:
            ids = submit.submit_array(first.cfg, first.layout, [p.run_dir for _, p in group], first.slurm_conf,
                                      first.run_dir.parent, first.frozen, after=after, parallel=parallel)
    except Exception as exc:  # sbatch refused: these points are not submitted, the others go on
        reason = f"submission failed: {str(exc).strip().splitlines()[0][:300] if str(exc).strip() else exc!r}"
        for _, p in group:
            refuse(session, reason, p.run_dir, p.label, p.overrides, record=True)
        return {num: 1 for num, _ in group}, []
    for (_, p), job_id in zip(group, ids):
        submitted(session, p, job_id)
        p.note_submitted()
    if after:
        print(f"starts after job(s) {after.replace(':', ', ')} (launcher.max_parallel={first.cfg.launcher.max_parallel})")
    return {num: 0 for num, _ in group}, ids
