"""The hang watchdog: a rank that never reaches the step's collective is named."""
from __future__ import annotations

import json
import time

import pytest

from conftest import launcher, run_dir_of
from spec.rundir import read_run_json
from train.harness.watchdog import COLLECTIVE, Watchdog, classify_failure, stuck_ranks


def beat(rank, phase=COLLECTIVE, step=5):
    return {"rank": rank, "phase": phase, "step": step}


@pytest.mark.parametrize("beats,stuck", [
    ([beat(0), beat(1, "compute"), beat(2), beat(3)], [1]),           # never arrived
    ([beat(0), beat(1), beat(2, step=4), beat(3)], [2]),              # all waiting, one behind
    ([beat(0, "compute"), beat(1, "compute")], [0, 1]),               # nobody in a collective
    ([beat(0), beat(1)], [0, 1]),                                      # true deadlock: unknown
    ([], []),
])
def test_stuck_ranks(beats, stuck):
    assert stuck_ranks(beats) == stuck


def test_startup_gets_the_longer_timeout_until_the_first_step(tmp_path):
    """Build, restore and the first step's lazy init (communicators, compile) are slow: a
    loaded machine must not read them as a hang. After one step the plain timeout applies."""
    dog = Watchdog(tmp_path, rank=0, node=0, host="h", world_size=1, timeout_s=5, startup_timeout_s=15)
    assert dog.limit_s() == 15
    dog.begin(0)
    assert dog.limit_s() == 15
    dog.progress(1)
    assert dog.limit_s() == 5
    assert Watchdog(tmp_path, 0, 0, "h", 1, timeout_s=5, startup_timeout_s=2).limit_s() == 5  # never below


@pytest.mark.slow
def test_sleeping_rank_is_detected_and_named(tmp_path):
    t0 = time.time()
    proc = launcher(["train.steps=50", "cluster.gpus_per_node=2", "cluster.hang_timeout_s=4", "fault.hang_rank=1",
                     "fault.hang_at_step=3"], cwd=tmp_path, timeout=120)
    elapsed = time.time() - t0
    assert proc.returncode != 0
    run_dir = run_dir_of(proc.stdout)
    report = json.loads((run_dir / "hang.json").read_text())
    assert report["stuck_ranks"] == [1] and report["timeout_s"] == 4
    phases = {b["rank"]: b["phase"] for b in report["ranks"]}
    assert phases[0] == COLLECTIVE and phases[1].startswith("fault")
    info = read_run_json(run_dir)
    assert info["status"] == "failed" and info["failure"] == "hang" and "stuck ranks [1]" in info["error"]
    for rank in (0, 1):
        assert "in train" in (run_dir / "logs" / f"stack_rank{rank}.txt").read_text()
    assert elapsed < 60  # the job ended by itself, long before the 3600 s sleep


def test_heartbeats_follow_the_hang_timeout(tmp_path):
    """None without a watchdog; a sixtieth of the timeout, 1 to 30 s: a shared file system
    sees ranks/5 writes a second at the default 300 s, not one per rank."""
    from spec.cluster import heartbeat_interval

    assert [heartbeat_interval(t) for t in (0, 30, 300, 1200, 7200)] == [0.0, 1.0, 5.0, 20.0, 30.0]
    dog = Watchdog(tmp_path, 0, 0, "h", 1, timeout_s=0, interval_s=0).start()
    time.sleep(0.6)
    assert not (tmp_path / "heartbeat").exists()  # the thread runs for STACK_NOW alone
    dog.stop()
    assert classify_failure(tmp_path, 2, interval_s=0)["failure"] == "communication"


def test_a_later_segments_hang_replaces_the_earlier_report(tmp_path, monkeypatch):
    """hang.json tells of the newest hang: one writer per segment (a lock file each), the
    report replaced atomically; a second rank of the same segment leaves it as written."""
    import os

    exits = []
    monkeypatch.setattr(os, "_exit", lambda code: exits.append(code))
    (tmp_path / "hang.json").write_text(json.dumps({"detected_by": 9, "stuck_ranks": [9]}))  # segment 0's
    reports = []
    for rank in (1, 0):  # both ranks of segment 1 see the hang; rank 1 is first
        dog = Watchdog(tmp_path, rank, 0, "h", 2, timeout_s=5, interval_s=0.01, segment=1,
                       on_hang=reports.append)
        (tmp_path / "heartbeat").mkdir(exist_ok=True)
        dog._hang()
    assert exits == [75, 75] and len(reports) == 2
    report = json.loads((tmp_path / "hang.json").read_text())
    assert report["detected_by"] == 1 and report["stuck_ranks"] != [9]
    assert not list(tmp_path.glob("hang.json.*.tmp"))
