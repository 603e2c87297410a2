"""The head and the loss in chunks: peak memory of head + loss, chunked over whole logits.

A head over Qwen2.5's 152,064-token vocabulary, fed 8,192 tokens of hidden states (fp32,
CPU, one process): the trainer's own loss (train/loss.py) with whole logits
(``loss_sum(head(h))``) and in checkpointed chunks (``chunked_head_loss``, what
``Transformer.forward`` runs with ``model.loss_chunk_tokens``), forward and backward.
Each runs in a fresh process; a thread samples the RSS every millisecond and the peak
rise over the RSS before the forward is taken (the head's weight gradient, written in
both, included). Printed: both peaks, their ratio (goal <= 0.25) and both times.

    .venv/bin/python bench/memory.py chunked-loss [--vocab 152064] [--tokens 8192] [--dim 256] [--chunk 1024]
"""
from __future__ import annotations

import argparse
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


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--vocab", type=int, default=152064)
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--chunk", type=int, default=AUTO_CHUNK)
    args = p.parse_args()
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "65536")  # freed buffers go back to the system
    gib = 2**30
    (whole, w_loss, w_s), (chunked, c_loss, c_s) = measure(args, 0), measure(args, args.chunk)
    print(f"vocab {args.vocab} x {args.tokens} tokens, dim {args.dim}, fp32, chunk {args.chunk}")
    print(f"whole logits: peak {whole / gib:.2f} GiB, {w_s:.1f} s, loss {w_loss:.5f}")
    print(f"chunked:      peak {chunked / gib:.2f} GiB, {c_s:.1f} s, loss {c_loss:.5f}")
    print(f"chunked / whole: peak {chunked / whole:.3f} (goal <= 0.25), time {c_s / w_s:.2f}")


if __name__ == "__main__":
    main()
