"""Frozen code per run, end to end on the local Slurm cluster.

In a temporary clone of this repository (never the checkout the suite runs from), the
trainer's ``train/job.py`` gets a marker: every segment appends "MARK RESTART_COUNT" to
RUN_DIR/code_marker.txt. Two 1 x 1 runs are submitted with marker "A", one frozen (the
default) and one with ``launcher.snapshot=false``; once both train, the clone's file is
edited to mark "BB" and both jobs are preempted (USR2). The requeued segment of the frozen
run still marks "A" (it imports the copy made at submission); the unfrozen one marks "BB".
"""
from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from conftest import REPO, submit_run, wait_until
from spec.rundir import read_metrics, read_run_json

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

# 30 steps of >= 0.5 s: the first job to train must still be training when the other (it
# may start seconds later on a loaded machine) has trained 2 steps and both are signalled.
ARGS = ["+cluster=localslurm", "cluster.nodes=1", "cluster.gpus_per_node=1", "train.steps=30", "train.seq_len=32",
        "data.num_tokens=50000", "fault.step_delay_s=0.5"]
MARKER = """

# tests/test_frozen_code_slurm.py: which code a segment imported
_main_unmarked = main


def main(run_dir):
    import os

    with open(os.path.join(run_dir, "code_marker.txt"), "a") as f:
        f.write("{mark} " + os.environ.get("SLURM_RESTART_COUNT", "0") + "\\n")
    return _main_unmarked(run_dir)
"""


def mark(clone: Path, text: str, original: str) -> None:
    (clone / "train" / "job.py").write_text(original + MARKER.replace("{mark}", text))


def marks(run_dir: Path) -> list:
    path = run_dir / "code_marker.txt"
    return path.read_text().splitlines() if path.exists() else []


def final_status(run_dir: Path):
    status = read_run_json(run_dir).get("status")
    return status if status in ("completed", "failed", "stopped") else None


def test_a_requeued_segment_runs_the_code_frozen_at_submission(tmp_path, slurm_cluster):
    clone = (tmp_path / "clone").resolve()
    subprocess.run(["git", "clone", "-q", str(REPO), str(clone)], check=True)
    original = (clone / "train" / "job.py").read_text()
    mark(clone, "A", original)  # uncommitted: the working tree as it is gets frozen
    runs = {}
    for name, extra in (("frozen", []), ("live", ["launcher.snapshot=false"])):
        runs[name] = submit_run(ARGS + extra + [f"launcher.run_dir=runs/{name}"], clone, slurm_cluster, repo=clone)
    for job, run_dir in runs.values():
        wait_until(lambda: len(read_metrics(run_dir)) >= 2, 180, f"job {job} to train 2 steps")
    mark(clone, "BB", original)  # edited between two segments of both jobs
    for job, _ in runs.values():
        subprocess.run(["scancel", "--signal=USR2", job], env=slurm_cluster, check=True)
    for job, run_dir in runs.values():
        status = wait_until(lambda: final_status(run_dir), 240, f"job {job} to finish")
        info = read_run_json(run_dir)
        assert (status, info.get("preemptions"), info["segments"]) == ("completed", 1, 2), info

    frozen, live = (runs[name][1] for name in ("frozen", "live"))
    assert marks(frozen) == ["A 0", "A 1"] and marks(live) == ["A 0", "BB 1"]
    code = read_run_json(frozen)["code_snapshot"]
    copy = Path(code["python_path"])
    assert code["frozen"] and code["trees"][0]["source"] == str(clone) and copy.parent == clone / "runs" / ".code"
    assert (copy / "train" / "job.py").read_text() == original + MARKER.replace("{mark}", "A")
    assert read_run_json(live)["code_snapshot"] == {"frozen": False, "source": str(clone),
                                                    "why": "launcher.snapshot=false"}
