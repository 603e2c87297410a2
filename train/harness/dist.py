"""Rendezvous: from srun's SLURM_* variables, a torchrun-style environment, or alone.

Under srun every task derives the same master address (first host of the job's node
list) and port (from the job id, see slurm.env.rendezvous_port), so no file or extra
service is needed. Under torchrun (or the local launcher) RANK / WORLD_SIZE /
LOCAL_RANK / MASTER_ADDR / MASTER_PORT are used as given. With neither, the process is
a world of one. Backend: NCCL when CUDA is there, gloo otherwise.
"""
from __future__ import annotations

import datetime
import gc
import os
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, MutableMapping, Optional

import torch
import torch.distributed as dist

from slurm.env import task_env


@dataclass(frozen=True)
class DistContext:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    node_rank: int
    hostname: str
    backend: str
    device: torch.device
    job_id: str
    restart_count: int
    launcher: str  # "srun" | "torchrun" | "single"

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def nccl_env_defaults(trace_dir: Optional[Path], env: MutableMapping[str, str] = os.environ) -> Dict[str, str]:
    """Set NCCL's error handling and flight-recorder variables that are not set yet.

    A value the user or the cluster group's ``env`` gave wins (either spelling, where
    torch renamed a variable). Must run before the NCCL process group is created: torch
    reads them there. Returns what it set.
    """
    defaults = [
        # On an error or collective timeout, abort the communicators instead of hanging.
        (("TORCH_NCCL_ASYNC_ERROR_HANDLING",), "1"),
        # Flight recorder: keep the last N collectives of every process group...
        (("TORCH_NCCL_TRACE_BUFFER_SIZE", "TORCH_FR_BUFFER_SIZE"), "2000"),
        # ...and dump them on a collective timeout to PREFIX<rank> (the hang watchdog,
        # which fires earlier, dumps them itself: train/harness/watchdog.py).
        (("TORCH_NCCL_DUMP_ON_TIMEOUT",), "1"),
    ]
    if trace_dir is not None:
        trace_dir.mkdir(parents=True, exist_ok=True)
        defaults.append((("TORCH_NCCL_DEBUG_INFO_TEMP_FILE", "TORCH_FR_DUMP_TEMP_FILE"),
                         str(trace_dir / "nccl_trace_rank")))
    applied = {}
    for names, value in defaults:
        if not any(env.get(name) for name in names):
            applied.update({name: value for name in names})
    env.update(applied)
    return applied


def init_distributed(timeout_s: int = 600, trace_dir: Optional[Path] = None) -> DistContext:
    """Join the process group of this job and pick the device of this rank.

    On NCCL, communication defaults are set first (:func:`nccl_env_defaults`); the
    flight recorder dumps into ``trace_dir`` (the run's logs/) on a collective timeout.
    """
    info = task_env()
    if torch.cuda.is_available():
        backend = "nccl"
        nccl_env_defaults(trace_dir)
        torch.cuda.set_device(info.local_rank % torch.cuda.device_count())
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        backend = "gloo"
        device = torch.device("cpu")
    timeout = datetime.timedelta(seconds=timeout_s)
    if info.world_size == 1 and info.launcher == "single":
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    else:
        # env:// reads these; under torchrun it also reuses the agent's store
        # (TORCHELASTIC_USE_AGENT_STORE) instead of opening a second server on its port.
        os.environ.update(info.torchrun_vars())
        dist.init_process_group(backend, init_method="env://",
                                rank=info.rank, world_size=info.world_size, timeout=timeout,
                                device_id=device if backend == "nccl" else None)
    return DistContext(rank=info.rank, world_size=info.world_size, local_rank=info.local_rank,
                       local_world_size=info.local_world_size, node_rank=info.node_rank,
                       hostname=socket.gethostname(), backend=backend, device=device, job_id=str(info.job_id),
                       restart_count=info.restart_count, launcher=info.launcher)


def all_hostnames(ctx: DistContext) -> list[str]:
    """One hostname per node, in node order (gathered from every rank)."""
    gathered: list = [None] * ctx.world_size
    dist.all_gather_object(gathered, (ctx.node_rank, ctx.hostname))
    by_node: dict[int, str] = {}
    for node, host in gathered:
        by_node.setdefault(node, host)
    return [by_node[n] for n in sorted(by_node)]


def shutdown() -> None:
    """Clean exit: FSDP2/DeviceMesh gloo workers can abort the process if torn down racing."""
    if not dist.is_initialized():
        return
    try:
        dist.barrier()
    finally:
        gc.collect()
        dist.destroy_process_group()
