"""Experiment tracking (TensorBoard, W&B offline) and the batch / learning-rate facts.

- a run killed in the middle of a save and resumed continues the same TensorBoard log
  (read back with TensorBoard's own reader: every step once, the values of
  metrics.jsonl) and the same W&B run (the resumed segment carries the run's id and
  starts where the checkpoint was);
- the global batch and the peak learning rate (none / linear / sqrt scaling) are
  printed at launch and used by the trainer (the lr in metrics.jsonl); so are the
  schedule's steps and warmup from train.epochs and optim.warmup_ratio, and each row's
  epoch (tests/test_schedule.py: the arithmetic).
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from conftest import launcher
from helpers import compose_run
from spec.batch import global_batch, peak_lr
from spec.layout import build_layout
from spec.rundir import read_metrics


def wandb_records(path: Path) -> list:
    """The protobuf records of a ``.wandb`` file: a 7-byte header, then LevelDB's log format
    (32 KiB blocks of chunks: CRC32C, length, type FULL/FIRST/MIDDLE/LAST)."""
    from wandb.proto import wandb_internal_pb2

    data, pos, block, buf, out = path.read_bytes(), 7, 32768, b"", []
    assert data[:4] == b":W&B"
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:
            pos += left
            continue
        length, kind = int.from_bytes(data[pos + 4:pos + 6], "little"), data[pos + 6]
        if kind == 0:  # the zero padding of a block
            pos += left
            continue
        buf += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(buf)
            out.append(record)
            buf = b""
    return out


def wandb_segments(run_dir: Path) -> list:
    """[(run id, [history steps])] of each offline segment, oldest first."""
    segments = []
    for f in sorted(run_dir.glob("wandb/offline-run-*/run-*.wandb")):
        records = wandb_records(f)
        ids = {r.run.run_id for r in records if r.WhichOneof("record_type") == "run"}
        steps = [r.history.step.num for r in records if r.WhichOneof("record_type") == "history"]
        segments.append((ids, steps))
    return segments


@pytest.mark.slow
def test_logs_continue_across_a_kill_and_resume(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from train.tracking import run_id

    run = tmp_path / "run"
    args = ["train.steps=12", "train.seq_len=32", "data.num_tokens=50000", "checkpoint.every_steps=4",
            "tracking.tensorboard=true", "tracking.wandb.project=sto-tests", f"launcher.run_dir={run}"]
    killed = launcher(args + ["fault.kill_in_save_at_step=8"], cwd=tmp_path)
    assert killed.returncode != 0
    again = launcher(args, cwd=tmp_path)
    assert again.returncode == 0, again.stdout + again.stderr
    final = {r["step"]: r["loss"] for r in read_metrics(run)}
    assert sorted(final) == list(range(1, 13))

    events = EventAccumulator(str(run / "tensorboard"))
    events.Reload()
    losses = events.Scalars("train/loss")
    assert [e.step for e in losses] == list(range(1, 13))  # steps 5-8 of the killed segment purged
    assert all(math.isclose(e.value, final[e.step], rel_tol=1e-6) for e in losses)

    # W&B: SIGKILL leaves the killed segment's file without what W&B's service had not
    # written yet (a graceful preemption finishes it: tests/test_hf_slurm.py); the resumed
    # segment is the same run and starts after the checkpoint.
    segments = wandb_segments(run)
    assert len(segments) == 2
    assert segments[1] == ({run_id(run)}, list(range(5, 13)))


@pytest.mark.parametrize("rule,factor", [("none", 1.0), ("linear", 4.0), ("sqrt", 2.0)])
def test_peak_lr_follows_the_global_batch(rule, factor):
    cfg = compose_run(["+cluster=a100x8", "cluster.nodes=2", "+strategy=fsdp", "train.micro_batch_size=2",
                       "train.grad_accum=2", f"optim.lr_scaling={rule}", "optim.base_global_batch=16"])
    layout = build_layout(cfg)
    assert global_batch(cfg, layout) == (2 * 2 * 16, 64 * cfg.train.seq_len)
    assert math.isclose(peak_lr(cfg, layout), cfg.optim.lr * factor)


def test_launch_prints_the_batch_and_uses_the_scaled_lr(tmp_path):
    dry = launcher(["+cluster=a100x8", "cluster.nodes=2", "+strategy=zero2", "train.grad_accum=4",
                    "optim.lr_scaling=linear", "optim.base_global_batch=128", "train.epochs=2",
                    "optim.warmup_ratio=0.05", "launcher.dry_run=true"], cwd=tmp_path)
    assert dry.returncode == 0, dry.stderr
    assert ("global batch: 512 sequences = 32,768 tokens per step (micro 8 x accum 4 x dp 16, seq_len 64); "
            "peak lr 0.012 (optim.lr 0.003 x 4.000: linear scaling from base_global_batch=128)\n"
            # markov data: (2,000,000 tokens - 1) // 64 samples; ceil(2 x 31,249 / 512) steps
            "schedule: samples per epoch 31,249 = 61.0 steps of 512; 123 steps (train.epochs=2) = 2.015 epochs; "
            "warmup 7 steps (optim.warmup_ratio=0.05)") in dry.stdout
    refused = launcher(["optim.lr_scaling=sqrt", "launcher.dry_run=true"], cwd=tmp_path)
    assert refused.returncode == 2 and "optim.lr_scaling=sqrt needs optim.base_global_batch" in refused.stderr
    # 0.03 epochs of 1,562 samples (50,000 tokens / 32): 47 samples, 3 steps of 16; warmup ceil(0.2 x 3) = 1
    run = launcher(["train.epochs=0.03", "train.seq_len=32", "data.num_tokens=50000", "optim.warmup_ratio=0.2",
                    "optim.lr_scaling=linear", "optim.base_global_batch=4", f"launcher.run_dir={tmp_path / 'r'}"],
                   cwd=tmp_path)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "global batch: 16 sequences" in run.stdout and "3 steps (train.epochs=0.03)" in run.stdout
    rows = read_metrics(tmp_path / "r")
    assert math.isclose(rows[0]["lr"], 0.003 * 16 / 4)  # the peak after a 1-step warmup: 4x optim.lr
    assert [(r["step"], r["epoch"]) for r in rows] == [(k, 16 * k / 1562) for k in (1, 2, 3)]
    info = json.loads((tmp_path / "r" / "run.json").read_text())
    assert (info["status"], info["steps"], info["epochs"]) == ("completed", 3, 0.03)
