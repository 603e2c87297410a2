"""Exact resume for the sharded strategies: DCP (torch; pipeline stages included) and
DeepSpeed's own format.

Every shipped strategy but DDP (tests/test_checkpoint.py and the Slurm preemption tests).
A run killed in the middle of a save resumes from the previous committed checkpoint and
ends with the same per-step losses as an uninterrupted run (bitwise, fp32 on CPU).
"""
from __future__ import annotations

import pytest

from conftest import launcher
from helpers import assert_committed, assert_same_state, strategy_options
from spec.rundir import read_metrics

pytestmark = pytest.mark.slow
BASE = ["train.steps=12", "train.seq_len=32", "data.num_tokens=50000", "checkpoint.every_steps=4"]
STRATEGIES = [s for s in strategy_options() if s != "ddp"]


def losses(run_dir):
    return {r["step"]: r["loss"] for r in read_metrics(run_dir)}


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_kill_in_save_then_resume_is_exact(tmp_path, strategy):
    args = BASE + [f"+strategy={strategy}"]
    if strategy == "hsdp":
        args.append("cluster.nodes=2")  # replicate across 2 "nodes", shard inside each
    if strategy == "pp_fsdp_tp":
        args.append("cluster.gpus_per_node=4")  # pp 2 x tp 2: stages hold their own DCP shards
    ref = launcher(args + [f"launcher.run_dir={tmp_path}/ref"], cwd=tmp_path)
    assert ref.returncode == 0, ref.stdout + ref.stderr
    killed = launcher(args + ["fault.kill_in_save_at_step=8", f"launcher.run_dir={tmp_path}/run"], cwd=tmp_path)
    assert killed.returncode != 0
    again = launcher(args + [f"launcher.run_dir={tmp_path}/run"], cwd=tmp_path)
    assert again.returncode == 0, again.stdout + again.stderr
    assert "resumed from step 4" in (tmp_path / "run" / "logs" / "rank0.log").read_text()
    assert losses(tmp_path / "run") == losses(tmp_path / "ref")
    assert_committed(tmp_path / "run" / "checkpoints")


# DTensor shards (1-D and 2-D meshes) and pipeline stages' own state dicts; DDP's plain
# tensors in tests/test_checkpoint.py.
@pytest.mark.parametrize("strategy", ["fsdp", "pp_fsdp_tp"])
def test_async_save_is_the_state_of_the_step_saved(tmp_path, strategy):
    """The async snapshot is copied on the checkpoint thread while the next step runs:
    its checkpoints equal the blocking saves' (every tensor bitwise, every plain value),
    and the training is unchanged."""
    args = BASE + [f"+strategy={strategy}"]
    if strategy == "pp_fsdp_tp":
        args.append("cluster.gpus_per_node=4")
    runs = {}
    for mode in ("false", "true"):
        runs[mode] = tmp_path / f"async_{mode}"
        proc = launcher(args + [f"checkpoint.async_save={mode}", "fault.slow_async_save_s=0.5",  # as in DDP's test
                                f"launcher.run_dir={runs[mode]}"], cwd=tmp_path)
        assert proc.returncode == 0, proc.stdout + proc.stderr
    assert losses(runs["true"]) == losses(runs["false"])
    assert_committed(runs["true"] / "checkpoints")
    for step in ("step_00000004", "step_00000008"):
        assert_same_state(runs["true"] / "checkpoints" / step, runs["false"] / "checkpoints" / step, tmp_path)
