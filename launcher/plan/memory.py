"""Memory per GPU of one run: model states, activations, buffers, overhead (pure, no torch).

Every formula is written out, with its source and the engine behaviour it models, in
docs/planner.md. Units are bytes; "GB" in messages is 1e9 bytes (as the ZeRO paper and
the cluster groups' ``gpu_mem_gb`` count: an "80 GB" GPU has 80 GiB = 85.9e9 bytes, so
comparing in 1e9 leaves a margin of about 7% for what the formulas do not see).

Ψ below is the number of parameters one rank holds before data-parallel sharding: the
heaviest pipeline stage's share, tensor-parallel matrices divided by tp.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Dict, Optional, Tuple

from spec.ac_modes import ALIASES, MODES, ac_mode
from spec.config import ClusterConfig, ModelConfig, RunConfig
from spec.layout import Layout
from launcher.plan.head import chunk_logits_bytes, loss_chunk
from spec.model_size import count_params, ffn_hidden_dim, head_dim, largest_module_params, param_breakdown
from spec.ds_config import deepspeed_config, use_bf16

GB = 1e9
ADAM = 8            # fp32 first and second moments per parameter
MASTER = 4          # fp32 master copy of a parameter (DeepSpeed ZeRO keeps one per partition)
AC_MODES = tuple(MODES)  # spec/ac_modes.py, cheapest recomputation first
# CUDA context + cuBLAS workspaces + NCCL communicator buffers per process; an assumption
# (typical figures, not measured here), counted only on GPU clusters.
CUDA_OVERHEAD = 2.0e9
# The caching allocator's fragmentation, as a share of everything allocated (assumption).
FRAGMENTATION = 0.05
# Host memory per node that offload may use when the job's is unknown (cluster.mem_gb null,
# or 0 without node_mem_gb; assumption: half of the 2 TB of an 8-GPU A100/H100 server such
# as a DGX, the rest left to the system, data loading and the page cache).
HOST_MEM_ASSUMED = 1000e9
# DeepSpeed ZeRO-3 (defaults that spec/ds_config.py keeps): a gathered parameter is not
# released when it is used again within stage3_max_reuse_distance parameters of the trace;
# the optimizer step upcasts the gradient partition to fp32 one sub_group_size at a time.
DS_MAX_REUSE = 1_000_000_000
DS_SUB_GROUP = 1_000_000_000
# torchtitan's op-level selective checkpointing (not a mode of this trainer): the planner
# models it for the comparison with torchtitan's published memory (docs/planner.md).
OP_SAC = "selective_op"


def host_budget(c: ClusterConfig) -> Tuple[Optional[float], str, bool]:
    """Host memory per node that offload may use, the fields it comes from, and whether it
    is assumed: the job's memory (mem_gb=N GB; mem_gb=0 is --mem=0, all of node_mem_gb),
    else HOST_MEM_ASSUMED on GPU clusters (None, no limit, on CPU clusters)."""
    if c.mem_gb:
        return c.mem_gb * GB, f"cluster.mem_gb={c.mem_gb}", False
    if c.mem_gb == 0 and c.node_mem_gb:
        return c.node_mem_gb * GB, f"cluster.mem_gb=0, node_mem_gb={c.node_mem_gb}", False
    given = "0, node_mem_gb=null" if c.mem_gb == 0 else "null"
    return (HOST_MEM_ASSUMED if c.accelerator == "gpu" else None), f"cluster.mem_gb={given}", True


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
    host_per_node: float = 0.0           # cpu_bytes x ranks per node
    host_limit: Optional[float] = None   # per node: host_budget(cluster)

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
        """GPU memory (and, with offload, the node's host memory) suffices."""
        return None if self.gpu_bytes is None else self.total_bytes <= self.gpu_bytes and self.host_fits

    @property
    def margin_bytes(self) -> Optional[float]:
        """Free memory left (negative: how much is missing)."""
        return None if self.gpu_bytes is None else self.gpu_bytes - self.total_bytes


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


def uses_autocast(cfg: RunConfig) -> bool:
    """DDP runs bf16 under autocast (fp32 weights and residual stream); FSDP and DeepSpeed
    hold bf16 parameters, so their whole forward is bf16."""
    return cfg.strategy.engine == "torch" and cfg.strategy.data_parallel != "fsdp" and compute_bytes(cfg) == 2


def op_sac_block_bytes(m: ModelConfig, tp: int, e: int) -> float:
    """Bytes per token one block keeps under torchtitan's op-level selective checkpointing
    (``_get_custom_policy``: the outputs of every other matmul, counted per block, and of
    the attention kernel are saved, everything else recomputed): the block input, wq h,
    wv kv, attention output h, w1 f, w2 h, all in compute dtype and sharded by tp."""
    q, kv = m.n_heads * head_dim(m), (m.n_kv_heads or m.n_heads) * head_dim(m)
    return e * (2 * m.dim + 2 * q + kv + ffn_hidden_dim(m)) / tp


def vocab_shards(layout: Layout) -> int:
    """Ranks the logits are split over: tp (train/parallelize.py keeps them sharded over the
    vocabulary and computes the loss vocab-parallel, a pipeline's last stage too)."""
    return layout.tp


def block_bytes(m: ModelConfig, tp: int, e: int, autocast: bool, checkpointed: bool) -> float:
    """Bytes one block saves for backward per token (Korthikanti et al. 2022's method
    applied to train/model.py's block: RMSNorm computed in fp32, GQA with fused attention,
    SwiGLU, no dropout).

    not checkpointed: each RMSNorm 12h (fp32 input and normalised copies, the output);
                      under autocast 14h and 12h (fp32 input and normalised, then one
                      bf16 cast of the output per consuming matmul); then in compute dtype
                      q h, k and v 2 kv, attention output h, w1 / w3 / silu / product 4f
    checkpointed:     the block input only (the residual stream: fp32 under autocast)
    Tensor parallel (train/strategies/tp.py, sequence parallel on DTensor) divides all by
    tp except the norms' outputs, which are all-gathered for the column-parallel matmuls
    and saved whole (Megatron keeps them sharded and gathers again in backward).
    In fp32 (e = 4) grouped-query K/V reach SDPA expanded to every query head (causal_attention,
    on CUDA): k and v count 2h, not 2 kv. Packed data's flex attention: alike (train/packed_attention.py).
    """
    h, f = m.dim, ffn_hidden_dim(m)
    if checkpointed:
        return (4 if autocast else e) * h / tp
    q = m.n_heads * head_dim(m)  # h, but for Qwen3's wider heads
    kv = q if e == 4 else (m.n_kv_heads or m.n_heads) * head_dim(m)
    whole = 10 * h if autocast else 2 * e * h
    norms = (26 if autocast else 24) * h
    return (norms - whole + e * (2 * q + 2 * kv + 4 * f)) / tp + whole


def checkpointed_blocks(layers: int, mode: str) -> int:
    """Blocks wrapped for recomputation (train/parallelize.py): all for full, every other
    one (blocks 0, 2, ...) for every_other, none for none."""
    return ac_mode(mode).blocks(layers)


def activation_terms(cfg: RunConfig, layout: Layout, mode: str) -> Tuple[float, float, float, float]:
    """Bytes per token of the heaviest stage: (saved, in flight, head, head gradient).

    saved:     what the stage's blocks keep from forward to backward (checkpointed: input);
    in flight: at the peak backward reaches the last block: its gradients (+1 block)
               and, if that block is checkpointed, its recomputed activations (+1 block);
    head:      the output layer: the final norm 12h (its output gathered whole), the
               logits in compute dtype and the fp32 log-softmax cross-entropy keeps,
               (e + 4) x vocab / v (v = :func:`vocab_shards`: the vocab-parallel loss);
    head gradient: the log-softmax's fp32 gradient, 4 x vocab / v (chunked: launcher/plan/head.py).
    ``mode`` may also be :data:`OP_SAC` (torchtitan's op-level selective checkpointing)."""
    m = cfg.model
    e, autocast = compute_bytes(cfg), uses_autocast(cfg)
    layers = math.ceil(m.n_layers / layout.pp)
    full, kept = (block_bytes(m, layout.tp, e, autocast, c) for c in (False, True))
    if mode == OP_SAC:
        ckpt, kept, last_recomputed = layers, op_sac_block_bytes(m, layout.tp, e), True
    else:
        ckpt = checkpointed_blocks(layers, mode)
        last_recomputed = ac_mode(mode).recomputes(layers - 1)
    saved = ckpt * kept + (layers - ckpt) * full
    flight = full + (full if last_recomputed else 0.0)
    v, vocab = vocab_shards(layout), 0 if loss_chunk(cfg, layout) else m.vocab_size  # chunked: plan/head.py
    head = (12 - e) * m.dim / layout.tp + e * m.dim + (e + 4) * vocab / v
    return saved, flight, head, 4.0 * vocab / v


def pipeline_held(cfg: RunConfig, layout: Layout) -> Tuple[int, int]:
    """Micro-batches whose saved tensors the (first, last) stage holds at its peak: GPipe
    runs every forward before the first backward (m, m); 1F1B starts the backward of a
    micro-batch after p - s warm-up forwards on stage s (min(p, m), 1). Interleaved 1F1B
    is counted as 1F1B (not measured)."""
    m = cfg.strategy.pp_microbatches
    return (m, m) if cfg.strategy.pp_schedule == "gpipe" else (min(layout.pp, m), 1)


def activation_bytes(cfg: RunConfig, layout: Layout, mode: str) -> float:
    """Activations on the heaviest rank for one micro-step (gradient accumulation reuses
    them): tokens x (saved + in flight + head + head gradient) of :func:`activation_terms`.

    Pipeline (train/strategies/pp.py runs the rank's whole step, micro_batch_size x
    grad_accum sequences, as one schedule of m = pp_microbatches micro-batches): the
    heaviest of these, each measured on CPU (docs/planner.md), per stage
      first: the held micro-batches' saved tensors, one block in flight, and the gradient
             receive buffers PipelineStage allocates for all m micro-batches (the whole
             step's residual stream: 4 B under autocast, else e; / tp);
      middle (pp > 2): one micro-batch less than the first, all three kinds of buffers;
      last:  the same for the blocks and the head, and the activation receive buffers of
             all m micro-batches with the gradients autograd accumulates in them (kept
             until the next step).
    pp.py calls schedule.step(return_outputs=False): with the default the last stage kept
    every micro-batch's logits (``output_chunks``) and concatenated them into a second
    copy after the last backward, two more copies of the step's logits (measured, then
    removed). The schedule's ``losses`` (m scalars) and the token ids are negligible."""
    m, s, t = cfg.model, cfg.strategy, cfg.train
    saved, flight, head, grad = activation_terms(cfg, layout, mode)
    e, n = compute_bytes(cfg), s.pp_microbatches
    if layout.pp == 1:
        return t.micro_batch_size * t.seq_len * (saved + flight + head + grad) + chunk_logits_bytes(cfg, layout, e)
    step = t.micro_batch_size * t.grad_accum * t.seq_len
    micro = step / n
    hidden = step * (4 if uses_autocast(cfg) else e) * m.dim / layout.tp
    first_held, last_held = pipeline_held(cfg, layout)
    first = micro * (first_held * saved + flight) + hidden
    # a middle stage (pp > 2) holds one micro-batch less than the first and all three buffers
    middle = micro * ((n if s.pp_schedule == "gpipe" else min(layout.pp - 1, n)) * saved + flight) + 3 * hidden
    last = micro * (last_held * (saved + head) + flight + grad) + 2 * hidden
    return max(first, middle if layout.pp > 2 else 0.0, last)


def _torch_states(cfg: RunConfig, layout: Layout, psi: int, block: int, root: int, e: int):
    """DDP keeps fp32 params, grads (views of its buckets) and Adam, plus autocast's bf16
    casts of the weights, saved for backward. FSDP2 shards fp32 params, grads, Adam over
    dp_shard (hybrid: replicated across dp_replicate) and gathers units in compute dtype.
    A DDP-wrapped pipeline stage (dp > 1) accumulates its gradients outside the buckets:
    the schedule runs every backward but the last under no_sync after zero_grad(set_to_none)
    and the last one copies them in, so the buckets (4 Ψ) are a second copy meanwhile."""
    s = cfg.strategy
    if s.data_parallel != "fsdp":
        casts = e * psi if e < 4 else 0.0
        no_sync = 4.0 * psi if layout.pp > 1 and layout.dp > 1 and s.pp_microbatches > 1 else 0.0
        return 4.0 * psi, 4.0 * psi, ADAM * psi, casts + no_sync, 0.0, 1
    d = layout.dp_shard
    p, g, o = 4.0 * psi / d, 4.0 * psi / d, ADAM * psi / d
    # Live at the activation peak (start of backward): the root unit, which FSDP2 keeps
    # gathered from forward to backward, the last block and the prefetched one, and the
    # first block's unsharded gradient plus its fp32 copy for the reduce-scatter. Grad-op
    # (no reshard after forward) keeps every gathered block until its backward.
    gathered = e * psi if not s.reshard_after_forward else e * (root + 2 * block)
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
    ``psi`` parameters before data-parallel sharding (the engines' model, above)."""
    e = compute_bytes(cfg)
    if cfg.strategy.engine == "deepspeed":
        return _deepspeed_states(cfg, layout, psi, e)
    _, block, root = stage_params(cfg.model, layout.tp, layout.pp)
    return _torch_states(cfg, layout, psi, block, root, e)


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
    return Memory(strategy=s.name, params=count_params(cfg.model), stage_params=psi, dp_degree=layout.dp,
                  shard_degree=shard, param_bytes=p, grad_bytes=g, optimizer_bytes=o, activation_bytes=act,
                  activations_by_mode=acts, buffer_bytes=buffers, overhead_bytes=overhead, init_bytes=init,
                  cpu_bytes=cpu, gpu_bytes=gpu_bytes, notes=tuple(notes), host_per_node=cpu * c.gpus_per_node,
                  host_limit=host_limit)
