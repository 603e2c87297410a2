"""Host memory per node (pure, no torch; part of the memory model of
:mod:`launcher.plan.memory`): what offload moves there (DeepSpeed, counted with the model
states) and the async checkpoint's snapshot, against the node's memory the job may use.
docs/planner.md, "Host memory per node".
"""
from __future__ import annotations

from typing import Optional, Tuple

from launcher.plan.state_bytes import snapshot_bytes_per_rank
from spec.checkpointing import saves_async
from spec.config import ClusterConfig, RunConfig
from spec.layout import Layout

GB = 1e9
# Host memory per node that offload and the async snapshot may use when the job's is
# unknown (cluster.mem_gb null, or 0 without node_mem_gb; assumption: half of the 2 TB of
# an 8-GPU A100/H100 server such as a DGX, the rest left to the system, data loading and
# the page cache).
HOST_MEM_ASSUMED = 1000e9


def host_budget(c: ClusterConfig) -> Tuple[Optional[float], str, bool]:
    """Host memory per node that offload and the async snapshot may use, the fields it comes
    from, and whether it is assumed: the job's memory (mem_gb=N GB; mem_gb=0 is --mem=0,
    all of node_mem_gb), else HOST_MEM_ASSUMED on GPU clusters (None, no limit, on CPU
    clusters)."""
    if c.mem_gb:
        return c.mem_gb * GB, f"cluster.mem_gb={c.mem_gb}", False
    if c.mem_gb == 0 and c.node_mem_gb:
        return c.node_mem_gb * GB, f"cluster.mem_gb=0, node_mem_gb={c.node_mem_gb}", False
    given = "0, node_mem_gb=null" if c.mem_gb == 0 else "null"
    return (HOST_MEM_ASSUMED if c.accelerator == "gpu" else None), f"cluster.mem_gb={given}", True


def takes_snapshot(cfg: RunConfig) -> bool:
    """Whether the run's periodic saves keep a snapshot in host memory: async saves
    (spec/checkpointing.py ``saves_async``) of the built-in trainer on a torch engine
    (DeepSpeed's saves block whatever ``checkpoint.async_save`` says: deepspeed_io.py)."""
    return saves_async(cfg) and cfg.strategy.engine == "torch" and not cfg.entrypoint


def snapshot_bytes(cfg: RunConfig, layout: Layout) -> float:
    """Host bytes one rank's async snapshot keeps (:func:`snapshot_bytes_per_rank`); 0 where
    the run's saves block."""
    return snapshot_bytes_per_rank(cfg, layout) if takes_snapshot(cfg) else 0.0
