"""The prepared-data contract shared by ``python -m train.data.prepare`` (writer), the
loader (reader) and the launch checks: file names, manifest fields, and the checks that
refuse a run before submission (no torch)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict, Optional, Tuple

from spec.config import ConfigError, RunConfig, read_json_in

MANIFEST = "manifest.json"
TRAIN_BIN = "train.bin"
VAL_BIN = "val.bin"
SOURCES = ("markov", "file", "tokens", "chat")
PREPARED = ("tokens", "chat")  # the sources read from a directory train.data.prepare wrote


def chat_files(split: str) -> tuple:
    """A chat split's files: token ids, the loss mask (uint8, 1 = carries loss as a
    target) and the conversations' offsets (int64, n+1 of them)."""
    return f"{split}.bin", f"{split}_mask.bin", f"{split}_offsets.bin"


def read_manifest(path: Path) -> Dict[str, Any]:
    return read_json_in(Path(path), MANIFEST, "data.path", "write the directory with "
                        "`python -m train.data.prepare INPUT... --tokenizer PATH --out DIR`")


def tokenizer_of(cfg: RunConfig) -> Tuple[Optional[Path], Optional[int], Optional[int]]:
    """(tokenizer file, EOS id, BOS id) of the run's prepared data (its manifest), else Nones."""
    manifest = Path(cfg.data.path or "", MANIFEST) if cfg.data.source in PREPARED else None
    if manifest is None or not manifest.is_file():
        return None, None, None
    info = json.loads(manifest.read_text())
    tok = info.get("tokenizer_copy")
    return (Path(manifest.parent, tok) if tok else None), info.get("eos_id"), info.get("bos_id")


def check_data(cfg: RunConfig) -> None:
    """The data source exists and fits the model (a tokenizer's vocabulary larger than the
    model's would index past the embedding)."""
    d = cfg.data
    if d.source not in SOURCES:
        raise ConfigError(f"data.source={d.source} is unknown; use one of {', '.join(SOURCES)}")
    if d.source == "file" and cfg.train.eval_every > 0:
        raise ConfigError(f"train.eval_every={cfg.train.eval_every} needs a validation split, which "
                          "data.source=file has not; use data.source=tokens (train.data.prepare) or eval_every=0")
    if d.source not in PREPARED:
        return
    if not d.path:
        raise ConfigError(f"data.source={d.source} needs data.path=DIR (a directory written by train.data.prepare)")
    info = read_manifest(Path(d.path))
    kind = info.get("format", "tokens")
    if kind != d.source:
        how = "python -m train.data.prepare --chat" if d.source == "chat" else "python -m train.data.prepare"
        raise ConfigError(f"data.source={d.source}: data.path={d.path} holds {kind} data; use data.source={kind}, "
                          f"or prepare the inputs with `{how}`")
    vocab = int(info["vocab_size"])
    if vocab > cfg.model.vocab_size:
        raise ConfigError(f"data.path={d.path}: its tokenizer's vocabulary ({vocab}) is larger than "
                          f"model.vocab_size={cfg.model.vocab_size}; set model.vocab_size>={vocab} or use the "
                          "model's own tokenizer")
    names = chat_files("train") + chat_files("val") if d.source == "chat" else (TRAIN_BIN, VAL_BIN)
    for name in names:
        if not (Path(d.path) / name).is_file():
            raise ConfigError(f"data.path={d.path}: {name} is missing; prepare the data again")
    # Evaluation needs a target in the validation split: a window and its next token, or a
    # conversation token that carries loss (truncation by --max-length can leave none).
    val = info.get("splits", {}).get("val", {})
    held = val.get("loss_tokens" if d.source == "chat" else "tokens")
    needed = 1 if d.source == "chat" else cfg.train.seq_len + 1
    if cfg.train.eval_every > 0 and held is not None and held < needed:
        what = "tokens carrying loss (assistant turns) in its validation conversations" if d.source == "chat" \
            else f"validation tokens, fewer than train.seq_len+1={needed}"
        raise ConfigError(f"train.eval_every={cfg.train.eval_every}: data.path={d.path} holds {held} {what}; "
                          "prepare it again with a larger --val-fraction (or --max-length), or set train.eval_every=0")
    if d.source == "chat" and int(info["longest"]) > cfg.train.seq_len + 1:
        raise ConfigError(f"data.path={d.path}: its longest conversation has {info['longest']} tokens, more than "
                          f"train.seq_len+1={cfg.train.seq_len + 1}; set train.seq_len>={int(info['longest']) - 1} "
                          f"or prepare again with --max-length {cfg.train.seq_len + 1}")
