"""``python -m launcher.list [ROOT]``: every run and sweep under ROOT, one line each
(launcher/track/catalog.py). Runs are made on disk with spec.rundir's writers; Slurm is a
stand-in ``squeue`` on the PATH that notes each call; one real local run is listed by the
real command."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import REPO, launcher, run_dir_of
from warm import pythonpath
from launcher.track import catalog, registry
from spec.rundir import append_metrics, update_run_json

NOW = time.time()


def make_run(root: Path, rel: str, age_s: float, rows: int = 0, **fields) -> Path:
    """A run directory as the launcher and rank 0 leave it, last written ``age_s`` ago."""
    run_dir = root / rel
    run_dir.mkdir(parents=True, exist_ok=True)
    update_run_json(run_dir, **{"job_id": "local", "strategy": "ddp", "nodes": 1, "world_size": 2, **fields})
    for step in range(1, rows + 1):
        append_metrics(run_dir, {"step": step, "loss": 4.0 - step / 100, "tokens_per_s": 12000.0 + step})
    for name in ("run.json", "metrics.jsonl"):
        if (run_dir / name).exists():
            os.utime(run_dir / name, (NOW - age_s, NOW - age_s))
    return run_dir


@pytest.fixture
def root(tmp_path) -> Path:
    """Two single runs, one with a run.json of an older launcher (no steps: config.yaml's), a
    run elsewhere under ROOT (launcher.run_dir=), and a sweep of three points, one skipped."""
    global NOW
    NOW = time.time()  # ages are from now, not from when the module was imported
    root = tmp_path / "runs"
    make_run(root, "fresh-1111", 10, rows=40, status="running", steps=100, nodes=2, world_size=16, gpus_per_node=8,
             strategy="fsdp")
    old = make_run(root, "old-2222", 3 * 86400 + 5, rows=50, status="completed", world_size=4)
    (old / "config.yaml").write_text("model:\n  steps: 9\ntrain:\n  lr: 0.1\n  sched:\n    steps: 7\n  steps: 50\n")
    make_run(root, "team/exp/mine", 2 * 3600 + 5, status="failed", rows=3)
    sweep = root / "multirun" / "lr-3333"
    for point, (status, age_s) in enumerate([("completed", 300), ("requeued", 200)]):
        make_run(sweep, str(point), age_s, rows=5, status=status, strategy="zero3", steps=5)
        registry.record(sweep, str(point), "submitted", job_id="local", nodes=1, gpus_per_node=2, strategy="zero3")
    registry.record(sweep, "2", "skipped", reason="does not fit", strategy="zero3", nodes=4, time=NOW - 100)
    os.utime(sweep / registry.REGISTRY, (NOW - 100, NOW - 100))
    for rel in ("multirun/lr-3333/0/checkpoints/step_5", "logs/x", ".trash/y", "wandb/run-1"):  # not walked into
        make_run(root, rel, 1, status="running")
    return root


def listing(capsys, *args: str) -> tuple:
    code = catalog.main([str(a) for a in args])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_one_line_per_run_and_sweep_newest_first(root, capsys):
    code, out, err = listing(capsys, root, "--no-slurm")
    assert code == 0 and not err
    lines = out.splitlines()
    assert lines[0].split() == ["NAME", "STATUS", "STRATEGY", "NODES", "STEP", "LOSS", "TOKENS/S", "AGE", "JOB"]
    names = [line.split()[0] for line in lines[1:]]
    assert names == ["fresh-1111", "multirun/lr-3333", "0", "1", "2", "team/exp/mine", "old-2222"], out
    fresh, sweep, p0, p1, p2, mine, old = (line.split() for line in lines[1:])
    assert fresh[:7] == ["fresh-1111", "running", "fsdp", "2x8", "40/100", "3.6", "12,040"]  # local, writing
    assert re.fullmatch(r"1\ds", fresh[7]) and fresh[8] == "local"  # written 10 s ago
    assert sweep[:4] == ["multirun/lr-3333", "unknown", "sweep", "1m"]
    assert lines[2].endswith("  3 points: 1 completed, 1 skipped, 1 unknown")
    assert lines[3].startswith("  0 ") and p0[1:5] == ["completed", "zero3", "1x2", "5/5"]
    assert p1[1:3] == ["unknown", "(requeued)"] and p2[1:5] == ["skipped", "zero3", "4x?", "-"]
    assert old[1:5] == ["completed", "ddp", "1x4", "50/50"] and old[-2:] == ["3d", "local"]  # steps: config.yaml's
    assert mine[1] == "failed" and mine[4] == "3" and mine[-2] == "2h"  # no steps anywhere: the step alone


def test_filters_by_status_and_age(root, capsys):
    def names(*args):
        code, out, err = listing(capsys, root, "--no-slurm", *args)
        assert code == 0 and not err, err
        return [line.split()[0] for line in out.splitlines()[1:]]

    assert names("--status", "completed") == ["multirun/lr-3333", "0", "old-2222"]
    assert names("--status", "failed,skipped") == ["multirun/lr-3333", "2", "team/exp/mine"]
    assert names("--status", "failed", "--status", "unknown") == ["multirun/lr-3333", "1", "team/exp/mine"]
    assert names("--status", "requeued") == ["multirun/lr-3333", "1"]  # run.json's own word
    assert names("--status", "running") == ["fresh-1111"]  # an outcome word: the decided status (p1: requeued)
    assert names("--since", "4m") == ["fresh-1111", "multirun/lr-3333", "1", "2"]
    assert names("--since", "90s") == ["fresh-1111"]
    assert names("--since", "1d", "--status", "completed") == ["multirun/lr-3333", "0"]
    code, out, _ = listing(capsys, root, "--since", "1s", "--no-slurm")
    assert out == f"no runs under {root} match\n"


def test_json_has_stable_keys(root, capsys):
    code, out, err = listing(capsys, root, "--json", "--no-slurm")
    rows = json.loads(out)
    assert code == 0 and all(tuple(r) == catalog.KEYS for r in rows)
    by = {r["name"]: r for r in rows}
    assert [r["kind"] for r in rows] == ["run", "sweep", "point", "point", "point", "run", "run"]
    fresh = by["fresh-1111"]
    assert (fresh["status"], fresh["state"], fresh["step"], fresh["steps"], fresh["world_size"]) == \
        ("running", "RUNNING", 40, 100, 16)
    assert fresh["run_dir"] == str(root / "fresh-1111") and abs(fresh["age_s"] - 10) < 5
    assert by["multirun/lr-3333/1"]["sweep"] == "multirun/lr-3333"
    assert by["multirun/lr-3333"]["state"] == "3 points: 1 completed, 1 skipped, 1 unknown"
    assert by["old-2222"]["gpus_per_node"] == 4 and by["old-2222"]["loss"] == pytest.approx(3.5)


@pytest.mark.parametrize("args, named", [
    (["--status", "runing"], "--status runing"),
    (["--since", "2x"], "--since 2x"),
    (["--since=-3d"], "--since -3d"),
    (["nowhere"], "ROOT"),
    (["afile"], "ROOT"),
])
def test_bad_input_is_one_error_line_and_exit_2(tmp_path, capsys, monkeypatch, args, named):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "afile").write_text("")
    (tmp_path / "runs").mkdir()
    code, out, err = listing(capsys, *args)
    assert code == 2 and not out and len(err.splitlines()) == 1 and err.startswith(f"error: {named}"), err
    assert " use " in err or " pass " in err


def test_the_last_row_is_read_from_the_end(tmp_path):
    path = tmp_path / "metrics.jsonl"
    rows = [json.dumps({"step": s, "loss": 1.0, "note": "x" * 300}) for s in range(1, 200)]
    path.write_text("\n".join(rows) + "\n" + '{"step": 200, "lo')  # a torn last line after a kill
    assert catalog.last_row(str(path), path.stat().st_size)["step"] == 199
    path.write_text(json.dumps({"step": 1}) + "\n" + json.dumps({"step": 2, "note": "y" * 50000}) + "\n")
    assert catalog.last_row(str(path), path.stat().st_size)["step"] == 2  # longer than the first block
    path.write_text("not json\n")
    assert catalog.last_row(str(path), path.stat().st_size) == {}


# ---- Slurm: one squeue per Slurm configuration, decide() says where each run stands ------

def stand_in_squeue(tmp_path: Path, queue: str, exit_code: int = 0) -> Path:
    """``squeue`` and ``sacct`` first on the PATH: each call noted in ``calls``; squeue
    prints ``queue`` (JobID|State|JobName|Submit|NNodes|Reason lines, query.squeue's -o)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    calls = tmp_path / "calls"
    for name, body in (("squeue", f"cat <<'EOF'\n{queue}EOF\nexit {exit_code}\n"), ("sacct", "exit 1\n")):
        (bin_dir / name).write_text(f'#!/bin/sh\necho "{name} $*" >> "{calls}"\n{body}')
        (bin_dir / name).chmod(0o755)
    return bin_dir


def slurm_runs(root: Path) -> None:
    make_run(root, "lost", 5, status="running", job_id="200")  # ran, no longer queued
    make_run(root, "queued", 6, status="submitted", job_id="201")
    make_run(root, "back", 7, status="requeued", job_id="202")
    make_run(root, "done", 8, status="completed", job_id="203")  # ended: not asked
    for i in range(20):
        make_run(root / "many", f"r{i}", 100 + i, status="running", job_id=str(300 + i))


def test_one_squeue_call_decides_every_unfinished_slurm_run(tmp_path, capsys, monkeypatch):
    root = tmp_path / "runs"
    slurm_runs(root)
    queue = "201|PENDING|x|2024-01-01T00:00:00|1|Priority\n202|RUNNING|x|2024-01-01T00:00:00|1|None\n" + \
        "".join(f"{300 + i}|RUNNING|x|2024-01-01T00:00:00|1|None\n" for i in range(20))
    monkeypatch.setenv("PATH", f"{stand_in_squeue(tmp_path, queue)}{os.pathsep}{os.environ['PATH']}")
    code, out, err = listing(capsys, root, "--json")
    by = {r["name"]: r for r in json.loads(out)}
    assert code == 0 and not err
    assert (by["lost"]["status"], by["queued"]["status"], by["back"]["status"]) == ("failed", "pending", "running")
    assert by["done"]["status"] == "completed" and {by[f"many/r{i}"]["status"] for i in range(20)} == {"running"}
    calls = (tmp_path / "calls").read_text().splitlines()
    assert len(calls) == 1 and calls[0].startswith("squeue ") and "203" not in calls[0], calls
    code, out, _ = listing(capsys, root)
    assert "failed (not in squeue)" in next(line for line in out.splitlines() if line.startswith("lost "))
    assert "slurm:" not in out
    make_run(root, "other-cluster", 1, status="running", job_id="400", slurm_conf=str(tmp_path / "slurm.conf"))
    (tmp_path / "calls").unlink()
    listing(capsys, root)
    calls = (tmp_path / "calls").read_text().splitlines()
    assert len(calls) == 2 and sum(c.startswith("squeue -h -r -j 400 ") for c in calls) == 1  # one per slurm_conf


@pytest.mark.parametrize("how", ["--no-slurm", "absent", "unreachable"])
def test_without_slurm_run_json_decides_and_a_footer_says_so(tmp_path, capsys, monkeypatch, how):
    root = tmp_path / "runs"
    slurm_runs(root)
    bin_dir = stand_in_squeue(tmp_path, "squeue: error: unable to contact the controller\n",
                              exit_code=0 if how == "--no-slurm" else 1)
    if how == "absent":
        (bin_dir / "squeue").unlink()
        monkeypatch.setenv("PATH", str(bin_dir))
    else:
        monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    code, out, err = listing(capsys, root, *(["--no-slurm"] if how == "--no-slurm" else []))
    assert code == 0 and not err
    footer = out.splitlines()[-1]
    assert footer.startswith("slurm: not asked (") and "23 unfinished runs show run.json's status" in footer
    assert {"--no-slurm": "(--no-slurm)", "absent": "squeue not found on PATH",
            "unreachable": "unable to contact"}[how] in footer
    assert "unknown (running)" in next(line for line in out.splitlines() if line.startswith("lost "))
    calls = tmp_path / "calls"
    assert not calls.exists() if how != "unreachable" else len(calls.read_text().splitlines()) == 1


def test_the_real_command_lists_a_real_local_run(tmp_path):
    proc = launcher(["train.steps=2", "cluster.gpus_per_node=1", f"launcher.root={tmp_path / 'runs'}"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    run_dir = run_dir_of(proc.stdout)
    listed = subprocess.run([sys.executable, "-m", "launcher.list", str(tmp_path / "runs")], cwd=tmp_path,
                            env={**os.environ, "PYTHONPATH": pythonpath()}, capture_output=True, text=True, timeout=60)
    assert listed.returncode == 0 and not listed.stderr, listed.stderr
    header, line = listed.stdout.splitlines()
    cells = line.split()
    assert cells[0] == run_dir.name and cells[1:5] == ["completed", "ddp", "1x1", "2/2"], listed.stdout
    assert cells[-1] == "local" and float(cells[5]) > 0 and cells[7].endswith("s")


def test_a_local_run_that_stopped_writing_is_not_called_running(tmp_path, capsys):
    """run.json says running, but nothing of the run was written for an hour (a killed
    launcher leaves it so): unknown; a heartbeat written now makes it running again."""
    global NOW
    NOW = time.time()
    root = tmp_path / "runs"
    stale = make_run(root, "stale", 3600, rows=3, status="running")
    code, out, _ = listing(capsys, root, "--no-slurm")
    assert code == 0 and out.splitlines()[1].split()[1:3] == ["unknown", "(running)"], out
    (stale / "heartbeat").mkdir()
    (stale / "heartbeat" / "rank0.json").write_text("{}")
    code, out, _ = listing(capsys, root, "--no-slurm")
    assert out.splitlines()[1].split()[1] == "running", out
