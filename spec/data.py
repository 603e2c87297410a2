"""The prepared-data contract shared by ``python -m train.data.prepare`` (writer), the
loader (reader) and the launch checks: file names, manifest fields, and the checks that
refuse a run before submission (no torch)."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Dict

from spec.config import ConfigError, RunConfig, read_json_in

MANIFEST = "manifest.json"
TRAIN_BIN = "train.bin"
VAL_BIN = "val.bin"
SOURCES = ("markov", "file", "tokens")


def read_manifest(path: Path) -> Dict[str, Any]:
    return read_json_in(Path(path), MANIFEST, "data.path", "write the directory with "
                        "`python -m train.data.prepare INPUT... --tokenizer PATH --out DIR`")


def check_data(cfg: RunConfig) -> None:
    """The data source exists and fits the model (a tokenizer's vocabulary larger than the
    model's would index past the embedding)."""
    d = cfg.data
    if d.source not in SOURCES:
        raise ConfigError(f"data.source={d.source} is unknown; use one of {', '.join(SOURCES)}")
    if d.source == "file" and cfg.train.eval_every > 0:
        raise ConfigError(f"train.eval_every={cfg.train.eval_every} needs a validation split, which "
                          "data.source=file has not; use data.source=tokens (train.data.prepare) or eval_every=0")
    if d.source != "tokens":
        return
    if not d.path:
        raise ConfigError("data.source=tokens needs data.path=DIR (a directory written by train.data.prepare)")
    info = read_manifest(Path(d.path))
    vocab = int(info["vocab_size"])
    if vocab > cfg.model.vocab_size:
        raise ConfigError(f"data.path={d.path}: its tokenizer's vocabulary ({vocab}) is larger than "
                          f"model.vocab_size={cfg.model.vocab_size}; set model.vocab_size>={vocab} or use the "
                          "model's own tokenizer")
    for name in (TRAIN_BIN, VAL_BIN):
        if not (Path(d.path) / name).is_file():
            raise ConfigError(f"data.path={d.path}: {name} is missing; prepare the data again")
