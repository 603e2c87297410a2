"""Memory per GPU of one run: model states, activations, buffers, overhead, and the host
memory per node beside it (pure, no torch).

Every formula is written out, with its source and the engine behaviour it models, in
docs/planner.md. Units are bytes; "GB" in messages is 1e9 bytes (as the ZeRO paper and
the cluster groups' ``gpu_mem_gb`` count: an "80 GB" GPU has 80 GiB = 85.9e9 bytes, so
comparing in 1e9 leaves a margin of about 7% for what the formulas do not see).

The terms live in modules by concern, all importable from here as before:
:mod:`.states` (parameters, gradients, optimizer states, the engines' buffers),
:mod:`.activations` (per checkpointing mode), :mod:`.host` (host memory per node: the
budget, the async checkpoint's snapshot) and :mod:`.state_bytes` (one rank's checkpoint
state). This module sums them: :class:`Memory`, :func:`estimate`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, Optional, Tuple

from spec.ac_modes import ALIASES
from spec.config import RunConfig
from spec.layout import Layout
from spec.model_size import count_params
from launcher.plan.activations import (AC_MODES, OP_SAC, activation_bytes, activation_terms,  # noqa: F401
                                       block_bytes, checkpointed_blocks, op_sac_block_bytes, pipeline_held,
                                       uses_autocast, vocab_shards)
from launcher.plan.host import GB, HOST_MEM_ASSUMED, host_budget, snapshot_bytes  # noqa: F401
from launcher.plan.state_bytes import state_bytes_per_rank  # noqa: F401
from launcher.plan.states import (ADAM, DS_MAX_REUSE, DS_SUB_GROUP, MASTER, compute_bytes,  # noqa: F401
                                  fp32_grad_copy, model_states, stage_params, zero3_gathered, zero_paper_bytes)

# CUDA context + cuBLAS workspaces + NCCL communicator buffers per process; an assumption
# (typical figures, not measured here), counted only on GPU clusters.
CUDA_OVERHEAD = 2.0e9
# The caching allocator's fragmentation, as a share of everything allocated (assumption).
FRAGMENTATION = 0.05


@dataclass(frozen=True)
class Memory:
    """Predicted bytes per GPU of one strategy; the largest rank (heaviest pipeline stage)."""

    strategy: str
    params: int                # whole model
    stage_params: int          # Ψ: one rank's parameters before data-parallel sharding
    dp_degree: int             # ranks that see different data
    shard_degree: int          # ranks model states are sharded over (1 = replicated)
    param_bytes: float
    grad_bytes: float
    optimizer_bytes: float
    activation_bytes: float    # for the configured activation_checkpointing mode
    activations_by_mode: Dict[str, float]
    buffer_bytes: float        # all-gathered layers, communication buckets, autocast casts
    overhead_bytes: float      # CUDA/NCCL context and allocator fragmentation
    init_bytes: float          # peak while the engine materialises the model
    cpu_bytes: float           # per rank, in host memory (offload)
    gpu_bytes: Optional[float]
    notes: Tuple[str, ...] = field(default=())
    host_per_node: float = 0.0           # (cpu_bytes + snapshot_bytes) x ranks per node
    host_limit: Optional[float] = None   # per node: host_budget(cluster)
    snapshot_bytes: float = 0.0          # per rank, in host memory: the async checkpoint's snapshot
    snapshot_per_node: float = 0.0       # snapshot_bytes x ranks per node

    @property
    def host_fits(self) -> bool:
        return self.host_limit is None or self.host_per_node <= self.host_limit

    @property
    def model_state_bytes(self) -> float:
        return self.param_bytes + self.grad_bytes + self.optimizer_bytes

    @property
    def total_bytes(self) -> float:
        return max(self.init_bytes, self.model_state_bytes + self.activation_bytes + self.buffer_bytes
                   + self.overhead_bytes)

    @property
    def fits(self) -> Optional[bool]:
        """GPU memory and the node's host memory (offload, the async snapshot) suffice."""
        return None if self.gpu_bytes is None else self.total_bytes <= self.gpu_bytes and self.host_fits

    @property
    def margin_bytes(self) -> Optional[float]:
        """Free memory left (negative: how much is missing)."""
        return None if self.gpu_bytes is None else self.gpu_bytes - self.total_bytes


def estimate(cfg: RunConfig, layout: Layout, mode: Optional[str] = None) -> Memory:
    """Predicted memory per GPU of ``cfg`` laid out as ``layout``; ``mode``: the activation
    checkpointing counted (default: the config's; :data:`OP_SAC` for torchtitan's)."""
    s = cfg.strategy
    psi = stage_params(cfg.model, layout.tp, layout.pp)[0]
    notes = []
    p, g, o, buffers, cpu, shard = model_states(cfg, layout, psi)
    if s.engine == "deepspeed":
        if s.zero_stage == 3 and not cfg.model.tie_embeddings:
            # built under zero.Init: each rank allocates its partition plus one module's
            # parameters at a time (train/strategies/deepspeed.py), all below the step's peak
            init = p
        else:
            # stages 0-2 (and a tied model at stage 3) build the whole model on every rank, in
            # the compute dtype, before deepspeed.initialize partitions it; its flattened copy
            # is made on the GPU only when memory allows (else on the host: stage_1_and_2.py)
            init = compute_bytes(cfg) * float(psi)
            notes.append("deepspeed builds the whole model on every rank before partitioning (stages 0-2, or "
                         "tied embeddings)")
    else:
        init = p
    mode = mode or s.activation_checkpointing
    acts = {m: activation_bytes(cfg, layout, m) for m in dict.fromkeys((*AC_MODES, *ALIASES, mode))}
    act = acts[mode]
    gpu = cfg.cluster.accelerator == "gpu"
    overhead = (CUDA_OVERHEAD + FRAGMENTATION * (p + g + o + act + buffers)) if gpu else 0.0
    c = cfg.cluster
    gpu_bytes = c.gpu_mem_gb * GB if c.gpu_mem_gb else None
    host_limit = host_budget(c)[0]
    snapshot = snapshot_bytes(cfg, layout)
    return Memory(strategy=s.name, params=count_params(cfg.model), stage_params=psi, dp_degree=layout.dp,
                  shard_degree=shard, param_bytes=p, grad_bytes=g, optimizer_bytes=o, activation_bytes=act,
                  activations_by_mode=acts, buffer_bytes=buffers, overhead_bytes=overhead, init_bytes=init,
                  cpu_bytes=cpu, gpu_bytes=gpu_bytes, notes=tuple(notes),
                  host_per_node=(cpu + snapshot) * c.gpus_per_node, host_limit=host_limit, snapshot_bytes=snapshot,
                  snapshot_per_node=snapshot * c.gpus_per_node)
