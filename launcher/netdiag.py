"""Why the inter-node bandwidth is low, read from what NCCL said it chose.

The doctor job (:mod:`train.doctor`) runs its all-reduces with ``NCCL_DEBUG=INFO`` and
``NCCL_DEBUG_SUBSYS=INIT,NET,ENV`` and keeps each rank's network lines; :func:`diagnose`
turns them, with the task's environment, into advice that names the variable to look at.
The lines it reads (NCCL 2.x; the aws-ofi-nccl plugin prefixes its own with ``NET/OFI``)::

    NCCL INFO NET/Socket : Using [0]eth0:10.0.0.5<0>
    NCCL INFO NET/IB : Using [0]mlx5_0:1/IB [1]mlx5_1:1/RoCE ; OOB ib0:10.1.0.5<0>
    NCCL INFO NET/IB : No device found.
    NCCL INFO NET/Plugin: Could not find: libnccl-net.so
    NCCL INFO NET/OFI Selected Provider is efa (found 4 nics)
    NCCL INFO Using network Socket | IB | AWS Libfabric
    NCCL INFO NET/IB : GPU Direct RDMA Disabled for HCA 0 'mlx5_0'
    NCCL INFO Channel 00/0 : 0[0] -> 1[0] [send] via NET/IB/0/GDRDMA
    NCCL INFO NCCL_IB_DISABLE set by environment to 1.

The settings per network, with their sources: docs/clusters.md, "Network settings". Pure:
no torch, no files.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Dict, List, Mapping, Optional, Sequence

# Below this fraction of the profile's inter_node_gbps the transport is suspect (the
# doctor's SLOW_FRACTION: NCCL's all-reduce reaches ~80 % of the link on a sound network).
FAR_BELOW = 0.5
# Interfaces that never carry traffic between nodes: loopback, container and VM bridges.
LOCAL_IFACES = re.compile(r"^(lo|docker\d*|virbr\d*|veth\w*|br-\w+|cni\d*|podman\d*)$")
TRUE = ("1", "true", "yes", "on")

_NETWORK = re.compile(r"Using network (.+?)\s*$")
_VIA = re.compile(r"via NET/([^/]+)/\d+(/GDRDMA)?")
_SOCKET = re.compile(r"NET/Socket : Using ((?:\[\d+\]\S+\s*)+)")
_IFACE = re.compile(r"\[\d+\]([^:\s]+):")
_IB_DEV = re.compile(r"\[\d+\]([\w.-]+):\d+/(IB|RoCE)")
_GDR = re.compile(r"GPU Direct RDMA (Enabled|Disabled) for HCA")
_PROVIDER = re.compile(r"NET/OFI Selected [Pp]rovider is ([\w;-]+)")
_SET = re.compile(r"\b((?:NCCL|FI)_\w+) set by environment to (\S*?)\.?\s*$")
_PLUGIN_MISSING = re.compile(r"NET/Plugin\s*:.*(could not find|no plugin found|cannot open)", re.I)


@dataclass
class NetFacts:
    """What NCCL's lines say: the network it used, its interfaces and devices."""

    network: Optional[str] = None  # "Socket", "IB", "AWS Libfabric", ... (the last "Using network")
    sockets: List[str] = field(default_factory=list)  # interfaces of NET/Socket
    ib: Dict[str, str] = field(default_factory=dict)  # HCA -> link layer (IB or RoCE)
    ib_none: bool = False  # "NET/IB : No device found."
    plugin_missing: bool = False  # no external net plugin (libnccl-net.so) loaded
    provider: Optional[str] = None  # aws-ofi-nccl's libfabric provider
    gdr: Optional[bool] = None  # GPUDirect RDMA: True when used or enabled, False when disabled only
    env: Dict[str, str] = field(default_factory=dict)  # "X set by environment to Y" (env or nccl.conf)


def parse(lines: Sequence[str]) -> NetFacts:
    """The facts of a rank's (or a node's) NCCL INFO lines."""
    f = NetFacts()
    gdr = set()
    for line in lines:
        if m := _NETWORK.search(line):
            f.network = m.group(1)
        if m := _VIA.search(line):
            f.network = f.network or m.group(1)
            gdr.add("Enabled" if m.group(2) else "Disabled")
        if m := _SOCKET.search(line):
            f.sockets += [i for i in _IFACE.findall(m.group(1)) if i not in f.sockets]
        if "NET/IB : Using" in line:
            f.ib.update(_IB_DEV.findall(line))
        f.ib_none |= "NET/IB : No device found" in line
        f.plugin_missing |= bool(_PLUGIN_MISSING.search(line))
        if m := _PROVIDER.search(line):
            f.provider = m.group(1)
        if m := _GDR.search(line):
            gdr.add(m.group(1))
        if m := _SET.search(line):
            f.env[m.group(1)] = m.group(2)
    f.gdr = True if "Enabled" in gdr else False if gdr else None
    return f


def diagnose(nccl_lines: Sequence[str], measured_gbps: Optional[float], expected_gbps: Optional[float],
             env: Mapping[str, str], fraction: float = FAR_BELOW) -> List[str]:
    """Advice, a line each, when ``measured_gbps`` is under ``fraction`` x ``expected_gbps``
    (the profile's ``inter_node_gbps``); [] when it is not, or either is unknown. ``env``:
    the task's NCCL_* / FI_* / GLOO_* variables (what NCCL reports it read wins)."""
    if measured_gbps is None or not expected_gbps or measured_gbps >= fraction * expected_gbps:
        return []
    f = parse(nccl_lines)
    env = {**env, **f.env}
    if f.network is None and not (f.sockets or f.ib or f.provider):
        return ["NCCL reported no network line (NCCL_DEBUG=INFO, NCCL_DEBUG_SUBSYS=INIT,NET): the transport "
                "is unknown; look for 'Using network' in the job's NCCL output"]
    name = (f.network or "").lower()
    if name == "socket" or (not name and f.sockets and not f.ib):
        advice = _socket(f, env)
    elif "libfabric" in name or "ofi" in name or f.provider:
        advice = _efa(f, env)
    elif name == "ib" or f.ib:
        advice = _ib(f, env)
    else:
        advice = [f"NCCL used the network '{f.network}' (an external plugin): see its documentation"]
    return advice + _ifaces(f, env)


def _set(env: Mapping[str, str], key: str) -> str:
    return f"{key}={env[key]}" if env.get(key) not in (None, "") else f"{key} unset"


def _efa_expected(f: NetFacts, env: Mapping[str, str]) -> bool:
    return env.get("FI_PROVIDER") == "efa" or any(k.startswith(("FI_EFA_", "OFI_NCCL_")) for k in env)


def _socket(f: NetFacts, env: Mapping[str, str]) -> List[str]:
    via = f"NET/Socket : Using {', '.join(f.sockets)}" if f.sockets else "Using network Socket"
    head = f"NCCL used TCP sockets ({via}): "
    if str(env.get("NCCL_IB_DISABLE", "")).lower() in TRUE:
        return [head + f"NCCL_IB_DISABLE={env['NCCL_IB_DISABLE']} turns InfiniBand/RoCE off; unset it "
                       "(cluster.env, cluster.setup, the site's modules or /etc/nccl.conf)"]
    if _efa_expected(f, env):
        missing = " (NET/Plugin: Could not find libnccl-net.so)" if f.plugin_missing else " (no NET/OFI line)"
        return [head + f"EFA not used: the aws-ofi-nccl plugin was not loaded{missing}; put its lib directory on "
                       "LD_LIBRARY_PATH in cluster.setup or name it with NCCL_NET_PLUGIN; NCCL_NET set to the plugin's "
                       "name ('AWS Libfabric', newer releases 'Libfabric') makes NCCL fail instead of falling back"]
    if f.ib_none:
        return [head + "NET/IB : No device found: no InfiniBand/RoCE device was usable by this task; check "
                       "`ibv_devices` on the node, that NCCL_IB_HCA names devices it lists "
                       f"({_set(env, 'NCCL_IB_HCA')}) and, in a container, that /dev/infiniband is mounted"]
    return [head + "InfiniBand not used; check NCCL_IB_DISABLE is unset and NCCL_IB_HCA matches `ibv_devices` "
                   f"({_set(env, 'NCCL_IB_HCA')}); a cluster without InfiniBand/EFA: set inter_node_gbps to "
                   "what TCP gives"]


def _ib(f: NetFacts, env: Mapping[str, str]) -> List[str]:
    devs = ", ".join(f"{d}/{link}" for d, link in f.ib.items()) or "?"
    out = []
    if env.get("NCCL_IB_HCA"):
        out.append(f"NCCL used {len(f.ib)} HCA(s) ({devs}) under NCCL_IB_HCA={env['NCCL_IB_HCA']}: check it "
                   "names every compute HCA of the node (`ibv_devices`)")
    if "RoCE" in f.ib.values():
        out.append(f"RoCE ({devs}), {_set(env, 'NCCL_IB_GID_INDEX')}: NCCL before 2.21 uses GID 0 (RoCE v1 on "
                   "most setups); set NCCL_IB_GID_INDEX to the RoCE v2 GID of the node's address (`show_gids`; "
                   "usually 3), and NCCL_IB_TC to the lossless traffic class of your switches")
    if f.gdr is False:
        out.append(f"GPUDirect RDMA not used (GPU Direct RDMA Disabled / no GDRDMA channel), "
                   f"{_set(env, 'NCCL_NET_GDR_LEVEL')}: load the nvidia-peermem kernel module (lsmod | grep "
                   "peermem) and leave NCCL_NET_GDR_LEVEL unset")
    return out or [f"NCCL used InfiniBand ({devs}) with GPUDirect RDMA: the transport is right; check the fabric "
                   "(`ibstat`: port state and rate; ib_write_bw between the nodes) and that inter_node_gbps is "
                   "per GPU"]


def _efa(f: NetFacts, env: Mapping[str, str]) -> List[str]:
    out = []
    if f.provider and f.provider != "efa":
        out.append(f"aws-ofi-nccl chose the libfabric provider '{f.provider}', not efa "
                   f"({_set(env, 'FI_PROVIDER')}): set FI_PROVIDER=efa and check `fi_info -p efa`")
    if f.gdr is not True and env.get("FI_EFA_USE_DEVICE_RDMA") != "1":
        out.append(f"{_set(env, 'FI_EFA_USE_DEVICE_RDMA')} and no GPUDirect RDMA seen: set "
                   "FI_EFA_USE_DEVICE_RDMA=1 on instances with EFA RDMA (p4d, p5)")
    return out or [f"NCCL used EFA through aws-ofi-nccl (provider {f.provider or '?'}): the transport is right; "
                   "check every EFA device is seen (`fi_info -p efa -t FI_EP_RDM`) and that inter_node_gbps is "
                   "per GPU"]


def _ifaces(f: NetFacts, env: Mapping[str, str]) -> List[str]:
    """NCCL's sockets on a loopback or a container bridge: a wrong NCCL_SOCKET_IFNAME."""
    bad = [i for i in f.sockets if LOCAL_IFACES.match(i)]
    if not bad:
        return []
    return [f"NCCL's sockets use {', '.join(bad)} (loopback or a container bridge), "
            f"{_set(env, 'NCCL_SOCKET_IFNAME')}: set NCCL_SOCKET_IFNAME to the interface between the nodes "
            "(`ip -br addr`, e.g. =eth0 or =ib0) and GLOO_SOCKET_IFNAME to the same name"]
