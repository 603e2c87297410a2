"""Start-up's draw of the initial weights: the slowest rank's share over the whole model.

A Llama of ~1.35 GB in fp32 (dim 2048, 4 layers, vocab 32000; ``--layers`` for more) is
parallelised on the meta device as the trainer does it, for FSDP (``fully_shard`` over 4
ranks: every weight's rows in 4) and for TP of degree 4 (train/strategies/tp.py's plan:
wq/wk/wv/w1/w3, the embedding and the head sharded by rows, wo/w2 by columns), then each
rank's part is filled in turn in this one process (the ``fake`` process group plays each
rank), timed with ``time.process_time`` (CPU time, so the machine's other work and its two
cores do not blur it). Printed per layout and scheme: the CPU time of the whole model
(one unsharded process), of the slowest rank's share, and their ratio; goal <= 0.35 at 4
ranks (a perfect split: 0.25).

- before: the scheme up to commit 35e633f, copied below as ``old_*``: one generator stream
  per weight, so an FSDP rank drew and discarded every row before its own, and a TP rank
  (any layout with TP) drew every weight whole.
- after: :meth:`train.model.Transformer.init_weights` (train/initial.py), each block of a
  weight from its own stream, a rank drawing only the blocks its part overlaps.

    .venv/bin/python bench/init_share.py [--layers 4] [--ranks 4] [--layouts fsdp,tp] [--repeats 5]
"""
from __future__ import annotations

import argparse
import gc
import math
import sys
import time
import zlib
from pathlib import Path
from typing import Dict, Iterator, Optional, Tuple

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

GOAL = 0.35


def old_generator(name: str, seed: int):
    import torch

    return torch.Generator(device="cpu").manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))


def old_row_chunks(n_rows: int, row: int, target: int = 1 << 22) -> Iterator[Tuple[int, int]]:
    step = max(16, target // max(row, 1) // 16 * 16)
    start = 0
    while start < n_rows:
        end = min(start + step, n_rows)
        if (n_rows - end) * row < 16:
            end = n_rows
        yield start, end
        start = end


def old_initial_chunks(cfg, name: str, shape: tuple, seed: int, rows: Tuple[int, int]):
    import torch
    from train.initial import initial_std

    lo, hi = rows
    std = initial_std(cfg, name)
    if std is None:
        if hi > lo:
            yield lo, torch.ones((hi - lo, *shape[1:]))
        return
    gen = old_generator(name, seed)
    for start, end in old_row_chunks(shape[0], math.prod(shape[1:])):
        if start >= hi:
            return
        chunk = torch.randn((end - start, *shape[1:]), generator=gen, dtype=torch.float32)
        DRAWN[0] += chunk.numel()
        if end > lo:
            yield max(lo, start), chunk[max(lo, start) - start:min(hi, end) - start].mul_(std)


def old_initial_tensor(cfg, name: str, shape: tuple, seed: int):
    import torch
    from train.initial import initial_std

    if initial_std(cfg, name) is not None:
        gen = old_generator(name, seed)
        DRAWN[0] += math.prod(shape)
        return torch.randn(shape, generator=gen, dtype=torch.float32).mul_(initial_std(cfg, name))
    return torch.cat([t for _, t in old_initial_chunks(cfg, name, shape, seed, (0, shape[0]))])


def old_local_rows(t) -> Optional[Tuple[int, int]]:
    from torch.distributed.tensor import DTensor, Shard

    if not isinstance(t, DTensor):
        return None
    sharded = [(i, p) for i, p in enumerate(t.placements) if not p.is_replicate()]
    if len(sharded) != 1 or type(sharded[0][1]) is not Shard or sharded[0][1].dim != 0:
        return None
    mesh_dim = sharded[0][0]
    n, k = t.shape[0], t.device_mesh.size(mesh_dim)
    size = -(-n // k)
    lo = min(t.device_mesh.get_local_rank(mesh_dim) * size, n)
    return lo, min(lo + size, n)


def old_init_weights(net, seed: int) -> None:
    """``Transformer.init_weights`` as it was (its weights; the rotary table is the same)."""
    import torch
    from torch.distributed.tensor import DTensor, distribute_tensor
    from train.model import clean_name

    with torch.no_grad():
        for name, param in net.named_parameters():
            t, shape = param.data, tuple(param.shape)
            rows = old_local_rows(t) or (None if isinstance(t, DTensor) else (0, shape[0]))
            if rows is None:
                full = old_initial_tensor(net.cfg, clean_name(name), shape, seed).to(t.dtype)
                t.copy_(distribute_tensor(full.to(t.device), t.device_mesh, t.placements, src_data_rank=None))
                continue
            target = t.to_local() if isinstance(t, DTensor) else t
            for first, piece in old_initial_chunks(net.cfg, clean_name(name), shape, seed, rows):
                target[first - rows[0]:first - rows[0] + piece.shape[0]].copy_(piece)


# Values drawn by the fill being timed (a count of work that the machine's load cannot blur).
DRAWN = [0]


def _timed(fill, net) -> Tuple[float, int]:
    """CPU seconds of one fill, and the values it drew."""
    gc.collect()
    DRAWN[0] = 0
    start = time.process_time()
    fill(net)
    return time.process_time() - start, DRAWN[0]


def _fills():
    return {"before": lambda net: old_init_weights(net, 0), "after": lambda net: net.init_weights(0)}


def _count_blocks() -> None:
    """Count the values of every block train.initial draws."""
    import train.initial as initial

    draw = initial._block

    def counted(key, std, rb, cb, n_rows, n_cols):
        DRAWN[0] += n_rows * n_cols
        return draw(key, std, rb, cb, n_rows, n_cols)

    initial._block = counted


def _parallel(cfg, layout: str, rank: int, ranks: int):
    """Rank ``rank``'s model of ``layout``, materialised (empty) on the CPU."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from train.model import build_model
    from train.strategies.tp import apply_tp
    from train.torch_compat import fake_process_group

    fake_process_group(rank, ranks)
    # A mesh name of this rank's own: DTensor caches specs (their mesh with them) by mesh
    # equality, which ignores the rank, so rank after rank would reuse the first one's mesh.
    mesh = init_device_mesh("cpu", (ranks,), mesh_dim_names=(f"{layout}{rank}",))
    net = build_model(cfg)
    if layout == "tp":
        apply_tp(net, mesh)
    else:
        for block in net.layers.values():
            fully_shard(block, mesh=mesh)
        fully_shard(net, mesh=mesh)
    return net.to_empty(device="cpu")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--dim", type=int, default=2048)
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--layouts", default="fsdp,tp", help="comma-separated: fsdp, tp")
    parser.add_argument("--repeats", type=int, default=5, help="rounds, each timing every fill once; the least counts")
    args = parser.parse_args()

    import torch

    from spec.config import ModelConfig
    from train.model import build_model

    torch.set_num_threads(1)
    _count_blocks()
    cfg = ModelConfig(dim=args.dim, n_layers=args.layers, n_heads=16, vocab_size=32000, max_seq_len=64,
                      multiple_of=256)
    whole_net = build_model(cfg, "cpu")
    gigabytes = sum(p.numel() for p in whole_net.parameters()) * 4 / 1e9
    print(f"model: dim {cfg.dim}, {cfg.n_layers} layers, vocab {cfg.vocab_size}: {gigabytes:.2f} GB in fp32; "
          f"{args.ranks} ranks; CPU seconds (time.process_time), the least of {args.repeats} rounds")
    layouts = args.layouts.split(",")
    # seconds[(layout or "whole", rank, scheme)]: the least over the rounds; a round times
    # everything once, so a burst of load on the machine falls on different items each round
    seconds: Dict[tuple, float] = {}
    drawn: Dict[tuple, int] = {}
    for _ in range(args.repeats):
        for layout, rank in [("whole", 0), *((lay, r) for lay in layouts for r in range(args.ranks))]:
            net = whole_net if layout == "whole" else _parallel(cfg, layout, rank, args.ranks)
            for scheme, fill in _fills().items():
                took, values = _timed(fill, net)
                key = (layout, rank, scheme)
                seconds[key], drawn[key] = min(seconds.get(key, math.inf), took), values
            del net
    print(f"{'layout':<7}{'scheme':<8}{'whole s':>9}{'slowest share s':>17}{'share/whole':>13}"
          f"{'values drawn':>14}  per rank s")
    for layout in layouts:
        for scheme in _fills():
            whole = seconds[("whole", 0, scheme)]
            times = [seconds[(layout, r, scheme)] for r in range(args.ranks)]
            ratio = max(times) / whole
            values = max(drawn[(layout, r, scheme)] for r in range(args.ranks)) / drawn[("whole", 0, scheme)]
            verdict = "" if scheme == "before" else ("  ok" if ratio <= GOAL else f"  above the goal {GOAL}")
            print(f"{layout:<7}{scheme:<8}{whole:>9.2f}{max(times):>17.2f}{ratio:>13.3f}{values:>14.3f}  "
                  f"{' '.join(f'{t:.2f}' for t in times)}{verdict}")
    import torch.distributed as dist

    dist.destroy_process_group()
    print(f"goal: share/whole <= {GOAL} after, for each layout (a perfect split: {1 / args.ranks:.2f}); "
          "values drawn: the slowest-drawing rank's over the whole model's")

if __name__ == "__main__":
    main()
