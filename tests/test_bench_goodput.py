"""bench/goodput.py's fault mode reads its phases from the product's own lines
(bench/goodput_faults.py): checked here on fabricated logs of one restart, so a changed
log line breaks this test rather than the benchmark's figures. Pure: no Slurm, no torch."""
from __future__ import annotations

import math
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


def agent_run(tmp_path, raised: bool) -> list:
    """One restart by the node agents (train/harness/agent.py): no new srun, so no second
    submitit 'Starting' line; the new rank 0's first line is its CPUs, placed after the fork."""
    (tmp_path / "logs").mkdir()
    (tmp_path / "slurm").mkdir()
    (tmp_path / "logs" / "rank0.log").write_text(
        f"{stamp(4)} rank0 rank 0: CPUs 0 (NUMA node 0; an even split of the task's 2 CPUs among 2 local ranks)\n"
        f"{stamp(5)} rank0 rank 0 coords {{'pp': 0}} device cpu backend gloo\n"
        f"{stamp(10.25)} rank0 training failed: Connection closed by peer\nRuntimeError: Connection closed\n\n"
        f"{stamp(10.5)} rank0 rank 0: CPUs 0 (NUMA node 0; an even split of the task's 2 CPUs among 2 local ranks)\n"
        f"{stamp(11.3)} rank0 rank 0 coords {{'pp': 0}} device cpu backend gloo\n"
        f"{stamp(11.5)} rank0 resumed from step 2 (segment 1)\n")
    (tmp_path / "logs" / "rank3.log").write_text(
        f"{stamp(10.2)} rank3 training failed: fault.raise_every_steps=4: injected failure at step 4\n" if raised
        else f"{stamp(4)} rank3 rank 3: CPUs 1 (NUMA node 0)\n")
    (tmp_path / "slurm" / "7_0_log.out").write_text(
        f"submitit INFO ({stamp(0)}) - Starting with JobEnvironment(job_id=7, hostname=node1, global_rank=0(2))\n"
        f"{stamp(4)} rank0 step 1/9\n")
    (tmp_path / "slurm" / "7_0_log.err").write_text(
        "agent node 0 (node1): 2 ranks from RANK 0 (imports 2.0 s)\n"
        "agent node 0 (node1): restarting the node's ranks from the warm agent (start 1 of the step)\n")
    rows = [{"step": s, "segment": g, "time": T + t, "step_time_s": d}
            for s, g, t, d in [(1, 0, 7, 1.0), (2, 0, 8, 1.0), (3, 0, 9, 1.0), (3, 1, 12.0, 0.4), (4, 1, 12.5, 0.5)]]
    restarts = [{"segment": 0, "srun": 0, "step": 4, "rank": 3, "node": "node2", "failed_at": T + 10.2,
                 "restarted_at": T + 11.2, "downtime_s": 1.0, "seconds_lost": 4.0,
                 **({} if raised else {"detected_by": "agent"})}]
    from bench.goodput_faults import analyse, rank_events, task0_starts

    return analyse(rank_events(tmp_path), task0_starts(tmp_path, "7"), restarts, rows, [(T - 1, T + 20)])


def test_an_agent_restart_inside_the_same_srun_is_timed_from_the_forked_rank(tmp_path):
    sys.path.insert(0, str(REPO))
    [fault] = agent_run(tmp_path, raised=True)
    assert fault["how"] == "agent" and fault["detected_by"] == "rank" and fault["resumed"] == 2
    expect = dict(detection=0.05, restart=0.25, restore=1.0, first=0.5, total=1.8, to_first=1.4, lost_steps=1,
                  lost=1.0, cost=3.6, init=0.7, build=0.1, load=0.2, downtime=1.0, seconds_lost=4.0)
    assert {k: fault[k] for k in expect} == pytest.approx(expect, abs=2e-3)
    assert math.isnan(fault["step_end"]) and math.isnan(fault["step_start"])  # no srun ended or began


def test_a_rank_the_agent_saw_die_is_timed_from_run_json(tmp_path):
    sys.path.insert(0, str(REPO))
    [fault] = agent_run(tmp_path, raised=False)  # SIGKILLed: no line of its own, run.json's failed_at
    assert fault["detected_by"] == "agent"
    expect = dict(detection=0.05, restart=0.25, total=1.8)
    assert {k: fault[k] for k in expect} == pytest.approx(expect, abs=2e-3)


def test_the_agents_imports_are_read_from_node_0s_agent_log(tmp_path):
    sys.path.insert(0, str(REPO))
    from bench.goodput_faults import agent_imports

    (tmp_path / "slurm").mkdir()
    assert agent_imports(tmp_path, "7") == []  # one srun task a rank: no agent
    (tmp_path / "slurm" / "7_agent0_log.err").write_text(
        "2026-11-28 21:30:00 agent node 0 (node1): 2 ranks from RANK 0 (imports 2.2 s)\n"
        "2026-11-28 21:31:00 agent node 0 (node1): rank 0 exited with code 1\n"
        "2026-11-28 21:32:00 agent node 0 (node1): 2 ranks from RANK 0 (imports 12.8 s)\n")
    assert agent_imports(tmp_path, "7") == [2.2, 12.8]
