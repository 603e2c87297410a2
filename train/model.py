"""A Llama-style decoder: RMSNorm, rotary embeddings, grouped-query attention, SwiGLU.

Built on the meta device (no memory), parallelised, then materialised once by
:func:`materialise` (``to_empty`` + :meth:`Transformer.init_weights`), as torchtitan does. Initialisation
draws each block of a weight from its own counter-based stream (train/initial.py), so
every rank (and a single-process reference) gets the same weights and draws only its part.
"""
from __future__ import annotations

import math
from typing import Callable, Iterable, Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from spec.config import ModelConfig, RopeScaling, RunConfig
# Pure size arithmetic lives in spec/model_size.py so the torch-free planner shares it.
from spec.model_size import count_params, ffn_hidden_dim, head_dim  # noqa: F401  (re-exported)
from spec.peft import is_adapter
from train.context_parallel import HeadSplit
from train.initial import fill_initial, local_runs
from train.loss import chunked_head_loss, loss_chunk_tokens, loss_sum
from train.packed_attention import Mask, document_attention, document_context
from train.torch_compat import settled


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.type_as(x) * self.weight

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)


def rope_tables(head_dim: int, seq_len: int, theta: float, device: torch.device,
                scaling: Optional[RopeScaling] = None) -> torch.Tensor:
    """cos/sin of the rotary angles, shape (seq_len, head_dim // 2, 2); with Llama 3's
    frequency scaling when ``scaling.type == "llama3"`` (as Hugging Face computes it)."""
    freqs = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))
    if scaling is not None and scaling.type == "llama3":
        freqs = _llama3_scaled(freqs, scaling)
    angles = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float32), freqs)
    return torch.stack((angles.cos(), angles.sin()), dim=-1)


def _llama3_scaled(freqs: torch.Tensor, s: RopeScaling) -> torch.Tensor:
    """Long wavelengths slowed by ``factor``, short ones kept, the band between blended."""
    low_wavelen = s.original_max_seq_len / s.low_freq_factor
    high_wavelen = s.original_max_seq_len / s.high_freq_factor
    wavelen = 2 * math.pi / freqs
    scaled = torch.where(wavelen > low_wavelen, freqs / s.factor, freqs)
    smooth = (s.original_max_seq_len / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    blended = (1 - smooth) * scaled / s.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, blended, scaled)


def apply_rope(x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """Rotate channel i with channel i + head_dim/2 of x (batch, seq, heads, head_dim) by
    position: Hugging Face's layout (``rotate_half``), so its q/k weights load as they are,
    with no permutation (Meta's checkpoints pair neighbouring channels instead). ``table``:
    (seq, head_dim // 2, 2) by position, or (batch, seq, head_dim // 2, 2) per token
    (packed sequences: train/packed_attention.py)."""
    seq = x.shape[1]
    xf = x.float()
    x1, x2 = xf.chunk(2, dim=-1)
    rows = table[:seq, None] if table.dim() == 3 else table[:, :seq, None]
    cos, sin = rows[..., 0], rows[..., 1]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).type_as(x)


class Attention(nn.Module):
    """Grouped-query attention; with ``qkv_bias`` biases on q, k and v (Qwen2), with
    ``qk_norm`` an RMSNorm over each query and key head before RoPE (Qwen3), and heads of
    ``head_dim`` (Qwen3's may be wider than dim / n_heads)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_heads = cfg.n_heads
        self.n_kv_heads = cfg.n_kv_heads or cfg.n_heads
        self.head_dim = head_dim(cfg)
        self.wq = nn.Linear(cfg.dim, self.n_heads * self.head_dim, bias=cfg.qkv_bias)
        self.wk = nn.Linear(cfg.dim, self.n_kv_heads * self.head_dim, bias=cfg.qkv_bias)
        self.wv = nn.Linear(cfg.dim, self.n_kv_heads * self.head_dim, bias=cfg.qkv_bias)
        self.wo = nn.Linear(self.n_heads * self.head_dim, cfg.dim, bias=False)
        self.q_norm = RMSNorm(self.head_dim, cfg.norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, cfg.norm_eps) if cfg.qk_norm else None
        # Context parallel's all-to-alls (train/context_parallel.py: x is this rank's slice of
        # the sequence, attention runs over whole sequences of its heads); None: off.
        self.head_split: Optional[HeadSplit] = None

    def forward(self, x: torch.Tensor, rope: torch.Tensor, mask: Optional[Mask] = None) -> torch.Tensor:
        """``mask``: packed sequences' documents (attention stays inside each); None: causal SDPA."""
        bsz, seq, _ = x.shape
        # -1 head counts: under tensor parallel each rank holds a slice of the heads.
        q = self.wq(x).view(bsz, seq, -1, self.head_dim)
        k = self.wk(x).view(bsz, seq, -1, self.head_dim)
        v = self.wv(x).view(bsz, seq, -1, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.head_split is not None:  # RoPE and the mask are the whole sequence's
            q, k, v = self.head_split.to_heads(q, k, v)
        q, k = apply_rope(q, rope), apply_rope(k, rope)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        out = causal_attention(q, k, v) if mask is None else document_attention(q, k, v, mask)
        out = out.transpose(1, 2)
        if self.head_split is not None:
            out = self.head_split.to_sequence(out)
        return self.wo(out.reshape(bsz, seq, -1))


def fused_gqa(device_type: str, dtype: torch.dtype) -> bool:
    """SDPA's ``enable_gqa`` keeps a fused kernel: on CUDA only FlashAttention takes it
    (fp16/bf16; the memory-efficient kernel does not), so fp32 with fewer K/V heads falls
    to the math kernel, which builds the whole S x S scores. Elsewhere (CPU) it is kept."""
    return device_type != "cuda" or dtype in (torch.float16, torch.bfloat16)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal SDPA over (batch, heads, seq, head_dim). Grouped-query K/V go to the kernel as
    they are where it takes them fused (:func:`fused_gqa`), else expanded to the query's
    heads first (what the kernel then saves for backward: launcher/plan/memory.py counts it)."""
    groups = q.shape[1] // k.shape[1]
    if groups > 1 and not fused_gqa(q.device.type, q.dtype):
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=k.shape[1] != q.shape[1])


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.feed_forward = FeedForward(cfg.dim, ffn_hidden_dim(cfg))

    def forward(self, x: torch.Tensor, rope: torch.Tensor, mask: Optional[Mask] = None) -> torch.Tensor:
        # mask by keyword: tensor parallel's input plan (train/strategies/tp.py) lists (x, rope) only.
        x = x + self.attention(self.attention_norm(x), rope, mask=mask)
        return x + self.feed_forward(self.ffn_norm(x))


# Wrappers whose names a parameter's path may hold (activation checkpointing, compile, DDP).
WRAPPERS = ("_checkpoint_wrapped_module.", "_orig_mod.", "module.")


def clean_name(name: str) -> str:
    """``layers.0._checkpoint_wrapped_module.attention.wq.weight`` -> the plain model's name."""
    for w in WRAPPERS:
        name = name.replace(w, "")
    return name


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        # A ModuleDict keyed "0".."n-1" keeps parameter names stable when pipeline
        # stages drop layers; a stage sets the modules it does not hold to None
        # (train/strategies/pp.py).
        self.layers = nn.ModuleDict({str(i): Block(cfg) for i in range(cfg.n_layers)})
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        self.register_buffer("rope", torch.empty(0), persistent=False)
        # Tokens per chunk of the head + loss the trainer decided for this run and device
        # (head_loss_chunk); None: model.loss_chunk_tokens with no run to go by.
        self.loss_chunk: Optional[int] = None
        # The loss through torch.compile (strategy.compile: train/parallelize.py).
        self.compile_loss = False

    @torch.no_grad()
    def init_weights(self, seed: int, device: Optional[torch.device] = None,
                     only: Optional[Callable[[str], bool]] = None) -> None:
        """Deterministic init (same on every rank); call after ``to_empty``.

        Each block of a weight draws from its own stream, keyed by ``seed`` and the weight's
        name in the full model (``layers.3.attention.wq.weight``), so a pipeline stage that
        holds only some modules, a sharded DTensor (FSDP, TP, 2-D) and an unsharded
        single-process model all get the very same values for the weights they hold
        (:func:`train.initial.initial_tensor`), each rank drawing only the blocks its part overlaps.
        ``only``: the weights whose (clean) names it accepts, the others left as they are.
        """
        for name, param in self.named_parameters():
            if only is not None and not only(clean_name(name)):
                continue
            t = param.data
            device = device or t.device
            local = t.to_local() if isinstance(t, DTensor) else t
            rows, cols = local_runs(t)
            n_rows, n_cols = sum(h - lo for lo, h in rows), sum(h - lo for lo, h in cols)
            if n_rows * n_cols != local.numel():
                raise RuntimeError(f"{name}: the local part holds {tuple(local.shape)}, its placements "
                                   f"{getattr(t, 'placements', None)} give {n_rows} x {n_cols}")
            dense = local if local.is_contiguous() else torch.empty(local.shape, dtype=local.dtype, device=local.device)
            fill_initial(dense.view(n_rows, n_cols), self.cfg, clean_name(name), tuple(param.shape), seed, rows, cols)
            if dense is not local:
                local.copy_(dense)
        self.init_buffers(device)

    def init_buffers(self, device: torch.device) -> None:
        """The rotary tables (not a parameter: computed, never loaded)."""
        cfg = self.cfg
        self.rope = rope_tables(head_dim(cfg), cfg.max_seq_len, cfg.rope_theta, device, cfg.rope_scaling)

    def forward(self, tokens: torch.Tensor, targets: Optional[torch.Tensor] = None,
                positions: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Token ids -> logits; a pipeline stage without the embedding takes (and one
        without the head returns) the hidden states instead. With ``targets``: the sum of
        cross-entropy over those not -100 (train/loss.py), the head applied
        ``model.loss_chunk_tokens`` tokens at a time so the whole logits never exist
        (not under tensor parallel: its vocab-sharded logits take the vocab-parallel loss).
        ``positions`` (packed sequences, ``data.packing``): each token's position in its
        document; attention stays inside documents (train/packed_attention.py)."""
        # settled: the TP embedding's output may be a pending collective (train/torch_compat.py)
        h = settled(self.tok_embeddings(tokens)) if self.tok_embeddings is not None else tokens
        if positions is None:
            for layer in self.layers.values():
                h = layer(h, self.rope)
        else:
            rope, mask = document_context(self.rope, positions)
            for layer in self.layers.values():
                h = layer(h, rope, mask)
        h = self.norm(h) if self.norm is not None else h
        if self.output is None:
            return h
        if targets is None:
            return self.output(h)
        chunk = self.loss_chunk if self.loss_chunk is not None else loss_chunk_tokens(self.cfg)
        if chunk > 0 and not isinstance(self.output.weight, DTensor):
            return chunked_head_loss(self.output, h, targets, chunk, self.compile_loss)
        return loss_sum(self.output(h), targets, self.compile_loss)


def head_loss_chunk(run: RunConfig, device: torch.device) -> int:
    """The run's tokens per chunk of the head + loss on ``device`` (0 = whole logits): as
    the planner counts it (spec.config_model.loss_chunk_tokens, launcher/plan/head.py), with
    the CUDA device's own memory where cluster.gpu_mem_gb is not given."""
    gpu = None
    if device.type == "cuda":
        gpu = run.cluster.gpu_mem_gb or torch.cuda.get_device_properties(device).total_memory / 2**30
    return loss_chunk_tokens(run.model, run.train.micro_batch_size * run.train.seq_len, gpu)


def build_model(cfg: ModelConfig, device: torch.device | str = "meta") -> Transformer:
    with torch.device(device):
        return Transformer(cfg)


def materialise(parts: Iterable[nn.Module], seed: int, device: torch.device, hf_path: Optional[str] = None) -> None:
    """Allocate the (sharded) meta model parts on ``device`` and fill them: with their
    initial weights, or with a Hugging Face checkpoint's (``hf_path``: each rank reads
    only its slices, :func:`train.hf_load.load_hf`). The trainer's one materialisation,
    between a builder's ``wrap`` and ``finish`` (train/strategies/base.py). A DDP or
    DeepSpeed wrapper does not exist yet."""
    parts = list(parts)
    for part in parts:
        part.to_empty(device=device)
        _retie(part)
        if hf_path:  # LoRA's adapters are not in the checkpoint: their initial values
            part.init_weights(seed, device, only=is_adapter)
        else:
            part.init_weights(seed, device)
    if hf_path:
        from train.hf_load import load_hf

        load_hf(parts, hf_path, tied=parts[0].cfg.tie_embeddings)


def _retie(part: nn.Module) -> None:
    """``to_empty`` gives each module its own new tensor, so a head tied to the embedding
    would come back as uninitialised memory of its own: share the embedding's again."""
    if part.cfg.tie_embeddings and part.tok_embeddings is not None and part.output is not None:
        if part.output.weight is not part.tok_embeddings.weight:
            part.output.weight = part.tok_embeddings.weight
