"""Exact resume for the sharded strategies: DCP (torch; pipeline stages included) and
DeepSpeed's own format.

A run killed in the middle of a save resumes from the previous committed checkpoint and
ends with the same per-step losses as an uninterrupted run (bitwise, fp32 on CPU). One
strategy for each way its state is saved and restored, of every engine:
  - DDP: tests/test_checkpoint.py (and the Slurm preemption tests);
  - FSDP's DTensor shards on a 1-D mesh (fsdp; fsdp_grad_op differs only in resharding
    after forward, which no saved state holds) and a 2-D replicate x shard mesh (hsdp);
  - the tensor-parallel module's DTensors (tp, over DDP's replicas);
  - pipeline stages' own state dicts (pp_fsdp_tp: stages of FSDP x TP DTensors, the state
    fsdp_tp holds unstaged; pp alone has the same stage state over DDP);
  - DeepSpeed's own format: ZeRO-2 (stage 1 saves through the same optimizer class,
    DeepSpeedZeroOptimizer, without partitioning the gradients, which no checkpoint holds),
    ZeRO-3, and ZeRO-3 with the optimizer offloaded to the CPU.
(``make test-torch-floor`` names the fsdp, zero2 and tp cases.)
"""
from __future__ import annotations

import pytest

from helpers import assert_committed, assert_same_state, strategy_options
from warm import launcher  # forked from one process that imported torch once (tests/warm.py)
from spec.rundir import read_metrics

pytestmark = pytest.mark.slow
# save_final=false: the periodic saves alone (steps 2 and 4; the default would also save step 6)
BASE = ["train.steps=6", "train.seq_len=32", "data.num_tokens=50000", "checkpoint.every_steps=2",
        "checkpoint.save_final=false"]
STRATEGIES = ["fsdp", "hsdp", "tp", "pp_fsdp_tp", "zero2", "zero3", "zero3_offload"]
SAME_STATE_AS = {"fsdp_grad_op": "fsdp", "fsdp_tp": "pp_fsdp_tp", "pp": "pp_fsdp_tp", "zero1": "zero2"}


def test_every_strategy_has_its_state_path_resumed():
    """A new strategy is added here, or named beside the one whose saved state it shares."""
    assert sorted(STRATEGIES + list(SAME_STATE_AS) + ["ddp"]) == strategy_options()  # ddp: test_checkpoint.py
    assert set(SAME_STATE_AS.values()) <= set(STRATEGIES)


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
    killed = launcher(args + ["fault.kill_in_save_at_step=4", f"launcher.run_dir={tmp_path}/run"], cwd=tmp_path)
    assert killed.returncode != 0
    again = launcher(args + [f"launcher.run_dir={tmp_path}/run"], cwd=tmp_path)
    assert again.returncode == 0, again.stdout + again.stderr
    assert "resumed from step 2" in (tmp_path / "run" / "logs" / "rank0.log").read_text()
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
    for step in ("step_00000002", "step_00000004"):
        assert_same_state(runs["true"] / "checkpoints" / step, runs["false"] / "checkpoints" / step, tmp_path)
