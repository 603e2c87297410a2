"""Initial weights drawn block by block equal the whole draw, so a rank draws only its part.

Each block of a weight is drawn from its own stream (train/initial.py), so any part of a
weight (FSDP/HSDP rows, TP rows or columns, 2-D FSDP + TP, ZeRO-3's flat ranges) is drawn
without the rest: its values must be bitwise those of the full tensor
:func:`train.initial.initial_tensor` defines, and a rank must draw only the blocks its part
overlaps (the strategies' tests then compare whole runs against one process)."""
from __future__ import annotations

import random

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Replicate, distribute_tensor

import train.initial as initial
import train.model as model
from spec.config import ModelConfig
from train.strategies.tp import apply_tp

from test_mesh import fake_world  # noqa: F401  (the fixture: this process plays one rank of a fake group)

NAME = "layers.0.attention.wq.weight"


@pytest.fixture
def small_blocks(monkeypatch):
    """Blocks of 8 x 8 (narrow weights: full-width blocks of 64 values): small tensors span many."""
    monkeypatch.setattr(initial, "BLOCK_ELEMENTS", 64)
    monkeypatch.setattr(initial, "BLOCK_COLS", 8)


def _assemble(parts, shape):
    """The full matrix from (rows, cols, local values) parts; NaN where no part wrote."""
    n_rows, n_cols = initial._matrix(shape)
    full = torch.full((n_rows, n_cols), float("nan"))
    for rows, cols, values in parts:
        r = torch.cat([torch.arange(lo, hi) for lo, hi in rows]) if rows else torch.empty(0, dtype=torch.long)
        c = torch.cat([torch.arange(lo, hi) for lo, hi in cols]) if cols else torch.empty(0, dtype=torch.long)
        full[r[:, None], c[None, :]] = values.reshape(len(r), len(c))
    return full.view(shape)


@pytest.mark.parametrize("blocks", ["small", "default"])
def test_row_ranges_equal_the_whole_tensor(request, blocks):
    if blocks == "small":
        request.getfixturevalue("small_blocks")
    cfg, rng = ModelConfig(), random.Random(2)
    for _ in range(60):
        shape = (rng.randint(1, 300), rng.randint(1, 50))
        full = initial.initial_tensor(cfg, NAME, shape, 3)
        k = rng.randint(1, 5)
        size = -(-shape[0] // k)
        for c in range(k):
            lo = min(c * size, shape[0])
            hi = min(lo + size, shape[0])
            assert torch.equal(initial.initial_tensor(cfg, NAME, shape, 3, (lo, hi)), full[lo:hi]), (shape, k, c)


def test_any_rows_by_columns_equal_the_whole_tensor(small_blocks):
    """Rows and columns in any ranges and order (a TP column shard, 2-D, a strided shard)."""
    cfg, rng = ModelConfig(), random.Random(5)
    for _ in range(80):
        shape = (rng.randint(1, 70), rng.randint(1, 40))
        full = initial.initial_tensor(cfg, NAME, shape, 1)

        def runs(n):
            cuts = sorted(rng.sample(range(n + 1), min(n + 1, rng.randint(2, 5))))
            spans = [(a, b) for a, b in zip(cuts, cuts[1:]) if b > a]
            rng.shuffle(spans)
            return spans[:rng.randint(1, len(spans))] if spans else []

        rows, cols = runs(shape[0]), runs(shape[1])
        out = torch.empty(sum(b - a for a, b in rows), sum(b - a for a, b in cols))
        initial.fill_initial(out, cfg, NAME, shape, 1, rows, cols)
        r = [i for a, b in rows for i in range(a, b)]
        c = [j for a, b in cols for j in range(a, b)]
        assert torch.equal(out, full[r][:, c]), (shape, rows, cols)


def test_blocks_are_their_own_streams():
    """Another seed, another weight or another block: other values (no shared stream)."""
    cfg, shape = ModelConfig(), (512, 512)
    w = initial.initial_tensor(cfg, NAME, shape, 0)
    assert not torch.equal(w[:256, :256], w[:256, 256:]) and not torch.equal(w[:256, :256], w[256:, :256])
    assert not torch.equal(w, initial.initial_tensor(cfg, NAME, shape, 1))
    assert not torch.equal(w, initial.initial_tensor(cfg, "layers.1.attention.wq.weight", shape, 0))
    assert abs(w.std().item() - 0.02) < 0.001 and abs(w.mean().item()) < 0.001


def test_a_flat_partition_is_filled_from_the_blocks_that_hold_it(small_blocks):
    """ZeRO-3's partition of a weight is a flat range of it, padded at the end: each rank's
    piece equals that range of the whole tensor, and the padding is left alone."""
    cfg, name = ModelConfig(), "layers.1.feed_forward.w2.weight"
    for shape in ((37, 11), (64, 16), (5,), (9, 3, 5)):
        whole = initial.initial_tensor(cfg, name, shape, 7).reshape(-1)
        numel = whole.numel()
        for world in (1, 2, 3, 4, 8):
            size = -(-numel // world)
            for rank in range(world):
                start, end = rank * size, min(rank * size + size, numel)
                out = torch.full((size,), -1.0)
                if end > start:
                    initial.fill_flat(out, cfg, name, shape, 7, start)
                    assert torch.equal(out[:end - start], whole[start:end]), (shape, world, rank)
                assert torch.all(out[max(end - start, 0):] == -1.0)


CFG = ModelConfig(dim=48, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=203, multiple_of=16, max_seq_len=16)
# (replicas, dp, tp): FSDP rows; TP rows and columns; 2-D, where FSDP shards TP's rows
# again (_StridedShard); HSDP (FSDP's rows, replicated)
LAYOUTS = [(1, 4, 1), (1, 3, 1), (1, 1, 4), (1, 1, 3), (1, 2, 2), (1, 3, 2), (2, 2, 1)]
# Qwen's extra weights (both kinds in one model, which no checkpoint has): q/k/v biases
# (zeros; TP shards them with their rows, FSDP again), q/k norms over 24-wide heads
# (ones; replicated under TP), on the 2-D layout.
QWEN = ModelConfig(dim=48, n_layers=1, n_heads=4, n_kv_heads=2, head_dim=24, vocab_size=203, multiple_of=16,
                   max_seq_len=16, qkv_bias=True, qk_norm=True)
CASES = [(*layout, CFG) for layout in LAYOUTS] + [(1, 2, 2, QWEN)]


def _parallel_model(replicas: int, dp: int, tp: int, rank: int, cfg: ModelConfig = CFG):
    # Names of this rank's own: DTensor caches specs (their mesh with them) by mesh equality,
    # which ignores the rank, so one process playing rank after rank would get stale meshes.
    names = (f"rep{rank}", f"dp{rank}", f"tp{rank}")
    mesh = init_device_mesh("cpu", (replicas, dp, tp), mesh_dim_names=names)
    net = model.build_model(cfg)
    if tp > 1:
        apply_tp(net, mesh[names[2]])
    if dp > 1:
        fsdp_mesh = mesh[names[:2]] if replicas > 1 else mesh[names[1]]
        for block in net.layers.values():
            fully_shard(block, mesh=fsdp_mesh)
        fully_shard(net, mesh=fsdp_mesh)
    net.to_empty(device="cpu")
    return net


@pytest.mark.parametrize("replicas,dp,tp,cfg", CASES,
                         ids=[f"rep{r}-dp{d}-tp{t}" + ("-qwen" if c is QWEN else "") for r, d, t, c in CASES])
def test_every_layouts_shards_assemble_to_the_whole_tensor(small_blocks, fake_world, monkeypatch, replicas, dp, tp,
                                                            cfg):
    """Each rank of FSDP, TP (rows: wq, w1, the embedding, the head; columns: wo, w2) and
    2-D FSDP + TP fills its own part: bitwise DTensor's own slice of the full tensor
    (``distribute_tensor``), the parts together are the full tensor, and a rank draws
    little beyond its share (the blocks its part's edges cut)."""
    whole = model.build_model(cfg, "cpu")
    whole.init_weights(0)
    full = {n: p.detach().clone() for n, p in whole.named_parameters()}
    parts = {n: [] for n in full}
    drawable = sum(t.numel() for n, t in full.items() if initial.initial_std(cfg, n))
    drawn = []
    real_block = initial._block
    monkeypatch.setattr(initial, "_block", lambda *a: drawn.append(a[4] * a[5]) or real_block(*a))
    world = replicas * dp * tp
    for rank in range(world):
        fake_world(rank, world)
        net = _parallel_model(replicas, dp, tp, rank, cfg)
        drawn.clear()
        net.init_weights(0)
        # here (blocks of 8 x 8) at most 1.3 x the share; before, a TP rank drew its column
        # shards' weights whole (2-D: every weight), an FSDP rank every row up to its last
        assert sum(drawn) * dp * tp <= 1.5 * drawable, (rank, sum(drawn), drawable)
        for name, param in net.named_parameters():
            name, t = model.clean_name(name), param.data
            assert isinstance(t, DTensor)
            mine = distribute_tensor(full[name], t.device_mesh, t.placements, src_data_rank=None).to_local()
            assert torch.equal(t.to_local(), mine), (rank, name, t.placements)
            parts[name].append((*initial.local_runs(t), t.to_local()))
    for name, tensor in full.items():
        assert torch.equal(_assemble(parts[name], tuple(tensor.shape)), tensor), name
    if cfg is QWEN:
        assert torch.equal(full["layers.0.attention.wk.bias"], torch.zeros(2 * 24))
        assert torch.equal(full["layers.0.attention.k_norm.weight"], torch.ones(24))
        assert Replicate() in net.layers["0"].attention.q_norm.weight.placements  # over the TP ranks


def test_an_unsharded_model_gets_the_whole_tensors():
    """One process, unsharded: init_weights gives initial_tensor's values for every weight."""
    net = model.build_model(CFG, "cpu")
    net.init_weights(4)
    for name, param in net.named_parameters():
        assert torch.equal(param.detach(), initial.initial_tensor(CFG, name, tuple(param.shape), 4)), name
