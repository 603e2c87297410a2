"""Hugging Face Llama checkpoints, as far as the login side needs them (no torch).

- :func:`model_fields`: a ``config.json`` -> our :class:`spec.config.ModelConfig` fields
  (transformers 4's ``rope_theta``/``rope_scaling`` and 5's ``rope_parameters``);
  an architecture we do not build is refused, naming what differs.
- :func:`apply_hf_model`: ``model.hf_path`` at launch: the dimensions come from the
  directory, an explicit override that disagrees is an error naming both, and every
  tensor the model needs must be in the safetensors files with its shape.
- :func:`hf_name` / :func:`our_name`: parameter names both ways. Our model rotates
  channel i with i + head_dim/2 as Hugging Face does (``train.model.apply_rope``), so the
  q/k weights need no permutation either way.
- :func:`tensor_index`: name -> (shape, dtype, file) from the safetensors headers alone
  (8-byte length + JSON), a model of any size read in milliseconds.
- :func:`hf_config`: our ModelConfig -> ``config.json`` for the export.
"""
from __future__ import annotations

import json
import re
import struct
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

from spec.config import ConfigError, ModelConfig, RopeScaling, RunConfig, read_json_in
from spec.model_size import ffn_hidden_dim

CONFIG = "config.json"
INDEX = "model.safetensors.index.json"
# Ours -> Hugging Face's, per block and for the rest.
_BLOCK = {
    "attention.wq": "self_attn.q_proj", "attention.wk": "self_attn.k_proj",
    "attention.wv": "self_attn.v_proj", "attention.wo": "self_attn.o_proj",
    "feed_forward.w1": "mlp.gate_proj", "feed_forward.w3": "mlp.up_proj", "feed_forward.w2": "mlp.down_proj",
    "attention_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
}
_TOP = {"tok_embeddings.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
        "output.weight": "lm_head.weight"}
_BLOCK_BACK = {v: k for k, v in _BLOCK.items()}
_TOP_BACK = {v: k for k, v in _TOP.items()}
_OURS = re.compile(r"^layers\.(\d+)\.(.+)\.weight$")
_THEIRS = re.compile(r"^model\.layers\.(\d+)\.(.+)\.weight$")
# config.json field -> ModelConfig field, for the plain ones.
_FIELDS = {"hidden_size": "dim", "num_hidden_layers": "n_layers", "num_attention_heads": "n_heads",
           "vocab_size": "vocab_size", "intermediate_size": "ffn_hidden_dim", "rms_norm_eps": "norm_eps",
           "max_position_embeddings": "max_seq_len"}
_DTYPES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16", "F64": "float64"}


def _rename(name: str, top: Dict[str, str], block: Dict[str, str], pattern: "re.Pattern[str]", prefix: str) -> str:
    if name in top:
        return top[name]
    m = pattern.match(name)
    if not m or m.group(2) not in block:
        raise KeyError(f"no counterpart for parameter {name!r}")
    return f"{prefix}{m.group(1)}.{block[m.group(2)]}.weight"


def hf_name(ours: str) -> str:
    """``layers.3.attention.wq.weight`` -> ``model.layers.3.self_attn.q_proj.weight``."""
    return _rename(ours, _TOP, _BLOCK, _OURS, "model.layers.")


def our_name(theirs: str) -> str:
    """The inverse of :func:`hf_name`."""
    return _rename(theirs, _TOP_BACK, _BLOCK_BACK, _THEIRS, "layers.")


def expected_shapes(m: ModelConfig) -> Dict[str, Tuple[int, ...]]:
    """Hugging Face name -> shape of every tensor our model of ``m`` takes from a checkpoint."""
    head_dim, kv = m.dim // m.n_heads, m.n_kv_heads or m.n_heads
    hidden = ffn_hidden_dim(m)
    shapes: Dict[str, Tuple[int, ...]] = {"tok_embeddings.weight": (m.vocab_size, m.dim), "norm.weight": (m.dim,)}
    if not m.tie_embeddings:
        shapes["output.weight"] = (m.vocab_size, m.dim)
    block = {"attention.wq": (m.n_heads * head_dim, m.dim), "attention.wk": (kv * head_dim, m.dim),
             "attention.wv": (kv * head_dim, m.dim), "attention.wo": (m.dim, m.n_heads * head_dim),
             "feed_forward.w1": (hidden, m.dim), "feed_forward.w3": (hidden, m.dim),
             "feed_forward.w2": (m.dim, hidden), "attention_norm": (m.dim,), "ffn_norm": (m.dim,)}
    for i in range(m.n_layers):
        shapes.update({f"layers.{i}.{k}.weight": v for k, v in block.items()})
    return {hf_name(k): v for k, v in shapes.items()}


def read_config(path: Path) -> Dict[str, Any]:
    return read_json_in(Path(path), CONFIG, "model.hf_path",
                        "point it at a Hugging Face model directory (config.json + *.safetensors)")


def model_fields(hf: Dict[str, Any], path: Any = "?") -> Dict[str, Any]:
    """Our ModelConfig fields of a Llama ``config.json``; ConfigError for what we do not build."""
    where = f"model.hf_path={path}"
    kind = hf.get("model_type")
    archs = hf.get("architectures") or []
    if kind != "llama" and "LlamaForCausalLM" not in archs:
        raise ConfigError(f"{where}: architecture {archs or kind!r} is not supported; only Llama "
                          "(model_type 'llama', LlamaForCausalLM) is built here")
    for key, want in (("hidden_act", "silu"), ("attention_bias", False), ("mlp_bias", False)):
        if hf.get(key, want) != want:
            raise ConfigError(f"{where}: {CONFIG} has {key}={hf[key]!r}; only {want!r} is supported")
    fields = {ours: hf[theirs] for theirs, ours in _FIELDS.items() if theirs in hf}
    missing = [t for t in ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size",
                           "intermediate_size") if t not in hf]
    if missing:
        raise ConfigError(f"{where}: {CONFIG} lacks {', '.join(missing)}")
    head_dim = hf.get("head_dim")
    if head_dim is not None and head_dim * hf["num_attention_heads"] != hf["hidden_size"]:
        raise ConfigError(f"{where}: head_dim={head_dim} x num_attention_heads={hf['num_attention_heads']} "
                          f"!= hidden_size={hf['hidden_size']}; only head_dim = hidden_size / heads is built")
    kv = hf.get("num_key_value_heads")
    fields["n_kv_heads"] = None if kv in (None, hf["num_attention_heads"]) else kv
    fields["tie_embeddings"] = bool(hf.get("tie_word_embeddings", False))
    rope = dict(hf.get("rope_parameters") or {})
    legacy = hf.get("rope_scaling") or {}
    theta = rope.get("rope_theta", hf.get("rope_theta", 10000.0))
    scaling = {**legacy, **{k: v for k, v in rope.items() if k != "rope_theta"}}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    fields["rope_theta"] = float(theta)
    if kind in (None, "default"):
        fields["rope_scaling"] = RopeScaling()
    elif kind == "llama3":
        fields["rope_scaling"] = RopeScaling(
            type="llama3", factor=float(scaling["factor"]), low_freq_factor=float(scaling["low_freq_factor"]),
            high_freq_factor=float(scaling["high_freq_factor"]),
            original_max_seq_len=int(scaling["original_max_position_embeddings"]))
    else:
        raise ConfigError(f"{where}: rope_type {kind!r} is not supported; 'default' and 'llama3' are")
    return fields


def _explicit(overrides: Sequence[str]) -> Dict[str, str]:
    """``model.<field>=value`` overrides the user typed (their text, by field)."""
    out = {}
    for o in overrides:
        key, sep, value = o.lstrip("+~").partition("=")
        if sep and key.startswith("model.") and key.count(".") == 1:
            out[key[len("model."):]] = value
    return out


def apply_hf_model(cfg: RunConfig, overrides: Sequence[str] = ()) -> None:
    """Fill ``cfg.model`` from ``cfg.model.hf_path`` (nothing when unset). A field set on
    the command line to another value than config.json's is an error naming both."""
    m = cfg.model
    if not m.hf_path:
        return
    path = Path(m.hf_path).expanduser()
    if not path.is_dir():
        raise ConfigError(f"model.hf_path={m.hf_path}: no such directory; give a Hugging Face model "
                          "directory (config.json + *.safetensors)")
    fields = model_fields(read_config(path), m.hf_path)
    explicit = _explicit(overrides)
    for key, value in fields.items():
        given = explicit.get(key)
        if given is not None and key != "rope_scaling" and str(value) != given and _num(given) != value:
            raise ConfigError(f"model.{key}={given} disagrees with model.hf_path's config.json "
                              f"({_theirs(key)}={value}); drop the override or use another hf_path")
        setattr(m, key, value)
    m.hf_path = str(path.resolve())
    if "name" not in explicit:
        m.name = path.resolve().name
    check_tensors(m)


def _num(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text


def _theirs(field: str) -> str:
    back = {v: k for k, v in _FIELDS.items()}
    return back.get(field, {"n_kv_heads": "num_key_value_heads", "tie_embeddings": "tie_word_embeddings",
                            "rope_theta": "rope_theta"}.get(field, field))


def safetensors_header(file: Path) -> Dict[str, Any]:
    """The JSON header of a ``.safetensors`` file (its first 8 bytes give its length)."""
    with open(file, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise ConfigError(f"{file}: truncated safetensors file (no header)")
        (n,) = struct.unpack("<Q", raw)
        body = f.read(n)
    if len(body) != n:
        raise ConfigError(f"{file}: truncated safetensors header ({len(body)} of {n} bytes)")
    header = json.loads(body)
    header.pop("__metadata__", None)
    return header


def tensor_index(path: Path) -> Dict[str, Tuple[Tuple[int, ...], str, str]]:
    """Name -> (shape, dtype, file name) of every tensor in a safetensors directory."""
    path = Path(path)
    index = path / INDEX
    files: List[str]
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = sorted(p.name for p in path.glob("*.safetensors"))
    if not files:
        raise ConfigError(f"model.hf_path={path}: no *.safetensors file there (a .bin checkpoint: "
                          "convert it with transformers' save_pretrained(safe_serialization=True))")
    out: Dict[str, Tuple[Tuple[int, ...], str, str]] = {}
    for name in files:
        if not (path / name).is_file():
            raise ConfigError(f"model.hf_path={path}: {INDEX} names {name}, which is missing")
        for key, info in safetensors_header(path / name).items():
            out[key] = (tuple(info["shape"]), _DTYPES.get(info["dtype"], info["dtype"]), name)
    return out


def check_tensors(m: ModelConfig) -> None:
    """Every tensor the model takes is in ``m.hf_path`` with its shape (one line for the first that is not)."""
    have = tensor_index(Path(m.hf_path))
    for name, shape in expected_shapes(m).items():
        if name not in have:
            raise ConfigError(f"model.hf_path={m.hf_path}: tensor {name} is missing from its safetensors files")
        if have[name][0] != shape:
            raise ConfigError(f"model.hf_path={m.hf_path}: tensor {name} has shape {list(have[name][0])}, "
                              f"the config.json's model needs {list(shape)}")


def hf_config(m: ModelConfig, dtype: str = "float32", eos_token_id: Optional[int] = None,
              bos_token_id: Optional[int] = None) -> Dict[str, Any]:
    """``config.json`` of a LlamaForCausalLM with our model's shape."""
    out: Dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
        "attention_bias": False, "mlp_bias": False, "attention_dropout": 0.0,
        "hidden_size": m.dim, "num_hidden_layers": m.n_layers, "num_attention_heads": m.n_heads,
        "num_key_value_heads": m.n_kv_heads or m.n_heads, "head_dim": m.dim // m.n_heads,
        "intermediate_size": ffn_hidden_dim(m), "vocab_size": m.vocab_size, "rms_norm_eps": m.norm_eps,
        "max_position_embeddings": m.max_seq_len, "tie_word_embeddings": m.tie_embeddings,
        "rope_theta": m.rope_theta, "torch_dtype": dtype, "initializer_range": 0.02, "use_cache": True,
        "bos_token_id": bos_token_id, "eos_token_id": eos_token_id,
    }
    s = m.rope_scaling
    out["rope_scaling"] = None if not s.type else {
        "rope_type": s.type, "factor": s.factor, "low_freq_factor": s.low_freq_factor,
        "high_freq_factor": s.high_freq_factor, "original_max_position_embeddings": s.original_max_seq_len}
    return out
