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
   slurm.conf and requeue cap) become one job array, the others one job each.

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
    for num, p in points:
        code = prepare(session, p, queued.get(p.slurm_conf, {}))
        if code is not None:
            codes[num] = code
        elif p.cfg.launcher.dry_run:
            codes[num] = dry_run(p)
        elif p.cfg.cluster.backend != "slurm":  # local runs block, one after the other, as before
            codes[num] = start(session, p, wait=False)
            p.note_submitted()
        else:
            to_submit.append((num, p))
    for group in _groups(to_submit):
        codes.update(_submit_group(session, group))

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


def _submit_group(session: Session, group: List[Tuple[int, Point]]) -> Dict[int, int]:
    first = group[0][1]
    try:
        if len(group) == 1:
            job = submit.submit(first.cfg, first.layout, first.run_dir, first.slurm_conf, code=first.frozen)
            ids = [str(job.job_id)]
        else:
            ids = submit.submit_array(first.cfg, first.layout, [p.run_dir for _, p in group], first.slurm_conf,
                                      first.run_dir.parent, first.frozen)
    except Exception as exc:  # sbatch refused: these points are not submitted, the others go on
        reason = f"submission failed: {str(exc).strip().splitlines()[0][:300] if str(exc).strip() else exc!r}"
        for _, p in group:
            refuse(session, reason, p.run_dir, p.label, p.overrides, record=True)
        return {num: 1 for num, _ in group}
    for (_, p), job_id in zip(group, ids):
        submitted(session, p, job_id)
        p.note_submitted()
    return {num: 0 for num, _ in group}
