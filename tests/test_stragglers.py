"""Where each step's time goes and which rank is slow (train/steptimes.py):
the detector on per-rank times recorded on this 2-core machine (tests/fixtures/steptimes.json:
clean runs raise no flag, a rank slowed alone is named), the peers of each layout, the
metrics rows' breakdown and train.straggler_action=restart_without on a real local run. On
the local Slurm cluster: tests/test_preemption.py's 2-node run names its slow rank."""
from __future__ import annotations

import json

import pytest

from conftest import REPO, launcher, run_dir_of
from spec.layout import Layout
from spec.rundir import STRAGGLERS, latest_checkpoint, read_metrics, read_run_json
from train.steptimes import FIELDS, Stragglers, breakdown, peers, self_times

RECORDED = json.loads((REPO / "tests" / "fixtures" / "steptimes.json").read_text())


def replay(tables, **kw) -> Stragglers:
    detector = Stragglers(**kw)
    for step, table in enumerate(tables, start=1):
        detector.update(table, step)
    return detector


def test_the_recordings_hold_what_the_loop_sends():
    assert RECORDED["fields"] == list(FIELDS)
    assert all(len(t) == 40 and all(len(row) == 4 for row in t) for k, t in RECORDED.items() if k.endswith(("clean",
                                                                                                         "delayed")))


@pytest.mark.parametrize("name", ["ddp_clean", "fsdp_clean", "hsdp_clean"])
def test_clean_runs_on_a_loaded_machine_raise_no_flag(name):
    assert replay(RECORDED[name]).flagged == {}


def test_a_rank_slowed_alone_is_named_within_the_window():
    detector = replay(RECORDED["ddp_rank2_delayed"])
    assert list(detector.flagged) == [2]
    flag = detector.flagged[2]
    assert flag["step"] <= 10 + 2 and flag["steps_in_a_row"] == 10  # K = train.straggler_steps = 10
    assert flag["score"] < 0.67 and flag["self_s"] - flag["median_self_s"] >= 0.15 * 0.8
    assert replay(RECORDED["ddp_rank2_delayed"], score=0).flagged == {}  # straggler_score=0: off


def test_self_time_sees_a_late_rank_through_ddps_all_reduce():
    """Rank 1 starts its step 0.2 s late: the others wait for it in backward's all-reduce,
    so every busy time is the same and only their longer fwd_bwd_s shows the wait."""
    late = [[0.001, 0.23, 0.005, 0.24], [0.001, 0.03, 0.005, 0.24], [0.001, 0.23, 0.005, 0.24],
            [0.001, 0.23, 0.005, 0.24]]
    own = self_times(late, [0, 1, 2, 3])
    assert own[1] == pytest.approx(0.24) and all(own[r] == pytest.approx(0.04) for r in (0, 2, 3))
    detector = Stragglers(steps=3)
    assert [detector.update(late, s) for s in (1, 2, 3)] == [[], [], [1]]
    spread = breakdown(late)
    assert spread["fwd_bwd_s"] == {"min": 0.03, "median": 0.23, "max": 0.23, "max_rank": 0}
    assert spread["wait_s"]["max"] == 0.0 and spread["busy_s"]["median"] == 0.24


def test_a_rank_behind_at_the_step_collective_waits_least():
    table = [[0.0, 0.1, 0.0, 0.1], [0.0, 0.1, 0.0, 0.5]]
    assert breakdown(table)["wait_s"] == {"min": 0.0, "median": pytest.approx(0.2), "max": pytest.approx(0.4),
                                          "max_rank": 0}


@pytest.mark.parametrize("shape, groups", [
    ((1, 4, 1, 1), [[0, 1, 2, 3]]),                          # data parallel: all peers
    ((2, 2, 1, 1), [[0, 1], [2, 3]]),                        # pipeline: a stage's ranks
    ((1, 2, 1, 2), [[0, 2], [1, 3]]),                        # tensor parallel: the same TP rank
])
def test_peers_do_the_same_work(shape, groups):
    pp, dp, shard, tp = shape
    layout = Layout(pp=pp, dp_replicate=dp, dp_shard=shard, tp=tp, nodes=1, gpus_per_node=pp * dp * shard * tp,
                    nvlink_domain=8)
    assert sorted(peers(layout)) == groups


def test_restart_without_records_the_slow_ranks_node_and_keeps_the_step(tmp_path):
    """A real 2-rank run, rank 1 slowed alone: named after 10 steps, the step saved, the run
    failed as a straggler with its node as suspect (on Slurm: a spare or a requeue without it)."""
    proc = launcher(["cluster.gpus_per_node=2", "train.steps=30", "fault.step_delay_s=0.4", "fault.step_delay_rank=1",
                     "train.straggler_action=restart_without"], cwd=tmp_path)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    run_dir = run_dir_of(proc.stdout)
    info = read_run_json(run_dir)
    flagged = json.loads((run_dir / STRAGGLERS).read_text())
    assert [r["rank"] for r in flagged["ranks"]] == [1] and flagged["ranks"][0]["node"] == 0
    step = flagged["step"]
    assert 11 <= step <= 13, flagged
    assert (info["status"], info["failure"], info["failed_rank"]) == ("failed", "straggler", 1), info
    assert info["suspect_nodes"] == info["hostnames"][:1]
    assert latest_checkpoint(run_dir)["step"] == step  # nothing done is lost
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == list(range(1, step + 1))
    for row in rows:
        for name in ("data_s", "fwd_bwd_s", "optim_s", "busy_s", "wait_s"):
            assert set(row[name]) == {"min", "median", "max", "max_rank"}, row
            assert 0 <= row[name]["min"] <= row[name]["median"] <= row[name]["max"]
    log = (run_dir / "logs" / "rank0.log").read_text()
    assert f"straggler: rank 1 (node 0) score " in log and "(stragglers.json)" in log


def test_the_median_of_the_others_is_what_statistics_says():
    import random
    import statistics

    from train.steptimes import medians_of_the_others

    rng = random.Random(0)
    for n in (2, 3, 4, 5, 8, 33):
        values = [rng.choice([0.1, 0.2, rng.random()]) for _ in range(n)]
        expected = [statistics.median(values[:i] + values[i + 1:]) for i in range(n)]
        assert medians_of_the_others(values) == pytest.approx(expected)


@pytest.mark.gpu
def test_on_cuda_the_step_parts_are_the_gpus_time():
    """CUDA events, read after the sync: a forward+backward of matmuls then an "optimizer"
    of one more, timed as the loop does; the parts add up to the host's view of the step."""
    import time

    import torch

    from train import steptimes

    x = torch.randn(4096, 4096, device="cuda", requires_grad=True)
    clock = steptimes.StepClock(torch.device("cuda"))
    clock.begin()
    clock.data_ready()
    start = time.perf_counter()
    loss = (x @ x @ x).sum()
    loss.backward()
    steptimes.mark_optimizer()
    x.grad @ x.grad
    clock.computed()
    loss.item()
    data, fwd_bwd, optim, busy = clock.arrive()
    host = time.perf_counter() - start
    assert 0 < optim < fwd_bwd and fwd_bwd + optim <= host * 1.05 and busy >= host, (fwd_bwd, optim, host, busy)
