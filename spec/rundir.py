"""The run directory's small shared files: ``run.json`` and ``metrics.jsonl``.

Pure standard library; written by the launcher (submission) and by rank 0 of the job.
``run.json`` fields relied on outside the project: job_id, status, strategy, nodes,
world_size, hostnames (plus segments, run_dir, times). Writes are atomic (temp file +
rename) so a reader never sees half a file.
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any, Dict, List

RUN_JSON = "run.json"
METRICS = "metrics.jsonl"
CONFIG = "config.yaml"


def read_run_json(run_dir: str | Path) -> Dict[str, Any]:
    path = Path(run_dir) / RUN_JSON
    if not path.exists():
        return {}
    return json.loads(path.read_text())


def update_run_json(run_dir: str | Path, /, **fields: Any) -> Dict[str, Any]:
    """Merge ``fields`` into run.json atomically and return the new content."""
    path = Path(run_dir) / RUN_JSON
    data = read_run_json(run_dir)
    data.update(fields)
    data["updated_at"] = time.time()
    tmp = path.with_name(f".{RUN_JSON}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, path)
    return data


def append_metrics(run_dir: str | Path, row: Dict[str, Any]) -> None:
    """Append one row to metrics.jsonl (never overwrites earlier segments)."""
    with open(Path(run_dir) / METRICS, "a") as f:
        f.write(json.dumps(row) + "\n")
        f.flush()


def read_metrics(run_dir: str | Path) -> List[Dict[str, Any]]:
    path = Path(run_dir) / METRICS
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        line = line.strip()
        if line:
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:  # a torn last line after a kill
                continue
    return rows
