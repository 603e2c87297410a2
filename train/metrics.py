"""Throughput, MFU and memory of a training step.

MFU = achieved FLOP/s / (peak FLOP/s per GPU x GPUs). FLOPs per token follow the PaLM
paper's estimate used by torchtitan (spec/model_size.py, shared with the planner):
6 x (parameters but the input embedding's; a tied head's matrix counts) for the dense
matmuls of forward and backward, plus
12 x layers x heads x head_dim x seq_len for attention scores. Peak is the cluster
group's dense bf16 figure; without one, MFU is null. Memory is each engine's report
(:meth:`train.strategies.base.Engine.peak_memory_bytes`), by default
:func:`peak_memory_bytes` of its device: on CUDA the step's own peaks, allocated and
reserved (the loop resets them as each step begins, :func:`reset_peaks`: preflight, build
and evaluation do not count), reserved being what runs out; on CPU the process's peak
resident set since it started (nothing to reset) and no reserved figure.
"""
from __future__ import annotations

import resource
import sys
from typing import Dict, MutableMapping, Optional

import torch


def mfu(tokens_per_s: float, flops_token: float, peak_tflops: Optional[float], n_gpus: int) -> Optional[float]:
    if not peak_tflops or n_gpus < 1:
        return None
    return tokens_per_s * flops_token / (peak_tflops * 1e12 * n_gpus)


def peak_memory_bytes(device: torch.device) -> int:
    """Peak allocated device memory on GPU (since :func:`reset_peaks`); peak resident set
    size of the process on CPU."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)


def peak_reserved_bytes(device: torch.device) -> Optional[int]:
    """Peak memory the CUDA caching allocator held (since :func:`reset_peaks`): allocated
    plus its cached free blocks. None on CPU."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_reserved(device))
    return None


def reset_peaks(device: torch.device) -> None:
    """Start the CUDA peaks afresh (a host-side counter: no device sync). Nothing on CPU."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


#: The CUDA caching allocator's settings this project gives a task that set none:
#: expandable segments grow a segment in place instead of caching fixed-size blocks, so
#: memory freed by one size serves another (less fragmentation; torchtitan sets it too).
ALLOCATOR_DEFAULT = "expandable_segments:True"


def allocator_env_defaults(env: MutableMapping[str, str]) -> Dict[str, str]:
    """Set ``PYTORCH_ALLOC_CONF`` (torch >= 2.9's name; 2.9.1 honoured only the old one for
    this setting, fixed by 2.11, the floor) unless the user or the cluster group's env set
    it under either name. Before CUDA is first touched: the allocator reads it once."""
    if env.get("PYTORCH_ALLOC_CONF") or env.get("PYTORCH_CUDA_ALLOC_CONF"):
        return {}
    env["PYTORCH_ALLOC_CONF"] = ALLOCATOR_DEFAULT
    return {"PYTORCH_ALLOC_CONF": ALLOCATOR_DEFAULT}
