"""LoRA as far as the login side needs it (no torch): the target modules by PEFT's names
and ours, the checks of ``peft.*``, the adapter's parameter names, and the identity of
the base model a LoRA run's checkpoints belong to.

- :data:`TARGETS`: PEFT's module name -> ours inside a block (``q_proj`` -> ``attention.wq``);
  ``all-linear`` is every one of them (PEFT's ``all-linear`` leaves out the output head too).
- :func:`check_peft`: one line naming the field, the value and the fix for what this
  version does not run (unknown method, rank < 1, a module the model lacks);
  :func:`check_peft_layout`: pipeline or tensor parallel, refused the same way.
- :func:`base_identity`: what a checkpoint records of its base (``model.hf_path`` and a
  fingerprint of its ``config.json``, index and safetensors sizes; or the model and the
  seed its initial weights came from), checked at resume (:func:`check_same_base`).
"""
from __future__ import annotations

import functools
import hashlib
import json
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional

from spec.config import ConfigError, RunConfig
from spec.model_size import ffn_hidden_dim, head_dim

# PEFT's names (transformers' Llama / Qwen modules) -> ours inside a block (spec/hf.py's _BLOCK).
TARGETS = {"q_proj": "attention.wq", "k_proj": "attention.wk", "v_proj": "attention.wv", "o_proj": "attention.wo",
           "gate_proj": "feed_forward.w1", "up_proj": "feed_forward.w3", "down_proj": "feed_forward.w2"}
ALL_LINEAR = "all-linear"
METHODS = (None, "lora")
# The adapter's two matrices on a target module: A (rank x in), B (out x rank), as PEFT's
# lora_A / lora_B; ours are parameters of the module itself (layers.0.attention.wq.lora_A).
ADAPTER_SUFFIXES = (".lora_A", ".lora_B")
# The key a manifest's shape holds the base under (train/checkpoint/manager.py checks it).
BASE_KEY = "adapter_base"


def lora_enabled(cfg: RunConfig) -> bool:
    return cfg.peft.method == "lora"


def target_names(cfg: RunConfig) -> List[str]:
    """PEFT's names of the modules that get an adapter, in PEFT's order."""
    wanted = list(cfg.peft.target_modules)
    return list(TARGETS) if ALL_LINEAR in wanted else [n for n in TARGETS if n in wanted]


def adapter_params(cfg: RunConfig) -> int:
    """Parameters of the adapters: rank x (in + out) for each target of every block."""
    m = cfg.model
    q, kv, hidden = m.n_heads * head_dim(m), (m.n_kv_heads or m.n_heads) * head_dim(m), ffn_hidden_dim(m)
    sizes = {"q_proj": m.dim + q, "k_proj": m.dim + kv, "v_proj": m.dim + kv, "o_proj": q + m.dim,
             "gate_proj": m.dim + hidden, "up_proj": m.dim + hidden, "down_proj": hidden + m.dim}
    return m.n_layers * cfg.peft.rank * sum(sizes[n] for n in target_names(cfg))


def is_adapter(name: str) -> bool:
    """Whether a parameter name (ours) is a LoRA matrix."""
    return name.endswith(ADAPTER_SUFFIXES)


def check_peft(cfg: RunConfig) -> None:
    """Raise ConfigError (field, value, fix) for a ``peft.*`` this version cannot run (its
    layouts: :func:`check_peft_layout`)."""
    p = cfg.peft
    if p.method not in METHODS:
        raise ConfigError(f"peft.method={p.method!r} is not known; use +peft=lora (peft.method=lora) or "
                          "peft.method=null (full fine-tuning)")
    if p.method is None:
        return
    if p.rank < 1:
        raise ConfigError(f"peft.rank={p.rank} must be at least 1; use e.g. peft.rank=16")
    if not p.alpha > 0:
        raise ConfigError(f"peft.alpha={p.alpha} must be positive (the update is alpha / rank x B A); "
                          "use e.g. peft.alpha=32")
    if not 0.0 <= p.dropout < 1.0:
        raise ConfigError(f"peft.dropout={p.dropout} must be in [0, 1); use e.g. peft.dropout=0.05")
    unknown = [n for n in p.target_modules if n != ALL_LINEAR and n not in TARGETS]
    if unknown or not p.target_modules:
        what = f"names {unknown[0]!r}, a module" if unknown else "is empty: it names no module"
        raise ConfigError(f"peft.target_modules={list(p.target_modules)} {what} model {cfg.model.name!r} does not "
                          f"have as a LoRA target; its linear layers are {', '.join(TARGETS)} (or all-linear)")


def check_peft_layout(cfg: RunConfig, layout) -> None:
    """Raise ConfigError for a layout LoRA does not run on (spec.support.check_supported:
    the launch refuses it, the planner passes it over)."""
    if not lora_enabled(cfg):
        return
    for field, degree in (("pipeline_parallel", layout.pp), ("tensor_parallel", layout.tp)):
        if degree != 1:
            raise ConfigError(f"peft.method=lora with strategy.{field}={degree}: LoRA runs under DDP, FSDP, HSDP "
                              f"and DeepSpeed ZeRO here, not {field.replace('_', ' ')}; use "
                              f"strategy.{field}=1 (e.g. +strategy=fsdp)")


FINGERPRINT_BYTES = 1 << 16  # of tensor data read from each end of every safetensors file


@functools.lru_cache(maxsize=4)
def _fingerprint(hf_path: str) -> str:
    """A digest of a Hugging Face directory's ``config.json``, its safetensors index, and of
    each safetensors file its name, size, header and the first and last 64 KiB of its
    tensor data: it changes with another model, other weights of the same shapes, or a
    truncated copy. It reads little (about 128 KiB a file) and once a process: a node's
    agent (or a local rank 0) computes it before it forks the node's ranks
    (train.main.warm_imports), which inherit it, so a 512-node job opens the base's files
    512 times at start rather than once a rank (a 70B base: 30 shards, 4,096 ranks)."""
    root, h = Path(hf_path), hashlib.sha256()
    for name in ("config.json", "model.safetensors.index.json"):
        f = root / name
        h.update(name.encode() + (f.read_bytes() if f.is_file() else b"-"))
    for f in sorted(root.glob("*.safetensors")):
        size = f.stat().st_size
        h.update(f"{f.name}:{size};".encode())
        with open(f, "rb") as fh:
            header = min(int.from_bytes(fh.read(8), "little"), 1 << 26)  # the JSON header (bounded)
            h.update(fh.read(header + FINGERPRINT_BYTES))
            fh.seek(max(0, size - FINGERPRINT_BYTES))
            h.update(fh.read(FINGERPRINT_BYTES))
    return h.hexdigest()[:16]


def base_identity(cfg: RunConfig) -> Dict[str, Any]:
    """{BASE_KEY: ...} for a LoRA run (what its checkpoints record of the frozen base they
    adapt: it is not in them), else {}. Without ``model.hf_path`` the base is the initial
    weights of the model, a function of its shape and ``train.seed``."""
    if not lora_enabled(cfg):
        return {}
    m = cfg.model
    if m.hf_path:
        return {BASE_KEY: {"hf_path": str(m.hf_path), "fingerprint": _fingerprint(m.hf_path)}}
    shape = json.dumps({k: getattr(m, k) for k in ("dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size",
                                                     "ffn_hidden_dim", "tie_embeddings")}, sort_keys=True)
    digest = hashlib.sha256(f"{shape};seed={cfg.train.seed}".encode()).hexdigest()[:16]
    return {BASE_KEY: {"hf_path": None, "fingerprint": digest, "seed": cfg.train.seed}}


def check_same_base(saved: Optional[Mapping[str, Any]], own: Mapping[str, Any], ckpt: str) -> None:
    """Raise ConfigError when checkpoint ``ckpt`` (its manifest's shape ``saved``) adapts another
    base than this run's (``own``: this run's shape)."""
    theirs, ours = (saved or {}).get(BASE_KEY), own.get(BASE_KEY)
    if ours is None and theirs is None:
        return
    if ours is None or theirs is None or theirs.get("fingerprint") != ours.get("fingerprint"):
        def name(b):
            return "no LoRA (full weights)" if b is None else (
                f"hf_path={b['hf_path']} (fingerprint {b['fingerprint']})" if b.get("hf_path")
                else f"initial weights of seed {b.get('seed')} (fingerprint {b['fingerprint']})")
        raise ConfigError(f"checkpoint {ckpt} holds a LoRA adapter of base {name(theirs)} but this run's base is "
                          f"{name(ours)}; resume with the model.hf_path (and train.seed) it was trained on, "
                          "or start a new run directory")
