"""Attention keeps a fused kernel in every precision, and fp32 matmuls follow strategy.tf32.

On CUDA, SDPA's ``enable_gqa`` is taken by FlashAttention only (fp16/bf16); in fp32 a
grouped-query model fell to the math kernel, which builds the whole S x S scores. The
model now expands K/V to the query's heads there (train/model.py:causal_attention), and
the planner counts the expanded K/V it saves. CUDA is stood in for by the predicate
:func:`train.model.fused_gqa`, which the tests set as a CUDA fp32 run would find it.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from helpers import compose_run
from launcher.plan.memory import block_bytes
from train import model as model_mod
from train.strategies.base import matmul_precision


def test_fused_gqa_is_refused_by_cuda_in_fp32_only():
    assert not model_mod.fused_gqa("cuda", torch.float32)
    assert model_mod.fused_gqa("cuda", torch.bfloat16) and model_mod.fused_gqa("cuda", torch.float16)
    assert model_mod.fused_gqa("cpu", torch.float32)


def _qkv(heads=8, kv_heads=2, seq=16, dim=8):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, heads, seq, dim, generator=g, requires_grad=True)
    k = torch.randn(2, kv_heads, seq, dim, generator=g, requires_grad=True)
    v = torch.randn(2, kv_heads, seq, dim, generator=g, requires_grad=True)
    return q, k, v


def test_without_a_fused_gqa_kernel_k_and_v_reach_sdpa_expanded_with_the_same_result(monkeypatch):
    q, k, v = _qkv()
    grouped = model_mod.causal_attention(q, k, v)  # CPU: enable_gqa as it is
    grads = torch.autograd.grad(grouped.square().sum(), (q, k, v))

    seen = []
    real = F.scaled_dot_product_attention

    def spy(q_, k_, v_, **kw):
        seen.append((q_.shape[1], k_.shape[1], v_.shape[1], kw.get("enable_gqa")))
        return real(q_, k_, v_, **kw)

    monkeypatch.setattr(model_mod, "fused_gqa", lambda device_type, dtype: False)  # as CUDA in fp32
    monkeypatch.setattr(model_mod.F, "scaled_dot_product_attention", spy)
    expanded = model_mod.causal_attention(q, k, v)
    assert seen == [(8, 8, 8, False)]  # every head given, no grouped-query path asked of the kernel
    torch.testing.assert_close(expanded, grouped, rtol=1e-6, atol=1e-6)
    for a, b in zip(torch.autograd.grad(expanded.square().sum(), (q, k, v)), grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)  # the expansion's backward sums the groups


def test_a_grouped_query_model_gives_the_same_loss_either_way(monkeypatch):
    cfg = compose_run(["model.n_heads=4", "model.n_kv_heads=2"]).model
    net = model_mod.build_model(cfg)
    model_mod.materialise([net], 0, torch.device("cpu"))
    tokens = torch.randint(0, cfg.vocab_size, (2, 16))
    fused = net(tokens)
    monkeypatch.setattr(model_mod, "fused_gqa", lambda device_type, dtype: False)
    torch.testing.assert_close(net(tokens), fused, rtol=1e-5, atol=1e-5)


def test_the_planner_counts_the_expanded_k_and_v_in_fp32_only():
    gqa = compose_run(["+model=llama3_8b"]).model  # 32 query heads, 8 K/V heads
    mha = dataclasses.replace(gqa, n_kv_heads=None)
    assert block_bytes(gqa, 1, 4, False, False) == block_bytes(mha, 1, 4, False, False)
    assert block_bytes(gqa, 1, 2, False, False) < block_bytes(mha, 1, 2, False, False)


@pytest.fixture
def saved_precision():
    before = torch.get_float32_matmul_precision()
    yield
    torch.set_float32_matmul_precision(before)


@pytest.mark.parametrize("tf32,setting,name", [(True, "high", "tf32"), (False, "highest", "fp32")])
def test_tf32_follows_the_strategy_on_cuda(saved_precision, tf32, setting, name):
    cfg = compose_run([f"strategy.tf32={str(tf32).lower()}"])
    torch.set_float32_matmul_precision("medium")
    assert matmul_precision(cfg, torch.device("cuda")) == name  # a device name: no CUDA needed to set it
    assert torch.get_float32_matmul_precision() == setting


def test_cpu_runs_are_ieee_fp32_and_the_setting_is_left_alone(saved_precision):
    torch.set_float32_matmul_precision("highest")
    assert matmul_precision(compose_run(["strategy.tf32=true"]), torch.device("cpu")) == "fp32"
    assert torch.get_float32_matmul_precision() == "highest"
