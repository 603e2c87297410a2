"""Checkpoints sized to the filesystem and the failure rate (launcher/plan/checkpoints.py,
train/checkpoint/policy.py, the watchdog's save bound). Pure or in-process: no job starts."""
from __future__ import annotations

import math
import re
import time

import pytest

from conftest import launcher
from helpers import compose_run
from launcher.checks import check
from launcher.plan.state_bytes import state_bytes_per_rank
from launcher.plan.checkpoints import COMMIT_S, describe, MIN_INTERVAL_S, SNAPSHOT_GBPS, WRITE_SHARE, plan_saves
from spec.config import ConfigError
from spec.layout import build_layout
from spec.model_size import count_params

BIG = ["+cluster=h100x8", "cluster.nodes=4", "+model=llama3_70b", "+strategy=fsdp_tp", "launcher.dry_run=true"]


def _checked(overrides):
    cfg = compose_run(overrides)
    layout, _, saves = check(cfg)
    return cfg, layout, saves


def test_a_gpu_run_gets_the_young_daly_interval_and_its_figures():
    """No interval given on a GPU profile: every_minutes = sqrt(2 x stall x MTBF), the
    figures computed here from the profile (h100x8: 4 GB/s a node, 20 in all, 0.001
    failures a node-hour) and the model's size."""
    cfg, layout, plan = _checked(BIG)
    psi = count_params(cfg.model)
    total, node, rank = 12 * psi, 12 * psi / 4, 12 * psi / 32  # fp32 params + AdamW's moments; fsdp_tp over 32
    assert (plan.total_bytes, plan.node_bytes) == pytest.approx((total, node))
    assert plan.rank_bytes == state_bytes_per_rank(cfg, layout) == pytest.approx(rank, rel=1e-2)  # the heaviest rank
    assert plan.save_s == pytest.approx(max(node / 4e9, total / 20e9) + COMMIT_S)
    assert plan.restore_s == pytest.approx(max(node / 8e9, total / 40e9) + COMMIT_S)
    mtbf_s = 3600 / (0.001 * 4)
    stall = plan.rank_bytes / (SNAPSHOT_GBPS * 1e9)  # async by default on a GPU with the torch engine
    assert plan.asynchronous and cfg.checkpoint.async_save is True
    assert plan.interval_s == pytest.approx(max(math.sqrt(2 * stall * mtbf_s), MIN_INTERVAL_S, WRITE_SHARE * plan.save_s))
    assert cfg.checkpoint.every_minutes == round(plan.interval_s / 60, 1) and cfg.checkpoint.every_steps == 0
    assert cfg.checkpoint.save_timeout_s == math.ceil(max(cfg.cluster.hang_timeout_s, 3 * plan.save_s + 60))


def test_the_dry_run_prints_the_interval_the_save_and_the_work_lost(tmp_path):
    proc = launcher(BIG, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    lines = [line for line in proc.stdout.splitlines() if line.startswith("checkpoints:")]
    text = "\n".join(lines)
    assert re.search(r"every [\d.]+ min, async .*derived: Young/Daly", text), text
    assert re.search(r"a blocking save predicted \d+ s .*signal_delay_s=120", text), text
    assert re.search(r"work lost per failure ~[\d.]+ min on average .*restore \d+ s", text), text
    config = next(tmp_path.glob("runs/*/config.yaml")).read_text()
    assert re.search(r"every_minutes: [1-9][\d.]*\n", config) and "async_save: true" in config


@pytest.mark.parametrize("extra, field, fix", [
    (["cluster.fs_write_gbps=1"], "cluster.signal_delay_s=120", "cluster.signal_delay_s=240"),
    (["cluster.checkpoint_quota_gb=2000"], "checkpoint.keep=2", "checkpoint.keep=1"),
])
def test_a_save_outside_its_window_or_quota_is_refused_in_one_line(tmp_path, extra, field, fix):
    proc = launcher([*BIG, *extra], cwd=tmp_path)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stdout + proc.stderr
    assert lines[0].startswith(f"error: {field}") and fix in lines[0], lines[0]
    assert not list(tmp_path.glob("runs/*/config.yaml"))  # a refusal leaves nothing


def test_the_window_fixes_it_names_are_accepted():
    cfg = compose_run([*BIG, "cluster.fs_write_gbps=1"])
    with pytest.raises(ConfigError) as exc:
        check(cfg)
    fixes = str(exc.value).split("; use ", 1)[1].split(" or ")
    for fix in fixes[:2]:  # the delay, the node count (the last names the figures to check)
        _checked([*BIG, "cluster.fs_write_gbps=1", fix.split()[0]])


def test_a_users_interval_is_kept_and_a_cpu_run_saves_on_signals_only(tmp_path):
    cfg, _, plan = _checked([*BIG, "checkpoint.every_minutes=20"])
    assert cfg.checkpoint.every_minutes == 20 and not plan.derived
    proc = launcher([*BIG, "checkpoint.every_minutes=20"], cwd=tmp_path)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("checkpoints:")]
    assert lines[0] == "checkpoints: every 20 min, async (the loop stalls for the host copy)", lines
    assert "work lost per failure ~10.0 min" in lines[1], lines
    cpu, _, plan = _checked(["+cluster=localslurm", "launcher.dry_run=true"])
    k = cpu.checkpoint
    assert (k.every_steps, k.every_minutes, k.async_save) == (0, 0.0, False) and plan.save_s is None
    assert k.save_timeout_s == 2 * cpu.cluster.hang_timeout_s  # no filesystem figures: twice the hang timeout
    steps, _, plan = _checked(["+cluster=localslurm", "checkpoint.every_steps=100", "launcher.dry_run=true"])
    assert describe(steps, plan)[:2] == ["checkpoints: every 100 steps, blocking",
                                         "checkpoints: work lost per failure ~50 steps on average (half the interval) "
                                         "+ the restart"]  # no step time predicted on a CPU profile
    off, _, _ = _checked([*BIG, "checkpoint.every_minutes=0"])  # 0: off, as before
    assert (off.checkpoint.every_minutes, off.checkpoint.every_steps) == (0, 0)


def test_deepspeed_adds_its_module_weights_and_rank0_writes_them_under_zero12():
    cfg = compose_run(["+cluster=h100x8", "cluster.nodes=4", "+model=llama3_8b", "+strategy=zero2"])
    plan = plan_saves(cfg, build_layout(cfg))
    psi = count_params(cfg.model)
    assert plan.total_bytes == pytest.approx(14 * psi) and plan.node_bytes == pytest.approx(12 * psi / 4 + 2 * psi)
    assert not plan.asynchronous  # DeepSpeed writes its own files, blocking
    z3 = compose_run(["+cluster=h100x8", "cluster.nodes=4", "+model=llama3_8b", "+strategy=zero3"])
    assert plan_saves(z3, build_layout(z3)).node_bytes == pytest.approx(14 * psi / 4)


def test_the_save_policy_decides_when_to_save(tmp_path):
    from train.checkpoint.policy import SAVE_REQUEST, SavePolicy

    p = SavePolicy(every_steps=3, save_final=True, run_dir=tmp_path)
    assert [d for d in range(1, 11) if p.due(d, 10, asked=False, preempted=False)] == [3, 6, 9, 10]
    assert p.due(4, 10, asked=True, preempted=False) and p.due(4, 10, asked=False, preempted=True)
    timed = SavePolicy(every_minutes=1.0, run_dir=tmp_path)
    assert not timed.asked()
    timed.last_save = time.monotonic() - 61
    assert timed.asked()
    timed.saved()
    assert not timed.asked()
    (tmp_path / SAVE_REQUEST).touch()
    assert timed.asked()
    timed.saved()  # answered: the request is gone
    assert not (tmp_path / SAVE_REQUEST).exists() and not timed.asked()


def test_a_save_is_bounded_by_its_own_timeout_and_nests():
    from train.harness.watchdog import Watchdog

    w = Watchdog(None, 0, 0, "h", 1, timeout_s=10, interval_s=0, save_timeout_s=40)
    w.progress(5)
    now = time.time()
    w.last_progress = now - 30
    assert w.overdue(now)  # a step: 30 s > the hang timeout
    w.saving(5)
    w.save_since = now - 30
    assert not w.overdue(now) and w.limit_s() == 40  # a save: its own bound
    w.saving(5)  # the checkpointer's wait inside the trainer's save
    w.saved()
    assert w.save_since is not None and not w.overdue(now)
    assert w.overdue(now + 11)  # 41 s since the save began
    w.saved()  # the save ended: progress, the hang timeout again
    assert w.save_since is None and w.phase_name == "compute" and not w.overdue(time.time() + 5)


def test_the_collective_timeout_covers_the_saves_bound():
    """The save's barriers wait for its slowest writer: the process group's timeout is
    train.dist_timeout_s, raised above checkpoint.save_timeout_s when that is longer."""
    from spec.checkpointing import SAVE_TIMEOUT_MARGIN_S, collective_timeout_s, save_timeout_s

    cfg, _, plan = _checked([*BIG, "cluster.fs_write_gbps=0.5", "cluster.signal_delay_s=600"])
    assert cfg.checkpoint.save_timeout_s == math.ceil(3 * plan.save_s + 60) > cfg.train.dist_timeout_s
    assert collective_timeout_s(cfg) == int(cfg.checkpoint.save_timeout_s + SAVE_TIMEOUT_MARGIN_S)
    small, _, _ = _checked(BIG)  # 480 s on h100x8: under the 600 s collective timeout
    assert collective_timeout_s(small) == small.train.dist_timeout_s
    unresolved = compose_run(["+cluster=localslurm"])  # a run the launcher did not resolve: twice the hang timeout
    assert unresolved.checkpoint.save_timeout_s is None and save_timeout_s(unresolved) == 2 * 120
