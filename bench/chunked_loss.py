"""The head and the loss in chunks: peak memory of head + loss, chunked over whole logits.

A head over Qwen2.5's 152,064-token vocabulary, fed 8,192 tokens of hidden states (fp32,
CPU, one process): the trainer's own loss (train/loss.py) with whole logits
(``loss_sum(head(h))``) and in checkpointed chunks (``chunked_head_loss``, what
``Transformer.forward`` runs with ``model.loss_chunk_tokens``), forward and backward.
Each runs in a fresh process; a thread samples the RSS every millisecond and the peak
rise over the RSS before the forward is taken (the head's weight gradient, written in
both, included). Printed: both peaks, their ratio (goal <= 0.25) and both times.

    .venv/bin/python bench/memory.py chunked-loss [--vocab 152064] [--tokens 8192] [--dim 256] [--chunk 1024]

``--gpu`` (``make gpu-check``'s ``speed/loss_128k`` and ``speed/loss_152k`` rows): one
training step's loss, forward and backward, on the GPU as the speed rows run it (the
head's fp32 weight under bf16 autocast, bf16 hidden states of the 1B Llama's dim 2048, the
speed run's micro-batch x 2048 tokens) four ways in one process: whole logits eager, whole
logits compiled (``strategy.compile``: train/loss.py ``compiled_cross_entropy_sum``), in
chunks of ``--chunk`` tokens eager, and chunked and compiled (what the trainer runs with
``model.loss_chunk_tokens`` and ``strategy.compile``). Each: the median time of
``--iters`` steps after ``--warmup`` (compilation), and the allocator's peak over the
memory held before the step (the head's weight gradient included). The four losses must
agree (bf16: within 1%), else the exit status is 1. Then the GPU memory outside the
caching allocator (device total - free - reserved: the CUDA context, cuBLAS, and NCCL's
buffers of a one-rank group), what the planner's CUDA_OVERHEAD stands for
(bench/calibrate_planner.py reads it). ``--json PATH`` writes the figures. ``--dry``: the
same code at a tiny size on the CPU (compiled variants through torch.compile's eager
backend), in a few seconds.

    python bench/chunked_loss.py --gpu --vocab 128256 --tokens 16384 --dim 2048 --json loss.json
    python bench/chunked_loss.py --gpu --dry
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from spec.config_model import AUTO_CHUNK  # noqa: E402  (the default chunk of a large vocabulary)
from tp_loss import PeakRSS  # noqa: E402  (bench/: the RSS sampler)


def _run(args, chunk: int, out) -> None:
    import torch
    from torch import nn

    from train.loss import chunked_head_loss, loss_sum

    torch.manual_seed(0)
    head = nn.Linear(args.dim, args.vocab, bias=False)
    h = torch.randn(args.tokens, args.dim, requires_grad=True)
    targets = torch.randint(0, args.vocab, (args.tokens,))
    with PeakRSS() as rss:
        t0 = time.perf_counter()
        loss = chunked_head_loss(head, h, targets, chunk) if chunk else loss_sum(head(h), targets)
        loss.backward()
        seconds = time.perf_counter() - t0
    out.put((rss.rise, float(loss.detach()) / args.tokens, seconds))


def measure(args, chunk: int):
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    proc = ctx.Process(target=_run, args=(args, chunk, out))
    proc.start()
    result = out.get(timeout=1200)
    proc.join()
    return result


def main(argv=None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--vocab", type=int, default=152064)
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--chunk", type=int, default=AUTO_CHUNK)
    p.add_argument("--gpu", action="store_true", help="the four losses on the GPU, bf16 (make gpu-check's loss rows)")
    p.add_argument("--iters", type=int, default=5, help="--gpu: timed steps per variant")
    p.add_argument("--warmup", type=int, default=2, help="--gpu: steps before the timed ones (compilation)")
    p.add_argument("--json", default=None, help="--gpu: write the figures here")
    p.add_argument("--dry", action="store_true", help="--gpu's code at a tiny size on the CPU")
    args = p.parse_args(argv)
    if args.gpu or args.dry:
        sys.exit(gpu_losses(args))
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "65536")  # freed buffers go back to the system
    gib = 2**30
    (whole, w_loss, w_s), (chunked, c_loss, c_s) = measure(args, 0), measure(args, args.chunk)
    print(f"vocab {args.vocab} x {args.tokens} tokens, dim {args.dim}, fp32, chunk {args.chunk}")
    print(f"whole logits: peak {whole / gib:.2f} GiB, {w_s:.1f} s, loss {w_loss:.5f}")
    print(f"chunked:      peak {chunked / gib:.2f} GiB, {c_s:.1f} s, loss {c_loss:.5f}")
    print(f"chunked / whole: peak {chunked / whole:.3f} (goal <= 0.25), time {c_s / w_s:.2f}")


# ---------------------------------------------------------------- --gpu: the loss rows of make gpu-check

VARIANTS = {"whole": (False, False), "whole+compile": (False, True),  # name -> (chunked, compiled)
            "chunked": (True, False), "chunked+compile": (True, True)}
LOSS_RTOL = 0.01  # bf16 logits: the variants' sums agree to well within this
DRY = dict(vocab=512, tokens=256, dim=64, chunk=64, iters=1, warmup=1)  # --dry: seconds on a CPU


def _time_variant(head, h, targets, chunk: int, compiled: bool, args, device) -> dict:
    """One variant's median step time (ms), peak memory over the step's start (bytes, None
    off CUDA) and loss per token; ``args.warmup`` steps first (compilation)."""
    import torch
    from statistics import median

    from train.loss import chunked_head_loss, loss_sum

    cuda = device.type == "cuda"
    times, peaks, loss = [], [], None
    for i in range(args.warmup + args.iters):
        head.weight.grad, h.grad = None, None
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated() if cuda else 0
        t0 = time.perf_counter()
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = chunked_head_loss(head, h, targets, chunk, compiled) if chunk else loss_sum(head(h), targets, compiled)
        loss.backward()
        if cuda:
            torch.cuda.synchronize()
        if i >= args.warmup:
            times.append(time.perf_counter() - t0)
            peaks.append(torch.cuda.max_memory_allocated() - base if cuda else None)
    return {"ms": round(1000 * median(times), 3), "peak_bytes": peaks[-1],
            "loss": float(loss.detach()) / targets.numel()}


def outside_allocator_bytes() -> int:
    """GPU memory this process holds outside the caching allocator, with a one-rank NCCL
    group set up and used: total - free - reserved (the GPU otherwise idle: the speed rows
    run alone)."""
    import torch
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1,
                                device_id=torch.device("cuda", 0))
    dist.all_reduce(torch.ones(1024, device="cuda"))
    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info()
    out = total - free - torch.cuda.memory_reserved()
    dist.destroy_process_group()
    return int(out)


def gpu_losses(args) -> int:
    """``--gpu`` / ``--dry``: the four variants side by side; 1 when their losses differ.
    Under ``--dry`` the trainer's compiled loss goes through torch.compile's eager backend
    (Dynamo's trace, no Inductor), for this call only."""
    from unittest import mock

    import torch

    import train.loss as loss_mod

    if not args.dry:
        return _gpu_losses(args)
    vars(args).update(DRY)
    fn = torch.compile(loss_mod.cross_entropy_sum, backend="eager", dynamic=False)
    with mock.patch.object(loss_mod, "compiled_cross_entropy_sum", lambda: fn):
        return _gpu_losses(args)


def _gpu_losses(args) -> int:
    import torch
    from torch import nn

    device = torch.device("cpu" if args.dry else "cuda")
    torch.manual_seed(0)
    head = nn.Linear(args.dim, args.vocab, bias=False, device=device)  # fp32 under autocast, as the speed rows
    h = torch.randn(args.tokens, args.dim, device=device, dtype=torch.bfloat16, requires_grad=True)
    targets = torch.randint(0, args.vocab, (args.tokens,), device=device)
    out = {"vocab": args.vocab, "tokens": args.tokens, "dim": args.dim, "chunk": args.chunk, "iters": args.iters,
           "device": "cpu (--dry)" if args.dry else torch.cuda.get_device_name(0), "torch": torch.__version__,
           "variants": {}}
    print(f"vocab {args.vocab:,} x {args.tokens:,} tokens, dim {args.dim}, bf16 autocast, chunk {args.chunk}, "
          f"{out['device']}")
    for name, (chunked, compiled) in VARIANTS.items():
        got = out["variants"][name] = _time_variant(head, h, targets, args.chunk if chunked else 0, compiled,
                                                    args, device)
        peak = f"peak {got['peak_bytes'] / 2**30:6.2f} GiB" if got["peak_bytes"] is not None else "peak n/a"
        print(f"{name:16s} {got['ms']:9.2f} ms  {peak}  loss/token {got['loss']:.5f}", flush=True)
    out["outside_allocator_bytes"] = None
    if not args.dry:
        try:  # a figure for the calibration; the four losses stand without it
            out["outside_allocator_bytes"] = outside_allocator_bytes()
            print(f"outside the caching allocator: {out['outside_allocator_bytes'] / 2**30:.2f} GiB")
        except Exception as exc:  # noqa: BLE001 - reported, the row's figures kept
            print(f"outside the caching allocator: not measured ({type(exc).__name__}: {exc})")
    ref = out["variants"]["whole"]["loss"]
    off = {n: v["loss"] for n, v in out["variants"].items() if abs(v["loss"] - ref) > LOSS_RTOL * abs(ref)}
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(out) + "\n")
    if off:
        print(f"losses differ from whole logits' {ref:.5f} by more than {LOSS_RTOL:.0%}: {off}")
    return 1 if off else 0


if __name__ == "__main__":
    main()
