"""Checkpoints on CPU without Slurm: atomic commit, kill during save, corruption, resume."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from conftest import REPO, run_dir_of
from helpers import assert_committed, assert_same_state
# Forked from one process that imported torch once (tests/warm.py); the signal test starts
# the launcher for real (it finds the ranks by their command line).
from warm import launcher, pythonpath
from train.checkpoint import find_latest, verify
from spec.rundir import read_metrics, read_run_json

pytestmark = pytest.mark.slow
# save_final=false: the periodic saves alone (steps 4 and 8; the default would also save step 12)
BASE = ["train.steps=12", "train.seq_len=32", "data.num_tokens=50000", "checkpoint.every_steps=4",
        "checkpoint.save_final=false"]


def by_step(run_dir):
    """Loss per step; a step logged again after a resume keeps its newest value."""
    return {r["step"]: r["loss"] for r in read_metrics(run_dir)}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    work = tmp_path_factory.mktemp("ref")
    proc = launcher(BASE, cwd=work)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return run_dir_of(proc.stdout)


def test_periodic_checkpoints_are_committed_and_pruned(reference):
    root = reference / "checkpoints"
    assert sorted(p.name for p in root.glob("step_*")) == ["step_00000004", "step_00000008"]  # keep=2
    assert (root / "latest").read_text().strip() == "step_00000008"
    assert not list(root.glob(".tmp-*"))
    assert_committed(root)


def test_kill_during_save_keeps_previous_and_resumes_exactly(tmp_path, reference):
    run_dir = tmp_path / "run"
    killed = launcher(BASE + ["fault.kill_in_save_at_step=8", f"launcher.run_dir={run_dir}"], cwd=tmp_path)
    assert killed.returncode != 0
    root = run_dir / "checkpoints"
    assert (root / "latest").read_text().strip() == "step_00000004"
    assert (root / ".tmp-step_00000008").is_dir() and not (root / "step_00000008").exists()
    again = launcher(BASE + [f"launcher.run_dir={run_dir}"], cwd=tmp_path)
    assert again.returncode == 0, again.stdout + again.stderr
    assert "resumed from step 4" in (run_dir / "logs" / "rank0.log").read_text()
    assert not list(root.glob(".tmp-*"))  # the killed save's files: removed, never loaded
    assert by_step(run_dir) == by_step(reference)  # bitwise: fp32 on CPU
    segments = [r["segment"] for r in read_metrics(run_dir)]
    assert segments[0] == 0 and segments[-1] == 1


def test_rank1_share_of_the_checksums_is_verified_on_resume(tmp_path, reference):
    """On resume each rank checksums its share of the files (its own DCP file as it loads
    it); a byte flipped in a tensor of the file rank 1 verifies makes every rank skip that
    checkpoint (here the only one: the run starts over, with the model built again since
    the load had read part of it) and the run still ends equal to the uninterrupted one."""
    from train.checkpoint.manifest import share as _share

    run_dir = tmp_path / "run"
    killed = launcher(BASE + ["fault.kill_in_save_at_step=8", f"launcher.run_dir={run_dir}"], cwd=tmp_path)
    assert killed.returncode != 0
    ckpt = run_dir / "checkpoints" / "step_00000004"
    files = [ckpt / rel for rel in json.loads((ckpt / "COMMITTED").read_text())["files"]]
    theirs = _share(files, 1, 2)
    assert theirs and not set(theirs) & set(_share(files, 0, 2))
    victim = max(theirs, key=lambda p: p.stat().st_size)
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))
    again = launcher(BASE + [f"launcher.run_dir={run_dir}"], cwd=tmp_path)
    assert again.returncode == 0, again.stdout + again.stderr
    log = (run_dir / "logs" / "rank0.log").read_text()
    rel = victim.relative_to(ckpt)
    assert f"checkpoint step_00000004 ignored: checksum mismatch in {rel}" in log
    assert "resumed from step" not in log
    assert "building the model again" in log
    assert by_step(run_dir) == by_step(reference)


def test_truncated_or_corrupt_checkpoint_is_skipped(tmp_path, reference):
    import shutil

    root = tmp_path / "checkpoints"
    shutil.copytree(reference / "checkpoints", root)
    newest = root / "step_00000008"
    shard = sorted((newest / "dcp").glob("*.distcp"))[0]
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2])
    reports = []
    assert find_latest(root, reports.append) == root / "step_00000004"
    assert "truncated file dcp/" in reports[0]
    shard.write_bytes(bytes([data[0] ^ 0xFF]) + data[1:])  # same size, one byte flipped
    assert "checksum mismatch" in verify(newest)
    (newest / "COMMITTED").unlink()
    assert verify(newest) == "no commit marker"


def test_signal_interrupts_and_rerun_resumes(tmp_path, reference):
    args = BASE + ["fault.step_delay_s=0.3", "checkpoint.every_steps=0"]
    env = dict(os.environ, PYTHONPATH=pythonpath())
    proc = subprocess.Popen([sys.executable, "-m", "launcher", *args], cwd=tmp_path, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    run_dir = None
    deadline = time.time() + 120
    while time.time() < deadline:
        runs = list((tmp_path / "runs").glob("*/metrics.jsonl"))
        if runs and len(runs[0].read_text().splitlines()) >= 3:
            run_dir = runs[0].parent
            break
        time.sleep(0.1)
    assert run_dir is not None, "the run never logged 3 steps"
    pids = subprocess.run(["pgrep", "-f", "--", f"-m train {run_dir}"], capture_output=True, text=True).stdout.split()
    assert len(pids) == 2
    for pid in pids:
        os.kill(int(pid), signal.SIGUSR2)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 1, out  # interrupted, not completed
    info = read_run_json(run_dir)
    assert info["status"] == "interrupted" and info["preemptions"] == 1
    stopped_at = max(r["step"] for r in read_metrics(run_dir))
    assert 3 <= stopped_at < 12
    again = launcher(args, cwd=tmp_path)  # the same command resumes the run
    assert again.returncode == 0 and run_dir_of(again.stdout) == run_dir, again.stdout + again.stderr
    assert f"resumed from step {stopped_at}" in (run_dir / "logs" / "rank0.log").read_text()
    assert by_step(run_dir) == by_step(reference)
    assert read_run_json(run_dir)["status"] == "completed" and read_run_json(run_dir)["segments"] == 2


def test_async_save_commits_and_does_not_change_training(tmp_path, reference):
    # The checkpoint thread lags: the training thread reaches the next optimizer step
    # before the snapshot is taken, and goes on past it before the snapshot is written.
    proc = launcher(BASE + ["checkpoint.async_save=true", "fault.slow_async_save_s=0.5"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    run_dir = run_dir_of(proc.stdout)
    root = run_dir / "checkpoints"
    assert sorted(p.name for p in root.glob("step_*")) == ["step_00000004", "step_00000008"]
    assert_committed(root)
    assert by_step(run_dir) == by_step(reference)
    # after step 1, in the background; the copy it makes is never saved (checked below)
    assert "host buffers for async saves: being allocated" in (run_dir / "logs" / "rank0.log").read_text()
    # The snapshot is copied in the background while the next step trains: it must be the
    # state of the step saved, equal to the blocking save's, tensor for tensor.
    for step in ("step_00000004", "step_00000008"):
        assert_same_state(root / step, reference / "checkpoints" / step, tmp_path)


def test_checkpoint_on_demand(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "SAVE_NOW").touch()  # requested before the first step: saved after step 1
    proc = launcher(["train.steps=3", "train.seq_len=32", "data.num_tokens=50000", f"launcher.run_dir={run_dir}"],
                    cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert [p.name for p in (run_dir / "checkpoints").glob("step_*")] == ["step_00000001"]
    assert not (run_dir / "SAVE_NOW").exists()
