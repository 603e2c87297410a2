"""The compute side of ``python -m launcher.doctor``: what each task of a doctor job finds.

The doctor is an ordinary run of a function entry point (``entrypoint=train.doctor:check``,
composed by :mod:`launcher.doctor`), so the harness, the rendezvous, the device choice and
its binding check, and the run directory are those of a training job. Every rank:

1. joins the process group as a training job does (:func:`train.harness.dist.init_distributed`)
   and writes what it got to ``RUN_DIR/doctor/rank{R}.json`` at once (so a job that hangs
   in a collective still says which device and CPUs each rank had): host, device, the
   GPU's name/UUID/PCI address, the profile's ``cluster.gpu_binding`` and how many GPUs the
   task sees, CPUs (``os.sched_getaffinity`` and ``SLURM_CPUS_PER_TASK``; placed first as a
   training rank is, ``cluster.cpu_bind``: which CPUs, their NUMA node(s) and its GPU's,
   :mod:`train.harness.affinity`), torch / CUDA / NCCL versions; local rank 0 adds the
   node's GPU health and driver
   (:func:`train.harness.health.gpu_health`);
2. times a matmul (bf16 8192^2 on GPU, fp32 512^2 on CPU: :mod:`train.harness.preflight`);
3. times an all-reduce inside its node (all nodes at once, one group per node) and then
   across nodes (one group per local rank, so every GPU's own network path is used at
   once, as in training), as nccl-tests' bus bandwidth ``bytes * 2(n-1)/n / time``;
4. rank 0 gathers every rank's facts into ``RUN_DIR/doctor.json``.

On GPU the first rank of each node runs NCCL with ``NCCL_DEBUG=INFO`` and
``NCCL_DEBUG_SUBSYS=INIT,NET,ENV`` (its profile's own NCCL_DEBUG is overridden for this
job), written to ``RUN_DIR/doctor/nccl-rank{R}.log``, and keeps NCCL's network lines
(``nccl_lines``) and the NCCL_* / FI_* / GLOO_* variables it started with (``net_env``),
from which the login side names the likely culprit of a slow network
(:mod:`launcher.netdiag`). One per node: the lines are the process's choice of transport,
the same for every rank of a node, and a file per node, not per rank, is written.

The verdicts are the login side's (:mod:`launcher.doctor`), against the profile's figures.
"""
from __future__ import annotations

import json
import os
import re
import socket
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from spec.config import RunConfig, to_run_config
from spec.doctor import DOCTOR_JSON, RANKS_DIR
from spec.rundir import CONFIG
# All-reduce buffers: large enough on GPU for NCCL to reach its bus bandwidth (nccl-tests
# plateaus from a few hundred MiB on NVLink), small on CPU so the job takes seconds.
GPU_ALLREDUCE_NUMEL = 64 << 20  # fp32: 256 MiB
CPU_ALLREDUCE_NUMEL = 1 << 20  # fp32: 4 MiB
# NCCL's report of the network it chose: INIT and NET say which transport, interfaces and
# HCAs, ENV which variables NCCL read (from the environment or /etc/nccl.conf).
NCCL_DEBUG_ENV = {"NCCL_DEBUG": "INFO", "NCCL_DEBUG_SUBSYS": "INIT,NET,ENV"}
NET_ENV_PREFIXES = ("NCCL_", "FI_", "OFI_NCCL_", "GLOO_")
NET_MARKERS = ("NET/", "Using network", "Bootstrap", "set by environment to")
MAX_NCCL_LINES = 40  # distinct network lines kept per rank (doctor.json gathers every rank's)


def _write_json(path: Path, data: Dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=1, sort_keys=True, default=str) + "\n")
    os.replace(tmp, path)


def cpu_facts(cfg: RunConfig) -> Dict[str, Any]:
    """The CPUs this task may run on and what Slurm and the profile said it would get; once
    placed (:func:`train.harness.affinity.bind_rank`), which CPUs, their NUMA node(s), its
    GPU's NUMA node and how they were chosen."""
    from train.harness.affinity import placed

    slurm = os.environ.get("SLURM_CPUS_PER_TASK")
    placement = placed()
    return {"cpus": len(os.sched_getaffinity(0)), "slurm_cpus_per_task": int(slurm) if slurm else None,
            "cpus_per_task": cfg.cluster.task_cpus(), "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
            **(placement.facts() if placement is not None else {})}


def device_facts(device, cfg: RunConfig) -> Dict[str, Any]:
    """The device this rank got, the GPU behind it and what the task can see."""
    import torch

    out: Dict[str, Any] = {"device": str(device), "accelerator": cfg.cluster.accelerator,
                           "gpu_binding": cfg.cluster.gpu_binding,
                           "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
                           "sto_device": os.environ.get("STO_DEVICE"),
                           "visible_gpus": torch.cuda.device_count() if torch.cuda.is_available() else 0}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        out.update(gpu_name=props.name, gpu_uuid=str(getattr(props, "uuid", "")) or None,
                   pci_bus_id=_pci(props), gpu_mem_gb=round(props.total_memory / 2 ** 30, 1))
    return out


def _pci(props) -> Optional[str]:
    """``DDDDDDDD:BB:DD.0`` as nvidia-smi writes it, from the device's properties."""
    try:
        return f"{props.pci_domain_id:08X}:{props.pci_bus_id:02X}:{props.pci_device_id:02X}.0"
    except AttributeError:  # a torch without the PCI fields
        return None


def versions() -> Dict[str, Any]:
    """The versions every node must agree on, as the harness records each node's
    (train/harness/node_facts.py: one collector of them)."""
    from train.harness.node_facts import node_facts

    facts = node_facts()
    return {key: facts[key] for key in ("python", "torch", "cuda", "nccl")}


def rank_facts(ctx, cfg: RunConfig) -> Dict[str, Any]:
    """Everything this rank can say before any collective."""
    from train.harness.health import gpu_health

    facts: Dict[str, Any] = {"rank": ctx.rank, "local_rank": ctx.local_rank, "node": ctx.node_rank,
                             "host": ctx.hostname, "backend": ctx.backend, "launcher": ctx.launcher,
                             **device_facts(ctx.device, cfg), **cpu_facts(cfg), **versions()}
    if ctx.local_rank == 0:  # one nvidia-smi per node
        health = gpu_health()
        gpus = health.get("gpus") or []
        facts["health"] = {k: v for k, v in health.items() if k != "gpus"}
        facts["health"]["gpus"] = len(gpus)
        facts["driver"] = gpus[0].get("driver_version") if gpus else None
    return facts


def capture_nccl(run_dir: Path, rank: int) -> Tuple[Dict[str, str], Path]:
    """Before the process group: this task's network variables as it got them, then NCCL's
    INFO lines sent to ``RUN_DIR/doctor/nccl-rank{R}.log`` (NCCL reads them at its first
    communicator, which :func:`train.harness.dist.init_distributed` creates)."""
    env = {k: v for k, v in os.environ.items() if k.startswith(NET_ENV_PREFIXES)}
    path = run_dir / RANKS_DIR / f"nccl-rank{rank}.log"
    path.parent.mkdir(parents=True, exist_ok=True)
    os.environ.update(NCCL_DEBUG_ENV, NCCL_DEBUG_FILE=str(path).replace("%", "%%"))  # NCCL expands %h, %p
    return env, path


def nccl_net_lines(text: str, limit: int = MAX_NCCL_LINES) -> List[str]:
    """NCCL's INFO/WARN lines about the network, each kind once (channels and communicators
    repeat them with other numbers), the first ``limit``."""
    out: List[str] = []
    seen = set()
    for line in text.splitlines():
        _, marker, message = line.partition(" NCCL INFO ")
        if not marker:
            _, marker, message = line.partition(" NCCL WARN ")
        key = re.sub(r"\d+", "#", message)
        if marker and key not in seen and any(m in message for m in NET_MARKERS):
            seen.add(key)
            out.append(line.strip())
    return out[:limit]


def _groups(ctx, placement: List[Any]):
    """This rank's node group and cross-node group (same local rank on every node), with
    their sizes; every rank creates every group, in the same order, as torch requires."""
    import torch.distributed as dist

    by_node: Dict[int, List[int]] = {}
    by_local: Dict[int, List[int]] = {}
    for rank, node, local in placement:
        by_node.setdefault(node, []).append(rank)
        by_local.setdefault(local, []).append(rank)
    mine = {}
    for kind, table, key in (("intra", by_node, ctx.node_rank), ("inter", by_local, ctx.local_rank)):
        for k in sorted(table):
            ranks = sorted(table[k])
            group = dist.new_group(ranks) if len(ranks) > 1 else None
            if k == key:
                mine[kind] = (group, len(ranks))
    return mine


def bandwidths(ctx) -> Dict[str, Optional[float]]:
    """Intra- and inter-node all-reduce bus bandwidth of this rank (GB/s; None where its
    group has one rank: one rank per node, or one node)."""
    import torch.distributed as dist

    from train.harness.preflight import allreduce_busbw

    placement: List[Any] = [None] * ctx.world_size
    dist.all_gather_object(placement, (ctx.rank, ctx.node_rank, ctx.local_rank))
    groups = _groups(ctx, placement)
    small = ctx.device.type != "cuda"
    numel = CPU_ALLREDUCE_NUMEL if small else GPU_ALLREDUCE_NUMEL
    out: Dict[str, Optional[float]] = {}
    for kind in ("intra", "inter"):  # one kind at a time: intra traffic must not share the time of inter
        group, size = groups[kind]
        out[f"{kind}_gbps"] = allreduce_busbw(ctx.device, size, small, group=group, numel=numel) if group else None
        dist.barrier()
    return out


def check(dcfg=None) -> None:
    """The doctor job's function: every rank measures, rank 0 writes doctor.json."""
    import torch.distributed as dist

    from train.harness.affinity import bind_rank
    from train.harness.dist import init_distributed, shutdown
    from train.harness.preflight import matmul_gflops
    from train.harness.run import rank_logger

    from slurm.env import task_identity

    run_dir = Path(os.environ["STO_RUN_DIR"])
    cfg = to_run_config(run_dir / CONFIG)
    t0 = time.time()
    te = task_identity()
    first_of_node = cfg.cluster.accelerator == "gpu" and te.local_rank == 0
    net_env, nccl_log = capture_nccl(run_dir, te.rank) if first_of_node else ({}, None)
    ctx = init_distributed(timeout_s=cfg.train.dist_timeout_s, accelerator=cfg.cluster.accelerator,
                           gpu_binding=cfg.cluster.gpu_binding)
    # the CPUs a training rank would get (cluster.cpu_bind; a forked local rank has them already)
    bind_rank(cfg.cluster, ctx.local_rank, ctx.local_world_size, ctx.device, rank_logger(run_dir, ctx.rank).info,
              rank=ctx.rank)
    facts = rank_facts(ctx, cfg)
    _write_json(run_dir / RANKS_DIR / f"rank{ctx.rank}.json", facts)
    small = ctx.device.type != "cuda"
    facts["matmul_tflops"] = matmul_gflops(ctx.device, small) / 1e3
    facts["matmul"] = "fp32 512x512" if small else "bf16 8192x8192"
    facts.update(bandwidths(ctx))
    if nccl_log is not None:
        facts["net_env"] = net_env
        facts["nccl_lines"] = nccl_net_lines(nccl_log.read_text(errors="replace")) if nccl_log.exists() else []
    _write_json(run_dir / RANKS_DIR / f"rank{ctx.rank}.json", facts)
    ranks: List[Any] = [None] * ctx.world_size
    dist.all_gather_object(ranks, facts)
    if ctx.is_main:
        _write_json(run_dir / DOCTOR_JSON, {"time": t0, "seconds": time.time() - t0, "world_size": ctx.world_size,
                                            "backend": ctx.backend, "host": socket.gethostname(),
                                            "allreduce_bytes": 4 * (CPU_ALLREDUCE_NUMEL if small
                                                                    else GPU_ALLREDUCE_NUMEL),
                                            "ranks": ranks})
    shutdown()
