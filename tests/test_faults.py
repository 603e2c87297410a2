"""The one seam for fault injection (train.harness.faults.Faults): what each ``fault.*``
option injects, that the per-start ones are keyed on the run's segment (how many
times the run started before), not on SLURM_RESTART_COUNT, and that the step faults fire
once per run. Pure: no process group."""
from __future__ import annotations

import json
import signal
from pathlib import Path
from types import SimpleNamespace

import pytest

from spec.config import FaultConfig
from train.harness import faults as faults_module
from train.harness.faults import Faults


class Phases:
    def __init__(self) -> None:
        self.seen = []

    def phase(self, name, step) -> None:
        self.seen.append((name, step))


def test_no_faults_by_default(monkeypatch):
    slept = []
    monkeypatch.setattr(faults_module.time, "sleep", slept.append)
    monkeypatch.setattr(faults_module.os, "kill", lambda *a: pytest.fail("killed"))
    none = Faults()
    for step in range(5):
        none.at_step_end(step, Phases())
        none.save_written(step)
    none.after_step()
    none.checkpoint_thread()
    assert none.preflight_delay() == 0.0 and slept == []


def test_a_fault_keyed_on_segment_1_fires_there_only(monkeypatch):
    cfg = FaultConfig(hardware_fault_rank=1, hardware_fault_at_step=3, hardware_fault_restart=1,
                      preflight_slow_rank=1, preflight_slow_s=4.0, preflight_slow_restart=1)
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")  # a later segment of the same job: Slurm's count is no key
    for segment in (0, 2, 3):
        Faults(cfg, rank=1, segment=segment).at_step_end(2, Phases())
        assert Faults(cfg, rank=1, segment=segment).preflight_delay() == 0.0
    with pytest.raises(RuntimeError, match="uncorrectable ECC error.*hardware_fault_at_step=3"):
        Faults(cfg, rank=1, segment=1).at_step_end(2, Phases())
    assert Faults(cfg, rank=1, segment=1).preflight_delay() == 4.0
    Faults(cfg, rank=0, segment=1).at_step_end(2, Phases())  # another rank
    assert Faults(cfg, rank=0, segment=1).preflight_delay() == 0.0


def test_segment_minus_one_fires_in_every_segment():
    cfg = FaultConfig(preflight_slow_rank=0, preflight_slow_s=2.0, preflight_slow_restart=-1)
    assert [Faults(cfg, 0, segment).preflight_delay() for segment in range(4)] == [2.0] * 4


def test_step_faults_fire_once_per_run_in_the_segment_that_reaches_them(tmp_path, monkeypatch):
    """fault.raise_at_step / hang_at_step / kill_in_save_at_step fire in the first segment
    that reaches their step, on every rank they name (the second rank of that segment
    finds the first one's record and fires too), and are recorded in RUN_DIR/faults/, so a
    restarted segment passes the step; fault.repeat fires them every time."""
    monkeypatch.setattr(faults_module.time, "sleep", lambda s: None)
    kills = []
    monkeypatch.setattr(faults_module.os, "kill", lambda pid, sig: kills.append(sig))
    cfg = FaultConfig(raise_at_step=4, hang_rank=1, hang_at_step=2, kill_in_save_at_step=6)
    for rank in (0, 1):  # segment 0: both ranks raise at step 4 (raise_rank -1: every rank)
        with pytest.raises(RuntimeError, match="fault.raise_at_step=4: injected failure"):
            Faults(cfg, rank, 0, tmp_path).at_step_end(3, Phases())
    Faults(cfg, 0, 1, tmp_path).at_step_end(3, Phases())  # segment 1 passes step 4
    hang = Phases()
    Faults(cfg, 1, 1, tmp_path).at_step_end(1, hang)  # ...and is the first to reach step 2's hang
    Faults(cfg, 1, 2, tmp_path).at_step_end(1, Phases())  # segment 2 passes it
    Faults(cfg, 0, 2, tmp_path).save_written(6)
    Faults(cfg, 0, 3, tmp_path).save_written(6)
    assert hang.seen == [("fault: sleeping before the collective", 1)] and kills == [signal.SIGKILL]
    assert {p.name: json.loads(p.read_text())["segment"] for p in (tmp_path / "faults").iterdir()} == {
        "raise_at_step.json": 0, "hang_at_step.json": 1, "kill_in_save_at_step.json": 2}
    repeat = FaultConfig(raise_at_step=4, repeat=True)
    for segment in (0, 1):
        with pytest.raises(RuntimeError, match="injected failure"):
            Faults(repeat, 0, segment, tmp_path).at_step_end(3, Phases())


def test_raise_rank_names_the_rank_that_raises(tmp_path):
    cfg = FaultConfig(raise_at_step=2, raise_rank=1)
    Faults(cfg, 0, 0, tmp_path).at_step_end(1, Phases())
    with pytest.raises(RuntimeError, match="fault.raise_at_step=2"):
        Faults(cfg, 1, 0, tmp_path).at_step_end(1, Phases())
    assert json.loads((tmp_path / "faults" / "raise_at_step.json").read_text())["rank"] == 1


def test_raise_every_steps_fires_once_at_each_multiple_of_its_step(tmp_path):
    """fault.raise_every_steps=N: rank raise_rank fails at N, 2N, 3N, ..., each step once
    per run, so the segment restarted from a checkpoint before 2N passes N and fails at 2N."""
    cfg = FaultConfig(raise_every_steps=3, raise_rank=1)
    fired = []
    for segment in range(4):
        for step in range(10):  # steps 1..10, as each restarted segment replays them
            Faults(cfg, 0, segment, tmp_path).at_step_end(step, Phases())  # not rank 0
            try:
                Faults(cfg, 1, segment, tmp_path).at_step_end(step, Phases())
            except RuntimeError as exc:
                fired.append((segment, step + 1, str(exc)))
                break
    assert fired == [(s, 3 * (s + 1), f"fault.raise_every_steps=3: injected failure at step {3 * (s + 1)}")
                     for s in range(3)]
    assert sorted(p.name for p in (tmp_path / "faults").iterdir()) == [
        "raise_every_steps_3.json", "raise_every_steps_6.json", "raise_every_steps_9.json"]


def test_step_faults_without_a_run_directory_fire_at_their_step_in_every_segment(monkeypatch):
    slept = []
    monkeypatch.setattr(faults_module.time, "sleep", slept.append)
    for segment in (0, 1):
        with pytest.raises(RuntimeError, match="fault.raise_at_step=4: injected failure"):
            Faults(FaultConfig(raise_at_step=4), 0, segment).at_step_end(3, Phases())
    hang = Faults(FaultConfig(hang_rank=1, hang_at_step=2, hang_s=9.0), rank=1)
    watchdog = Phases()
    hang.at_step_end(0, watchdog)
    hang.at_step_end(1, watchdog)
    assert slept == [9.0] and watchdog.seen == [("fault: sleeping before the collective", 1)]
    Faults(FaultConfig(step_delay_s=0.25)).after_step()
    Faults(FaultConfig(slow_async_save_s=0.5)).checkpoint_thread()
    assert slept == [9.0, 0.25, 0.5]


def test_kill_in_save_kills_this_process_at_its_step_only(monkeypatch):
    kills = []
    monkeypatch.setattr(faults_module.os, "kill", lambda pid, sig: kills.append(sig))
    seam = Faults(FaultConfig(kill_in_save_at_step=8))
    for step in (4, 7, 9):
        seam.save_written(step)
    assert kills == []
    seam.save_written(8)
    assert kills == [signal.SIGKILL]


def test_a_task_hands_out_the_seam_of_its_rank_and_segment():
    from spec.config import RunConfig
    from train.harness.run import Task

    cfg = RunConfig()
    cfg.fault.raise_at_step = 3
    task = Task(cfg, None, Path("."), SimpleNamespace(rank=2), 1, print, None, None)
    assert task.faults == Faults(cfg.fault, rank=2, segment=1, run_dir=Path("."))
