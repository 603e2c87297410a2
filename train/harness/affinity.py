"""Each rank's CPUs next to its GPU (``cluster.cpu_bind``): which CPUs a rank runs on.

Without it a rank runs wherever Slurm (``--cpus-per-task``, ``cluster.srun_args``) or the
kernel puts it: on a DGX (GPUs 0-3 on NUMA node 0, 4-7 on node 1) a rank may run on the
far socket, and its data loading, pinned copies and zero3_offload's host Adam cross the
socket link without a word. ``cluster.cpu_bind=gpu`` (the default) computes, per rank:

- on a GPU profile: the NUMA node of the rank's GPU (its PCI address from torch, then
  ``/sys/bus/pci/devices/ADDR/numa_node``), that node's CPUs
  (``/sys/devices/system/node/nodeN/cpulist``, else the device's ``local_cpulist``)
  intersected with the CPUs the task was given (``os.sched_getaffinity(0)`` at start),
  shared evenly among the node's local ranks whose GPUs are on that NUMA node (the k-th
  of m gets the k-th contiguous 1/m slice, whole cores: hyperthread siblings stay
  together). Slurm gave the task no CPU there: an even split of the task's CPUs instead,
  and the reason says so;
- on a CPU profile: an even split of the task's CPUs among the node's local ranks.

It is kept as it is (and described) with ``cluster.cpu_bind=none``, with an explicit
``--cpu-bind=...`` in ``cluster.srun_args`` (or ``SLURM_CPU_BIND`` in ``cluster.env``),
and when srun already bound the task to CPUs of its own (``SLURM_CPU_BIND_TYPE`` in the
task's environment: the site's task/affinity binding; splitting that set again would
starve the rank). ``--cpu-bind=none`` is no binding: the harness places the ranks.

:func:`plan` is pure (a sysfs tree under any root: :class:`Topology`); :func:`apply` sets
the process's affinity; :func:`bind_rank` is the harness's once-per-process call: local
runs call it in each forked rank right after the fork (:mod:`train.harness.forked`), a
Slurm task or torchrun worker as it joins its job (:mod:`train.harness.run`), the doctor
before it reports (:mod:`train.doctor`). No torch at module level.
"""
from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple, Union

NVIDIA = "0x10de"  # PCI vendor id
GPU_CLASSES = ("0x0300", "0x0302")  # PCI class: VGA controller, 3D controller (data-center GPUs)


def parse_cpulist(text: str) -> List[int]:
    """A Linux CPU list (``"0-3,8-11"``, ``"0,2,4"``, ``""``) -> sorted CPU numbers."""
    cpus = set()
    for part in text.strip().split(","):
        part = part.strip()
        if not part:
            continue
        lo, sep, hi = part.partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()):
            raise ValueError(f"bad CPU list {text!r}: {part!r} is not N or N-M")
        if sep and int(hi) < int(lo):
            raise ValueError(f"bad CPU list {text!r}: descending range {part!r}")
        cpus.update(range(int(lo), int(hi if sep else lo) + 1))
    return sorted(cpus)


def format_cpulist(cpus: Iterable[int]) -> str:
    """Sorted CPU numbers -> the Linux CPU list form (``[0, 1, 2, 8]`` -> ``"0-2,8"``)."""
    out: List[str] = []
    run: List[int] = []
    for cpu in sorted(set(cpus)):
        if run and cpu != run[-1] + 1:
            out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
            run = []
        run.append(cpu)
    if run:
        out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
    return ",".join(out)


def pci_address(address: Union[str, Tuple[int, int, int]]) -> str:
    """A GPU's PCI address as sysfs names it (``0000:18:00.0``), from nvidia-smi's form
    (``00000000:18:00.0``), sysfs's, or torch's (domain, bus, device) numbers."""
    if isinstance(address, tuple):
        domain, bus, device = address
        function = 0
    else:
        try:
            domain_s, bus_s, rest = address.strip().split(":")
            device_s, _, function_s = rest.partition(".")
            domain, bus, device, function = (int(domain_s, 16), int(bus_s, 16), int(device_s, 16),
                                             int(function_s or "0", 16))
        except ValueError:
            raise ValueError(f"bad PCI address {address!r}: expected DOMAIN:BUS:DEVICE.FUNCTION") from None
    return f"{domain:04x}:{bus:02x}:{device:02x}.{function:x}"


class Topology:
    """The NUMA nodes, cores and GPUs of this machine as sysfs says (``root``: where the
    tree is; tests give a fake one). Missing files mean "unknown", never an error."""

    def __init__(self, root: Union[str, Path] = "/") -> None:
        self.root = Path(root)
        self._nodes: Optional[Dict[int, List[int]]] = None

    def _read(self, *parts: str) -> Optional[str]:
        try:
            return (self.root.joinpath("sys", *parts)).read_text().strip()
        except OSError:
            return None

    def numa_nodes(self) -> Dict[int, List[int]]:
        """NUMA node -> its CPUs (empty without NUMA information)."""
        if self._nodes is None:
            self._nodes = {}
            base = self.root / "sys" / "devices" / "system" / "node"
            names = sorted(p.name for p in base.glob("node[0-9]*")) if base.is_dir() else []
            for name in names:
                text = self._read("devices", "system", "node", name, "cpulist")
                if text is not None:
                    self._nodes[int(name[4:])] = parse_cpulist(text)
        return self._nodes

    def nodes_of(self, cpus: Iterable[int]) -> List[int]:
        """The NUMA nodes holding ``cpus``."""
        cpus = set(cpus)
        return sorted(n for n, node_cpus in self.numa_nodes().items() if cpus & set(node_cpus))

    def local_cpus(self, address: str) -> List[int]:
        """The CPUs sysfs lists as near the PCI device (``local_cpulist``; empty: unknown)."""
        text = self._read("bus", "pci", "devices", pci_address(address), "local_cpulist")
        return parse_cpulist(text) if text else []

    def gpu_numa(self, address: str) -> Optional[int]:
        """The NUMA node of a PCI device; -1 (a machine that does not say) is its local CPUs'
        node, or the only node there is; None when unknown."""
        text = self._read("bus", "pci", "devices", pci_address(address), "numa_node")
        if text is not None and text.lstrip("-").isdigit() and int(text) >= 0:
            return int(text)
        nodes = self.nodes_of(self.local_cpus(address))
        if len(nodes) == 1:
            return nodes[0]
        return next(iter(self.numa_nodes())) if len(self.numa_nodes()) == 1 else None

    def node_cpus(self, node: int, address: Optional[str] = None) -> List[int]:
        """The CPUs of NUMA node ``node``; without NUMA information, those near ``address``."""
        return self.numa_nodes().get(node) or (self.local_cpus(address) if address else [])

    def gpus(self) -> List[str]:
        """The PCI addresses of the node's NVIDIA GPUs, sorted (whatever the task may see)."""
        base = self.root / "sys" / "bus" / "pci" / "devices"
        found = []
        for dev in sorted(base.iterdir()) if base.is_dir() else []:
            vendor, cls = self._read("bus", "pci", "devices", dev.name, "vendor"), \
                self._read("bus", "pci", "devices", dev.name, "class")
            if vendor == NVIDIA and cls and cls.startswith(GPU_CLASSES):
                found.append(pci_address(dev.name))
        return found

    def cores(self, cpus: Sequence[int]) -> List[List[int]]:
        """``cpus`` grouped by physical core (hyperthread siblings together, sysfs's
        ``thread_siblings_list``; one CPU a core where it says nothing), in CPU order."""
        groups: Dict[int, List[int]] = {}
        for cpu in sorted(cpus):
            text = self._read("devices", "system", "cpu", f"cpu{cpu}", "topology", "thread_siblings_list")
            siblings = parse_cpulist(text) if text else [cpu]
            groups.setdefault(min(siblings + [cpu]), []).append(cpu)
        return [groups[k] for k in sorted(groups, key=lambda k: groups[k][0])]


def share(cpus: Sequence[int], k: int, m: int, topo: Optional[Topology] = None) -> List[int]:
    """The k-th of m contiguous, even slices of ``cpus``, by whole cores where there are at
    least m (the first ``n % m`` slices one unit larger); with fewer CPUs than slices,
    slice k shares CPU k mod n."""
    cpus = sorted(cpus)
    if not cpus or m < 1:
        return cpus
    units = topo.cores(cpus) if topo is not None else [[c] for c in cpus]
    if len(units) < m:
        units = [[c] for c in cpus]
    if len(units) < m:
        return units[k % len(units)]
    base, extra = divmod(len(units), m)
    start = k * base + min(k, extra)
    return sorted(c for unit in units[start:start + base + (1 if k < extra else 0)] for c in unit)


@dataclass(frozen=True)
class Placement:
    """One rank's CPUs and why. ``how``: "gpu" (next to its GPU), "split" (an even split of
    the task's CPUs), "fallback" (its GPU's NUMA node had none of the task's CPUs, or is
    unknown: an even split instead) or "kept" (the CPUs as given, ``reason`` says why)."""

    cpus: Tuple[int, ...]
    numa_nodes: Tuple[int, ...]
    how: str
    reason: str = ""
    gpu: Optional[str] = None
    gpu_numa: Optional[int] = None

    @property
    def near_gpu(self) -> Optional[bool]:
        """All its CPUs on its GPU's NUMA node (None: no GPU, or its node unknown)."""
        if self.gpu_numa is None or not self.numa_nodes:
            return None
        return set(self.numa_nodes) == {self.gpu_numa}

    def line(self, rank: int) -> str:
        """``rank 3: CPUs 12-15 (NUMA node 0, its GPU's)``, and why where it is not that."""
        nodes = ",".join(map(str, self.numa_nodes)) or "?"
        where = f"NUMA node{'s' if len(self.numa_nodes) > 1 else ''} {nodes}"
        if self.near_gpu:
            where += ", its GPU's"
        elif self.gpu_numa is not None:
            where += f"; its GPU {self.gpu} is on NUMA node {self.gpu_numa}"
        return f"rank {rank}: CPUs {format_cpulist(self.cpus)} ({where}{'; ' + self.reason if self.reason else ''})"

    def facts(self) -> Dict[str, Any]:
        """What the doctor and the node facts record."""
        return {"cpu_list": format_cpulist(self.cpus), "cpu_numa": list(self.numa_nodes), "gpu_numa": self.gpu_numa,
                "near_gpu": self.near_gpu, "cpu_bind": self.how, "cpu_bind_reason": self.reason}


def _placement(cpus: Iterable[int], topo: Topology, how: str, reason: str = "", gpu: Optional[str] = None,
               gpu_numa: Optional[int] = None) -> Placement:
    cpus = tuple(sorted(set(cpus)))
    return Placement(cpus, tuple(topo.nodes_of(cpus)), how, reason, gpu, gpu_numa)


def plan(task_cpus: Iterable[int], local_rank: int, local_world_size: int, topo: Topology,
         gpu: Optional[str] = None, gpus: Optional[Sequence[str]] = None, kept: str = "",
         on_gpu: Optional[bool] = None) -> Placement:
    """This rank's CPUs. ``task_cpus``: what the task was given (shared by the node's local
    ranks); ``gpu``: its GPU's PCI address (None on a CPU profile; ``on_gpu``: a GPU
    profile's rank whose address is unknown); ``gpus``: the PCI addresses of the GPUs of
    the node's local ranks, in local-rank order (None: every NVIDIA GPU sysfs lists, in
    address order); ``kept``: a reason to keep ``task_cpus`` as they are (then only
    described). Pure."""
    task = sorted(set(task_cpus))
    address = pci_address(gpu) if gpu else None
    gpu_numa = topo.gpu_numa(address) if address else None
    if kept:
        return _placement(task, topo, "kept", kept, address, gpu_numa)
    even = (f"an even split of the task's {len(task)} CPU{'s' if len(task) != 1 else ''} among "
            f"{local_world_size} local rank{'s' if local_world_size != 1 else ''}")
    split = share(task, local_rank, local_world_size, topo)
    if address is None:
        if on_gpu:
            return _placement(split, topo, "fallback", f"its GPU's PCI address is unknown: {even}")
        return _placement(split, topo, "split", even)
    if gpu_numa is None:
        return _placement(split, topo, "fallback", f"the NUMA node of its GPU {address} is unknown: {even}", address)
    near = set(topo.node_cpus(gpu_numa, address))
    local = [c for c in task if c in near]
    if not local:
        return _placement(split, topo, "fallback", f"the task has no CPU on its GPU's NUMA node {gpu_numa} "
                          f"(it was given {format_cpulist(task)}): {even}", address, gpu_numa)
    peers = [pci_address(p) for p in (gpus if gpus is not None else topo.gpus())]
    same = list(dict.fromkeys(p for p in peers + [address] if p == address or topo.gpu_numa(p) == gpu_numa))
    return _placement(share(local, same.index(address), len(same), topo), topo, "gpu", "", address, gpu_numa)


def apply(cpus: Iterable[int]) -> None:
    """Run this process on ``cpus``: ``os.sched_setaffinity(0, cpus)``, and every other
    thread already running with the same CPUs as this one (a thread that set its own,
    e.g. NCCL's, keeps them); threads and processes started later inherit it."""
    cpus = set(cpus)
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cpus)
    me = threading.get_native_id()
    try:
        tids = [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        return
    for tid in tids:
        try:
            if tid != me and os.sched_getaffinity(tid) == before:
                os.sched_setaffinity(tid, cpus)
        except OSError:  # the thread ended meanwhile
            pass


def srun_binding(srun_args: Sequence[str], env: Mapping[str, str]) -> Optional[str]:
    """An explicit CPU binding the user asked of srun (``--cpu-bind=X`` in
    ``cluster.srun_args``, ``SLURM_CPU_BIND`` in ``cluster.env``), other than none."""
    asked = [(a, a.partition("=")[2]) for a in srun_args if a.split("=", 1)[0] in ("--cpu-bind", "--cpu_bind")]
    if env.get("SLURM_CPU_BIND"):
        asked.append((f"SLURM_CPU_BIND={env['SLURM_CPU_BIND']} in cluster.env", env["SLURM_CPU_BIND"]))
    for text, value in asked:
        if _binds(value):
            return text
    return None


def _binds(value: str) -> bool:
    """Whether srun's --cpu-bind value (``verbose,cores``, ``none``) binds."""
    kinds = [v.strip() for v in value.lower().split(",") if v.strip() not in ("", "verbose", "quiet", "v", "q")]
    return any(k not in ("none", "no") for k in kinds)


def slurm_bound(env: Mapping[str, str]) -> Optional[str]:
    """srun bound this task to CPUs of its own (task/affinity): the variable saying so."""
    kind = env.get("SLURM_CPU_BIND_TYPE")
    return f"SLURM_CPU_BIND_TYPE={kind}" if kind and _binds(kind.replace(":", "")) else None


# --- the harness's side: once per process ---------------------------------------------------

_PLACED: Optional[Placement] = None  # this process's, once bind_rank decided it


def placed() -> Optional[Placement]:
    """This process's placement (None before :func:`bind_rank`)."""
    return _PLACED


def _torch_pci(index: int) -> Optional[str]:
    """The PCI address of CUDA device ``index`` from torch's properties (None: a torch
    without the fields)."""
    import torch

    props = torch.cuda.get_device_properties(index)
    try:
        return pci_address((props.pci_domain_id, props.pci_bus_id, props.pci_device_id))
    except AttributeError:
        return None


def gpu_addresses(cluster, local_rank: int, local_world_size: int,
                  device=None) -> Tuple[Optional[str], Optional[List[str]]]:
    """This rank's GPU's PCI address and those of the node's local ranks (binding ``node``:
    ``cuda:0..N-1``; ``task``: None, each task sees only its own). Initialises CUDA."""
    import socket

    import torch

    from spec.device import device_index

    if device is not None and getattr(device, "type", None) == "cuda" and device.index is not None:
        index = device.index
    else:
        index = device_index(cluster.gpu_binding, local_rank, local_world_size, torch.cuda.device_count(),
                             os.environ.get("CUDA_VISIBLE_DEVICES"), socket.gethostname())
    peers = None
    if cluster.gpu_binding == "node":
        found = [_torch_pci(i) for i in range(local_world_size)]
        peers = None if None in found else [p for p in found if p]
    return _torch_pci(index), peers


def _kept(cluster, env: Mapping[str, str]) -> str:
    """Why this task's CPUs are left as they are ("" : they are not)."""
    if getattr(cluster, "cpu_bind", "gpu") == "none":
        return "cluster.cpu_bind=none: the task's CPUs, left as they are"
    explicit = srun_binding(cluster.srun_args, cluster.env) if cluster.backend == "slurm" else None
    if explicit:
        return f"srun binds them as asked ({explicit} in cluster.srun_args / env): kept"
    bound = slurm_bound(env) if "SLURM_STEP_ID" in env or "SLURM_STEPID" in env else None
    if bound:
        return (f"srun bound this task to them ({bound}): kept; cluster.srun_args=['--cpu-bind=none'] lets the "
                "harness place the ranks next to their GPUs")
    return ""


def bind_rank(cluster, local_rank: int, local_world_size: int, device=None, log: Optional[Callable[[str], None]] = None,
              rank: Optional[int] = None, env: Optional[Mapping[str, str]] = None,
              topo: Optional[Topology] = None) -> Placement:
    """Place this rank (``cluster``: the run's ClusterConfig) by ``cluster.cpu_bind``, once per
    process: a second call returns the first one's placement. Logs one line
    (:meth:`Placement.line`). Never raises for a placement it cannot make: the CPUs stay
    as they are and the reason says why. ``device``: the rank's torch device when known
    (else, on a GPU profile, derived from the binding; CUDA is initialised)."""
    global _PLACED
    if _PLACED is not None:
        return _PLACED
    env = os.environ if env is None else env
    topo = topo or Topology()
    task = sorted(os.sched_getaffinity(0))
    kept = _kept(cluster, env)
    gpu = peers = None
    if cluster.accelerator == "gpu":
        try:
            gpu, peers = gpu_addresses(cluster, local_rank, local_world_size, device)
        except Exception as exc:  # noqa: BLE001 - the harness refuses a task without its GPU itself
            kept = kept or f"its GPU is unknown here ({type(exc).__name__}: {exc}): kept"
    try:
        placement = plan(task, local_rank, local_world_size, topo, gpu=gpu, gpus=peers, kept=kept,
                         on_gpu=cluster.accelerator == "gpu")
        if placement.how != "kept":
            apply(placement.cpus)
            got = sorted(os.sched_getaffinity(0))  # what the kernel now says, not what was asked
            placement = _placement(got, topo, placement.how, placement.reason, placement.gpu, placement.gpu_numa)
    except Exception as exc:  # noqa: BLE001 - a placement, never a reason not to run
        placement = Placement(tuple(task), (), "kept", f"not placed ({type(exc).__name__}: {exc}): kept", gpu)
    _PLACED = placement
    if log is not None:
        log(placement.line(local_rank if rank is None else rank))
    return placement


def node_topology(topo: Optional[Topology] = None) -> Dict[str, Any]:
    """The node's NUMA nodes (their CPUs) and its GPUs' NUMA nodes, for the node facts."""
    topo = topo or Topology()
    return {"numa_nodes": {str(n): format_cpulist(cpus) for n, cpus in topo.numa_nodes().items()},
            "gpu_numa": {gpu: topo.gpu_numa(gpu) for gpu in topo.gpus()}}
