"""The run registry of a sweep: ``SWEEP_DIR/registry.jsonl``, one line per event.

Each point of a multirun appends what happened to it (submitted with its job id, skipped
with the reason, found already completed or queued). Readers (status, cancel, report)
take the newest line per point. Lines are appended under a file lock, so concurrent
launchers writing the same sweep do not interleave.
"""
from __future__ import annotations

import fcntl
import json
import re
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

from spec.rundir import REGISTRY  # noqa: F401  (re-exported: the sweep's file name)


def record(sweep_dir: Path, point: str, event: str, **fields: Any) -> None:
    sweep_dir.mkdir(parents=True, exist_ok=True)
    row = {"point": point, "event": event, "time": time.time(), **fields}
    with open(sweep_dir / REGISTRY, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        f.write(json.dumps(row) + "\n")
        f.flush()


def is_sweep(path: Path) -> bool:
    return (Path(path) / REGISTRY).is_file()


def is_point(path: Path) -> bool:
    """One point's directory of a sweep (``SWEEP_DIR/1``), not a sweep itself."""
    return not is_sweep(path) and is_sweep(Path(path).parent)


def read(sweep_dir: Path) -> List[Dict[str, Any]]:
    """Newest entry per point, in point order; each entry keeps its whole history in ``history``."""
    path = Path(sweep_dir) / REGISTRY
    if not path.exists():
        return []
    points: Dict[str, Dict[str, Any]] = {}
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        history = points.get(row["point"], {}).get("history", [])
        points[row["point"]] = {**row, "history": history + [row]}
    return [points[k] for k in sorted(points, key=lambda p: (len(p), p))]


def job_name_of(run_dir: Optional[Path]) -> Optional[str]:
    """The job name in a run's ``sbatch.sh`` (status and cancel take a job id for ours only
    when Slurm's record of it has this name: ids are reused)."""
    try:
        match = re.search(r"^#SBATCH --job-name=(\S+)", (run_dir / "sbatch.sh").read_text(), re.M)
    except (OSError, TypeError):
        return None
    return match.group(1) if match else None
