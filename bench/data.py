"""``python -m train.data.prepare`` against the tokenizer's own ``encode_batch``.

The same text (JSONL of documents: the repository's text files repeated to
``--mb`` MB), the same tokenizer (a byte-level BPE of ``--vocab`` tokens trained on it
first, outside the timings). The baseline is the least a pipeline can spend: one
``encode_batch`` per batch of documents already in memory, with every core (the Rust
tokenizer's own threads), nothing read or written. ``prepare`` reads the files, encodes,
splits, appends EOS and writes the token files. Runs alternate; the medians and their
ratio (prepare tokens/s over encode_batch tokens/s) are printed. Goal >= 0.8.

    .venv/bin/python bench/data.py [--mb 20] [--repeats 3]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from train.data import prepare as prep  # noqa: E402


def corpus(out: Path, megabytes: int) -> list:
    texts = [p.read_text(errors="replace") for pattern in ("*.md", "docs/*.md", "**/*.py")
             for p in sorted(REPO.glob(pattern)) if ".venv" not in p.parts and p.stat().st_size > 200]
    docs, size, i = [], 0, 0
    while size < megabytes * 2**20:
        doc = f"[copy {i // len(texts)}] " + texts[i % len(texts)]
        docs.append(doc)
        size += len(doc)
        i += 1
    with open(out, "w") as f:
        for doc in docs:
            f.write(json.dumps({"text": doc}) + "\n")
    return docs


def baseline(tok, docs: list) -> tuple:
    """(seconds, tokens) of encode_batch over the documents in prepare's batches."""
    encode = getattr(tok, "encode_batch_fast", tok.encode_batch)
    t0 = time.perf_counter()
    tokens = sum(len(e.ids) for batch in prep.batches(iter(docs)) for e in encode(batch))
    return time.perf_counter() - t0, tokens


def ours(source: Path, tokenizer: Path, out: Path) -> tuple:
    args = prep.parse([str(source), "--tokenizer", str(tokenizer), "--out", str(out), "--no-progress"])
    t0 = time.perf_counter()
    info = prep.prepare(args)
    seconds = time.perf_counter() - t0
    return seconds, info["splits"]["train"]["tokens"] + info["splits"]["val"]["tokens"]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--mb", type=int, default=20)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        docs = corpus(tmp / "docs.jsonl", args.mb)
        tokenizer = prep.train_tokenizer([tmp / "docs.jsonl"], "text", args.vocab, tmp / "tok")
        tok, _, _ = prep.load_tokenizer(tokenizer)
        base_rates, our_rates = [], []
        for r in range(args.repeats):
            s, n = baseline(tok, docs)
            base_rates.append(n / s)
            s, n_ours = ours(tmp / "docs.jsonl", tokenizer, tmp / f"out{r}")
            our_rates.append(n_ours / s)  # n_ours = n + one EOS per document
        b, o = statistics.median(base_rates), statistics.median(our_rates)
        print(f"{len(docs)} documents, {args.mb} MB, vocab {args.vocab}, {os.cpu_count()} cores")
        print(f"encode_batch: {b:,.0f} tokens/s   prepare: {o:,.0f} tokens/s (medians of {args.repeats})")
        print(f"ratio prepare / encode_batch: {o / b:.3f}  (goal >= 0.8)")


if __name__ == "__main__":
    main()
