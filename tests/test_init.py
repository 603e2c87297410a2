"""Initial weights drawn in pieces equal the whole draw, so a rank can draw only its rows.

FSDP/HSDP ranks draw each weight's stream only up to the end of their own rows, in
chunks (train/model.py ``_row_chunks``), instead of the full tensor: the values must be
bitwise those of one ``torch.randn`` of the whole weight, for every shape and shard
count (the strategies' tests then compare whole runs)."""
from __future__ import annotations

import random

import pytest
import torch

import train.model as model
from spec.config import ModelConfig


@pytest.mark.parametrize("target", [64, 1 << 22])
def test_rows_drawn_in_chunks_equal_the_whole_draw(monkeypatch, target):
    monkeypatch.setattr(model._row_chunks, "__defaults__", (target,))
    cfg, rng = ModelConfig(), random.Random(2)
    for _ in range(60):
        shape = (rng.randint(1, 300), rng.randint(1, 50))
        full = model.initial_tensor(cfg, "layers.0.attention.wq.weight", shape, 3)
        k = rng.randint(1, 5)
        size = -(-shape[0] // k)
        for c in range(k):
            lo = min(c * size, shape[0])
            hi = min(lo + size, shape[0])
            assert torch.equal(model.initial_tensor(cfg, "layers.0.attention.wq.weight", shape, 3, (lo, hi)),
                               full[lo:hi]), (shape, k, c)


def test_chunks_keep_blocks_of_sixteen():
    for n, row in ((1000, 7), (33, 5), (5, 3), (4096, 4096)):
        chunks = list(model._row_chunks(n, row, target=200))
        assert chunks[0][0] == 0 and chunks[-1][1] == n
        assert all(a[1] == b[0] for a, b in zip(chunks, chunks[1:]))
        assert all((e - s) * row % 16 == 0 for s, e in chunks[:-1])
        assert (chunks[-1][1] - chunks[-1][0]) * row >= 16 or len(chunks) == 1


def test_a_flat_partition_is_filled_from_the_rows_that_hold_it():
    """ZeRO-3's partition of a weight is a flat range of it, padded at the end: each rank's
    piece, filled from only the rows it spans, equals that range of the whole draw."""
    cfg, name = ModelConfig(), "layers.1.feed_forward.w2.weight"
    for shape in ((37, 11), (64, 16), (5,)):
        whole = model.initial_tensor(cfg, name, shape, 7).reshape(-1)
        numel = whole.numel()
        for world in (1, 2, 3, 4, 8):
            size = -(-numel // world)
            for rank in range(world):
                start, end = rank * size, min(rank * size + size, numel)
                out = torch.full((size,), -1.0)
                row = 1 if len(shape) == 1 else shape[1]
                if end > start:
                    rows = (start // row, -(-end // row))
                    model.copy_flat(out, model.initial_chunks(cfg, name, shape, 7, rows), row, start)
                    assert torch.equal(out[:end - start], whole[start:end]), (shape, world, rank)
                assert torch.all(out[max(end - start, 0):] == -1.0)  # the padding is left alone
