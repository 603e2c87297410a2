"""Tier 4: a 2 x 2 sweep on the real local Slurm cluster -> status, report (CSV, Markdown,
PNG) checked against the metrics files and sacct; a point killed by scancel is reported
as failed with its class and the report still comes out."""
from __future__ import annotations

import csv
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import REPO, launcher
from warm import pythonpath
from launcher.track import report
from spec.rundir import read_metrics, read_run_json

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

# Two configurations that differ: two strategies where the parallelism work has landed.
SECOND = ["+strategy=ddp,fsdp"] if (REPO / "conf/strategy/fsdp.yaml").exists() else \
    ["+strategy=ddp", "train.micro_batch_size=4,8"]


def module(name, args, cwd, env, timeout=240):
    return subprocess.run([sys.executable, "-m", f"launcher.{name}", *args], cwd=cwd, capture_output=True, text=True,
                          env=dict(env, PYTHONPATH=pythonpath()), timeout=timeout)


def sweep_dir_of(proc) -> Path:
    dirs = {Path(line.split(": ", 1)[1]).parent for line in proc.stdout.splitlines() if line.startswith("run_dir: ")}
    assert len(dirs) == 1, proc.stdout + proc.stderr
    return dirs.pop()


def sacct_states(jobs, env):
    out = subprocess.run(["sacct", "-X", "-n", "-P", "-j", ",".join(jobs), "-o", "JobID,State"], env=env,
                         capture_output=True, text=True, check=True).stdout
    return dict(line.split("|", 1) for line in out.splitlines() if "|" in line)


def expected_throughput(run_dir: Path):
    """The report's documented rule, recomputed from metrics.jsonl: newest row per step,
    drop the first quarter (at least one step), total work / total time."""
    by_step = {r["step"]: r for r in read_metrics(run_dir)}
    rows = [by_step[s] for s in sorted(by_step)]
    steady = rows[max(1, len(rows) // 4):]
    time_s = sum(r["step_time_s"] for r in steady)
    return (sum(r["tokens_per_step"] for r in steady) / time_s,
            sum(r["global_batch_size"] for r in steady) / time_s, rows)


def test_sweep_report_status_and_a_cancelled_point(tmp_path, slurm_cluster, monkeypatch):
    env = slurm_cluster
    # Both sweeps go in first, so their jobs run side by side.
    # one rank a node: 1 and 2 GPUs a series, at half the CPU of two a node
    ok = launcher(["+cluster=localslurm", *SECOND, "cluster.nodes=1,2", "cluster.gpus_per_node=1", "train.steps=8", "-m"],
                  cwd=tmp_path, env=env, timeout=120)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    slow = launcher(["+cluster=localslurm", "cluster.nodes=1", "cluster.gpus_per_node=1", "train.steps=400",
                     "fault.step_delay_s=0.5", "-m"], cwd=tmp_path, env=env, timeout=120)
    assert slow.returncode == 0, slow.stdout + slow.stderr
    sweep, doomed = sweep_dir_of(ok), sweep_dir_of(slow)

    # Cancel the slow point once it trains, then wait for it as launcher.wait=true would.
    # It starts once the first sweep's points leave the pair's two nodes: a bound for a loaded
    # 2-core machine (seen: over 90 s in a full suite run), not a timing under test.
    deadline = time.time() + 360
    while not read_metrics(doomed / "0") and time.time() < deadline:
        time.sleep(0.5)
    assert read_metrics(doomed / "0"), f"the slow point never trained: {read_run_json(doomed / '0')}"
    cancel = module("cancel", [str(doomed), "0"], tmp_path, env)
    assert cancel.returncode == 0 and "cancelled job" in cancel.stdout, cancel.stdout + cancel.stderr
    monkeypatch.setenv("SLURM_CONF", env["SLURM_CONF"])
    assert report.wait_sweep(doomed, poll_s=0.5) == 1  # finished, not completed
    with open(doomed / "report.csv") as f:
        (failed,) = list(csv.DictReader(f))
    assert failed["outcome"] == "failed" and failed["state"] == "CANCELLED", failed
    assert failed["failure_class"] == "other" and "cancelled" in failed["failure_detail"]
    assert "failed (other)" in (doomed / "report.md").read_text()

    # The 2 x 2 sweep: wait, report, compare with metrics files and sacct.
    rep = module("report", [str(sweep), "--wait", "--poll", "1"], tmp_path, env)
    assert rep.returncode == 0, rep.stdout + rep.stderr
    assert all((sweep / name).is_file() for name in ("report.md", "report.csv", "scaling.png"))
    with open(sweep / "report.csv") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 4 and {r["outcome"] for r in rows} == {"completed"}, rows
    states = sacct_states([r["job_id"] for r in rows], env)
    for row in rows:
        run_dir = Path(row["run_dir"])
        tokens, samples, metrics = expected_throughput(run_dir)
        assert states[row["job_id"]] == row["state"] == "COMPLETED"
        assert int(row["gpus"]) == read_run_json(run_dir)["world_size"] == int(row["nodes"])
        assert float(row["tokens_per_s"]) == pytest.approx(tokens, rel=1e-6)
        assert float(row["samples_per_s"]) == pytest.approx(samples, rel=1e-6)
        assert float(row["tokens_per_s_per_gpu"]) == pytest.approx(tokens / int(row["gpus"]), rel=1e-6)
        assert int(row["global_batch"]) == metrics[-1]["global_batch_size"] and int(row["last_step"]) == 8
        assert float(row["peak_mem_gib_per_gpu"]) == pytest.approx(max(r["peak_mem_bytes"] for r in metrics) / 2**30)
        assert float(row["wall_s"]) > 0 and float(row["gpu_hours"]) > 0 and row["requeues"] == "0"
    for series in {r["series"] for r in rows}:
        small, big = sorted((r for r in rows if r["series"] == series), key=lambda r: int(r["gpus"]))
        assert small["efficiency"] == "1" and small["scaling"] == big["scaling"] == "weak"
        expected = float(big["samples_per_s"]) / (float(small["samples_per_s"]) * int(big["gpus"]) / int(small["gpus"]))
        assert float(big["efficiency"]) == pytest.approx(expected, rel=1e-6)

    png = sweep / "scaling.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    import matplotlib.image
    from PIL import Image

    height, width, _ = matplotlib.image.imread(png).shape
    assert width >= 800 and height >= 300
    with Image.open(png) as image:
        assert image.text["Series"].split("; ") == sorted({r["series"] for r in rows})

    stat = module("status", [str(sweep)], tmp_path, env)
    assert stat.returncode == 0 and "4 points: 4 completed" in stat.stdout, stat.stdout + stat.stderr
    assert all(r["job_id"] in stat.stdout for r in rows)
    newest = module("status", [], tmp_path, env)  # default: the newest sweep under runs/multirun
    assert newest.returncode == 0 and "points:" in newest.stdout, newest.stdout + newest.stderr
    assert os.path.basename(str(sweep)) in newest.stdout or os.path.basename(str(doomed)) in newest.stdout
