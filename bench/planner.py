"""Planner vs reality: predicted and measured memory per rank on CPU, with the ratio.

For every strategy this version runs (conf/strategy/*.yaml that pass the launcher's
check), each rank count and precision, N processes (gloo, torch.multiprocessing) build
a small Llama with the project's own code (train.parallelize: the builders the jobs
use), take two optimizer steps, and measure:

- model states: unique storages of every live tensor right after the optimizer's step
  and, with gradient accumulation, at the start of every forward (a gc census: RSS
  overstates sharded strategies, glibc keeping what they free), minus what lived before the
  model was built and the logits the loop still holds. Predicted: params + grads +
  optimizer (+ host memory) of launcher.memory.estimate;
- activations: the distinct storages autograd saves for backward in one micro-step
  (saved-tensor hooks), parameters aside; pipeline runs: the most saved at any one time, as a
  stage frees each micro-batch's in its backward. Predicted: the planner's activations
  without what autograd does not save (``predicted_saved``);
- peak: the rise of the peak RSS over the RSS before the model was built, with
  MALLOC_MMAP_THRESHOLD_=65536 so freed buffers go back to the OS. Predicted: the
  planner's total (states + activations + buffers; no GPU overhead on CPU).

    .venv/bin/python bench/planner.py [--ranks 2,4] [--strategies ddp,zero3] [--precision fp32,bf16]
                                      [--overrides 'strategy.zero_stage=0'] [--json]
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "65536")  # inherited by the spawned ranks
os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(REPO / ".cache" / "torch_extensions"))
os.environ.setdefault("OMP_NUM_THREADS", "1")

# DeepSpeed's CPU all-reduce allocates a shared-memory workspace per rank (2 x 1 MiB + 2 x
# 32 MiB, deepspeed/ops/csrc/cpu/comm/shm.cpp) that its GPU path does not have: added to
# the predicted peak of DeepSpeed runs here, never by the planner.
DS_CPU_SHM = 2 * 2**20 + 2 * 32 * 2**20

# A model where model states and activations both reach tens of MB (a few M params).
MODEL = ["model.dim=256", "model.n_layers=4", "model.n_heads=8", "model.vocab_size=2048", "train.seq_len=128",
         "train.micro_batch_size=8", "model.max_seq_len=128"]


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def live_tensor_bytes(vocab: tuple = ()) -> int:
    """Bytes of the distinct storages of every live CPU tensor (DTensors: their local shard),
    leaving out tensors whose last dimension is in ``vocab``: the logits the loop holds
    (weights' transposed views share a storage counted through the weight itself)."""
    import gc
    import warnings

    import torch

    gc.collect()
    storages = {}
    with warnings.catch_warnings():  # isinstance on torch.distributed's deprecated aliases warns
        warnings.simplefilter("ignore", FutureWarning)
        objects = [o for o in gc.get_objects() if isinstance(o, torch.Tensor)]
    for obj in objects:
        key = _storage(obj) if obj.device.type == "cpu" and obj.shape[-1:] not in vocab else None
        if key:
            storages[key[0]] = max(storages.get(key[0], 0), key[1])
    return sum(storages.values())


def _storage(t):
    """(data pointer, bytes) of a tensor's storage; None for tensors without one (freed
    storages, wrapper subclasses)."""
    t = getattr(t, "_local_tensor", t)  # a DTensor's storage is its local shard's
    try:
        st = t.untyped_storage()
        return (st.data_ptr(), st.nbytes()) if st.data_ptr() else None
    except (RuntimeError, NotImplementedError):
        return None


def rank_main(rank: int, world: int, port: int, cfg, out_dir: str) -> None:
    import resource

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import torch

    from train.harness.dist import init_distributed, shutdown
    from spec.layout import build_layout
    from train.model import build_model
    from train.parallelize import parallelize
    from train.strategies import get_builder

    os.dup2(2, 1)  # DeepSpeed logs to stdout; keep the table on the parent's stdout clean
    ctx = init_distributed(120)
    layout = build_layout(cfg)
    get_builder(cfg)  # imports the engine (deepspeed: ~100 MB of RSS) before the baseline
    if layout.pp > 1:  # parallelize imports it lazily: torch.distributed.pipelining pulls in
        import train.strategies.pp  # noqa: F401  torch._dynamo, ~29 MB of RSS
    before_tensors, before_rss = live_tensor_bytes(), _rss()
    most = [0]
    logits = tuple(torch.Size([v]) for v in {cfg.model.vocab_size, cfg.model.vocab_size // layout.tp})

    def census(*_) -> None:
        # right after the optimizer's step every model state exists: DeepSpeed ZeRO-1/2
        # free their gradient partition inside their own step, so a census after the
        # engine's step would miss it
        most[0] = max(most[0], live_tensor_bytes(logits))

    from torch.optim.optimizer import register_optimizer_step_post_hook
    register_optimizer_step_post_hook(census)
    engine = parallelize(build_model(cfg.model, "meta"), cfg, layout, ctx)
    gen = torch.Generator().manual_seed(rank)
    t, saved, held = cfg.train, [{}], {}

    def pre(module, _args) -> None:
        """At the start of every forward: a new micro-step's saved tensors and, with
        gradient accumulation, a census (an engine may hold whole gradients between
        micro-steps: DeepSpeed ZeRO-1 reduces them at the boundary only)."""
        if torch.is_grad_enabled() and layout.pp == 1:
            saved.append({})
            if t.grad_accum > 1:
                grads = [p.grad for p in module.parameters() if p.grad is not None]  # noqa: F841 (for gc)
                census()

    for part in engine.model_parts:
        part.register_forward_pre_hook(pre)
    most_held = [0, 0]  # bytes of the storages saved right now, and their most

    class Held:
        """A saved tensor in a pipeline run: counts its storage until autograd frees it."""
        __slots__ = ("x", "key")

        def __init__(self, x: torch.Tensor, key: tuple) -> None:
            self.x, self.key = x, key
            if held.setdefault(key[0], [0, key[1]])[0] == 0:
                most_held[0] += key[1]
                most_held[1] = max(most_held)
            held[key[0]][0] += 1

        def __del__(self) -> None:
            held[self.key[0]][0] -= 1
            if held[self.key[0]][0] == 0:
                most_held[0] -= held.pop(self.key[0])[1]

    def pack(x: torch.Tensor):
        # activations: what autograd keeps for backward, parameters (and FSDP's gathered
        # ones) aside; the bf16 weight casts of autocast do count (a planner buffer)
        param = isinstance(x, torch.nn.Parameter) or isinstance(x._base, torch.nn.Parameter)
        key = None if param or x.device.type != "cpu" else _storage(x)
        if key and layout.pp > 1:
            # a pipeline stage frees each micro-batch's tensors in its backward while it
            # saves other micro-batches' (at recycled addresses): count the most saved at once
            return Held(x, key)
        if key:
            saved[-1][key[0]] = max(saved[-1].get(key[0], 0), key[1])
        return x

    for step in range(2):
        batches = []
        for _ in range(t.grad_accum):
            tokens = torch.randint(0, cfg.model.vocab_size, (t.micro_batch_size, t.seq_len + 1), generator=gen)
            batches.append((tokens[:, :-1], tokens[:, 1:]))
        unpack = lambda h: h.x if isinstance(h, Held) else h  # noqa: E731
        with torch.autograd.graph.saved_tensors_hooks(pack, unpack) if step else contextlib.nullcontext():
            engine.train_step(batches, 1e-3)
    states = max(most[0], live_tensor_bytes(logits)) - before_tensors
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before_rss
    Path(out_dir, f"{rank}.json").write_text(json.dumps({"states": states, "peak": peak,
                                                         "saved": most_held[1] or max(sum(d.values()) for d in saved)}))
    shutdown()


def measure(cfg, world: int, target=None) -> list:
    """Run ``target(rank, world, port, cfg, out_dir)`` (default :func:`rank_main`) on
    ``world`` spawned gloo ranks; each writes ``out_dir/<rank>.json``: the list of them."""
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as out:
        mp.start_processes(target or rank_main, args=(world, port, cfg, out), nprocs=world, start_method="spawn")
        return [json.loads(Path(out, f"{r}.json").read_text()) for r in range(world)]


def predicted_saved(cfg, layout, mem) -> float:
    """The planner's activations less what autograd does not save. One micro-batch through
    the whole model: the logits the loop holds and their fp32 gradient ((e + 4) x vocab per
    token, over the vocabulary shards under tensor parallel) and the block in flight. A pipeline: the most saved at once on the first or the
    last stage, the held micro-batches' blocks (and head, less its logits). Autocast's
    weight casts are saved too (a planner buffer; the heaviest stage's)."""
    from launcher.plan.memory import (activation_terms, block_bytes, compute_bytes, pipeline_held, uses_autocast,
                                      vocab_shards)

    e, t, m, autocast = compute_bytes(cfg), cfg.train, cfg.model, uses_autocast(cfg)
    casts = e * mem.stage_params if autocast else 0.0
    if layout.pp == 1:
        unsaved = (e + 4) * m.vocab_size / vocab_shards(layout) + block_bytes(m, layout.tp, e, autocast, False)
        return mem.activation_bytes - t.micro_batch_size * t.seq_len * unsaved + casts
    saved, _, head, _ = activation_terms(cfg, layout, cfg.strategy.activation_checkpointing)
    first, last = pipeline_held(cfg, layout)
    micro = t.micro_batch_size * t.grad_accum * t.seq_len / cfg.strategy.pp_microbatches
    return micro * max(first * saved, last * (saved + head - e * m.vocab_size)) + casts


def row_of(name: str, world: int, prec: str, cfg, layout, mem, ranks: list, seconds: float) -> dict:
    """One row of the table: what the ranks measured (:func:`measure`'s list) beside the
    planner's prediction ``mem`` (launcher.plan.memory.estimate), and their ratios."""
    row = dict(strategy=name, ranks=world, precision=prec,
               measured_state_bytes=max(r["states"] for r in ranks),
               predicted_state_bytes=mem.model_state_bytes + mem.cpu_bytes,
               measured_activation_bytes=max(r["saved"] for r in ranks),
               predicted_activation_bytes=predicted_saved(cfg, layout, mem),
               measured_peak_bytes=max(r["peak"] for r in ranks), predicted_peak_bytes=mem.total_bytes + mem.cpu_bytes
               + (DS_CPU_SHM if cfg.strategy.engine == "deepspeed" else 0), seconds=seconds)
    row["state_ratio"] = row["measured_state_bytes"] / row["predicted_state_bytes"]
    row["activation_ratio"] = row["measured_activation_bytes"] / row["predicted_activation_bytes"]
    row["peak_ratio"] = row["measured_peak_bytes"] / row["predicted_peak_bytes"]
    return row


def main() -> None:
    from launcher.plan.memory import estimate
    from launcher.overrides import group_options
    from launcher.plan.cli import compose
    from spec.config import ConfigError
    from spec.layout import build_layout
    from spec.support import check_supported

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", default="2,4")
    ap.add_argument("--strategies", default=",".join(group_options("strategy")))
    ap.add_argument("--precision", default="fp32,bf16")
    ap.add_argument("--overrides", default="", help="extra config overrides for every run, space-separated "
                    "(e.g. 'strategy.zero_stage=0' with --strategies zero1)")
    ap.add_argument("--json", action="store_true", help="one JSON object per line instead of the table")
    args = ap.parse_args()
    mb = 1e6
    if not args.json:
        print(f"{'strategy':<15}{'ranks':>5}{'prec':>6}  {'states MB meas/pred':>20}{'ratio':>7}"
              f"  {'activ MB meas/pred':>19}{'ratio':>7}  {'peak MB meas/pred':>18}{'ratio':>7}{'secs':>6}")
    for name in args.strategies.split(","):
        for world in (int(r) for r in args.ranks.split(",")):
            for prec in args.precision.split(","):
                cfg = compose(["+cluster=local", f"cluster.gpus_per_node={world}", f"+strategy={name}",
                               f"strategy.mixed_precision={prec}", *MODEL, *args.overrides.split()])
                try:
                    layout = build_layout(cfg)
                    check_supported(cfg, layout)
                except ConfigError as exc:
                    print(f"{name:<15}{world:>5}{prec:>6}  skipped: {exc}")
                    continue
                mem = estimate(cfg, layout)
                t0 = time.time()
                try:
                    ranks = measure(cfg, world)
                except Exception as exc:  # a strategy that fails here is reported, the rest still run
                    print(f"{name:<15}{world:>5}{prec:>6}  failed: {str(exc).strip().splitlines()[-1][:200]}")
                    continue
                row = row_of(name, world, prec, cfg, layout, mem, ranks, seconds=round(time.time() - t0, 1))
                states, peak = row["measured_state_bytes"], row["measured_peak_bytes"]
                if args.json:
                    print(json.dumps(row), flush=True)
                    continue
                act = f"{row['predicted_activation_bytes'] / mb:<9.1f}{row['activation_ratio']:>7.2f}"
                print(f"{name:<15}{world:>5}{prec:>6}  {states / mb:>9.1f}/{row['predicted_state_bytes'] / mb:<10.1f}"
                      f"{row['state_ratio']:>7.2f}  {row['measured_activation_bytes'] / mb:>9.1f}/"
                      f"{act}  {peak / mb:>8.1f}/{row['predicted_peak_bytes'] / mb:<9.1f}"
                      f"{row['peak_ratio']:>7.2f}{row['seconds']:>6.0f}", flush=True)


if __name__ == "__main__":
    main()
