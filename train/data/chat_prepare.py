"""``python -m train.data.prepare --chat``: conversations -> tokens, loss mask, offsets.

Each conversation is rendered (:mod:`train.data.chat`) and encoded without added special
tokens (the template writes them, as ``apply_chat_template`` tokenizes). Conversations
longer than ``--max-length`` tokens are cut to it (``--overlong truncate``, the default)
or left out (``--overlong drop``); the manifest counts both. The train/val split is by
conversation, seeded, as for text. Written per split: ``<split>.bin`` (token ids),
``<split>_mask.bin`` (uint8, 1 = the token carries loss as a target) and
``<split>_offsets.bin`` (int64, conversation ``i`` is tokens ``offsets[i]:offsets[i+1]``).
The main thread renders (Python) while a second encodes the previous batch (Rust, on
every core).
"""
from __future__ import annotations

import argparse
import json
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Tuple

import numpy as np

from spec.data import chat_files
from train.data.chat import ChatTemplate, Span, messages_of, token_mask

BATCH = 512  # conversations per encode_batch call
OVERLONG = ("truncate", "drop")


def conversations(files: List[Path]) -> Iterator[Tuple[str, List[Dict[str, Any]]]]:
    """(where, messages) of every JSONL record of ``files`` in order."""
    for f in files:
        with open(f, encoding="utf-8") as lines:
            for n, line in enumerate(lines, 1):
                if line.strip():
                    yield f"{f}:{n}", messages_of(json.loads(line), f"{f}:{n}")


def _rendered(template: ChatTemplate, files: List[Path]) -> Iterator[Tuple[List[str], List[List[Span]]]]:
    texts: List[str] = []
    spans: List[List[Span]] = []
    for _, messages in conversations(files):
        text, found = template.render(messages)
        texts.append(text)
        spans.append(found)
        if len(texts) == BATCH:
            yield texts, spans
            texts, spans = [], []
    if texts:
        yield texts, spans


def _encoded(tok: Any, template: ChatTemplate, files: List[Path]) -> Iterator[Tuple[Any, List[List[Span]]]]:
    """(encodings, spans) per batch; the next batch renders while this one encodes."""
    encode = tok.encode_batch if template.loss_on == "assistant" else tok.encode_batch_fast
    with ThreadPoolExecutor(1) as pool:
        pending = None
        for texts, spans in _rendered(template, files):
            future = pool.submit(encode, texts, add_special_tokens=False)
            if pending is not None:
                yield pending[0].result(), pending[1]
            pending = (future, spans)
        if pending is not None:
            yield pending[0].result(), pending[1]


class _Split:
    def __init__(self, out: Path, name: str, dtype: np.dtype) -> None:
        self.paths = [out / (p + ".tmp") for p in chat_files(name)]
        self.tokens, self.mask = open(self.paths[0], "wb"), open(self.paths[1], "wb")
        self.dtype = dtype
        self.lengths: List[int] = []
        self.loss_tokens = 0

    def add(self, ids: np.ndarray, mask: np.ndarray) -> None:
        ids.astype(self.dtype).tofile(self.tokens)
        mask.tofile(self.mask)
        self.lengths.append(len(ids))
        self.loss_tokens += int(mask[1:].sum())  # the first token is never a target

    def close(self) -> Dict[str, int]:
        self.tokens.close()
        self.mask.close()
        np.concatenate([[0], np.cumsum(self.lengths, dtype=np.int64)]).astype(np.int64).tofile(self.paths[2])
        for path in self.paths:
            os.replace(path, path.with_suffix(""))
        return {"documents": len(self.lengths), "tokens": int(sum(self.lengths)), "loss_tokens": self.loss_tokens}


def write_chat(args: argparse.Namespace, tok: Any, template: ChatTemplate, files: List[Path], dtype: np.dtype,
               in_val: Callable[[int, int, float], bool]) -> Dict[str, Any]:
    """Write both splits; the manifest's chat fields. The split is ``in_val``'s (prepare's,
    by index); when no conversation fell in val (few of them), the last training one is
    moved there."""
    split = {"train": _Split(args.out, "train", dtype), "val": _Split(args.out, "val", dtype)}
    counts = {"conversations": 0, "truncated": 0, "dropped": 0}
    longest = 0
    held = None
    for encodings, spans in _encoded(tok, template, files):
        for enc, found in zip(encodings, spans):
            index = counts["conversations"]
            counts["conversations"] += 1
            ids = np.asarray(enc.ids, dtype=np.int64)
            mask = (np.ones(len(ids), np.uint8) if template.loss_on == "all"
                    else token_mask(np.asarray(enc.offsets, dtype=np.int64).reshape(-1, 2), found))
            if args.max_length and len(ids) > args.max_length:
                if args.overlong == "drop":
                    counts["dropped"] += 1
                    continue
                counts["truncated"] += 1
                ids, mask = ids[:args.max_length], mask[:args.max_length]
            longest = max(longest, len(ids))
            if in_val(index, args.seed, args.val_fraction):
                split["val"].add(ids, mask)
            else:
                if held is not None:
                    split["train"].add(*held)
                held = (ids, mask)
    if held is not None:
        last = "val" if not split["val"].lengths and split["train"].lengths else "train"
        split[last].add(*held)
    splits = {name: s.close() for name, s in split.items()}
    if not splits["train"]["documents"]:
        raise SystemExit(f"error: no conversation was kept for training ({counts['dropped']} dropped as longer than "
                         f"--max-length {args.max_length}); raise --max-length or use --overlong truncate")
    return {"format": "chat", "loss_on": template.loss_on, "spans": template.method,
            "max_length": args.max_length, "overlong": args.overlong, "longest": longest, **counts,
            "splits": splits}
