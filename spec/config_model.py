"""The model section of the run configuration (``model.*``): the decoder's shape. Pure;
:mod:`spec.config` re-exports it as part of ``RunConfig``.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional


@dataclass
class RopeScaling:
    """Llama 3.1's scaling of the rotary frequencies (null type = none)."""

    type: Optional[str] = None  # "llama3"
    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_seq_len: int = 8192


@dataclass
class ModelConfig:
    """A Llama-style decoder (RMSNorm, RoPE, SwiGLU, grouped-query attention)."""

    name: str = "tiny"
    dim: int = 64
    n_layers: int = 2
    n_heads: int = 4
    # Key/value heads (grouped-query attention); null = n_heads (plain multi-head).
    n_kv_heads: Optional[int] = None
    vocab_size: int = 256
    # SwiGLU hidden size: int(8/3 * dim * ffn_dim_multiplier) rounded up to multiple_of.
    ffn_dim_multiplier: float = 1.0
    multiple_of: int = 32
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_seq_len: int = 256
    # Share the token embedding with the output head (GPT-2 does, Llama does not).
    tie_embeddings: bool = False
    # Tokens per chunk of the output head + loss (train/loss.py): the logits exist one
    # chunk at a time, recomputed in the backward (never vocab x all tokens). 0 = whole
    # logits; null = whole logits below a vocabulary of 65536 and, on a GPU, while one
    # micro-batch's logits take at most a quarter of its memory, else 1024. Not under tensor parallel
    # (its vocab-sharded loss) nor on a pipeline's last stage (whole logits there).
    loss_chunk_tokens: Optional[int] = None
    # SwiGLU hidden size given outright (Hugging Face's intermediate_size); null = from
    # ffn_dim_multiplier and multiple_of as above.
    ffn_hidden_dim: Optional[int] = None
    # Llama 3's RoPE frequency scaling (Hugging Face's rope_scaling, rope_type "llama3").
    rope_scaling: RopeScaling = field(default_factory=lambda: RopeScaling())
    # Width of one attention head; null = dim / n_heads (Llama). Qwen3 sets it apart
    # (Qwen3-0.6B: dim 1024, 16 heads of 128): q/k/v then project to heads x head_dim.
    head_dim: Optional[int] = None
    # Biases on the q, k and v projections (Qwen2 / Qwen2.5); o and the MLP have none.
    qkv_bias: bool = False
    # RMSNorm over head_dim on each query and key head, before RoPE (Qwen3).
    qk_norm: bool = False
    # A Hugging Face Llama, Qwen2 / Qwen2.5 or Qwen3 directory (config.json + safetensors):
    # the dimensions above are read from its config.json at launch and the weights replace the random init
    # (README "Start from Hugging Face weights"). Nothing is downloaded.
    hf_path: Optional[str] = None


#: model.loss_chunk_tokens null: whole logits below a vocabulary of AUTO_VOCAB; from there,
#: on a GPU of known memory, whole logits while one micro-batch's take at most
#: AUTO_LOGITS_SHARE of it, else chunks of AUTO_CHUNK tokens (CPU ranks: always chunks).
AUTO_CHUNK, AUTO_VOCAB, AUTO_LOGITS_SHARE = 1024, 65536, 0.25
#: Bytes per token and vocabulary entry of whole logits at the backward's peak: the bf16
#: logits, their fp32 log-softmax and its gradient (launcher/plan/head.py counts the same).
LOGIT_BYTES = 10


def loss_chunk_tokens(m: ModelConfig, tokens: int = 0, gpu_mem_gb: Optional[float] = None) -> int:
    """Tokens per chunk of the head + loss (train/loss.py); 0 = whole logits.

    ``model.loss_chunk_tokens`` when set; with null, ``tokens`` (one micro-batch's) and
    ``gpu_mem_gb`` (the GPU's memory as the cluster groups count it; None off a GPU or
    unknown) decide: the chunks' recompute cost 12% of a 1B Llama's step on an H100 (48.8k
    against 42.8k tokens/s with the loss still eager, bench/GPU_RESULTS.md),
    so whole logits where they take at most a quarter of the GPU's memory (one micro-batch
    of 8k tokens at a 128k vocabulary: 10.5 GB of 80), chunks beyond (Qwen's 152k at 32k
    tokens: 100 GB)."""
    if m.loss_chunk_tokens is not None:
        return int(m.loss_chunk_tokens)
    if m.vocab_size < AUTO_VOCAB:
        return 0
    if tokens and gpu_mem_gb and tokens * m.vocab_size * LOGIT_BYTES <= AUTO_LOGITS_SHARE * gpu_mem_gb * 1e9:
        return 0
    return AUTO_CHUNK
