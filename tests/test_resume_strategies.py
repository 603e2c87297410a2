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


def strategy_args(strategy):
    args = BASE + [f"+strategy={strategy}"]
    if strategy == "hsdp":
        args.append("cluster.nodes=2")  # replicate across 2 "nodes", shard inside each
    if strategy == "pp_fsdp_tp":
        args.append("cluster.gpus_per_node=4")  # pp 2 x tp 2: stages hold their own DCP shards
    return args


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """An uninterrupted run of a strategy with blocking saves, made once and shared: the
    kill-in-save test compares against it, the async test takes it as its blocking run."""
    root, runs = tmp_path_factory.mktemp("references"), {}

    def get(strategy):
        if strategy not in runs:
            runs[strategy] = root / strategy
            proc = launcher(strategy_args(strategy) + ["checkpoint.async_save=false",
                                                       f"launcher.run_dir={runs[strategy]}"], cwd=root)
            assert proc.returncode == 0, proc.stdout + proc.stderr
        return runs[strategy]
    return get


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_kill_in_save_then_resume_is_exact(tmp_path, strategy, reference):
    args = strategy_args(strategy)
    ref = reference(strategy)
    killed = launcher(args + ["fault.kill_in_save_at_step=8", f"launcher.run_dir={tmp_path}/run"], cwd=tmp_path)
    assert killed.returncode != 0
    again = launcher(args + [f"launcher.run_dir={tmp_path}/run"], cwd=tmp_path)
    assert again.returncode == 0, again.stdout + again.stderr
    assert "resumed from step 4" in (tmp_path / "run" / "logs" / "rank0.log").read_text()
    assert losses(tmp_path / "run") == losses(ref)
    assert_committed(tmp_path / "run" / "checkpoints")


# DTensor shards (1-D and 2-D meshes) and pipeline stages' own state dicts; DDP's plain
# tensors in tests/test_checkpoint.py.
@pytest.mark.parametrize("strategy", ["fsdp", "pp_fsdp_tp"])
def test_async_save_is_the_state_of_the_step_saved(tmp_path, strategy, reference):
    """The async snapshot is copied on the checkpoint thread while the next step runs:
    its checkpoints equal the blocking saves' (every tensor bitwise, every plain value),
    and the training is unchanged."""
    runs = {"false": reference(strategy), "true": tmp_path / "async_true"}
    proc = launcher(strategy_args(strategy) + ["checkpoint.async_save=true", "fault.slow_async_save_s=0.5",  # as in DDP's
                                               f"launcher.run_dir={runs['true']}"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert losses(runs["true"]) == losses(runs["false"])
    assert_committed(runs["true"] / "checkpoints")
    for step in ("step_00000004", "step_00000008"):
        assert_same_state(runs["true"] / "checkpoints" / step, runs["false"] / "checkpoints" / step, tmp_path)
