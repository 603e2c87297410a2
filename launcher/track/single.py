"""One run, by its directory: ``launcher.status RUN_DIR``, ``launcher.cancel RUN_DIR``,
``launcher.logs RUN_DIR [--rank N] [--follow]``.

A run directory that is not a point of a sweep (no sweep registry beside it) is a single
run: its run.json says where it stands, Slurm's accounting (``sacct``: state, elapsed,
exit code, max RSS, nodes) says how its job ended, and its logs are the per-task files
submitit wrote (``slurm/JOB_RANK_log.out|err``) and the harness's ``logs/rank{R}.*``.
"""
from __future__ import annotations

import re
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional

from launcher import chain, evaljobs
from launcher.track import registry
from launcher.track.summary import summary_lines
from slurm import query
from slurm.states import ended, failed, is_job_id
from spec.rundir import LOGS, RUN_JSON, read_run_json, status_of

# submitit's per-task logs: JOB_RANK_log.out, or ARRAY_TASK_RANK_log.out for an array element.
_TASK_LOG = re.compile(r"^\d+(?:_\d+)?_(\d+)_log\.(out|err)$")


def is_single_run(path: Path) -> bool:
    return (path / RUN_JSON).is_file() and not registry.is_sweep(path.parent) and not registry.is_sweep(path)


def slurm_conf_of(info: Dict) -> Optional[str]:
    return info.get("slurm_conf")


def job_lines(info: Dict) -> List[str]:
    """Slurm's view of the run's job (one line), or nothing for a local run."""
    job = str(info.get("job_id", ""))
    if not is_job_id(job):
        return []
    try:
        acct = query.job_accounting(job, query.slurm_env(slurm_conf_of(info)))
    except query.SlurmUnavailable as exc:
        return [f"slurm: job {job}: accounting unavailable ({str(exc).splitlines()[0][:120]})"]
    if not acct:
        return [f"slurm: job {job}: not in the accounting yet"]
    rss = acct.get("MaxRSS") or "n/a"
    return [f"slurm: job {job} {acct['State']}  elapsed {acct['Elapsed']}  exit {acct['ExitCode']}  "
            f"max RSS {rss}  nodes {acct['NNodes']} ({acct['NodeList']})  segments {acct['segments']}"]


def failure_line(info: Dict) -> List[str]:
    if not failed(status_of(info)):
        return []
    kind = info.get("failure") or ("exit status" if "exited with status" in str(info.get("error", "")) else "other")
    extra = f"; suspect nodes {', '.join(info['suspect_nodes'])}" if info.get("suspect_nodes") else ""
    return [f"failure: {kind}{extra}"]


def status_main(run_dir: Path) -> int:
    info = read_run_json(run_dir)
    lines = summary_lines(run_dir)
    env = query.slurm_env(slurm_conf_of(info))
    then = chain.status_lines(info, env) if info.get("chain") else []
    then += evaljobs.status_lines(run_dir, env)  # eval.on_checkpoint's jobs, eval.jsonl's newest scores
    print("\n".join(lines[:-1] + job_lines(info) + failure_line(info) + then + lines[-1:]))
    return 0


def cancel_main(run_dir: Path) -> int:
    info = read_run_json(run_dir)
    job = str(info.get("job_id", ""))
    if not is_job_id(job):
        print(f"error: {run_dir} is a local run (job_id={job or 'none'}): stop it with Ctrl-C in its terminal",
              file=sys.stderr)
        return 2
    env = query.slurm_env(slurm_conf_of(info))
    # the run's job, and the checkpoint conversion a resume submitted before it (launcher.resume)
    name = registry.job_name_of(run_dir)
    conversion = str(info.get("conversion_job") or "")
    wanted = {job: name, **({conversion: f"{name}-convert" if name else None} if is_job_id(conversion) else {})}
    wanted.update({str(e["job_id"]): None for e in info.get("chain") or []})  # launcher.then's jobs
    wanted.update({j: None for j in evaljobs.in_flight(run_dir)})  # evaluations not ended
    try:
        queued = query.squeue_jobs(list(wanted), env)
        ours = [j for j, jname in wanted.items() if j in queued and (not jname or queued[j]["JobName"] == jname)]
        if not ours:
            print(f"{run_dir}: nothing to cancel (job {job} is not queued as ours: {status_of(info) or 'unknown'})")
            return 0
        query.scancel(ours, env)
    except query.SlurmUnavailable as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    for j in ours:
        print(f"cancelled job {j} ({queued[j]['State']}){' (checkpoint conversion)' if j == conversion else ''}")
    return 0


def log_files(run_dir: Path) -> Dict[int, List[Path]]:
    """rank -> its log files: submitit's task logs, then the harness's."""
    files: Dict[int, List[Path]] = {}
    for path in sorted((run_dir / "slurm").glob("*_log.*")):
        match = _TASK_LOG.match(path.name)
        if match:
            files.setdefault(int(match.group(1)), []).append(path)
    for path in sorted((run_dir / LOGS).glob("rank*.*")):
        match = re.match(r"^rank(\d+)\.(log|out)$", path.name)
        if match:
            files.setdefault(int(match.group(1)), []).append(path)
    return dict(sorted(files.items()))


def logs_main(run_dir: Path, rank: Optional[int], follow: bool, poll_s: float = 0.5) -> int:
    files = log_files(run_dir)
    if rank is not None:
        if rank not in files:
            print(f"error: --rank {rank}: {run_dir} has no logs of rank {rank} (ranks with logs: "
                  f"{', '.join(map(str, files)) or 'none yet'})", file=sys.stderr)
            return 2
        files = {rank: files[rank]}
    offsets: Dict[Path, int] = {}
    for r, paths in files.items():
        for path in paths:
            if len(files) > 1 or len(paths) > 1:
                print(f"== rank {r} ({path.relative_to(run_dir)}) ==")
            data = path.read_bytes()
            offsets[path] = len(data)
            sys.stdout.write(data.decode(errors="replace"))
    sys.stdout.flush()
    while follow:
        status = status_of(read_run_json(run_dir))
        time.sleep(poll_s)
        grew = False
        for r, paths in (log_files(run_dir) if rank is None else {rank: log_files(run_dir).get(rank, [])}).items():
            for path in paths:
                data = path.read_bytes()[offsets.get(path, 0):]
                if data:
                    offsets[path] = offsets.get(path, 0) + len(data)
                    sys.stdout.write(data.decode(errors="replace"))
                    grew = True
        sys.stdout.flush()
        if not grew and ended(status):
            break
    return 0
