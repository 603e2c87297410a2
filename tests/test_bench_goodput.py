"""bench/goodput.py's fault mode reads its phases from the product's own lines
(bench/goodput_faults.py): checked here on fabricated logs of one restart, so a changed
log line breaks this test rather than the benchmark's figures. Pure: no Slurm, no torch."""
from __future__ import annotations

import sys
from datetime import datetime
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
T = datetime(2026, 1, 1, 12, 0, 0).timestamp()


def stamp(seconds: float) -> str:
    return datetime.fromtimestamp(T + seconds).strftime("%Y-%m-%d %H:%M:%S,%f")[:-3]


def test_one_restart_is_split_into_detection_restart_restore_and_first_step(tmp_path):
    sys.path.insert(0, str(REPO))
    from bench.goodput_faults import analyse, rank_events, task0_starts

    (tmp_path / "logs").mkdir()
    (tmp_path / "slurm").mkdir()
    (tmp_path / "logs" / "rank0.log").write_text(
        f"{stamp(4)} rank0 rank 0 coords {{'pp': 0}} device cpu backend gloo\n"
        f"{stamp(10.2)} rank0 training failed: Connection closed by peer\nRuntimeError: Connection closed\n\n"
        f"{stamp(14)} rank0 rank 0 coords {{'pp': 0}} device cpu backend gloo\n"
        f"{stamp(14.5)} rank0 resumed from step 2 (segment 1)\n")
    (tmp_path / "logs" / "rank3.log").write_text(
        f"{stamp(10)} rank3 training failed: fault.raise_every_steps=4: injected failure at step 4\n"
        f"{stamp(10.01)} rank3 segment 0 failed at step 4: the job starts its ranks again\n")
    (tmp_path / "slurm" / "7_0_log.out").write_text(
        f"submitit INFO ({stamp(0)}) - Starting with JobEnvironment(job_id=7, global_rank=0(4))\n"
        f"{stamp(4)} rank0 step 1/9\n"
        f"submitit INFO ({stamp(11)}) - Starting with JobEnvironment(job_id=7, global_rank=0(4))\n")
    rows = [{"step": s, "segment": g, "time": T + t, "step_time_s": 1.0}
            for s, g, t in [(1, 0, 7), (2, 0, 8), (3, 0, 9), (3, 1, 15.5), (4, 1, 16.5)]]
    restarts = [{"segment": 0, "step": 4, "rank": 3, "node": "node2", "restarted_at": T + 12.5, "downtime_s": 2.5,
                 "seconds_lost": 6.5}]
    [fault] = analyse(rank_events(tmp_path), task0_starts(tmp_path, "7"), restarts, rows,
                      [(T - 1, T + 10), (T + 10, T + 20)])
    assert fault["step"] == 4 and fault["rank"] == 3 and fault["resumed"] == 2
    expect = dict(detection=0.2, restart=0.8, restore=3.5, first=1.0, total=5.5, lost_steps=1, lost=1.0, cost=6.5,
                  step_end=0.0, step_start=0.0, init=1.5, build=1.5, load=0.5, downtime=2.5, seconds_lost=6.5)
    assert {k: fault[k] for k in expect} == pytest.approx(expect, abs=2e-3)


def test_a_restart_that_never_trained_is_left_out(tmp_path):
    sys.path.insert(0, str(REPO))
    from bench.goodput_faults import analyse

    rows = [{"step": 1, "segment": 0, "time": T + 1, "step_time_s": 1.0}]
    assert analyse([], [], [{"segment": 0, "step": 2, "rank": 1}], rows, []) == [None]
