"""Hugging Face Llama, Qwen2 / Qwen2.5 and Qwen3 checkpoints, as far as the login side
needs them (no torch). Qwen2 is Llama with biases on q, k and v; Qwen3 is Llama with an
RMSNorm on each query and key head (and heads of their own width, ``head_dim``).

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
from spec.model_size import ffn_hidden_dim, head_dim

CONFIG = "config.json"
INDEX = "model.safetensors.index.json"
# Ours -> Hugging Face's, per block and for the rest.
_BLOCK = {
    "attention.wq": "self_attn.q_proj", "attention.wk": "self_attn.k_proj",
    "attention.wv": "self_attn.v_proj", "attention.wo": "self_attn.o_proj",
    "feed_forward.w1": "mlp.gate_proj", "feed_forward.w3": "mlp.up_proj", "feed_forward.w2": "mlp.down_proj",
    "attention_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attention.q_norm": "self_attn.q_norm", "attention.k_norm": "self_attn.k_norm",
}
_TOP = {"tok_embeddings.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
        "output.weight": "lm_head.weight"}
_BLOCK_BACK = {v: k for k, v in _BLOCK.items()}
_TOP_BACK = {v: k for k, v in _TOP.items()}
_OURS = re.compile(r"^layers\.(\d+)\.(.+)\.(weight|bias)$")
_THEIRS = re.compile(r"^model\.layers\.(\d+)\.(.+)\.(weight|bias)$")
# model_type -> (architecture, its ModelConfig flags): what each adds to Llama.
ARCHITECTURES = {"llama": ("LlamaForCausalLM", {}), "qwen2": ("Qwen2ForCausalLM", {"qkv_bias": True}),
                 "qwen3": ("Qwen3ForCausalLM", {"qk_norm": True})}
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
    return f"{prefix}{m.group(1)}.{block[m.group(2)]}.{m.group(3)}"


def hf_name(ours: str) -> str:
    """``layers.3.attention.wq.weight`` -> ``model.layers.3.self_attn.q_proj.weight``."""
    return _rename(ours, _TOP, _BLOCK, _OURS, "model.layers.")


def our_name(theirs: str) -> str:
    """The inverse of :func:`hf_name`."""
    return _rename(theirs, _TOP_BACK, _BLOCK_BACK, _THEIRS, "layers.")


def our_shapes(m: ModelConfig) -> Dict[str, Tuple[int, ...]]:
    """Our name -> shape of every tensor our model of ``m`` takes from a checkpoint, in the
    order Hugging Face lists them (embeddings, layers, norm, head; a tied head is none)."""
    hd, kv, hidden = head_dim(m), m.n_kv_heads or m.n_heads, ffn_hidden_dim(m)
    block: Dict[str, Tuple[int, ...]] = {
        "attention.wq.weight": (m.n_heads * hd, m.dim), "attention.wk.weight": (kv * hd, m.dim),
        "attention.wv.weight": (kv * hd, m.dim), "attention.wo.weight": (m.dim, m.n_heads * hd)}
    if m.qkv_bias:
        block.update({"attention.wq.bias": (m.n_heads * hd,), "attention.wk.bias": (kv * hd,),
                      "attention.wv.bias": (kv * hd,)})
    if m.qk_norm:
        block.update({"attention.q_norm.weight": (hd,), "attention.k_norm.weight": (hd,)})
    block.update({"feed_forward.w1.weight": (hidden, m.dim), "feed_forward.w3.weight": (hidden, m.dim),
                  "feed_forward.w2.weight": (m.dim, hidden), "attention_norm.weight": (m.dim,),
                  "ffn_norm.weight": (m.dim,)})
    shapes: Dict[str, Tuple[int, ...]] = {"tok_embeddings.weight": (m.vocab_size, m.dim)}
    for i in range(m.n_layers):
        shapes.update({f"layers.{i}.{k}": v for k, v in block.items()})
    shapes["norm.weight"] = (m.dim,)
    if not m.tie_embeddings:
        shapes["output.weight"] = (m.vocab_size, m.dim)
    return shapes


def expected_shapes(m: ModelConfig) -> Dict[str, Tuple[int, ...]]:
    """Hugging Face name -> shape of every tensor our model of ``m`` takes from a checkpoint."""
    return {hf_name(k): v for k, v in our_shapes(m).items()}


def read_config(path: Path) -> Dict[str, Any]:
    return read_json_in(Path(path), CONFIG, "model.hf_path",
                        "point it at a Hugging Face model directory (config.json + *.safetensors)")


def _architecture(hf: Dict[str, Any], where: str) -> Dict[str, Any]:
    """The flags of the architecture a ``config.json`` names; ConfigError for one we do not
    build, for a setting none of them has and for sliding-window attention."""
    kind = hf.get("model_type")
    archs = hf.get("architectures") or []
    found = [k for k, (arch, _) in ARCHITECTURES.items() if kind == k or arch in archs]
    if not found:
        raise ConfigError(f"{where}: architecture {archs or kind!r} is not supported; only Llama, Qwen2 / "
                          "Qwen2.5 and Qwen3 (model_type 'llama', 'qwen2', 'qwen3') are built here")
    flags = ARCHITECTURES[found[0]][1]
    # Qwen2 has q/k/v biases whatever attention_bias says; elsewhere it would add o's too.
    checks = [("hidden_act", "silu"), ("mlp_bias", False), ("use_sliding_window", False)]
    checks += [] if flags.get("qkv_bias") else [("attention_bias", False)]
    for key, want in checks:
        if hf.get(key, want) != want:
            extra = "; full attention only" if key == "use_sliding_window" else ""
            raise ConfigError(f"{where}: {CONFIG} has {key}={hf[key]!r}; only {want!r} is supported{extra}")
    sliding = [i for i, t in enumerate(hf.get("layer_types") or []) if t != "full_attention"]
    if sliding:
        raise ConfigError(f"{where}: {CONFIG} has layer_types[{sliding[0]}]="
                          f"{hf['layer_types'][sliding[0]]!r}; full attention only (every layer 'full_attention')")
    return {"qkv_bias": False, "qk_norm": False, **flags}


def model_fields(hf: Dict[str, Any], path: Any = "?") -> Dict[str, Any]:
    """Our ModelConfig fields of a Llama, Qwen2 or Qwen3 ``config.json``; ConfigError for what we do not build."""
    where = f"model.hf_path={path}"
    fields = _architecture(hf, where)
    fields.update({ours: hf[theirs] for theirs, ours in _FIELDS.items() if theirs in hf})
    missing = [t for t in ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size",
                           "intermediate_size") if t not in hf]
    if missing:
        raise ConfigError(f"{where}: {CONFIG} lacks {', '.join(missing)}")
    hd = hf.get("head_dim")
    fields["head_dim"] = None if hd in (None, hf["hidden_size"] // hf["num_attention_heads"]) else hd
    kv = hf.get("num_key_value_heads")
    fields["n_kv_heads"] = None if kv in (None, hf["num_attention_heads"]) else kv
    fields["tie_embeddings"] = bool(hf.get("tie_word_embeddings", False))
    fields.update(_rope_fields(hf, where))
    return fields


def _rope_fields(hf: Dict[str, Any], where: str) -> Dict[str, Any]:
    """rope_theta and rope_scaling (transformers 4's fields and 5's ``rope_parameters``)."""
    rope = dict(hf.get("rope_parameters") or {})
    legacy = hf.get("rope_scaling") or {}
    theta = rope.get("rope_theta", hf.get("rope_theta", 10000.0))
    scaling = {**legacy, **{k: v for k, v in rope.items() if k != "rope_theta"}}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind in (None, "default"):
        return {"rope_theta": float(theta), "rope_scaling": RopeScaling()}
    if kind == "llama3":
        return {"rope_theta": float(theta), "rope_scaling": RopeScaling(
            type="llama3", factor=float(scaling["factor"]), low_freq_factor=float(scaling["low_freq_factor"]),
            high_freq_factor=float(scaling["high_freq_factor"]),
            original_max_seq_len=int(scaling["original_max_position_embeddings"]))}
    raise ConfigError(f"{where}: rope_type {kind!r} is not supported; 'default' and 'llama3' are")


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
        # null head_dim: config.json's heads are hidden_size / num_attention_heads wide
        theirs = fields["dim"] // fields["n_heads"] if key == "head_dim" and value is None else value
        if given is not None and key != "rope_scaling" and str(theirs) != given and _num(given) != theirs:
            raise ConfigError(f"model.{key}={given} disagrees with model.hf_path's config.json "
                              f"({_theirs(key)}={theirs}); drop the override or use another hf_path")
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
                            "rope_theta": "rope_theta", "head_dim": "head_dim"}.get(field, field))


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
    """``config.json`` of a LlamaForCausalLM with our model's shape (a Qwen2ForCausalLM with
    q/k/v biases, a Qwen3ForCausalLM with q/k norms)."""
    kind = "qwen3" if m.qk_norm else "qwen2" if m.qkv_bias else "llama"
    out: Dict[str, Any] = {
        "architectures": [ARCHITECTURES[kind][0]], "model_type": kind, "hidden_act": "silu",
        "attention_bias": m.qkv_bias, "mlp_bias": False, "attention_dropout": 0.0,
        "hidden_size": m.dim, "num_hidden_layers": m.n_layers, "num_attention_heads": m.n_heads,
        "num_key_value_heads": m.n_kv_heads or m.n_heads, "head_dim": head_dim(m),
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
