"""``python -m train.data.prepare`` against the tokenizer's own ``encode_batch``.

The same text (JSONL of documents: the repository's text files repeated to
``--mb`` MB), the same tokenizer (a byte-level BPE of ``--vocab`` tokens trained on it
first, outside the timings). The baseline is the least a pipeline can spend: one
``encode_batch`` per batch of documents already in memory, with every core (the Rust
tokenizer's own threads), nothing read or written. ``prepare`` reads the files, encodes,
splits, appends EOS and writes the token files. Runs alternate; the medians and their
ratio (prepare tokens/s over encode_batch tokens/s) are printed. Goal >= 0.8.

``--chat``: ``prepare --chat`` (render, encode, assistant mask, write) against
transformers' ``apply_chat_template(..., tokenize=True, return_assistant_tokens_mask=True)``
on the same conversations (the repository's text cut into user / assistant turns), the
same tokenizer and template (tests/fixtures/chat/qwen's ChatML with generation markers),
in the same batches of conversations. Goal >= 1.0.

    .venv/bin/python bench/data.py [--mb 20] [--repeats 3] [--chat]
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


def conversations(out: Path, docs: list) -> list:
    """Each document cut into turns of a conversation: system?, (user, assistant)+."""
    convs = []
    for i, doc in enumerate(docs):
        parts = [doc[k:k + 700] for k in range(0, len(doc), 700)][:8] or [doc]
        messages = [{"role": "system", "content": "Answer as the repository does."}] if i % 2 else []
        messages += [{"role": "user" if j % 2 == 0 else "assistant", "content": part} for j, part in enumerate(parts)]
        if messages[-1]["role"] != "assistant":
            messages.append({"role": "assistant", "content": parts[0][:200]})
        convs.append(messages)
    with open(out, "w") as f:
        for messages in convs:
            f.write(json.dumps({"messages": messages}) + "\n")
    return convs


def chat(args: argparse.Namespace, tmp: Path) -> None:
    import shutil

    from transformers import AutoTokenizer

    from train.data.chat_prepare import BATCH

    docs = corpus(tmp / "docs.jsonl", args.mb)
    convs = conversations(tmp / "chat.jsonl", docs)
    tok_dir = tmp / "tok"
    prep.train_tokenizer([tmp / "docs.jsonl"], "text", args.vocab, tok_dir)
    tok, _, _ = prep.load_tokenizer(tok_dir)
    for special in ("<|im_start|>", "<|im_end|>"):
        tok.add_special_tokens([special])
    tok.save(str(tok_dir / "tokenizer.json"))
    shutil.copy(REPO / "tests/fixtures/chat/qwen/tokenizer_config.json", tok_dir)
    theirs = AutoTokenizer.from_pretrained(str(tok_dir))
    base_rates, our_rates = [], []
    for r in range(args.repeats):
        t0, n = time.perf_counter(), 0
        for k in range(0, len(convs), BATCH):
            out = theirs.apply_chat_template(convs[k:k + BATCH], tokenize=True, return_dict=True,
                                             return_assistant_tokens_mask=True)
            n += sum(map(len, out["input_ids"]))
        base_rates.append(n / (time.perf_counter() - t0))
        t0 = time.perf_counter()
        info = prep.prepare(prep.parse([str(tmp / "chat.jsonl"), "--chat", "--tokenizer", str(tok_dir), "--out",
                                        str(tmp / f"chat{r}"), "--no-progress"]))
        n_ours = info["splits"]["train"]["tokens"] + info["splits"]["val"]["tokens"]
        our_rates.append(n_ours / (time.perf_counter() - t0))
        assert n_ours == n, (n_ours, n)  # the same tokens
    b, o = statistics.median(base_rates), statistics.median(our_rates)
    print(f"{len(convs)} conversations, {n:,} tokens, vocab {args.vocab}, {os.cpu_count()} cores")
    print(f"apply_chat_template: {b:,.0f} tokens/s   prepare --chat: {o:,.0f} tokens/s (medians of {args.repeats})")
    print(f"ratio prepare --chat / apply_chat_template: {o / b:.3f}  (goal >= 1.0)")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--mb", type=int, default=20)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--chat", action="store_true", help="the chat path against transformers' apply_chat_template")
    args = p.parse_args()
    if args.chat:
        with tempfile.TemporaryDirectory() as tmp:
            return chat(args, Path(tmp))
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
