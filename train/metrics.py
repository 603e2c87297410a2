"""Throughput, MFU and memory of a training step.

MFU = achieved FLOP/s / (peak FLOP/s per GPU x GPUs). FLOPs per token follow the PaLM
paper's estimate used by torchtitan (spec/model_size.py, shared with the planner):
6 x (parameters without embeddings) for the dense matmuls of forward and backward, plus
12 x layers x heads x head_dim x seq_len for attention scores. Peak is the cluster
group's dense bf16 figure; without one, MFU is null. Memory is each engine's report
(:meth:`train.strategies.base.Engine.peak_memory_bytes`), by default
:func:`peak_memory_bytes` of its device.
"""
from __future__ import annotations

import resource
import sys
from typing import Optional

import torch


def mfu(tokens_per_s: float, flops_token: float, peak_tflops: Optional[float], n_gpus: int) -> Optional[float]:
    if not peak_tflops or n_gpus < 1:
        return None
    return tokens_per_s * flops_token / (peak_tflops * 1e12 * n_gpus)


def peak_memory_bytes(device: torch.device) -> int:
    """Peak allocated device memory on GPU; peak resident set size of the process on CPU."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)
