"""The task harness runs any workload: the seam the built-in trainer and users' code share.

A world of one in this process (no launcher, no torchrun): ``run_task`` joins, marks the
run ``running``, hands the workload a :class:`train.harness.run.Task`, and records what
the workload's end means in run.json.
"""
from __future__ import annotations

import os

import pytest
from omegaconf import OmegaConf

from spec.config import RunConfig
from spec.rundir import CONFIG, read_metrics, read_run_json, update_run_json
from train.harness.preempt import PreemptionFlag
from train.harness.run import Task, run_task


@pytest.fixture
def run_dir(tmp_path, monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "SLURM_JOB_ID", "SLURM_ARRAY_JOB_ID", "SLURM_PROCID", "SLURM_STEP_ID"):
        monkeypatch.delenv(name, raising=False)
    cfg = RunConfig()
    cfg.cluster.gpus_per_node = 1
    cfg.cluster.hang_timeout_s = 0  # no watchdog: a failed test's watchdog must not end pytest
    OmegaConf.save(OmegaConf.structured(cfg), tmp_path / CONFIG)
    return tmp_path


def test_a_workload_runs_under_the_harness(run_dir):
    seen = []

    def workload(task: Task) -> str:
        seen.append(task)
        assert read_run_json(run_dir)["status"] == "running"
        task.watchdog.progress(1)
        task.write_metrics({"step": 1, "loss": 1.0})
        return "completed"

    assert run_task(run_dir, workload, PreemptionFlag()) == 0
    task = seen[0]
    assert task.ctx.world_size == 1 and task.segment == 0 and task.layout.world_size == 1
    info = read_run_json(run_dir)
    assert info["status"] == "completed" and info["segments"] == 1 and info["launcher"] == "single"
    assert [r["step"] for r in read_metrics(run_dir)] == [1]
    assert not (run_dir / "heartbeat").exists()  # hang_timeout_s=0: no watchdog, no heartbeat files


def test_a_failing_workload_is_recorded_and_raised(run_dir):
    def workload(task: Task) -> str:
        task.watchdog.stop()  # the harness leaves it beating for the failure's classification
        raise ValueError("boom")

    with pytest.raises(ValueError):
        run_task(run_dir, workload, PreemptionFlag())
    info = read_run_json(run_dir)
    assert info["status"] == "failed" and info["error"] == "ValueError: boom"
    from train.harness.dist import shutdown
    shutdown()  # a failed task leaves the process group to its process's exit


def test_a_finished_run_is_not_run_again(run_dir):
    update_run_json(run_dir, status="completed", segments=3)
    assert run_task(run_dir, lambda task: pytest.fail("ran"), PreemptionFlag()) == 0
    assert read_run_json(run_dir)["segments"] == 3


def test_an_interruption_without_slurm_is_counted(run_dir):
    flag = PreemptionFlag()
    flag.agreed_requeue = True  # as the loop sets it when a rank got USR2
    assert run_task(run_dir, lambda task: "interrupted", flag) == 0
    info = read_run_json(run_dir)
    assert info["status"] == "interrupted" and info["preemptions"] == 1 and os.environ.get("SLURM_JOB_ID") is None


def test_a_new_segment_clears_the_last_ones_failure_but_keeps_the_exclusions(run_dir):
    update_run_json(run_dir, status="requeued", failure="node_failure", suspect_nodes=["node2"], dead_ranks=[2, 3],
                    dead_hosts=["node2"], error="RuntimeError: gloo", excluded_nodes=["node2"], segments=1)
    seen = []

    def workload(task: Task) -> str:
        seen.append(read_run_json(run_dir))
        return "completed"

    assert run_task(run_dir, workload, PreemptionFlag()) == 0
    during = seen[0]
    assert [during.get(k) for k in ("failure", "suspect_nodes", "dead_ranks", "dead_hosts", "error")] == [None] * 5
    assert during["excluded_nodes"] == ["node2"] and during["segments"] == 2
