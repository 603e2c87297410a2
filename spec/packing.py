"""Packing chat conversations into sequences (``data.packing=true``): which conversations
share a sequence, and the launch checks. Pure (no torch, no numpy): the launcher counts
the packed sequences of an epoch (spec/schedule.py) with the same function the loader
packs with (train/data/chat_loader.py), so the two always agree.

A conversation of L tokens takes L - 1 positions of a sequence (its first L - 1 tokens
as inputs, its last L - 1 as targets), exactly the positions it has unpacked, padded to
``train.seq_len + 1``: so a sequence of ``train.seq_len`` inputs holds whole
conversations up to that total, and every conversation that fits unpacked fits packed
(one longer than ``train.seq_len + 1`` is refused at launch either way: spec/data.py;
prepare's ``--max-length`` truncates or drops it). A conversation is never split.

Which conversations share a sequence: best-fit decreasing over their lengths (TRL's
``packing_strategy="bfd"``): longest first, each into the open sequence with the least
room that still holds it, else a new one. It depends on the lengths and ``seq_len`` only
(ties: the earlier conversation first), so it is the same on every rank, every restart
and every data-parallel size; the loader's seeded per-epoch permutations then shuffle
the packed sequences as they shuffle conversations unpacked.
"""
from __future__ import annotations

from array import array
from bisect import bisect_left, insort
from functools import lru_cache
from pathlib import Path
from typing import List, Sequence, Tuple

from spec.config import ConfigError, RunConfig
from spec.data import chat_files
from spec.layout import Layout
from spec.model_size import head_dim

#: The smallest head flex attention's CUDA kernel takes (torch/_inductor/kernel/flex:
#: "embedding dimension of the query, key, and value must be at least 16").
FLEX_MIN_HEAD_DIM = 16


def costs(offsets: Sequence[int], seq_len: int) -> List[int]:
    """Positions each conversation takes in a sequence: its tokens (at most seq_len + 1,
    as the loader reads it) less one."""
    return [max(min(b - a, seq_len + 1) - 1, 0) for a, b in zip(offsets[:-1], offsets[1:])]


def pack(sizes: Sequence[int], capacity: int) -> Tuple[List[int], List[int]]:
    """Best-fit decreasing of items of ``sizes`` (each <= ``capacity``) into bins of
    ``capacity``: ``(order, starts)``, bin ``b`` holding items ``order[starts[b]:starts[b+1]]``
    (longest first). Bins in the order they were opened."""
    rooms: List[int] = []  # sorted distinct free room of the open bins
    bins_at: dict = {}  # free room -> ids of the open bins with that room (a stack)
    contents: List[List[int]] = []
    for item in sorted(range(len(sizes)), key=lambda i: -sizes[i]):  # stable: ties keep their order
        size = sizes[item]
        if size > capacity:
            raise ValueError(f"item {item} of size {size} does not fit a bin of {capacity}")
        k = bisect_left(rooms, size)
        if k == len(rooms):
            b, room = len(contents), capacity
            contents.append([])
        else:
            room = rooms[k]
            stack = bins_at[room]
            b = stack.pop()
            if not stack:
                del bins_at[room]
                rooms.pop(k)
        contents[b].append(item)
        room -= size
        if room not in bins_at:
            insort(rooms, room)
            bins_at[room] = []
        bins_at[room].append(b)
    order: List[int] = []
    starts = [0]
    for items in contents:
        order.extend(items)
        starts.append(len(order))
    return order, starts


def read_offsets(path: Path) -> array:
    """A chat split's conversation offsets (int64, n + 1 of them)."""
    out = array("q")
    with open(path, "rb") as f:
        out.frombytes(f.read())
    return out


@lru_cache(maxsize=8)
def _count(path: str, mtime: float, size: int, seq_len: int) -> int:
    return len(pack(costs(read_offsets(Path(path)), seq_len), seq_len)[1]) - 1


def packed_sequences(directory: Path, seq_len: int, split: str = "train") -> int:
    """Packed sequences of ``train.seq_len`` inputs that a chat split fills: an epoch's samples."""
    path = Path(directory) / chat_files(split)[2]
    stat = path.stat()
    return _count(str(path), stat.st_mtime, stat.st_size, seq_len)


def check_packing(cfg: RunConfig, layout: Layout) -> None:
    """``data.packing=true`` runs where its attention runs fused, else one line: field, value, fix."""
    if not cfg.data.packing:
        return
    fix = "or data.packing=false (one conversation a sequence)"
    if cfg.data.source != "chat":
        raise ConfigError(f"data.packing=true packs chat conversations, but data.source={cfg.data.source}; "
                          f"use data.source=chat (a directory from `train.data.prepare --chat`), {fix}")
    if layout.pp > 1:
        raise ConfigError(f"data.packing=true with strategy.pipeline_parallel={layout.pp}: the pipeline's stages "
                          f"pass activations only, not the packed documents' positions; use "
                          f"strategy.pipeline_parallel=1, {fix}")
    width = head_dim(cfg.model)
    if cfg.cluster.accelerator == "gpu" and width < FLEX_MIN_HEAD_DIM:
        raise ConfigError(f"data.packing=true on GPUs runs flex attention, whose CUDA kernel takes heads of at "
                          f"least {FLEX_MIN_HEAD_DIM} channels; the model's are {width} (model.dim / model.n_heads, "
                          f"or model.head_dim): use model.head_dim>={FLEX_MIN_HEAD_DIM} or fewer heads, {fix}")
