"""Rendezvous: from srun's SLURM_* variables, a torchrun-style environment, or alone.

Under srun every task derives the same master address (first host of the job's node
list) and port (from the job id, see slurm.env.rendezvous_port), so no file or extra
service is needed. Under torchrun (or the local launcher) RANK / WORLD_SIZE /
LOCAL_RANK / MASTER_ADDR / MASTER_PORT are used as given. With neither, the process is
a world of one.

Device and backend follow the profile (``cluster.accelerator``), not what the node
happens to have: a GPU profile takes its GPU by ``cluster.gpu_binding``
(:mod:`spec.device`) and NCCL, and a task that finds no usable CUDA, or GPUs shown
otherwise than the binding says, stops at start with one line (:class:`DeviceError`)
before any collective; a CPU profile runs on gloo and the CPU, even where CUDA exists.
"""
from __future__ import annotations

import contextlib
import datetime
import fcntl
import gc
import ipaddress
import os
import socket
import struct
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Dict, List, MutableMapping, Optional, Tuple

import torch
import torch.distributed as dist

from slurm.env import task_identity
from spec.device import DeviceError, device_index, no_cuda_line
from spec.identity import TaskIdentity
from spec.rundir import NO_CUDA
from train.metrics import allocator_env_defaults
from train.torch_compat import require_supported_torch, set_allocator_settings


@dataclass(frozen=True)
class DistContext(TaskIdentity):
    """This task's identity (:class:`spec.identity.TaskIdentity`, read once from the
    environment) and what joining the process group gave it."""

    hostname: str
    backend: str  # "nccl" | "gloo"
    device: torch.device


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


def gloo_interface_default(master_addr: str, multi_node: bool,
                           env: MutableMapping[str, str] = os.environ) -> Optional[str]:
    """Set ``GLOO_SOCKET_IFNAME``, when unset, to the interface that holds this host's
    address toward ``master_addr`` (the one the kernel's route to it leaves from), and
    return it; None when set already or not found. Without it gloo binds to the address
    its host name resolves to, which is a loopback on hosts whose /etc/hosts maps the
    name to 127.0.1.1: peers on other nodes then cannot connect. A loopback found for a
    job of several nodes is not set (the master's own name resolves to it there: gloo's
    choice is left alone). Standard library only: a UDP socket's connect sends nothing."""
    if env.get("GLOO_SOCKET_IFNAME"):
        return None
    try:
        family, _, _, _, addr = socket.getaddrinfo(master_addr, 9, type=socket.SOCK_DGRAM)[0]
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.connect(addr)
            local = ipaddress.ip_address(probe.getsockname()[0].split("%")[0])
    except (OSError, ValueError, IndexError):
        return None
    if local.is_loopback and multi_node:
        return None
    name = next((n for n, a in _interface_addresses() if a == local), None)
    if name:
        env["GLOO_SOCKET_IFNAME"] = name
    return name


def _interface_addresses() -> List[Tuple[str, "ipaddress.IPv4Address | ipaddress.IPv6Address"]]:
    """(interface, address) of this host: IPv4 by the SIOCGIFADDR ioctl, IPv6 from /proc/net/if_inet6."""
    found: List[Tuple[str, Any]] = []
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                raw = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name.encode()[:15]))  # SIOCGIFADDR
            except OSError:  # no IPv4 address
                continue
            found.append((name, ipaddress.IPv4Address(raw[20:24])))
    with contextlib.suppress(OSError):
        for line in Path("/proc/net/if_inet6").read_text().splitlines():
            fields = line.split()
            found.append((fields[-1], ipaddress.IPv6Address(bytes.fromhex(fields[0]))))
    return found


def cuda_devices() -> Tuple[int, str]:
    """How many CUDA devices this process can use; when none, what CUDA said (the init
    error, a driver's warning) on one line."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if torch.cuda.is_available():
            return torch.cuda.device_count(), ""
        try:
            torch.cuda.init()  # raises with the reason: no driver, too old, no device, CPU build
            said = ""
        except Exception as exc:  # noqa: BLE001 - its message is the diagnosis
            said = f"{type(exc).__name__}: {exc}"
    messages = [said, *(str(w.message) for w in caught)]
    return 0, "; ".join(dict.fromkeys(m for m in messages if m))  # each once, in order


def pick_device(accelerator: Optional[str], binding: str, local_rank: int, local_world_size: int,
                host: Optional[str] = None) -> torch.device:
    """This task's device, made the current CUDA device of the calling thread: the CPU
    for ``accelerator`` "cpu", ``cuda:N`` by ``binding`` for "gpu" (:func:`spec.device.device_index`),
    and for None (no profile: a bench script, torchrun alone) "gpu" where CUDA is.
    Raises :class:`DeviceError` for a GPU profile whose task cannot take its GPU."""
    if accelerator is None:
        accelerator = "gpu" if torch.cuda.is_available() else "cpu"
    if accelerator != "gpu":
        return torch.device("cpu")
    host = host or socket.gethostname()
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    count, said = cuda_devices()
    if count < 1:
        raise DeviceError(no_cuda_line(host, torch.__version__, torch.version.cuda, said, visible), NO_CUDA)
    index = device_index(binding, local_rank, local_world_size, count, visible, host)
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def init_distributed(timeout_s: int = 600, trace_dir: Optional[Path] = None, accelerator: Optional[str] = None,
                     gpu_binding: str = "node") -> DistContext:
    """Take this rank's device (:func:`pick_device`), then join the process group of this job.

    ``accelerator`` / ``gpu_binding``: the profile's ``cluster.accelerator`` and
    ``cluster.gpu_binding`` (None: "gpu" where CUDA is). A task that cannot take its
    device raises :class:`DeviceError` here, before any collective. On NCCL,
    communication defaults are set first (:func:`nccl_env_defaults`); the flight
    recorder dumps into ``trace_dir`` (the run's logs/) on a collective timeout.
    """
    require_supported_torch()  # an older torch: one line here, not an error deep in DCP later
    allocator = allocator_env_defaults(os.environ)  # before pick_device's set_device initialises CUDA
    info = task_identity()
    device = pick_device(accelerator, gpu_binding, info.local_rank, info.local_world_size)
    if allocator and device.type == "cuda":  # also when torch read the variable before it was set
        set_allocator_settings(allocator["PYTORCH_ALLOC_CONF"])
    backend = "nccl" if device.type == "cuda" else "gloo"
    if backend == "nccl":
        nccl_env_defaults(trace_dir)
    timeout = datetime.timedelta(seconds=timeout_s)
    if info.world_size == 1 and info.launcher == "single":
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    else:
        # env:// reads these; under torchrun it also reuses the agent's store
        # (TORCHELASTIC_USE_AGENT_STORE) instead of opening a second server on its port.
        os.environ.update(info.torchrun_vars())
        gloo_interface_default(info.master_addr, multi_node=info.world_size > info.local_world_size)
        dist.init_process_group(backend, init_method="env://",
                                rank=info.rank, world_size=info.world_size, timeout=timeout,
                                device_id=device if backend == "nccl" else None)
    return DistContext(**asdict(info), hostname=socket.gethostname(), backend=backend, device=device)


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
