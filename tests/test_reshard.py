"""Resume on another shape (``python -m launcher.resume RUN_DIR KEY=VALUE``): the
checkpoint of a run saved at one world size and strategy continues at another.

A run fails at step 7 (``fault.raise_at_step``) with its checkpoint of step 4; it is
resumed on the new shape and completes. Its losses then equal, to fp32 rounding, those of
an uninterrupted run (the same global batch sees the same data; the optimizer state came
through, or the curves would part after step 5), and the sample trace of every rank
(``fault.trace_samples``) shows each sample of the global stream seen once: nothing
skipped or repeated across the change. Refusals and the batch arithmetic run without
training.
"""
from __future__ import annotations

import math
import subprocess
from pathlib import Path

import numpy as np
import pytest
import yaml

import warm
from spec.config import DataConfig, RunConfig, to_yaml
from spec.rundir import CONFIG, read_metrics, read_run_json

BASE = ["train.steps=10", "train.seq_len=32", "data.num_tokens=50000", "fault.trace_samples=true"]
GLOBAL = 32  # sequences per step in every run here


# The launcher, launcher.resume and their local ranks: forked from one process that
# imported torch once (tests/warm.py).
launcher = warm.launcher


def resume(run_dir: Path, *overrides: str) -> subprocess.CompletedProcess:
    """``python -m launcher.resume RUN_DIR OVERRIDES`` from the run's parent directory."""
    return warm.run_module("launcher.resume", [str(run_dir), *overrides], cwd=run_dir.parent, timeout=600)


def losses(run_dir: Path) -> dict:
    return {r["step"]: r["loss"] for r in read_metrics(run_dir)}


def traced_steps(run_dir: Path) -> dict:
    """step -> window ids of that step, all ranks of the last segment that ran it."""
    seen: dict = {}  # step -> {segment: [ids]}
    for path in (run_dir / "logs").glob("samples_seg*_rank*.txt"):
        segment = int(path.name.split("_")[1][3:])
        for line in path.read_text().splitlines():
            step, *ids = (int(x) for x in line.split())
            seen.setdefault(step, {}).setdefault(segment, []).extend(ids)
    return {step: by_segment[max(by_segment)] for step, by_segment in seen.items()}


def stream(count: int) -> np.ndarray:
    """The first ``count`` samples of the global stream of these runs (dp 1 sees it all)."""
    from train.data import ShardedLoader, token_file

    cfg = DataConfig(num_tokens=50000)
    return ShardedLoader(token_file(cfg, 256), 256, 32, 1, 1, 0, 1, seed=cfg.seed).stream(0, count)


def assert_every_sample_once(run_dir: Path, steps: int = 10) -> None:
    traced = traced_steps(run_dir)
    assert sorted(traced) == list(range(1, steps + 1))
    want = stream(steps * GLOBAL)
    for step, ids in traced.items():
        assert sorted(ids) == sorted(want[(step - 1) * GLOBAL:step * GLOBAL].tolist()), step
    everything = [i for ids in traced.values() for i in ids]
    assert len(everything) == len(set(everything)) == steps * GLOBAL  # none repeated, none skipped


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted curve: FSDP on 4 ranks, global batch 32."""
    root = tmp_path_factory.mktemp("reference")
    proc = launcher(BASE + ["+strategy=fsdp", "cluster.gpus_per_node=4", f"launcher.run_dir={root}/run"], cwd=root)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return losses(root / "run")


def failed_at_7(tmp_path: Path, args: list) -> Path:
    run = tmp_path / "run"
    # periodic saves only (steps 4 and 8 kept), so the step-4 conversion a test asserts is not pruned
    proc = launcher(BASE + args + ["checkpoint.every_steps=4", "checkpoint.save_final=false", "fault.raise_at_step=7",
                                   f"launcher.run_dir={run}"], cwd=tmp_path)
    assert proc.returncode != 0 and read_run_json(run)["status"] == "failed", proc.stdout + proc.stderr
    return run


def assert_continued(run: Path, reference: dict, before: dict, after: dict) -> None:
    info = read_run_json(run)
    assert info["status"] == "completed" and info["world_size"] == after["world_size"]
    (change,) = info["reshaped"]
    assert change["at_step"] == 4
    assert {k: change["from"][k] for k in before} == before and {k: change["to"][k] for k in after} == after
    assert change["to"]["global_batch"] == change["from"]["global_batch"] == GLOBAL
    assert "resharded: saved by" in (run / "logs" / "rank0.log").read_text()
    got = losses(run)
    assert sorted(got) == list(range(1, 11))
    assert all(math.isclose(got[s], reference[s], rel_tol=0, abs_tol=1e-5) for s in got), (got, reference)
    assert_every_sample_once(run)


@pytest.mark.slow
def test_fsdp_4_ranks_resumed_on_2(tmp_path, reference):
    run = failed_at_7(tmp_path, ["+strategy=fsdp", "cluster.gpus_per_node=4"])
    proc = resume(run, "cluster.gpus_per_node=2", "fault.raise_at_step=0")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "global batch kept at 32 sequences: dp 4 -> 2" in proc.stdout
    assert yaml.safe_load((run / CONFIG).read_text())["train"]["grad_accum"] == 2
    assert_continued(run, reference, {"world_size": 4, "strategy": "fsdp"},
                     {"world_size": 2, "strategy": "fsdp", "micro_batch_size": 8, "grad_accum": 2})


@pytest.mark.slow
def test_ddp_2_ranks_resumed_as_fsdp_on_4(tmp_path, reference):
    run = failed_at_7(tmp_path, ["cluster.gpus_per_node=2", "train.grad_accum=2"])  # ddp, 8 x 2 x 2 = 32
    proc = resume(run, "strategy=fsdp", "cluster.gpus_per_node=4", "fault.raise_at_step=0")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert_continued(run, reference, {"world_size": 2, "strategy": "ddp"},
                     {"world_size": 4, "strategy": "fsdp", "grad_accum": 1})


@pytest.mark.slow
def test_fsdp_resumed_with_tensor_parallel(tmp_path, reference):
    """The same 4 ranks, FSDP over 4 -> FSDP over 2 x TP 2: DTensor shards on another mesh."""
    run = failed_at_7(tmp_path, ["+strategy=fsdp", "cluster.gpus_per_node=4"])
    proc = resume(run, "strategy=fsdp_tp", "fault.raise_at_step=0")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert_continued(run, reference, {"world_size": 4, "tp": 1, "dp": 4}, {"world_size": 4, "tp": 2, "dp": 2})


@pytest.mark.slow
def test_fsdp_resumed_as_pipeline_stages(tmp_path, reference):
    """The whole model's state -> two pipeline stages x DDP 2: the optimizer state is keyed
    by full-model names (flattened), so each stage asks for its own layers' keys."""
    run = failed_at_7(tmp_path, ["+strategy=fsdp", "cluster.gpus_per_node=4"])
    proc = resume(run, "strategy=pp", "fault.raise_at_step=0")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert_continued(run, reference, {"world_size": 4, "pp": 1, "dp": 4}, {"world_size": 4, "pp": 2, "dp": 2})


@pytest.mark.slow
def test_deepspeed_zero1_4_ranks_resumed_as_zero3_on_2(tmp_path, reference):
    """DeepSpeed refuses ZeRO partitions of another DP size: the trainer converts the step
    to the universal format (checkpoints/universal/) and loads that, here under ZeRO-3,
    whose loader in DeepSpeed 0.19 shares one step tensor among the sub-groups and copies
    the first group's weight decay onto all (both undone: the curve would part by 1e-2)."""
    run = failed_at_7(tmp_path, ["+strategy=zero1", "cluster.gpus_per_node=4"])
    dry = resume(run, "strategy=zero3", "cluster.gpus_per_node=2", "launcher.dry_run=true")
    assert "would first convert the newest checkpoint to DeepSpeed's universal format for ZeRO stage 3" in dry.stdout
    assert not (run / "checkpoints" / "universal").exists()
    proc = resume(run, "strategy=zero3", "cluster.gpus_per_node=2", "fault.raise_at_step=0")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "universal conversion of" in proc.stdout  # before the ranks start (train/checkpoint/convert.py)
    assert (run / "checkpoints" / "universal" / "step_00000004" / "state" / "zero").is_dir()
    assert_continued(run, reference, {"world_size": 4, "zero_stage": 1}, {"world_size": 2, "zero_stage": 3})


@pytest.mark.slow
def test_deepspeed_zero3_offload_4_ranks_resumed_as_zero2_on_2(tmp_path, reference):
    """The other way: a ZeRO-3 conversion (flat tensors, no per-parameter step) loaded by
    the stage-1/2 loader; the profile replaces the strategy section, so no offload is left."""
    run = failed_at_7(tmp_path, ["+strategy=zero3_offload", "cluster.gpus_per_node=4"])
    proc = resume(run, "strategy=zero2", "cluster.gpus_per_node=2", "fault.raise_at_step=0")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    saved = yaml.safe_load((run / CONFIG).read_text())["strategy"]
    assert not saved["offload_optimizer"] and not saved["offload_params"]
    assert_continued(run, reference, {"world_size": 4, "zero_stage": 3}, {"world_size": 2, "zero_stage": 2})
    # the conversion, rewritten for stage 2, is reused as it is by a later load at any stage
    import torch

    from train.checkpoint.deepspeed_io import for_stage

    tag = run / "checkpoints" / "universal" / "step_00000004" / "state"
    files = {p: p.read_bytes() for p in tag.rglob("*.pt") if not p.is_symlink()}
    for stage in (2, 3, 1):
        for_stage(tag, stage)
    assert {p: p.read_bytes() for p in tag.rglob("*.pt") if not p.is_symlink()} == files
    assert set(torch.load(tag / "zero" / "output.weight" / "exp_avg.pt", weights_only=False)) == {"cat_dim", "param"}


# --- without training: the loader, the refusals, the batch arithmetic -------------------


@pytest.mark.parametrize("before,after", [(4, 2), (2, 4), (4, 1)])
def test_loader_resumed_at_another_dp_degree_sees_every_sample_once(tmp_path, before, after):
    """Steps 0-2 at one degree, saved, steps 3-5 at another with the same global batch."""
    from train.data import ShardedLoader, token_file

    path = token_file(DataConfig(num_tokens=20_000, cache_dir=str(tmp_path)), 256)

    def loaders(dp):
        return [ShardedLoader(path, 256, 16, 2, GLOBAL // 2 // dp, r, dp, seed=3) for r in range(dp)]

    seen, first = [], loaders(before)
    for _ in range(3):
        for loader in first:
            seen += [row for inputs, _ in loader.next_step() for row in map(tuple, inputs.tolist())]
    state = first[0].state_dict()
    assert state == {"step": 3, "samples": 3 * GLOBAL, "global_batch": GLOBAL, "samples_are": "windows"}
    second = loaders(after)
    for loader in second:
        loader.load_state_dict(state)
    for _ in range(3):
        for loader in second:
            seen += [row for inputs, _ in loader.next_step() for row in map(tuple, inputs.tolist())]
    whole = ShardedLoader(path, 256, 16, 6 * GLOBAL, 1, 0, 1, seed=3).next_step()[0][0]
    assert sorted(seen) == sorted(map(tuple, whole.tolist()))  # each of the first 6 x 32 samples once


def test_loader_after_a_global_batch_change_continues_at_the_sample(tmp_path):
    from train.data import ShardedLoader, token_file

    path = token_file(DataConfig(num_tokens=20_000, cache_dir=str(tmp_path)), 256)
    small = ShardedLoader(path, 256, 16, 4, 1, 0, 1, seed=3)
    small.next_step()
    big = ShardedLoader(path, 256, 16, 8, 1, 0, 1, seed=3)
    big.load_state_dict(small.state_dict())
    assert (big.state.step, big.state.samples) == (1, 4)
    assert np.array_equal(big._window_ids(), big.stream(4, 8))
    legacy = ShardedLoader(path, 256, 16, 8, 1, 0, 1, seed=3)
    legacy.load_state_dict({"step": 2})  # a checkpoint from before the loader kept samples
    assert legacy.state.samples == 16
    wrap = ShardedLoader(path, 256, 16, 8, 1, 0, 1, seed=3)  # a batch across the end of an epoch
    ids = wrap.stream(wrap.num_windows - 3, 8)
    assert len(set(ids[:3].tolist())) == 3 and len(set(ids[3:].tolist())) == 5


def saved_run(tmp_path: Path, **sections) -> Path:
    cfg = RunConfig()
    cfg.cluster.gpus_per_node = 4
    for dotted, value in sections.items():
        section, key = dotted.split("__")
        setattr(getattr(cfg, section), key, value)
    run = tmp_path / "run"
    run.mkdir()
    (run / CONFIG).write_text(to_yaml(cfg))
    return run


@pytest.mark.parametrize("overrides,words", [
    (["model.dim=128"], "model.dim=128: a resume keeps the saved run's model"),
    (["data.seed=5"], "data.seed=5: a resume keeps the saved run's data stream"),
    (["train.seq_len=128"], "train.seq_len=128: a resume keeps train.seq_len=64"),
    (["strategy=zero2"], "strategy.engine=deepspeed (strategy=zero2): the checkpoint was saved by the torch engine"),
    (["cluster.gpus_per_node=3"], "data-parallel degree 3 does not divide the global batch of 32"),
    (["train.nope=1"], "unknown field 'train.nope'"),
    (["cluster.nodes=1,2"], "one value per field"),
    (["strategy=nope"], "unknown strategy 'nope'"),
], ids=["model", "data", "seq_len", "engine", "batch", "field", "sweep", "profile"])
def test_a_change_the_checkpoint_cannot_take_is_refused(tmp_path, capsys, overrides, words):
    from launcher.relaunch import main

    run = saved_run(tmp_path)
    before = (run / CONFIG).read_text()
    assert main([str(run), *overrides]) == 2
    err = capsys.readouterr().err
    assert words in err and err.count("\n") == 1, err
    assert (run / CONFIG).read_text() == before and not (run / "run.json").exists()  # nothing written


@pytest.mark.parametrize("stage,overrides", [(0, ["strategy.zero_stage=1"]), (2, ["strategy.zero_stage=0"])])
def test_deepspeed_reshapes_it_cannot_load_are_refused(tmp_path, capsys, stage, overrides):
    from launcher.relaunch import main

    run = saved_run(tmp_path, strategy__engine="deepspeed", strategy__name=f"zero{stage}", strategy__zero_stage=stage)
    assert main([str(run), *overrides]) == 2
    assert "strategy.zero_stage=" in capsys.readouterr().err


@pytest.mark.parametrize("gpus,micro,accum", [(2, 8, 2), (8, 4, 1), (1, 8, 4), (16, 2, 1)])
def test_the_global_batch_is_kept_when_dp_changes(tmp_path, gpus, micro, accum):
    from launcher.track.resume import reshape

    cfg = RunConfig()
    cfg.cluster.gpus_per_node = 4  # ddp: dp 4, 8 x 1 x 4 = 32
    new, notes = reshape(cfg, [f"cluster.gpus_per_node={gpus}"])
    assert (new.train.micro_batch_size, new.train.grad_accum) == (micro, accum)
    assert new.train.micro_batch_size * new.train.grad_accum * gpus == GLOBAL and notes
    given, _ = reshape(cfg, ["cluster.gpus_per_node=2", "train.grad_accum=1"])  # asked for: a new global batch
    assert (given.train.micro_batch_size, given.train.grad_accum) == (8, 1)


def test_the_new_shape_goes_through_the_memory_planner(tmp_path, capsys):
    """Saved on 8 A100s (FSDP, Llama 3 8B): on 1 GPU it is predicted not to fit, refused;
    on 2 nodes (a new global batch, asked for) it passes, and a dry run changes nothing."""
    from helpers import compose_run
    from launcher.relaunch import main

    run = tmp_path / "run"
    run.mkdir()
    cfg = compose_run(["+cluster=a100x8", "+model=llama3_8b", "+strategy=fsdp", "train.seq_len=4096",
                       "train.micro_batch_size=1"])
    (run / CONFIG).write_text(to_yaml(cfg))
    before = (run / CONFIG).read_text()
    assert main([str(run), "cluster.gpus_per_node=1"]) == 2
    err = capsys.readouterr().err
    assert "is predicted to need" in err and err.count("\n") == 1, err
    assert main([str(run), "cluster.nodes=2", "train.grad_accum=1", "launcher.dry_run=true"]) == 0
    out = capsys.readouterr().out
    assert "dry run: nothing submitted" in out and "--nodes=2" in out, out
    assert (run / CONFIG).read_text() == before and not (run / "run.json").exists()


def test_the_conversion_job_is_one_cpu_task_on_the_runs_partition():
    """launcher.resume's conversion before a DeepSpeed reshape (tests/test_reshard_slurm.py
    runs it): one node, one task with the node's CPUs, no GPU, no requeue."""
    from helpers import compose_run
    from launcher.submit import conversion_parameters, slurm_parameters
    from slurm import submitit_adapter
    from spec.layout import build_layout

    cfg = compose_run(["+cluster=a100x8", "cluster.nodes=4", "+strategy=zero3", "cluster.cpus_per_task=12"])
    job, conv = slurm_parameters(cfg, build_layout(cfg)), conversion_parameters(cfg, build_layout(cfg))
    assert job["gpus_per_node"] == 8 and job["additional_parameters"]["requeue"] and "teardown" in job
    assert (conv["nodes"], conv["ntasks_per_node"], conv["cpus_per_task"]) == (1, 1, 96)
    assert "gpus_per_node" not in conv and "teardown" not in conv and "requeue" not in conv["additional_parameters"]
    # the profile's setup lines, without the training step's function (a conversion runs once)
    from spec.cluster import heartbeat_interval

    grace = submitit_adapter.restart_grace_s(heartbeat_interval(cfg.cluster.hang_timeout_s))
    loop = submitit_adapter.step_loop(cfg.cluster.in_job_restarts, grace_s=grace, agent=cfg.cluster.gpus_per_node)
    assert loop and job["setup"] == conv["setup"] + loop
    assert conv["partition"] == job["partition"] and conv["time"] == job["time"]
    assert conv["job_name"] == job["job_name"] + "-convert"
