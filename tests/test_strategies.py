"""Tier 3: every strategy at 2 and 4 gloo ranks trains like one process on the same batch.

Reference: one rank with DDP and micro_batch_size = 8, the global batch every case
splits over its data-parallel ranks (TP ranks and the stages of one pipeline share
their batch; a pipeline splits it again into its micro-batches). Each
strategy runs 5 steps of the tiny model in fp32 through the launcher; losses and
gradient norms must match within 1e-4 relative. Clipping is set below the gradient
norm (~0.62) so every engine's clipping is exercised too.
"""
from __future__ import annotations

import os

import pytest

from conftest import REPO, run_dir_of
from helpers import compose_run
from warm import launcher  # forked from one process that imported torch once (tests/warm.py)
from spec.layout import build_layout
from spec.rundir import read_metrics, read_run_json

pytestmark = pytest.mark.slow
GLOBAL_BATCH = 8
COMMON = ["train.steps=5", "train.seq_len=32", "data.num_tokens=50000", "optim.grad_clip=0.5",
          "strategy.mixed_precision=fp32"]
# DeepSpeed compiles its CPU comms extension once; every run reuses this cache.
ENV = {"TORCH_EXTENSIONS_DIR": os.environ.get("TORCH_EXTENSIONS_DIR", str(REPO / ".cache" / "torch_extensions"))}

# (strategy, ranks as nodes x gpus_per_node, extra overrides)
# Four ranks once per way a rank is built (fsdp_grad_op, zero3_offload, tp, pp...): a second
# 4-rank case of the same builder as its 2-rank one (fsdp, zero1, zero2, zero3 at 1x4) cost
# the suite ~20 CPU-s and tested the same code (tests/test_reshard.py resumes 4-rank ZeRO).
CASES = [
    ("ddp", (1, 4), []),  # 2 ranks: tests/test_ddp.py
    # torch.compile (Inductor's CPU code: blocks and loss) against the eager reference,
    # compiled once (tests/test_step_costs.py); the loss in chunks, and a pipeline's loss_fn
    ("ddp", (1, 2), ["strategy.compile=true"]),
    ("fsdp", (1, 2), ["strategy.compile=true", "model.loss_chunk_tokens=48"]),
    ("zero2", (1, 2), ["strategy.compile=true"]),  # blocks compiled before deepspeed.initialize
    ("fsdp_tp", (1, 2), ["strategy.compile=true"]),  # DTensor blocks; the loss vocab-parallel, eager
    # compiled, checkpointed TP blocks: torch 2.13 refuses them (COMPILED_TP_AC_FAILS), the floor runs them
    ("fsdp_tp", (1, 2), ["strategy.activation_checkpointing=full", "strategy.compile=true"]),
    ("fsdp", (1, 2), ["model.loss_chunk_tokens=48"]),  # head + loss in 3 checkpointed chunks (train/loss.py)
    ("fsdp_grad_op", (1, 2), ["train.grad_accum=2"]),
    ("fsdp_grad_op", (1, 4), []),
    ("hsdp", (2, 1), []),  # 2 replicas x 1 shard
    ("hsdp", (2, 2), ["train.grad_accum=2"]),  # 2 replicas x 2 shards; all-reduced at the last micro-batch
    ("zero1", (1, 2), ["strategy.zero_stage=0", "strategy.name=zero0"]),
    ("zero1", (1, 2), []),
    ("zero2", (1, 2), ["train.grad_accum=2"]),
    ("zero3", (1, 2), ["model.loss_chunk_tokens=48"]),  # chunks under ZeRO-3's gathers
    ("zero3_offload", (1, 2), []),
    ("zero3_offload", (1, 4), []),
    ("tp", (1, 2), []),
    ("tp", (1, 4), []),  # 2 replicas x tp 2
    ("tp", (1, 4), ["strategy.tensor_parallel=4"]),
    ("tp", (1, 2), ["strategy.data_parallel=none"]),  # TP alone, no data-parallel wrapper
    ("tp", (1, 2), ["model.qkv_bias=true"]),  # Qwen2's q/k/v biases, split with their columns
    ("fsdp_tp", (1, 2), ["strategy.activation_checkpointing=selective"]),  # tp 2, one shard
    ("fsdp_tp", (1, 4), ["strategy.activation_checkpointing=full"]),  # 2 shards x tp 2; TP, then AC, then FSDP
    # Pipeline parallel: 2 stages of the 2-layer tiny model; 4-stage and interleaved cases
    # on a 4-layer model (its own reference).
    ("pp", (1, 2), []),  # 1F1B, 4 micro-batches
    ("pp", (1, 2), ["strategy.compile=true"]),
    ("pp", (1, 2), ["strategy.pp_schedule=gpipe", "train.grad_accum=2"]),
    ("pp", (1, 4), []),  # pp 2 x DDP 2
    ("pp", (1, 4), ["strategy.pp_schedule=gpipe"]),  # pp 2 x DDP 2, every forward before the backwards
    ("pp", (1, 2), ["strategy.pp_schedule=interleaved_1f1b", "model.n_layers=4"]),  # 4 stages on 2 ranks
    ("pp", (1, 4), ["strategy.pipeline_parallel=4", "strategy.data_parallel=none", "model.n_layers=4"]),
    ("pp_fsdp_tp", (1, 4), ["strategy.activation_checkpointing=full"]),  # pp 2 x tp 2
    ("pp_fsdp_tp", (2, 4), ["strategy.pp_schedule=interleaved_1f1b", "model.n_layers=4"]),  # pp 2 x fsdp 2 x tp 2
]


def _run(cwd, data, overrides):
    proc = launcher(COMMON + [f"data.cache_dir={data}", *overrides], cwd=cwd, env=ENV, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return run_dir_of(proc.stdout)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("strategies")


@pytest.fixture(scope="module")
def references(workdir):
    """Single-process reference runs, one per model shape (by its model.* overrides)."""
    cache = {}

    def get(model_overrides):
        key = tuple(model_overrides)
        if key not in cache:
            run = _run(workdir, workdir / "data", ["cluster.gpus_per_node=1", f"train.micro_batch_size={GLOBAL_BATCH}",
                                                   *model_overrides])
            cache[key] = read_metrics(run)
        return cache[key]
    return get


def _ids(case):
    """strategy-NODESxGPUS and the first override's value, or its key's last part where the
    value is true: ddp-1x2-compile, tp-1x2-qkv_bias, fsdp-1x2-48."""
    strategy, (nodes, gpn), extra = case
    tags = [value if value != "true" else key.split(".")[-1] for key, value in (e.split("=") for e in extra[:1])]
    return f"{strategy}-{nodes}x{gpn}" + "".join("-" + t for t in tags)


@pytest.mark.parametrize("strategy,shape,extra", CASES, ids=[_ids(c) for c in CASES])
def test_matches_single_process(workdir, references, strategy, shape, extra):
    nodes, gpn = shape
    ranks = nodes * gpn
    overrides = [f"+strategy={strategy}", f"cluster.nodes={nodes}", f"cluster.gpus_per_node={gpn}", *extra]
    cfg = compose_run(overrides)
    layout = build_layout(cfg)
    if cfg.strategy.compile:  # what this torch refuses to compile (tests/test_torch_compat.py), the floor runs
        from train.parallelize import refuse_unsupported_compile
        from train.torch_compat import UnsupportedTorch

        try:
            refuse_unsupported_compile(cfg, layout)
        except UnsupportedTorch as refused:
            pytest.skip(f"refused on this torch, run by make test-torch-floor: {refused}")
    # the reference keeps whole logits: a chunked head + loss must match it
    reference = references([e for e in extra if e.startswith("model.") and "loss_chunk" not in e])
    dp = layout.dp  # TP ranks share their data: the batch splits over dp only
    micro = GLOBAL_BATCH // dp // cfg.train.grad_accum
    run = _run(workdir, workdir / "data", overrides + [f"train.micro_batch_size={micro}"])
    rows = read_metrics(run)
    assert len(rows) == len(reference) == 5
    for ref, got in zip(reference, rows):
        assert got["global_batch_size"] == GLOBAL_BATCH and got["world_size"] == ranks
        for key in ("loss", "grad_norm"):
            assert abs(got[key] - ref[key]) <= 1e-4 * abs(ref[key]), (key, [r[key] for r in reference],
                                                                     [r[key] for r in rows])
    assert rows[-1]["loss"] < rows[0]["loss"]
    info = read_run_json(run)
    name = next((e.split("=")[1] for e in extra if e.startswith("strategy.name=")), strategy)
    assert info["status"] == "completed" and info["strategy"] == name
