"""Tier 1: the DeepSpeed config is generated from the run config; bad combinations refused."""
from __future__ import annotations

import re
import subprocess
import sys

import pytest
from conftest import REPO
from helpers import compose_run
from spec.config import ConfigError
from spec.layout import build_layout
from spec.support import check_supported
from spec.ds_config import DEFAULT_BUCKET, deepspeed_config


def _ds(overrides, dp=2, device="cpu"):
    cfg = compose_run(overrides)
    return deepspeed_config(cfg, dp, device)


def test_batch_accumulation_clipping_and_precision_come_from_the_run():
    ds = _ds(["+strategy=zero2", "train.micro_batch_size=3", "train.grad_accum=5", "optim.grad_clip=0.25"], dp=4)
    assert ds["train_micro_batch_size_per_gpu"] == 3 and ds["gradient_accumulation_steps"] == 5
    assert ds["train_batch_size"] == 3 * 5 * 4
    assert ds["gradient_clipping"] == 0.25
    assert ds["bf16"] == {"enabled": False}  # auto on CPU = fp32
    assert ds["zero_optimization"]["stage"] == 2 and "offload_optimizer" not in ds["zero_optimization"]


@pytest.mark.parametrize("mode,device,bf16", [("auto", "cuda", True), ("auto", "cpu", False), ("fp32", "cuda", False),
                                              ("bf16", "cpu", True)])
def test_precision(mode, device, bf16):
    ds = _ds(["+strategy=zero1", f"strategy.mixed_precision={mode}"], device=device)
    assert ds["bf16"]["enabled"] is bf16
    assert ds["communication_data_type"] == "fp32"  # gradients reduced in fp32 whatever the compute, as FSDP's


def test_buckets_scale_with_the_model():
    tiny = _ds(["+strategy=zero3"])["zero_optimization"]
    assert tiny["reduce_bucket_size"] == tiny["allgather_bucket_size"] == 64 * 64
    assert tiny["stage3_prefetch_bucket_size"] == int(0.9 * 64 * 64)
    assert tiny["stage3_param_persistence_threshold"] == 640  # norms stay whole, matrices are split
    big = _ds(["+model=llama3_8b", "+strategy=zero3"], device="cuda")["zero_optimization"]
    assert big["reduce_bucket_size"] == 4096 * 4096 and big["stage3_param_persistence_threshold"] == 40960
    assert big["overlap_comm"] is True and tiny["overlap_comm"] is False
    huge = _ds(["+strategy=zero2", "model.dim=32768", "model.n_heads=64"])["zero_optimization"]
    assert huge["reduce_bucket_size"] == DEFAULT_BUCKET


def test_stage_zero_has_no_zero_settings():
    assert _ds(["+strategy=zero1", "strategy.zero_stage=0"])["zero_optimization"] == {"stage": 0}


def test_offload_to_cpu():
    z = _ds(["+strategy=zero3_offload"], device="cuda")["zero_optimization"]
    assert z["stage"] == 3
    assert z["offload_optimizer"] == {"device": "cpu", "pin_memory": True}
    assert z["offload_param"] == {"device": "cpu", "pin_memory": True}
    cpu = _ds(["+strategy=zero3_offload"])["zero_optimization"]
    assert cpu["offload_param"]["pin_memory"] is False  # no pinned memory without CUDA


@pytest.mark.parametrize("overrides,message", [
    (["+strategy=zero2", "strategy.offload_params=true"],
     "strategy.offload_params=true with zero_stage=2: DeepSpeed offloads parameters only in ZeRO stage 3"),
    (["+strategy=zero1", "strategy.zero_stage=0", "strategy.offload_optimizer=true"],
     "strategy.offload_optimizer=true with zero_stage=0"),
    (["+strategy=zero1", "strategy.zero_stage=4"], "strategy.zero_stage=4 is not a ZeRO stage; use 0, 1, 2 or 3"),
    (["+strategy=fsdp", "strategy.zero_stage=2"], "need strategy.engine=deepspeed (engine=torch)"),
])
def test_refused_before_submission(overrides, message):
    cfg = compose_run(overrides)
    with pytest.raises(ConfigError, match=re.escape(message)):
        check_supported(cfg, build_layout(cfg))


@pytest.mark.parametrize("strategy", ["zero1", "zero2", "zero3", "zero3_offload", "fsdp", "fsdp_grad_op", "hsdp"])
def test_shipped_strategies_are_supported(strategy):
    cfg = compose_run([f"+strategy={strategy}"])
    check_supported(cfg, build_layout(cfg))


def test_config_module_imports_no_torch():
    code = "import sys, spec.ds_config, spec.support, train.strategies; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
