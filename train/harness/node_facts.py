"""Each node's own environment facts: ``RUN_DIR/nodes/<host>.json``.

The launcher's ``environment.txt`` describes the login node; what a job ran on is the
compute nodes' business. Local rank 0 of every node writes, at each segment's start:
hostname, CPU count, Python, torch, its CUDA build, cuDNN, NCCL, the driver, the GPU
model and count (nvidia-smi when present, else torch's view), the Slurm job and restart,
the NUMA nodes' CPUs and the GPUs' NUMA nodes, and the CPUs local rank 0 runs on.
CPU-safe: the CUDA fields are null on a node without CUDA. ``launcher.status`` prints
one line per node.
"""
from __future__ import annotations

import json
import os
import platform
import socket
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

NODES_DIR = "nodes"


def _cuda_facts(torch) -> Dict[str, Any]:
    """What torch says about CUDA here (null fields without it)."""
    facts: Dict[str, Any] = {"cuda": torch.version.cuda, "cudnn": None, "nccl": None, "gpu_count": 0,
                             "gpu_model": None}
    try:
        if torch.backends.cudnn.is_available():
            facts["cudnn"] = torch.backends.cudnn.version()
    except Exception:  # noqa: BLE001 - a fact, never a failure
        pass
    if not torch.cuda.is_available():
        return facts
    try:
        version = torch.cuda.nccl.version()
        facts["nccl"] = ".".join(map(str, version)) if isinstance(version, tuple) else str(version)
    except Exception:  # noqa: BLE001
        pass
    facts["gpu_count"] = torch.cuda.device_count()
    facts["gpu_model"] = torch.cuda.get_device_name(0)
    return facts


def _smi_facts(gpus: Optional[List[Dict[str, Any]]]) -> Dict[str, Any]:
    """Driver, GPU model and count, memory from nvidia-smi's rows (None: no nvidia-smi)."""
    if not gpus:
        return {"driver": None}
    names = sorted({str(g.get("name")) for g in gpus})
    return {"driver": gpus[0].get("driver_version"), "gpu_model": ", ".join(names), "gpu_count": len(gpus),
            "gpu_memory_mib": gpus[0].get("memory.total")}


def node_facts(gpus: Optional[List[Dict[str, Any]]] = None) -> Dict[str, Any]:
    """This node's facts (torch imported here: call it on the compute side only)."""
    import torch

    facts: Dict[str, Any] = {"hostname": socket.gethostname(), "cpu_count": os.cpu_count(),
                             "python": platform.python_version(), "torch": torch.__version__,
                             "platform": platform.platform(), "time": time.time(),
                             "slurm_job_id": os.environ.get("SLURM_JOB_ID"),
                             "slurm_node": os.environ.get("SLURMD_NODENAME"),  # may differ from hostname
                             "slurm_restart_count": int(os.environ.get("SLURM_RESTART_COUNT", 0) or 0),
                             "executable": sys.executable}
    facts.update(_cuda_facts(torch))
    smi = _smi_facts(gpus)
    facts.update({k: v for k, v in smi.items() if v is not None or k not in facts})
    facts.update(_cpu_facts())
    return facts


def _cpu_facts() -> Dict[str, Any]:
    """The node's NUMA nodes and its GPUs' (sysfs), and the CPUs the writer (local rank 0)
    was placed on (``cluster.cpu_bind``: train/harness/affinity.py; every rank's are in its
    log, ``rank R: CPUs ...``)."""
    from train.harness.affinity import node_topology, placed

    try:
        numa = node_topology()
    except Exception as exc:  # noqa: BLE001 - a fact, never a failure
        numa = {"error": f"{type(exc).__name__}: {exc}"}
    mine = placed()
    return {"numa": numa, "local_rank0_cpus": mine.facts() if mine is not None else None}


def slurm_names(run_dir: Path, hosts: List[str]) -> List[str]:
    """Slurm's names of ``hosts`` (hostnames as the ranks saw them, which may be
    fully qualified) from the nodes' facts; a host without facts keeps its name."""
    names = []
    for host in hosts:
        try:
            name = json.loads((Path(run_dir) / NODES_DIR / f"{host}.json").read_text()).get("slurm_node")
        except (OSError, ValueError):
            name = None
        names.append(name or host)
    return sorted(set(names))


def write_node_facts(run_dir: Path, host: str) -> Path:
    """Local rank 0: write this node's facts to ``RUN_DIR/nodes/<host>.json`` (atomic)."""
    from train.harness.health import query_gpus

    facts = dict(node_facts(query_gpus()), host=host)
    out = Path(run_dir) / NODES_DIR
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{host}.json"
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(facts, indent=1, sort_keys=True) + "\n")
    os.replace(tmp, path)
    return path
