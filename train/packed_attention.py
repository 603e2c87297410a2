"""Attention inside each document of a packed sequence (``data.packing=true``).

A packed row holds several conversations one after another (train/data/chat_loader.py);
its ``positions`` restart at 0 where each document (and the trailing padding) begins.
From them the model takes, once per forward (:func:`document_context`):

- the RoPE angles of each token's own position (:func:`rope_at`), so a document sees
  the positions it has alone;
- a mask: a query attends to the keys of its own document up to itself, nothing across
  documents.

On CUDA the mask is a flex attention block mask (:func:`block_mask`) and the attention
flex attention compiled (its Triton kernel: nothing of size S x S exists). The block
mask is built from the document boundaries at the level of 128 x 128 tiles
(:data:`BLOCK`), never as an S x S tensor (``create_block_mask`` without compiling
evaluates the mask over every (query, key) pair: 1 GB a sequence at 32k): a tile is
empty (skipped), full (no mask evaluated) or partial (the mask function decides each
pair); it is the block mask ``create_block_mask`` builds (tests/test_packing.py).

Elsewhere (CPU ranks: tests, small runs) it is a dense (batch, 1, S, S) boolean mask
for SDPA (:func:`dense_mask`): torch's flex attention has no backward on CPU ("FlexAttention
does not support backward on CPU", torch 2.11 and 2.13), and uncompiled it builds the
S x S scores anyway. Unpacked batches never come here (train/model.py: SDPA, causal).

The planner (launcher/plan/memory.py) counts packed runs as unpacked ones: flex attention
keeps for backward what FlashAttention keeps (q, k, v, its output, an fp32 logsumexp per
head and token) and nothing S x S (an H100 at 16k tokens: the same peak memory as SDPA,
bench/GPU_RESULTS.md); it takes grouped K/V unexpanded in fp32 too, where the planner's
count of expanded ones is then high. The block mask (batch x (S/128)^2 tiles) and the
per-token RoPE table (batch x S x head_dim x 4 bytes, shared by every block) are left
out: megabytes at 32k.
"""
from __future__ import annotations

from typing import Optional, Tuple, Union

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask, flex_attention

#: Tile of flex attention's block mask (its default BLOCK_SIZE).
BLOCK = 128
_compiled: Optional[object] = None


def document_ids(positions: torch.Tensor) -> torch.Tensor:
    """(batch, seq) positions -> (batch, seq) document index: a new one where position is 0."""
    return (positions == 0).to(torch.int32).cumsum(dim=1) - 1


def rope_at(table: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """The rotary table (max_seq, head_dim // 2, 2) at each token's position: (batch, seq, head_dim // 2, 2)."""
    return table[positions]


def _ordered(blocks: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """(count, indices) of the true tiles of each query tile row, the true ones first."""
    count = blocks.sum(dim=-1, dtype=torch.int32)
    indices = torch.argsort((~blocks).to(torch.int8), dim=-1, stable=True).to(torch.int32)
    return count, indices


def block_mask(positions: torch.Tensor) -> BlockMask:
    """The causal, within-document flex attention block mask of packed rows with these ``positions``."""
    batch, seq = positions.shape
    docs = document_ids(positions)
    tiles = -(-seq // BLOCK)
    # Past the end: a document of its own (after every real one), so the last tile is never full.
    padded = torch.nn.functional.pad(docs, (0, tiles * BLOCK - seq), value=seq)
    first, last = padded.view(batch, tiles, BLOCK).amin(-1), padded.view(batch, tiles, BLOCK).amax(-1)
    q_first, q_last = first[:, :, None], last[:, :, None]
    k_first, k_last = first[:, None, :], last[:, None, :]
    index = torch.arange(tiles, device=positions.device)
    below = index[None, :, None] > index[None, None, :]  # key tile strictly before the query tile
    diagonal = index[None, :, None] == index[None, None, :]
    # Document ids never decrease along a row: a key tile before the query tile shares a
    # document with it iff its last document is the query tile's first.
    shared = (below & (k_last >= q_first)) | diagonal
    full = below & (k_first == k_last) & (q_first == q_last) & (k_first == q_first)
    partial = shared & ~full
    kv_num, kv_idx = _ordered(partial)
    full_num, full_idx = _ordered(full)

    def within_document(b, h, q, kv):
        return (docs[b, q] == docs[b, kv]) & (q >= kv)

    return BlockMask.from_kv_blocks(kv_num[:, None], kv_idx[:, None], full_num[:, None], full_idx[:, None],
                                    BLOCK_SIZE=BLOCK, mask_mod=within_document, seq_lengths=(seq, seq))


def dense_mask(positions: torch.Tensor) -> torch.Tensor:
    """The same mask as (batch, 1, S, S) booleans (True: attends), for SDPA off CUDA."""
    docs = document_ids(positions)
    seq = positions.shape[1]
    causal = torch.ones(seq, seq, dtype=torch.bool, device=positions.device).tril()
    return (docs[:, None, :, None] == docs[:, None, None, :]) & causal


Mask = Union[BlockMask, torch.Tensor]


def document_context(table: torch.Tensor, positions: torch.Tensor) -> Tuple[torch.Tensor, Mask]:
    """What every block of one forward shares: the per-token rotary table and the mask
    (a block mask on CUDA, else dense)."""
    mask = block_mask(positions) if positions.device.type == "cuda" else dense_mask(positions)
    return rope_at(table, positions), mask


def document_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Mask) -> torch.Tensor:
    """Causal attention within documents over (batch, heads, seq, head_dim); grouped K/V go
    as they are. A block mask: flex attention (compiled on CUDA; on CPU forward only);
    a dense mask: SDPA."""
    gqa = k.shape[1] != q.shape[1]
    if not isinstance(mask, BlockMask):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
    fn = flex_attention  # inside a compiled block (strategy.compile) dynamo compiles it with the block
    if q.device.type == "cuda" and not torch.compiler.is_compiling():
        global _compiled
        if _compiled is None:
            _compiled = torch.compile(flex_attention, dynamic=False)
        fn = _compiled
    return fn(q, k, v, block_mask=mask, enable_gqa=gqa)
