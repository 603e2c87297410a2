"""Tier 1: scaling arithmetic, failure classes, job-id reuse, report files and the
number of Slurm calls of status/cancel/wait, on fixed inputs with a fake Slurm."""
from __future__ import annotations

import csv
import re
import subprocess
import sys
import time

import pytest

from conftest import REPO
from launcher.track import cancel, registry, report, status
from launcher.track.scaling import classify, efficiency, point_metrics, scaling_kind, series_labels, stitch
from slurm import query
from spec.rundir import MetricsRow, append_metrics, update_run_json

NAME = "sto-tiny-ddp"


def stamp(t: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(t))


class FakeSlurm:
    """Stands in for slurm.query._run: answers squeue/sacct/scancel from tables, counts calls."""

    def __init__(self, acct=None, queue=None):
        self.acct = acct or {}    # job id -> list of {field: value} (HISTORY_FIELDS)
        self.queue = queue or {}  # job id -> {field: value} (SQUEUE_FIELDS)
        self.calls = []

    def __call__(self, cmd, env=None, timeout=30):
        self.calls.append(cmd[0])
        if cmd[0] == "sacct":
            return "".join("|".join(r.get(f, "") for f in query.HISTORY_FIELDS) + "\n"
                           for rows in self.acct.values() for r in rows)
        if cmd[0] == "squeue":
            return "".join("|".join(r.get(f, "") for f, _ in query.SQUEUE_FIELDS) + "\n" for r in self.queue.values())
        return ""


def acct_row(job, state, submit, start=None, end=None, name=NAME, exit_code="0:0"):
    return {"JobID": job, "JobName": name, "State": state, "Submit": stamp(submit),
            "Start": stamp(start) if start else "Unknown", "End": stamp(end) if end else "Unknown",
            "ExitCode": exit_code, "NNodes": "1", "NodeList": "node1", "Partition": "debug", "Reason": "None"}


def metric(step, samples_per_s, global_batch, world, segment=0, seq=64):
    step_time = global_batch / samples_per_s
    return {"step": step, "loss": 5.0, "samples_per_s": samples_per_s, "tokens_per_s": global_batch * seq / step_time,
            "step_time_s": step_time, "global_batch_size": global_batch, "tokens_per_step": global_batch * seq,
            "world_size": world, "peak_mem_bytes": 2**30, "mfu": None, "segment": segment, "time": 0.0}


def add_point(sweep, n, job, status_, nodes, gpn, rows, overrides=None, name=NAME, strategy="ddp"):
    run_dir = sweep / str(n)
    run_dir.mkdir(parents=True)
    (run_dir / "sbatch.sh").write_text(f"#!/bin/bash\n#SBATCH --job-name={name}\n")
    update_run_json(run_dir, job_id=job, status=status_, world_size=nodes * gpn, nodes=nodes, strategy=strategy)
    for row in rows:
        append_metrics(run_dir, MetricsRow.from_dict(row))
    registry.record(sweep, str(n), "submitted", overrides=overrides or ["+cluster=localslurm", f"cluster.nodes={nodes}"],
                    run_dir=str(run_dir), job_id=job, nodes=nodes, gpus_per_node=gpn, strategy=strategy)
    return run_dir


# --- arithmetic -------------------------------------------------------------------------

def test_efficiency_matches_the_seeds_example():
    # docs/scaling.md's example, 95.8%, is 46 / 48: 12 samples/s *per GPU* on 2 GPUs (24 in all),
    # 46 samples/s in all on 4 GPUs; equally 12 samples/s on 1 GPU and 46 on 4.
    assert round(efficiency(46, 4, 24, 2) * 100, 1) == 95.8
    assert round(efficiency(46, 4, 12, 1) * 100, 1) == 95.8
    # Read as 12 samples/s in all on 2 GPUs, its own formula gives 46 / 24 = 191.7%.
    assert round(efficiency(46, 4, 12, 2) * 100, 1) == 191.7
    assert efficiency(12, 2, 12, 2) == 1.0
    assert efficiency(24, 4, 12, 2) == 1.0              # linear
    assert efficiency(12, 4, 12, 2) == 0.5              # no gain from doubling
    assert efficiency(90, 16, 12, 2) == pytest.approx(90 / 96)
    assert efficiency(0, 4, 12, 2) is None and efficiency(46, 4, 0, 2) is None


def test_scaling_kind_weak_strong_mixed():
    assert scaling_kind([(2, 16), (4, 32), (8, 64)]) == "weak"     # per-rank batch fixed
    assert scaling_kind([(2, 32), (4, 32)]) == "strong"            # global batch fixed
    assert scaling_kind([(2, 16), (4, 24)]) == "mixed"
    assert scaling_kind([(2, 16)]) == "single size"


def test_stitch_keeps_the_newest_row_of_a_step_and_steady_skips_warmup():
    rows = [metric(s, 10.0, 16, 2) for s in (1, 2, 3)] + [metric(s, 20.0, 16, 2, segment=1) for s in (2, 3, 4)]
    stitched = stitch(rows)
    assert [r["step"] for r in stitched] == [1, 2, 3, 4]
    assert [r["segment"] for r in stitched] == [0, 1, 1, 1]
    m = point_metrics(rows)  # 4 rows: the first is warm-up; the rest run at 20 samples/s
    assert m["samples_per_s"] == pytest.approx(20.0) and m["last_step"] == 4 and m["segments"] == 2
    assert m["tokens_per_s"] == pytest.approx(20.0 * 64)


def test_throughput_is_total_work_over_total_time():
    rows = [metric(1, 1.0, 16, 2), metric(2, 10.0, 16, 2), metric(3, 30.0, 16, 2)]
    # steps 2 and 3: 32 samples in 1.6 + 0.533 s, not the mean of 10 and 30
    assert point_metrics(rows)["samples_per_s"] == pytest.approx(32 / (1.6 + 16 / 30))


def test_series_labels_name_what_varies_besides_size():
    overrides = [["+strategy=ddp", "cluster.nodes=1", "train.micro_batch_size=4"],
                 ["+strategy=ddp", "cluster.nodes=2", "train.micro_batch_size=8"]]
    assert series_labels(overrides, ["ddp", "ddp"]) == ["ddp micro_batch_size=4", "ddp micro_batch_size=8"]
    assert series_labels([["cluster.nodes=1"], ["cluster.nodes=2"]], ["fsdp", "fsdp"]) == ["fsdp", "fsdp"]


# --- failure classes --------------------------------------------------------------------

@pytest.mark.parametrize("state, text, info, expected", [
    ("OUT_OF_MEMORY", "", {}, "out of memory"),
    ("FAILED", "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB", {}, "out of memory"),
    ("FAILED", "RuntimeError: Connection reset by peer\ntorch.OutOfMemoryError: CUDA out of memory", {},
     "out of memory"),  # the cause wins over the peers' symptom
    ("TIMEOUT", "", {}, "time limit"),
    ("CANCELLED by 0", "slurmstepd: error: *** JOB 12 ON node1 CANCELLED AT 2025-01-01T00:00:00 DUE TO TIME LIMIT ***",
     {}, "time limit"),
    ("PREEMPTED", "", {}, "preempted"),
    ("COMPLETED", "", {"status": "stopped", "stop_reason": "requeue cap cluster.max_requeues=3 reached after timeout"},
     "time limit"),
    ("COMPLETED", "", {"status": "stopped", "stop_reason": "requeue cap cluster.max_requeues=3 reached after preemption"},
     "preempted"),
    ("NODE_FAIL", "", {}, "node failure"),
    ("FAILED", "[E ProcessGroupNCCL.cpp:475] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=9, "
               "OpType=ALLREDUCE) ran for 600030 milliseconds before timing out.", {}, "communication timeout"),
    ("FAILED", "", {"error": "DistNetworkError: failed to connect to node1:29517"}, "communication timeout"),
    ("CANCELLED by 0", "RuntimeError: Connection reset by peer", {}, "other"),  # the cancel caused it
    ("FAILED", "ValueError: bad value", {"error": "ValueError: bad value"}, "other"),
])
def test_classify(state, text, info, expected):
    klass, detail = classify(state, "1:0", text, info)
    assert klass == expected and detail


# --- status: job-id reuse and bounded queries --------------------------------------------

def test_job_id_reuse_is_detected(tmp_path):
    now = time.time()
    p = status.Point(point="0", event="submitted", overrides=[], job_id="7", submitted_at=now, job_name=NAME)
    ours = [acct_row("7", "REQUEUED", now - 2, now - 1, now + 5), acct_row("7", "COMPLETED", now + 10, now + 12, now + 20)]
    assert status.own_rows(p, ours) == ours and not p.reused
    older = [acct_row("7", "COMPLETED", now - 90000, now - 89000, now - 88000)]
    assert status.own_rows(p, older + ours) == ours and not p.reused      # a wrapped id's old job
    assert status.own_rows(p, [acct_row("7", "RUNNING", now + 3600, now + 3601)]) == [] and "reused" in p.reused
    p.reused = ""
    assert status.own_rows(p, [acct_row("7", "RUNNING", now - 2, now, name="someone-else")]) == []
    assert "someone-else" in p.reused
    p.reused = ""
    assert status.own_rows(p, [acct_row("7", "PENDING", now - 2, name="allocation")])  # dbd's name before start


def test_status_of_a_20_point_sweep_issues_two_slurm_queries(tmp_path, monkeypatch, capsys):
    sweep = tmp_path / "sweep"
    now = time.time()
    fake = FakeSlurm()
    for n in range(20):
        job = str(100 + n)
        add_point(sweep, n, job, "running" if n % 2 else "completed", 1 + n % 4, 2,
                  [metric(s, 10.0, 16, 2) for s in (1, 2, 3)])
        if n % 2:
            fake.queue[job] = {"JobID": job, "State": "RUNNING", "JobName": NAME, "Submit": stamp(now), "NNodes": "1",
                               "Reason": "None"}
        fake.acct[job] = [acct_row(job, "RUNNING" if n % 2 else "COMPLETED", now - 5, now - 4,
                                   None if n % 2 else now - 1)]
    monkeypatch.setattr(query, "_run", fake)
    assert status.main([str(sweep)]) == 0
    assert sorted(fake.calls) == ["sacct", "squeue"]
    out = capsys.readouterr().out
    assert "20 points: 10 completed, 10 running" in out and "RUNNING" in out


def test_cancel_issues_one_scancel_for_the_queued_points_only(tmp_path, monkeypatch, capsys):
    sweep, now, fake = tmp_path / "sweep", time.time(), FakeSlurm()
    for n in range(4):
        job = str(200 + n)
        add_point(sweep, n, job, "running", 1, 2, [])
        fake.acct[job] = [acct_row(job, "RUNNING", now - 5, now - 4)]
        fake.queue[job] = {"JobID": job, "State": "RUNNING", "JobName": NAME, "Submit": stamp(now), "NNodes": "1",
                           "Reason": "None"}
    scancels = []
    fake_run = fake.__call__

    def run(cmd, env=None, timeout=30):
        if cmd[0] == "scancel":
            scancels.append(cmd[1:])
        return fake_run(cmd, env, timeout)

    monkeypatch.setattr(query, "_run", run)
    assert cancel.main([str(sweep), "1", "3"]) == 0
    # one squeue + one sacct to find the jobs, one update to stop them requeueing, one scancel
    assert scancels == [["201", "203"]] and fake.calls.count("scancel") == 1 and len(fake.calls) == 4
    assert fake.calls.count("scontrol") == 1
    assert cancel.main([str(sweep), "9"]) == 2
    assert capsys.readouterr().err.strip().startswith("error: ") and len(scancels) == 1
    # one point's directory cancels that point alone, not its whole sweep
    assert cancel.main([str(sweep / "2")]) == 0
    assert scancels[-1] == ["202"] and "point 2: cancelled job 202" in capsys.readouterr().out
    assert cancel.main([str(sweep / "2"), "3"]) == 2 and len(scancels) == 2
    assert "point 2 of the sweep" in capsys.readouterr().err


def test_user_errors_are_one_line_exit_2(tmp_path, capsys):
    for main in (status.main, report.main):
        assert main([str(tmp_path / "missing")]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("error: ") and "\n" not in err and "sweep directory" in err


# --- report files -----------------------------------------------------------------------

def build_sweep(root):
    """2 GPUs at 24 samples/s; 4 GPUs at 46 samples/s over two segments; one OOM; one skipped."""
    sweep, now, fake = root / "sweep", time.time(), FakeSlurm()
    add_point(sweep, 0, "300", "completed", 1, 2, [metric(s, 24.0, 16, 2) for s in range(1, 9)])
    fake.acct["300"] = [acct_row("300", "COMPLETED", now - 60, now - 58, now - 40)]
    first = [metric(s, 46.0 if s <= 3 else 1.0, 32, 4) for s in range(1, 6)]  # steps 4, 5 ran again after requeue
    add_point(sweep, 1, "301", "completed", 2, 2, first + [metric(s, 46.0, 32, 4, segment=1) for s in range(4, 9)])
    fake.acct["301"] = [acct_row("301", "REQUEUED", now - 60, now - 58, now - 40, exit_code="0:15"),
                        acct_row("301", "COMPLETED", now - 38, now - 35, now - 5)]
    oom = add_point(sweep, 2, "302", "failed", 4, 2, [])
    (oom / "logs").mkdir()
    (oom / "logs" / "rank3.log").write_text("step 1\ntorch.OutOfMemoryError: CUDA out of memory.\n")
    fake.acct["302"] = [acct_row("302", "FAILED", now - 60, now - 50, now - 45, exit_code="1:0")]
    registry.record(sweep, "3", "skipped", overrides=["+cluster=localslurm", "cluster.nodes=8"],
                    run_dir=str(sweep / "3"), reason="tensor_parallel=4 exceeds gpus_per_node=2")
    return sweep, fake


def test_report_files_from_synthetic_run_dirs(tmp_path, monkeypatch):
    sweep, fake = build_sweep(tmp_path)
    monkeypatch.setattr(query, "_run", fake)
    assert report.main([str(sweep)]) == 0
    assert sorted(fake.calls) == ["sacct", "squeue"]
    with open(sweep / "report.csv") as f:
        rows = {r["point"]: r for r in csv.DictReader(f)}
    assert list(rows) == ["0", "1", "2", "3"]
    base, big = rows["0"], rows["1"]
    assert float(base["samples_per_s"]) == pytest.approx(24.0) and float(big["samples_per_s"]) == pytest.approx(46.0)
    assert float(big["tokens_per_s"]) == pytest.approx(46.0 * 64)
    assert float(big["tokens_per_s_per_gpu"]) == pytest.approx(46.0 * 64 / 4)
    assert float(big["efficiency"]) == pytest.approx(46 / 48) and big["scaling"] == "weak"
    assert base["efficiency"] == "1" and big["baseline_point"] == "0"
    assert big["requeues"] == "1" and big["last_step"] == "8"
    assert float(big["queue_s"]) == pytest.approx(5, abs=1.01) and float(big["wall_s"]) == pytest.approx(48, abs=2.01)
    assert float(big["gpu_hours"]) == pytest.approx(float(big["wall_s"]) * 4 / 3600)
    assert float(big["peak_mem_gib_per_gpu"]) == pytest.approx(1.0)
    assert rows["2"]["outcome"] == "failed" and rows["2"]["failure_class"] == "out of memory"
    assert rows["2"]["efficiency"] == "" and rows["3"]["outcome"] == "skipped"
    md = (sweep / "report.md").read_text()
    assert "95.8%" in md and "weak scaling, baseline point 0" in md
    assert "failed (out of memory)" in md and "tensor_parallel=4 exceeds" in md
    from PIL import Image

    with Image.open(sweep / "scaling.png") as png:
        assert png.format == "PNG" and png.size[0] > 400 and png.text["Series"] == "ddp"


def test_wait_sweep_returns_1_when_a_point_failed_and_writes_the_report(tmp_path, monkeypatch, capsys):
    sweep, fake = build_sweep(tmp_path)
    monkeypatch.setattr(query, "_run", fake)
    assert report.wait_sweep(sweep, poll_s=0) == 1
    assert "scaling report" in capsys.readouterr().out and (sweep / "report.csv").exists()
    fake.acct.pop("302")
    (sweep / "registry.jsonl").write_text("".join(line + "\n" for line in (sweep / "registry.jsonl").read_text()
                                                  .splitlines() if '"point": "2"' not in line))
    assert report.wait_sweep(sweep, poll_s=0) == 0  # every submitted point completed; skipped ones do not count


def test_readers_import_no_torch():
    for module in ("launcher.track.status", "launcher.track.report", "launcher.track.cancel", "launcher.track.progress"):
        proc = subprocess.run([sys.executable, "-X", "importtime", "-c", f"import {module}"], capture_output=True,
                              text=True, cwd=REPO)
        assert proc.returncode == 0, proc.stderr
        imported = re.findall(r"\|\s+(torch|matplotlib)(?:\.\S+)?\s*$", proc.stderr, re.M)
        assert not imported, f"{module} imports {set(imported)} at module level"
