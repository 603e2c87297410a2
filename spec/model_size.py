"""Sizes of the model of :mod:`train.model` from its config alone (pure, no torch).

The launcher's planner runs on the login node without torch, so the arithmetic that
the model builder and the planner share lives here; ``train/model.py`` imports it, and
a test checks :func:`count_params` against ``sum(p.numel())`` of the built model.
"""
from __future__ import annotations

from dataclasses import dataclass

from spec.config import ConfigError, ModelConfig


def ffn_hidden_dim(cfg: ModelConfig) -> int:
    """Llama's SwiGLU width: ``ffn_hidden_dim`` when given (a Hugging Face config's
    intermediate_size), else 2/3 of 4*dim, times the multiplier, rounded up to multiple_of."""
    if cfg.ffn_hidden_dim:
        return cfg.ffn_hidden_dim
    hidden = int(2 * (4 * cfg.dim) / 3)
    hidden = int(cfg.ffn_dim_multiplier * hidden)
    return cfg.multiple_of * ((hidden + cfg.multiple_of - 1) // cfg.multiple_of)


def head_dim(cfg: ModelConfig) -> int:
    """Width of one attention head: ``model.head_dim`` when given (Qwen3), else dim / n_heads."""
    return cfg.head_dim or cfg.dim // cfg.n_heads


@dataclass(frozen=True)
class ParamBreakdown:
    """Parameters by part; matrices are what tensor parallel shards, norms stay whole."""

    embedding: int        # tok_embeddings (vocab x dim)
    layer_matrices: int   # wq, wk, wv, wo, w1, w2, w3 of one block (and q/k/v biases: TP shards them too)
    layer_norms: int      # the two RMSNorm weights of one block (and the q/k norms: replicated)
    n_layers: int
    final_norm: int
    head: int             # output projection; 0 when tied to the embedding

    @property
    def layer(self) -> int:
        return self.layer_matrices + self.layer_norms

    @property
    def total(self) -> int:
        return self.embedding + self.n_layers * self.layer + self.final_norm + self.head


def param_breakdown(cfg: ModelConfig) -> ParamBreakdown:
    hd, kv = head_dim(cfg), cfg.n_kv_heads or cfg.n_heads
    attn = cfg.dim * cfg.n_heads * hd + 2 * cfg.dim * kv * hd + cfg.n_heads * hd * cfg.dim
    bias = (cfg.n_heads + 2 * kv) * hd if cfg.qkv_bias else 0
    mlp = 3 * cfg.dim * ffn_hidden_dim(cfg)
    norms = 2 * cfg.dim + (2 * hd if cfg.qk_norm else 0)
    return ParamBreakdown(embedding=cfg.vocab_size * cfg.dim, layer_matrices=attn + bias + mlp, layer_norms=norms,
                          n_layers=cfg.n_layers, final_norm=cfg.dim,
                          head=0 if cfg.tie_embeddings else cfg.vocab_size * cfg.dim)


def count_params(cfg: ModelConfig) -> int:
    """Parameters of :class:`train.model.Transformer` from the config alone."""
    return param_breakdown(cfg).total


def flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Training FLOPs per token (PaLM's estimate, as torchtitan and train/metrics.py count):
    6 x the parameters of the matmuls for forward + backward (all but the input embedding,
    a lookup), plus 12 x layers x heads x head_dim x seq_len for the attention scores. A
    head tied to the embedding shares its matrix and still multiplies by it: its 6 x vocab
    x dim count whether or not the weights are tied (torchtitan's count of an untied model)."""
    n = count_params(cfg) - (0 if cfg.tie_embeddings else cfg.vocab_size * cfg.dim)
    return 6.0 * n + 12.0 * cfg.n_layers * cfg.n_heads * head_dim(cfg) * seq_len


def largest_module_params(cfg: ModelConfig) -> int:
    """Parameters of the largest single module (embedding, head or one projection): what
    DeepSpeed ZeRO-3 gathers at once, and DeepSpeed's estimators call the largest layer."""
    b = param_breakdown(cfg)
    return max(b.embedding, b.head, cfg.dim * ffn_hidden_dim(cfg), cfg.dim * cfg.n_heads * head_dim(cfg))


def check_model(m: ModelConfig) -> None:
    """The model section's own consistency (heads, widths, RoPE): ConfigError in one line."""
    if m.head_dim is None and m.dim % m.n_heads:
        raise ConfigError(f"model.dim={m.dim} is not divisible by model.n_heads={m.n_heads}; "
                          "pick n_heads dividing dim (or set model.head_dim)")
    if m.head_dim is not None and m.head_dim <= 0:
        raise ConfigError(f"model.head_dim={m.head_dim} must be positive; give the head width or null for dim/n_heads")
    if head_dim(m) % 2:
        raise ConfigError(f"model head dim {head_dim(m)} (model.head_dim, else model.dim={m.dim} / "
                          f"model.n_heads={m.n_heads}) must be even for RoPE; pick an even head width")
    if m.qkv_bias and m.qk_norm:
        raise ConfigError("model.qkv_bias=true with model.qk_norm=true is no Hugging Face architecture (Qwen2 has "
                          "the biases, Qwen3 the norms); set one of them to false")
    kv = m.n_kv_heads or m.n_heads
    if m.n_heads % kv:
        raise ConfigError(f"model.n_kv_heads={kv} must divide model.n_heads={m.n_heads}; "
                          f"pick a divisor of {m.n_heads} (or null for {m.n_heads})")
