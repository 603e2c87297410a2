"""Model states per GPU: parameters, gradients, optimizer states and the engines' buffers
(pure, no torch; part of the memory model of :mod:`launcher.plan.memory`).

Ψ below is the number of parameters one rank holds before data-parallel sharding: the
heaviest pipeline stage's share, tensor-parallel matrices divided by tp. Every formula,
with its source and the engine behaviour it models: docs/planner.md, "Model states".
"""
from __future__ import annotations

import math
from typing import Tuple

from spec.config import ModelConfig, RunConfig
from spec.layout import Layout
from spec.model_size import largest_module_params, param_breakdown
from spec.ds_config import deepspeed_config, use_bf16
from spec.peft import adapter_params, lora_enabled
from launcher.plan.float8 import converted, converted_total, gather_saving

ADAM = 8            # fp32 first and second moments per parameter
MASTER = 4          # fp32 master copy of a parameter (DeepSpeed ZeRO keeps one per partition)
# DeepSpeed ZeRO-3 (defaults that spec/ds_config.py keeps): a gathered parameter is not
# released when it is used again within stage3_max_reuse_distance parameters of the trace;
# the optimizer step upcasts the gradient partition to fp32 one sub_group_size at a time.
DS_MAX_REUSE = 1_000_000_000
DS_SUB_GROUP = 1_000_000_000


def zero_paper_bytes(psi: float, stage: int, n: int, k: int = 12) -> Tuple[float, float, float]:
    """(params, grads, optimizer) bytes per GPU by the ZeRO paper (Rajbhandari et al. 2020,
    Fig. 1): mixed-precision Adam holds 2Ψ fp16 params, 2Ψ fp16 grads and KΨ optimizer
    states (fp32 params, momentum, variance: K=12). Stage 1 shards the K part over n,
    stage 2 also the gradients, stage 3 also the parameters; stage 0 is plain DDP."""
    p, g, o = 2.0 * psi, 2.0 * psi, float(k) * psi
    if stage >= 1:
        o /= n
    if stage >= 2:
        g /= n
    if stage >= 3:
        p /= n
    return p, g, o


def compute_bytes(cfg: RunConfig) -> int:
    """Bytes of one activation / low-precision parameter element: 2 (bf16) or 4 (fp32)."""
    device = "cuda" if cfg.cluster.accelerator == "gpu" else "cpu"
    return 2 if use_bf16(cfg.strategy.mixed_precision, device) else 4


def stage_params(m: ModelConfig, tp: int, pp: int) -> Tuple[int, int, int]:
    """(Ψ of the heaviest pipeline stage, one block, the root unit) for tp x pp.

    Tensor parallel splits every matrix (vocab-parallel embedding and head, as torchtitan
    does) and replicates the norms. Pipeline stages take ceil(layers/pp) blocks; the first
    also the embedding, the last the final norm and head (a tied head is a second copy
    there). The root unit is what FSDP's root module holds besides the blocks (embedding,
    final norm, head): train/strategies/fsdp.py wraps each block, then the root."""
    b = param_breakdown(m)
    block = b.layer_matrices // tp + b.layer_norms
    embed = b.embedding // tp
    head = (b.head or (b.embedding if pp > 1 else 0)) // tp
    if pp == 1:
        root = embed + b.final_norm + head
        return m.n_layers * block + root, block, root
    blocks = math.ceil(m.n_layers / pp) * block
    root = max(embed, head + b.final_norm)
    return blocks + root, block, root



def _torch_states(cfg: RunConfig, layout: Layout, psi: int, block: int, root: int, e: int):
    """DDP keeps fp32 params, grads (views of its buckets) and Adam, plus autocast's bf16
    casts of the weights, saved for backward. FSDP2 shards fp32 params, grads, Adam over
    dp_shard (hybrid: replicated across dp_replicate) and gathers units in compute dtype.
    A DDP-wrapped pipeline stage (dp > 1) accumulates its gradients outside the buckets:
    the schedule runs every backward but the last under no_sync after zero_grad(set_to_none)
    and the last one copies them in, so the buckets (4 Ψ) are a second copy meanwhile."""
    s = cfg.strategy
    if s.data_parallel != "fsdp":  # float8's Linears save their fp32 weight, no cast (launcher/plan/float8.py)
        casts = e * (psi - converted_total(cfg, layout)) if e < 4 else 0.0
        no_sync = 4.0 * psi if layout.pp > 1 and layout.dp > 1 and s.pp_microbatches > 1 else 0.0
        return 4.0 * psi, 4.0 * psi, ADAM * psi, casts + no_sync, 0.0, 1
    d = layout.dp_shard * layout.cp  # context parallel's ranks shard too (train/mesh.py)
    p, g, o = 4.0 * psi / d, 4.0 * psi / d, ADAM * psi / d
    # Live at the activation peak (start of backward): the root unit, which FSDP2 keeps
    # gathered from forward to backward, the last block and the prefetched one, and the
    # first block's unsharded gradient plus its fp32 copy for the reduce-scatter. Grad-op
    # (no reshard after forward) keeps every gathered block until its backward.
    gathered = e * psi if not s.reshard_after_forward else e * (root + 2 * block)
    # converted weights gathered in float8 (FSDP's float8 all-gather): launcher/plan/float8.py
    (cb, ch), w = converted(cfg, layout), gather_saving(cfg, layout, e)
    gathered -= w * (converted_total(cfg, layout) if not s.reshard_after_forward else ch + 2 * cb)
    return p, g, o, gathered + (e + 4.0) * block, 0.0, d


def _deepspeed_states(cfg: RunConfig, layout: Layout, psi: int, e: int):
    """What DeepSpeed 0.19 holds (measured, bench/planner.py): stage 1 and 2 keep the
    module's params (e Ψ), the reduced gradient partition (e Ψ/N) and, at the step, its fp32
    copy (4 Ψ/N), an fp32 master partition and Adam (12 Ψ/N): fp32 4 + 20/N, bf16 2 + 18/N.
    Stage 1 with gradient accumulation reduces only at the boundary: the full gradients
    (e Ψ) accumulate between micro-steps. Stage 3 partitions the params too and upcasts the
    gradient partition to fp32 one sub-group (sub_group_size) at a time: (2e + 12)/N +
    4 min(Ψ/N, sub group). Offloading the optimizer moves the gradient partition, its fp32
    copy, the master and Adam to host memory. Stage 0 keeps fp32 params, grads and Adam
    (bf16: BF16_Optimizer's bf16 params and grads, fp32 master and accumulated grads)."""
    s, n = cfg.strategy, layout.dp
    zero = deepspeed_config(cfg, n, "cuda" if cfg.cluster.accelerator == "gpu" else "cpu")["zero_optimization"]
    bucket = min(zero.get("reduce_bucket_size", 0), psi)
    if s.zero_stage == 0:
        if e == 4:
            return 4.0 * psi, 4.0 * psi, ADAM * psi, 0.0, 0.0, 1
        return 2.0 * psi, 6.0 * psi, (MASTER + ADAM) * psi, 0.0, 0.0, 1
    p = e * psi / (n if s.zero_stage == 3 else 1)
    o, cpu = (MASTER + ADAM) * psi / n, 0.0
    if s.zero_stage < 3:
        g = (e + 4.0) * psi / n
        if s.zero_stage == 1 and cfg.train.grad_accum > 1 and layout.pp == 1:
            g = max(g, e * psi)  # the full gradients, until the boundary's backward reduces them
        # the reduce bucket, doubled when overlap_comm double-buffers it (GPU)
        buffers = e * bucket * (2 if zero.get("overlap_comm") else 1)
        if s.offload_optimizer:  # fp32 master, Adam and fp32 grads move to pinned host memory
            cpu, g, o = o + 4.0 * psi / n, e * psi / n, 0.0
    else:
        g = e * psi / n + 4.0 * min(psi / n, DS_SUB_GROUP)
        buffers = e * (bucket + min(zero["stage3_prefetch_bucket_size"], psi)) + zero3_gathered(cfg, layout, psi, e)
        if s.offload_optimizer:  # the gradient partition buffer lives on the host (stage3.py: self.device)
            cpu, g, o = o + (e + 4.0) * psi / n, 0.0, 0.0
    if s.offload_params:
        cpu += p
        p = 0.0
    return p, g, o, buffers, cpu, n


def fp32_grad_copy(cfg: RunConfig, layout: Layout, psi: int) -> float:
    """The part of :func:`model_states`' gradients that DeepSpeed holds only at the optimizer
    step: the fp32 copy of the gradient partition (4Ψ/N at stages 1-2, 4 min(Ψ/N,
    sub_group_size) at stage 3), a temporary buffer (the ZeRO paper's residual states, not
    its model states). None at stage 0, under optimizer offload (on the host) and where
    stage 1's accumulated full gradients are the larger term."""
    s, n, e = cfg.strategy, layout.dp, compute_bytes(cfg)
    if s.engine != "deepspeed" or s.zero_stage == 0 or s.offload_optimizer:
        return 0.0
    if s.zero_stage == 3:
        return 4.0 * min(psi / n, DS_SUB_GROUP)
    if s.zero_stage == 1 and cfg.train.grad_accum > 1 and layout.pp == 1 and e * psi >= (e + 4.0) * psi / n:
        return 0.0
    return 4.0 * psi / n


def zero3_gathered(cfg: RunConfig, layout: Layout, psi: int, e: int, reuse_cache: bool = True) -> float:
    """ZeRO-3's gathered parameters beyond the partition: the largest module gathered and its
    unsharded gradient before the reduce-scatter (2e x largest: DeepSpeed's estimators count
    4 x largest layer in fp16), and with ``reuse_cache`` the parameters kept gathered because
    their next use comes within stage3_max_reuse_distance of the trace (at the turn from
    forward to backward: the last modules, about half that distance, at least the head)."""
    largest = largest_module_params(cfg.model) / layout.tp
    cache = max(0.0, min(psi, DS_MAX_REUSE / 2) - largest) if reuse_cache else 0.0
    return e * (2 * largest + cache)


def model_states(cfg: RunConfig, layout: Layout, psi: int):
    """(params, grads, optimizer, buffers, host bytes, shard degree) of one rank holding
    ``psi`` parameters before data-parallel sharding (the engines' model, above); with
    LoRA (``peft.method``) the frozen base and the adapters (:func:`_lora_states`)."""
    e = compute_bytes(cfg)
    if cfg.strategy.engine == "deepspeed":
        states = _deepspeed_states(cfg, layout, psi, e)
    else:
        _, block, root = stage_params(cfg.model, layout.tp, layout.pp)
        states = _torch_states(cfg, layout, psi, block, root, e)
    if lora_enabled(cfg):
        return _lora_states(cfg, layout, psi, states)
    return states


def _lora_states(cfg: RunConfig, layout: Layout, psi: int, full):
    """LoRA (train/lora.py): the base is frozen, held as the engine holds parameters (fp32
    under DDP and FSDP, the compute dtype under DeepSpeed; sharded as the engine shards
    them) with no gradient and no optimizer state; the adapters (:func:`spec.peft.adapter_params`)
    train, and hold what the engine holds for a model of their size: parameters, gradients,
    Adam (and DeepSpeed's fp32 master). The buffers stay the base's (the gathered units,
    conservatively with their gradients); the host holds the adapters' offloaded states
    and, with ``offload_params``, the base."""
    e, s = compute_bytes(cfg), cfg.strategy
    a = adapter_params(cfg)
    if s.engine == "deepspeed":
        ap, ag, ao, _, acpu, _ = _deepspeed_states(cfg, layout, a, e)
    else:
        ap, ag, ao, _, acpu, _ = _torch_states(cfg, layout, a, 0, 0, e)
    p, _, _, buffers, _, shard = full
    base_host = e * psi / layout.dp if s.engine == "deepspeed" and s.offload_params else 0.0
    return p + ap, ag, ao, buffers, acpu + base_host, shard

