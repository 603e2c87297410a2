"""The output head's logits in the memory model, chunked or whole (train/loss.py).

With ``model.loss_chunk_tokens`` in force (not under tensor parallel, whose logits stay
sharded for the vocab-parallel loss, nor with a pipeline, whose last stage keeps whole
logits; by default from a 65536 vocabulary up where one micro-batch's whole logits would
take more than a quarter of the GPU's memory, spec/config_model.py) the head and the loss
run one chunk of tokens at a time, each chunk recomputed
in the backward: what remains of the logits is one chunk's, in compute dtype, its fp32
log-softmax and that one's gradient, (e + 8) x vocab x chunk bytes, whatever the tokens.
"""
from __future__ import annotations

from spec.config import RunConfig
from spec.config_model import loss_chunk_tokens
from spec.layout import Layout


def loss_chunk(cfg: RunConfig, layout: Layout) -> int:
    """Tokens per chunk of the head + loss as the trainer runs it; 0 = whole logits."""
    if layout.tp > 1 or layout.pp > 1:
        return 0
    gpu = cfg.cluster.gpu_mem_gb if cfg.cluster.accelerator == "gpu" else None
    return loss_chunk_tokens(cfg.model, cfg.train.micro_batch_size * cfg.train.seq_len, gpu)


def chunk_logits_bytes(cfg: RunConfig, layout: Layout, e: int) -> float:
    """Bytes of one chunk's logits at the backward's peak (0 when whole logits are counted per token)."""
    chunk = loss_chunk(cfg, layout)
    tokens = cfg.train.micro_batch_size * cfg.train.seq_len / layout.cp  # a cp rank's slice
    return min(chunk, tokens) * (e + 8.0) * cfg.model.vocab_size if chunk else 0.0
