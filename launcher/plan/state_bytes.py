"""One rank's checkpoint state, in bytes (pure, no torch): what a save of the built-in
trainer holds per rank, and the host memory the async save's snapshot keeps for it.

The torch engines save ``AppState`` (train/checkpoint/state.py): the engine's
``state_dict()``, torch's ``get_state_dict`` over the model and its AdamW, the optimizer
state flattened and keyed by parameter name (train/strategies/base.py, pp.py). Per
parameter tensor of the rank that is the parameter as the engine holds it, in fp32
whatever ``mixed_precision`` (DDP and TP keep fp32 weights and compute under autocast;
FSDP2's MixedPrecisionPolicy casts to bf16 only for compute, its sharded parameters stay
fp32), AdamW's ``exp_avg`` and ``exp_avg_sq`` of the same shape in fp32, and its ``step``,
a float32 scalar: 12 bytes a parameter + 4 a tensor. A head tied to the embedding is one
tensor under two keys of the model's state dict (``tok_embeddings.weight`` and
``output.weight``), with one optimizer state.

The rank's share (the heaviest rank, as :func:`launcher.plan.states.stage_params` picks
the heaviest pipeline stage): tensor parallel splits each matrix along the dim its plan
shards (train/strategies/tp.py: colwise dim 0, rowwise dim 1, the vocab-parallel
embedding and head dim 0; the norms stay whole), FSDP2 then splits dim 0 of that over
dp_shard (``torch.chunk``: the first ranks take ``ceil(rows / dp_shard)``), DDP and the
replicas of HSDP hold it whole.

The async save (train/checkpoint/async_save.py, ``Snapshot``) copies every tensor of that
state into a host buffer of its own (one per state-dict key), kept from save to save; on
GPU clusters page-locked through torch's caching host allocator, which rounds each
allocation up to a power of two (``CachingHostAllocator.h``: ``PowerOf2Ceil`` below
``pinned_max_round_threshold``, unlimited by default): :func:`snapshot_bytes_per_rank`.
On CPU the buffers are plain memory of the tensors' size.

DeepSpeed engines write their own files and never save asynchronously
(train/checkpoint/deepspeed_io.py): :func:`state_bytes_per_rank` gives an estimate for
them (below), :func:`snapshot_bytes_per_rank` nothing.
"""
from __future__ import annotations

import math
from typing import Callable, List, Optional, Tuple

from launcher.plan.states import ADAM, MASTER, compute_bytes, stage_params
from spec.config import ModelConfig, RunConfig
from spec.layout import Layout
from spec.model_size import ffn_hidden_dim, head_dim

FP32 = 4    # bytes of a parameter as the torch engines hold it (and of each AdamW moment)
STEP = 4    # AdamW's step counter of one parameter tensor (a float32 scalar)

# One parameter tensor: (shape, the dim tensor parallel shards or None: whole on every TP rank)
Param = Tuple[Tuple[int, ...], Optional[int]]


def block_params(m: ModelConfig) -> List[Param]:
    """The parameters of one block of train/model.py, with the dim tp.py's plan shards."""
    hd, kv = head_dim(m), m.n_kv_heads or m.n_heads
    q, k, f = m.n_heads * hd, kv * hd, ffn_hidden_dim(m)
    out: List[Param] = [((m.dim,), None), ((q, m.dim), 0), ((k, m.dim), 0), ((k, m.dim), 0), ((m.dim, q), 1),
                        ((m.dim,), None), ((f, m.dim), 0), ((m.dim, f), 1), ((f, m.dim), 0)]
    if m.qkv_bias:  # sharded with their ColwiseParallel linears
        out += [((q,), 0), ((k,), 0), ((k,), 0)]
    if m.qk_norm:
        out += [((hd,), None), ((hd,), None)]
    return out


# A stage's parameters: (blocks, the parameters of one block, the others), the others
# being (tensor, keys): a tied head's weight is one tensor under two state-dict keys.
Stage = Tuple[int, List[Param], List[Tuple[Param, int]]]


def stages(m: ModelConfig, pp: int) -> List[Stage]:
    """The stages that may be the heaviest: the whole model (pp = 1), else ceil(layers / pp)
    blocks with the embedding (first stage) or with the final norm and the head (last
    stage; a tied head is its own tensor there), as :func:`launcher.plan.states.stage_params`."""
    embed, norm, head = ((m.vocab_size, m.dim), 0), ((m.dim,), None), ((m.vocab_size, m.dim), 0)
    if pp == 1:
        tied = m.tie_embeddings  # output.weight is tok_embeddings.weight: one tensor, two keys
        return [(m.n_layers, block_params(m), [(embed, 2 if tied else 1), (norm, 1)] + ([] if tied else [(head, 1)]))]
    blocks = math.ceil(m.n_layers / pp)
    return [(blocks, block_params(m), [(embed, 1)]), (blocks, block_params(m), [(norm, 1), (head, 1)])]


def local_elements(param: Param, tp: int, shard: int) -> int:
    """Elements of ``param`` on the heaviest rank: its tp chunk, then dim 0's first chunk
    of ``shard`` (FSDP2; 1 = whole)."""
    shape, dim = list(param[0]), param[1]
    if dim is not None:
        shape[dim] = -(-shape[dim] // tp)
    shape[0] = -(-shape[0] // shard)
    return math.prod(shape)


def shard_degree(cfg: RunConfig, layout: Layout) -> int:
    """Ranks a torch engine shards each parameter over: dp_shard (x cp: train/mesh.py) with FSDP2, else 1."""
    return layout.dp_shard * layout.cp if cfg.strategy.data_parallel == "fsdp" else 1


def tensor_bytes(param: Param, keys: int, tp: int, shard: int) -> List[int]:
    """The state dict's tensors for one parameter, in bytes: the parameter under each of
    its ``keys``, AdamW's exp_avg and exp_avg_sq (fp32, its shape) and step (a scalar)."""
    size = FP32 * local_elements(param, tp, shard)
    return [size] * keys + [size, size, STEP]


def state_sum(cfg: RunConfig, layout: Layout, each: Callable[[int], int]) -> int:
    """The heaviest stage's sum of ``each`` over the tensors of one rank's state dict (torch
    engines): ``each`` the bytes a tensor of so many bytes takes."""
    shard, tp = shard_degree(cfg, layout), layout.tp
    sums = []
    for blocks, block, others in stages(cfg.model, layout.pp):
        per_block = sum(each(b) for p in block for b in tensor_bytes(p, 1, tp, shard))
        sums.append(blocks * per_block + sum(each(b) for p, keys in others for b in tensor_bytes(p, keys, tp, shard)))
    return max(sums)


def state_bytes_per_rank(cfg: RunConfig, layout: Layout) -> float:
    """Bytes of one rank's checkpoint state dict, the heaviest rank's (module docstring).

    Torch engines: 12 bytes a parameter of the rank's share (fp32 parameter, AdamW's two
    fp32 moments) and 4 a tensor (AdamW's step), a tied head's weight twice (pp = 1).
    DeepSpeed (an estimate; its files are its own): data-parallel rank 0 writes the
    module's weights in the compute dtype (its partition at ZeRO-3) and every rank its
    fp32 master and AdamW partition, 12 Ψ/dp (12 Ψ at stage 0)."""
    if cfg.strategy.engine == "deepspeed":
        psi, stage, n = stage_params(cfg.model, layout.tp, layout.pp)[0], cfg.strategy.zero_stage, layout.dp
        return (MASTER + ADAM) * psi / (n if stage else 1) + compute_bytes(cfg) * psi / (n if stage == 3 else 1)
    return float(state_sum(cfg, layout, lambda b: b))


def pinned(nbytes: int) -> int:
    """Bytes torch's caching host allocator takes for a page-locked buffer of ``nbytes``:
    the next power of two (``c10::llvm::PowerOf2Ceil``)."""
    return 1 << (nbytes - 1).bit_length() if nbytes > 0 else 0


def snapshot_bytes_per_rank(cfg: RunConfig, layout: Layout) -> float:
    """Host memory one rank's async snapshot keeps (its heaviest rank): a buffer per tensor
    of the state dict, each rounded up to a power of two where it is page-locked (GPU
    clusters), the tensors' bytes on CPU. 0 for DeepSpeed engines (never async)."""
    if cfg.strategy.engine != "torch":
        return 0.0
    return float(state_sum(cfg, layout, pinned if cfg.cluster.accelerator == "gpu" else lambda b: b))
