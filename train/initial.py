"""The initial weights, drawn block by block so that any part of a weight is drawn alone.

A weight ``name`` seen as a matrix (rows = shape[0], columns = the rest flattened) is cut
into blocks of :data:`BLOCK_COLS` columns and ``BLOCK_ELEMENTS // BLOCK_COLS`` rows (a
narrower weight: full-width blocks of :data:`BLOCK_ELEMENTS` values), and each block is
drawn from its own counter-based stream: Philox keyed by (seed, the weight's name), its
counter starting at (row block, column block). A rank thus draws only the blocks its part
overlaps, whatever the layout (FSDP/HSDP rows, TP rows or columns, 2-D, a pipeline stage's
layers, ZeRO-3's flat ranges, or the whole tensor in one process), and every layout gets
the values of the one whole tensor :func:`initial_tensor` defines. Blocks are small
(256 KB) so that a shard of a few rows or columns draws little beyond itself; the values
depend on the block grid, never on the layout.

numpy's Philox, not torch's CPU generator: that one is seeded from 32 bits only, too few
for the millions of blocks of a large model (some blocks would be equal, by the birthday
bound). ``bench/init_share.py`` measures a rank's share against the whole model.
"""
from __future__ import annotations

import hashlib
import math
from typing import Dict, Iterable, List, Optional, Tuple

import numpy as np
import torch
from torch.distributed.tensor import DTensor, distribute_tensor

from spec.config import ModelConfig

def initial_std(cfg: ModelConfig, name: str) -> Optional[float]:
    """The standard deviation a weight is drawn with; None: a norm's weight, set to ones;
    0: a bias (q/k/v's in Qwen2), set to zeros."""
    if name.endswith("norm.weight"):
        return None
    if name.endswith((".bias", ".lora_B")):  # LoRA's B starts at zero (train/lora.py), as PEFT's
        return 0.0
    if name == "tok_embeddings.weight":
        return 1.0 if not cfg.tie_embeddings else 0.02
    if name == "output.weight":
        return cfg.dim ** -0.5
    if name.endswith(("attention.wo.weight", "feed_forward.w2.weight")):
        return 0.02 / math.sqrt(2 * cfg.n_layers)
    return 0.02


BLOCK_ELEMENTS = 1 << 16
BLOCK_COLS = 256

# Global (lo, hi) ranges of rows or columns, in the order a local tensor holds them.
Runs = List[Tuple[int, int]]


def _matrix(shape: tuple) -> Tuple[int, int]:
    """(rows, columns) of a weight seen as a matrix: shape[0] by the rest flattened."""
    return (shape[0] if shape else 1), math.prod(shape[1:])


def block_shape(shape: tuple) -> Tuple[int, int]:
    """(rows, columns) of one block of a weight of this shape."""
    cols = max(1, min(_matrix(shape)[1], BLOCK_COLS))
    return max(1, BLOCK_ELEMENTS // cols), cols


def _stream_key(name: str, seed: int) -> int:
    """Philox's 128-bit key: the seed and a 64-bit hash of the weight's name."""
    digest = int.from_bytes(hashlib.blake2b(name.encode(), digest_size=8).digest(), "little")
    return (digest << 64) | (seed % (1 << 64))


def _block(key: int, std: float, rb: int, cb: int, n_rows: int, n_cols: int) -> torch.Tensor:
    """Block (rb, cb): its own Philox stream (the counter's two high words hold the block's
    index, so no other block's draw reaches it), made normal by Box-Muller: each 64 random
    bits give two uniforms in (0, 1] (24 bits each), each pair two normal values. (numpy's
    own normals are its ziggurat, about twice as slow here; torch's CPU ``randn`` is faster
    but its generator takes a 32-bit seed.)"""
    half = -(-n_rows * n_cols // 2)
    words = np.random.Philox(key=key, counter=(rb << 128) | (cb << 192)).random_raw(half).view(np.uint32)
    u = (words >> 8).astype(np.float32)
    u += np.float32(1)
    u *= np.float32(2.0 ** -24)
    radius, angle = u[:half], u[half:]
    np.log(radius, out=radius)
    radius *= np.float32(-2)
    np.sqrt(radius, out=radius)
    angle *= np.float32(2 * math.pi)
    out = np.empty(2 * half, np.float32)
    np.cos(angle, out=out[:half])
    np.sin(angle, out=out[half:])
    out[:half] *= radius
    out[half:] *= radius
    return torch.from_numpy(out[:n_rows * n_cols]).view(n_rows, n_cols).mul_(std)


def _by_block(runs: Runs, size: int) -> Dict[int, List[Tuple[int, int, int]]]:
    """block index -> its pieces (position in the local tensor, offset in the block, length)."""
    parts: Dict[int, List[Tuple[int, int, int]]] = {}
    at = 0
    for lo, hi in runs:
        while lo < hi:
            b = lo // size
            end = min(hi, (b + 1) * size)
            parts.setdefault(b, []).append((at, lo - b * size, end - lo))
            at, lo = at + end - lo, end
    return parts


def fill_initial(out: torch.Tensor, cfg: ModelConfig, name: str, shape: tuple, seed: int,
                 rows: Runs, cols: Runs) -> None:
    """Fill the 2-D ``out`` (the listed rows by the listed columns, in that order) with those
    elements of weight ``name``'s initial value seen as a matrix: only the blocks they
    overlap are drawn, one at a time (beside ``out``, one block is held)."""
    if name.endswith(".lora_A"):
        whole = lora_A_initial(_stream_key(name, seed), shape)
        index = [torch.cat([torch.arange(lo, hi) for lo, hi in runs] or [torch.zeros(0, dtype=torch.long)])
                 for runs in (rows, cols)]
        out.copy_(whole[index[0]][:, index[1]])
        return
    std = initial_std(cfg, name)
    if not std:
        out.fill_(1.0 if std is None else 0.0)
        return
    n_rows, n_cols = _matrix(shape)
    br, bc = block_shape(shape)
    key, col_parts = _stream_key(name, seed), _by_block(cols, bc)
    for rb, row_pieces in _by_block(rows, br).items():
        for cb, col_pieces in col_parts.items():
            block = _block(key, std, rb, cb, min(br, n_rows - rb * br), min(bc, n_cols - cb * bc))
            for at_r, in_r, nr in row_pieces:
                for at_c, in_c, nc in col_pieces:
                    out[at_r:at_r + nr, at_c:at_c + nc].copy_(block[in_r:in_r + nr, in_c:in_c + nc])


def lora_A_initial(key: int, shape: tuple) -> torch.Tensor:
    """The whole initial A of a LoRA adapter (rank x in_features): uniform in
    +-1/sqrt(in_features), PEFT's ``kaiming_uniform_(a=sqrt(5))``, from torch's generator
    seeded by the weight's stream key. Small, so every rank draws it whole and keeps its part."""
    gen = torch.Generator().manual_seed(key % (1 << 63))
    bound = 1.0 / math.sqrt(shape[1])
    return (torch.rand(tuple(shape), generator=gen, dtype=torch.float64) * 2 - 1).mul_(bound).float()


def initial_tensor(cfg: ModelConfig, name: str, shape: tuple, seed: int,
                   rows: Optional[Tuple[int, int]] = None) -> torch.Tensor:
    """The initial value of weight ``name`` (fp32, CPU), the same for every layout; with
    ``rows`` = (lo, hi) only those rows of it, drawn without the rest."""
    lo, hi = rows or (0, _matrix(shape)[0])
    out = torch.empty((hi - lo, _matrix(shape)[1]))
    fill_initial(out, cfg, name, shape, seed, [(lo, hi)], [(0, out.shape[1])])
    return out.view(hi - lo, *shape[1:]) if shape else out.view(())


def fill_flat(out: torch.Tensor, cfg: ModelConfig, name: str, shape: tuple, seed: int, start: int) -> None:
    """The elements ``start .. start + out.numel()`` of weight ``name``'s flattened initial
    value into the 1-D ``out`` (ZeRO-3's partition of a parameter is a flat range of it;
    elements past the weight's end stay as they are: padding). Drawn as at most three
    boxes: the end of a first row, whole rows, the start of a last row."""
    n_rows, n_cols = _matrix(shape)
    pos, end = start, min(start + out.numel(), n_rows * n_cols)
    while pos < end:
        r, c = divmod(pos, n_cols)
        whole = 0 if c else (end - pos) // n_cols
        if whole:
            stop, box = pos + whole * n_cols, ([(r, r + whole)], [(0, n_cols)])
        else:
            stop = min(end, (r + 1) * n_cols)
            box = ([(r, r + 1)], [(c, c + stop - pos)])
        fill_initial(out[pos - start:stop - start].view(max(whole, 1), -1), cfg, name, shape, seed, *box)
        pos = stop


def copy_flat(out: torch.Tensor, pieces: Iterable[Tuple[int, torch.Tensor]], row: int, start: int) -> None:
    """Copy the elements ``start .. start + out.numel()`` of a flattened weight into the 1-D
    ``out`` from its (first row, rows) ``pieces`` (a checkpoint's rows for ZeRO-3's flat
    partition; elements past the weight's end stay as they are: padding)."""
    end = start + out.numel()
    for first_row, rows in pieces:
        flat, first = rows.reshape(-1), first_row * row
        lo, hi = max(start, first), min(end, first + flat.numel())
        if hi > lo:
            out[lo - start:hi - start].copy_(flat[lo - first:hi - first])


def _runs(index: torch.Tensor) -> Runs:
    """Ascending stretches of a 1-D index tensor as (lo, hi) ranges, in its order."""
    if index.numel() == 0:
        return []
    breaks = (torch.nonzero(index[1:] - index[:-1] != 1).flatten() + 1).tolist()
    starts, ends = [0, *breaks], [*breaks, index.numel()]
    return [(int(index[s]), int(index[s]) + e - s) for s, e in zip(starts, ends)]


def _dim_index(t: DTensor, dim: int) -> torch.Tensor:
    """The global indices along ``dim`` that this rank's local tensor holds, in its order, as
    DTensor's own sharding gives them (Shard, and FSDP's _StridedShard over TP): a small
    index tensor is distributed like ``t`` (locally, no communication), as long along
    ``dim`` as ``t`` and along every other dim as many as the ranks sharding it."""
    mesh, placements, n = t.device_mesh, t.placements, t.shape[dim]
    ways = [math.prod(mesh.size(m) for m, p in enumerate(placements) if getattr(p, "dim", None) == e)
            for e in range(t.ndim)]
    if ways[dim] == 1:
        return torch.arange(n)
    probe = torch.arange(n).view([n if e == dim else 1 for e in range(t.ndim)])
    probe = probe.expand([n if e == dim else ways[e] for e in range(t.ndim)]).contiguous()
    local = distribute_tensor(probe, mesh, placements, src_data_rank=None).to_local()
    return local[tuple(slice(None) if e == dim else 0 for e in range(t.ndim))].cpu()


def local_runs(t: torch.Tensor) -> Tuple[Runs, Runs]:
    """The rows and the (flattened) columns of the full weight's matrix that this rank's
    part of ``t`` holds, in the local tensor's order: all of them for a plain tensor (DDP,
    ZeRO-1/2, a pipeline stage's whole weights); for a DTensor (FSDP, HSDP, TP's rows or
    columns, 2-D) those its placements give this rank."""
    shape = tuple(t.shape)
    if not isinstance(t, DTensor) or not shape:
        n_rows, n_cols = _matrix(shape)
        return [(0, n_rows)], [(0, n_cols)]
    cols = torch.zeros(1, dtype=torch.long)
    for d in range(1, len(shape)):
        cols = (cols[:, None] * shape[d] + _dim_index(t, d)[None, :]).reshape(-1)
    return _runs(_dim_index(t, 0)), _runs(cols)
