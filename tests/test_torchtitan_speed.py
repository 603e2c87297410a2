"""bench/torchtitan_speed.py without torchtitan installed: its model is the built-in
trainer's Llama 3.2 1B (conf/model/llama3_1b.yaml), its MFU is our FLOP formula, its
command line for torchtitan says what the speed row compares, its medians leave the
warm-up out, and the ``datasets`` stand-in raises when used. The run itself (torchtitan's
trainer) needs torchtitan: the CPU proof is in the docstring of the script."""
from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest
import yaml

from bench.torchtitan_speed import (PEAK_TFLOPS, model_config, parse_args, stub_datasets, summarize,
                                    titan_argv, titan_model_kwargs)
from conftest import REPO
from spec.config import ModelConfig
from spec.model_size import count_params, ffn_hidden_dim, flops_per_token


def test_default_model_is_the_speed_rows_llama3_1b():
    """Dimensions, FLOPs a token and parameters equal those of the model the built-in
    trainer's speed rows train (+model=llama3_1b), so one formula serves both rows."""
    ours = ModelConfig(**yaml.safe_load((REPO / "conf/model/llama3_1b.yaml").read_text()))
    args = parse_args([])
    cfg = model_config(args)
    for name in ("dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "ffn_dim_multiplier", "multiple_of",
                 "rope_theta", "tie_embeddings"):
        assert getattr(cfg, name) == getattr(ours, name), name
    assert ffn_hidden_dim(cfg) == 8192
    assert (args.seq_len, args.batch, args.precision, args.ac) == (2048, 4, "bf16", "none")
    assert flops_per_token(cfg, 2048) == flops_per_token(ours, 2048) == pytest.approx(8.2202e9, rel=1e-4)
    # torchtitan's own count for its (untied) model at this shape: the head's matmul counts tied or not
    assert flops_per_token(model_config(parse_args(["--untied"])), 2048) == flops_per_token(cfg, 2048)
    # torchtitan's Llama 3 (0.2.x) does not tie: its parameters are our untied count
    # (1,498,482,688, checked against torchtitan's model on the meta device)
    assert count_params(model_config(parse_args(["--untied"]))) == 1_498_482_688
    assert titan_model_kwargs(args) == dict(dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, vocab_size=128256,
                                            ffn_dim_multiplier=1.5, multiple_of=256, rope_theta=500000.0,
                                            max_seq_len=2048)


def test_torchtitan_command_line():
    args = parse_args(["--compile", "--steps", "12", "--seq-len", "1024", "--batch", "2", "--",
                       "--parallelism.data_parallel_shard_degree=2"])
    argv = titan_argv(args, "/tmp/out")
    for expected in ("--model.name=sto_bench", "--model.flavor=bench", "--training.seq_len=1024",
                     "--training.local_batch_size=2", "--training.steps=12", "--training.dtype=float32",
                     "--training.mixed_precision_param=bfloat16", "--activation_checkpoint.mode=none",
                     "--metrics.log_freq=1", "--compile.enable", "--compile.components=model,loss",
                     "--job.dump_folder=/tmp/out", "--checkpoint.no-enable"):
        assert expected in argv, expected
    assert argv[-1] == "--parallelism.data_parallel_shard_degree=2"  # after ``--``: torchtitan's, last
    assert not any(a.startswith("--comm.") for a in argv)             # CPU-only settings stay off the GPU run
    cpu = titan_argv(parse_args(["--cpu", "--precision", "fp32"]), "/tmp/out")
    assert "--training.mixed_precision_param=float32" in cpu and "--comm.trace_buf_size=0" in cpu
    assert "--compile.enable" not in cpu


@pytest.mark.parametrize("argv", [["--steps", "5"], ["--steps", "3", "--warmup", "3"], ["--n-heads", "30"]])
def test_refused_arguments(argv):
    with pytest.raises(SystemExit):
        parse_args(argv)


def _step(step: int, tps: float, mem: float = 10.0) -> dict:
    return {"step": step, "throughput(tps)": tps, "time_metrics/end_to_end(s)": 8192 / tps,
            "memory/max_active(GiB)": mem, "memory/max_reserved(GiB)": mem + 1, "mfu(%)": 40.0,
            "loss_metrics/global_avg_loss": 12.0 - step}


def test_summary_leaves_the_warmup_out_and_uses_our_flops():
    steps = [_step(1, 10.0, 70.0), _step(2, 20_000.0), _step(3, 40_000.0, 12.0), _step(4, 30_000.0)]
    fpt = 6.644e9
    out = summarize(steps, warmup=1, fpt=fpt, peak_tflops=PEAK_TFLOPS)
    assert out["tokens_per_s"] == 30_000.0                   # median of steps 2-4, step 1 (compile) left out
    assert out["mfu"] == round(30_000.0 * fpt / 989e12, 4)   # ours: tokens/s per GPU x flops_per_token / peak
    assert out["peak_active_gib"] == 12.0 and out["peak_reserved_gib"] == 13.0  # max over the measured steps
    assert out["titan_mfu"] == 0.4 and out["steps_measured"] == 3
    assert (out["loss_first"], out["loss_last"]) == (11.0, 8.0)
    cpu = summarize([_step(1, 5.0, -1 / 2**30), _step(2, 6.0, -1 / 2**30)], warmup=1, fpt=fpt, peak_tflops=1.0)
    assert cpu["peak_active_gib"] is None                     # no allocator statistics (torchtitan reads -1)
    with pytest.raises(ValueError, match="no logged step after step 5"):
        summarize(steps, warmup=5, fpt=fpt, peak_tflops=PEAK_TFLOPS)


def test_datasets_stub_only_when_absent(monkeypatch):
    real = importlib.util.find_spec
    assert stub_datasets() is (real("datasets") is None)
    saved = {k: sys.modules.get(k) for k in ("datasets", "datasets.distributed")}
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "datasets" else real(name, *a))
    try:
        assert stub_datasets() is True
        from datasets import load_dataset
        from datasets.distributed import split_dataset_by_node
        with pytest.raises(RuntimeError, match="synthetic tokens only"):
            load_dataset("allenai/c4")
        with pytest.raises(RuntimeError):
            split_dataset_by_node(None, rank=0, world_size=1)
    finally:
        for name, module in saved.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module


def test_wheels_script_is_pure_python_and_pinned():
    script = (REPO / "bench/torchtitan_wheels.sh").read_text()
    assert subprocess.run(["bash", "-n", str(REPO / "bench/torchtitan_wheels.sh")]).returncode == 0
    assert "torchtitan==0.2.2" in script and "--platform any" in script
    assert "rm -f \"$OUT\"/*.whl" not in script  # gpu_wheels.sh's wheels stay
