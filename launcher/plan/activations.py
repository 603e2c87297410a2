"""Activations per GPU for each checkpointing mode (pure, no torch; part of the memory
model of :mod:`launcher.plan.memory`): what each block saves for backward, the output
layer, and the pipeline schedules' held micro-batches and receive buffers. Every
formula, with its source and measurements: docs/planner.md, "Activations".
"""
from __future__ import annotations

import math
from typing import Tuple

from spec.ac_modes import MODES, ac_mode
from spec.config import ModelConfig, RunConfig
from spec.layout import Layout
from launcher.plan.head import chunk_logits_bytes, loss_chunk
from launcher.plan.states import compute_bytes
from spec.model_size import ffn_hidden_dim, head_dim

AC_MODES = tuple(MODES)  # spec/ac_modes.py, cheapest recomputation first
# torchtitan's op-level selective checkpointing (not a mode of this trainer): the planner
# models it for the comparison with torchtitan's published memory (docs/planner.md).
OP_SAC = "selective_op"


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
    if layout.pp == 1:  # context parallel: a rank holds seq_len / cp tokens of everything (train/context_parallel.py)
        tokens = t.micro_batch_size * t.seq_len / layout.cp
        return tokens * (saved + flight + head + grad) + chunk_logits_bytes(cfg, layout, e)
    step = t.micro_batch_size * t.grad_accum * t.seq_len
    micro = step / n
    hidden = step * (4 if uses_autocast(cfg) else e) * m.dim / layout.tp
    first_held, last_held = pipeline_held(cfg, layout)
    first = micro * (first_held * saved + flight) + hidden
    # a middle stage (pp > 2) holds one micro-batch less than the first and all three buffers
    middle = micro * ((n if s.pp_schedule == "gpipe" else min(layout.pp - 1, n)) * saved + flight) + 3 * hidden
    last = micro * (last_held * (saved + head) + flight + grad) + 2 * hidden
    return max(first, middle if layout.pp > 2 else 0.0, last)

