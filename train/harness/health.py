"""Node health: hardware faults named in a crash's text, and the GPUs' own health counters.

Two pure parts, tested on captured text, and the thin calls that feed them:

- :func:`hardware_fault` reads an error message and log lines for what names a hardware
  fault: a GPU's Xid, an uncorrectable ECC error, NCCL's "unhandled system error" (the
  local NIC or driver), NCCL's "remote process exited" (a peer, not this node). A fault
  of this node's own hardware makes :mod:`train.harness.outcome` record
  ``failure: hardware_fault`` with this node as suspect, so the requeued job avoids it
  (:mod:`train.harness.badnodes`).
- :func:`parse_gpu_query` / :func:`unhealthy_reasons` read ``nvidia-smi
  --query-gpu=...`` and ``--query-remapped-rows=...`` (ECC counts since the driver
  loaded, retired pages, remapped rows; with or without ``--format=csv``'s header and
  units), :func:`parse_remap_q` the same flags from ``nvidia-smi -q -d ROW_REMAPPER``
  (drivers without the CSV query), and :func:`parse_xids` the kernel log's ``NVRM: Xid``
  lines. The same flag prints differently by form: ``--query-remapped-rows`` in CSV
  prints ``0``/``1`` (NVML's ``bPending`` / ``bFailureOccurred``), ``-q`` and
  ``--query-gpu``'s ``retired_pages.pending`` print ``Yes``/``No``: :func:`flag` reads
  both. Samples of each form, with their sources: tests/fixtures/nvidia_smi/. :func:`gpu_health` runs
  them on this node when ``nvidia-smi`` exists and says ``skipped`` (with why) otherwise:
  a CPU node is not unhealthy.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
from typing import Any, Dict, List, Optional, Sequence

# (kind, pattern, local), strongest first: a GPU's own fault is this node's whatever else
# the text says; otherwise a line naming a remote peer makes the text the peer's (NCCL's
# "unhandled system error" is also what a survivor sees when its peer's node died).
FAULT_PATTERNS = (
    ("gpu_xid", re.compile(r"\bNVRM: Xid\b|\bXid \d+\b|\bXid error", re.I), True),
    ("gpu_ecc", re.compile(r"uncorrectable ECC error|ECC errors? (?:detected|encountered)|"
                           r"double[- ]bit ECC|uncorrected ECC", re.I), True),
    ("gpu_lost", re.compile(r"GPU (?:has )?fallen off the bus|GPU is lost|"
                            r"unrecoverable (?:hardware|GPU) (?:error|fault)", re.I), True),
    ("nccl_remote", re.compile(r"remote process exited|Connection closed by remote peer|"
                               r"NCCL.{0,300}Connection reset by peer", re.I), False),
    ("nccl_system", re.compile(r"NCCL.{0,300}unhandled system error|NCCL WARN.{0,200}"
                               r"(?:ibv_\w+ failed|NET/IB.{0,100}error)", re.I), True),
)
GPU_FIELDS = ("index", "name", "pci.bus_id", "driver_version", "memory.total", "ecc.mode.current",
              "ecc.errors.corrected.volatile.total", "ecc.errors.uncorrected.volatile.total",
              "retired_pages.double_bit.count", "retired_pages.pending", "temperature.gpu")
BASIC_FIELDS = ("index", "name", "pci.bus_id", "driver_version", "memory.total")
REMAP_FIELDS = ("gpu_bus_id", "remapped_rows.pending", "remapped_rows.failure")
# Clock slowdowns the hardware imposes (reported, not held against the node: they come
# and go with temperature and power). r525 renamed clocks_throttle_reasons.* to
# clocks_event_reasons.*; older drivers know only the first spelling.
THROTTLE_NAMES = ("hw_slowdown", "hw_thermal_slowdown", "hw_power_brake_slowdown", "sw_thermal_slowdown")
THROTTLE_PREFIXES = ("clocks_event_reasons.", "clocks_throttle_reasons.")
# Xids that mean the GPU needs a reset or a replacement (NVIDIA's Xid catalogue): 48 DBE,
# 63/64 row remapping, 74 NVLink, 79 fallen off the bus, 92 high SBE rate, 94/95 ECC
# contained/uncontained, 119/120 GSP.
CRITICAL_XIDS = frozenset({48, 63, 64, 74, 79, 92, 94, 95, 119, 120})
_XID_LINE = re.compile(r"NVRM: Xid \((?:PCI:)?([0-9A-Fa-f:.]+)\): (\d+)")
_NOT_A_VALUE = {"", "n/a", "[n/a]", "[not supported]", "not supported", "[unknown error]", "[insufficient permissions]",
                "[gpu is lost]", "[gpu requires reset]"}
# A cell of --format=csv without nounits: "81559 MiB", "31 C", "45.12 W", "100 %".
_WITH_UNIT = re.compile(r"^(-?\d+(?:\.\d+)?) ?(?:[KMGT]i?B|%|W|MHz|C|mV|KB/s)$")


def hardware_fault(text: str) -> Optional[Dict[str, Any]]:
    """The first hardware fault ``text`` names, or None: ``{"kind", "local", "line"}``.

    Pure. ``local``: the fault is this node's (Xid, ECC, lost GPU, NCCL's system error);
    False when the text names a remote peer (NCCL's "remote process exited", a connection
    closed by the remote peer): the peer is the suspect, which the heartbeats find."""
    lines = text.splitlines()
    for kind, pattern, local in FAULT_PATTERNS:
        for line in lines:
            if pattern.search(line):
                return {"kind": kind, "local": local, "line": line.strip()[:300]}
    return None


def _value(text: str) -> Any:
    """One nvidia-smi CSV cell: int, float, bool (Yes/No, Enabled/Disabled), str or None."""
    text = text.strip()
    low = text.lower()
    if low in _NOT_A_VALUE:
        return None
    if low in ("yes", "enabled", "active"):
        return True
    if low in ("no", "disabled", "not active"):
        return False
    unit = _WITH_UNIT.match(text)
    text = unit.group(1) if unit else text
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return text


def flag(value: Any) -> bool:
    """A yes/no cell as either form prints it: True, or a count/flag of 1 or more
    (``--query-remapped-rows`` prints 0/1); False for No/0 and for no value."""
    return value is True or (type(value) is int and value > 0)


def parse_gpu_query(out: str, fields: Sequence[str]) -> List[Dict[str, Any]]:
    """``nvidia-smi --query-gpu=FIELDS --format=csv[,noheader][,nounits]`` (or
    ``--query-remapped-rows``) -> one dict per GPU. Pure. The header line of
    ``--format=csv`` is skipped and units are dropped ("81559 MiB" -> 81559); rows with
    another number of cells than fields (an error text) are dropped."""
    rows = []
    for line in out.splitlines():
        cells = [c for c in line.split(",")]
        if len(cells) != len(fields) or not line.strip():
            continue
        if cells[0].strip().split(" [")[0] == fields[0]:  # the header: "memory.total [MiB]"
            continue
        rows.append({f: _value(c) for f, c in zip(fields, cells)})
    return rows


_Q_GPU = re.compile(r"^GPU ([0-9A-Fa-f]+:[0-9A-Fa-f]+:[0-9A-Fa-f]+\.[0-9A-Fa-f]+)\s*$")
_Q_REMAP = {"pending": "remapped_rows.pending", "remapping failure occurred": "remapped_rows.failure"}


def parse_remap_q(out: str) -> List[Dict[str, Any]]:
    """The ``Remapped Rows`` section of ``nvidia-smi -q [-d ROW_REMAPPER]`` -> rows shaped
    like ``--query-remapped-rows=gpu_bus_id,remapped_rows.pending,remapped_rows.failure``
    (Yes/No -> True/False; N/A -> None). Pure."""
    rows: List[Dict[str, Any]] = []
    section = False
    for line in out.splitlines():
        gpu = _Q_GPU.match(line.strip())
        if gpu:
            rows.append({"gpu_bus_id": gpu.group(1)})
            section = False
            continue
        indent = len(line) - len(line.lstrip())
        key, _, value = line.strip().partition(":")
        if rows and indent == 4:  # a top-level section of this GPU
            section = key.strip() == "Remapped Rows"
        elif rows and section and key.strip().lower() in _Q_REMAP:
            rows[-1][_Q_REMAP[key.strip().lower()]] = _value(value)
    return [r for r in rows if len(r) > 1]


def _pci(text: Any) -> Optional[tuple]:
    """(domain, bus, device) of a PCI address as nvidia-smi ("00000000:2A:00.0") or the
    kernel log ("0000:2a:00") writes it."""
    parts = str(text).lower().removeprefix("pci:").split(".")[0].split(":")
    try:
        return tuple(int(p, 16) for p in parts[-3:]) if len(parts) >= 3 else None
    except ValueError:
        return None


def parse_xids(dmesg: str) -> Dict[str, List[int]]:
    """Kernel log text -> PCI address -> the Xid codes logged for it (in order). Pure."""
    out: Dict[str, List[int]] = {}
    for bus, code in _XID_LINE.findall(dmesg):
        out.setdefault(bus.lower(), []).append(int(code))
    return out


def unhealthy_reasons(gpus: List[Dict[str, Any]], xids: Optional[Dict[str, List[int]]] = None) -> List[str]:
    """Why a node's GPUs should not be trusted (empty when healthy). Pure.

    Uncorrected ECC errors since the driver loaded, pages waiting for retirement, a failed
    or pending row remap, and critical Xids in the kernel log. Corrected errors are
    reported by :func:`gpu_health`, not held against the node."""
    reasons = []
    for g in gpus:
        name = f"GPU {g.get('index')}"
        uncorrected = g.get("ecc.errors.uncorrected.volatile.total")
        if type(uncorrected) is int and uncorrected > 0:
            reasons.append(f"{name}: {uncorrected} uncorrected ECC errors")
        if flag(g.get("retired_pages.pending")):
            reasons.append(f"{name}: retired pages pending (needs a reset)")
        if flag(g.get("remapped_rows.failure")):
            reasons.append(f"{name}: row remapping failed")
        if flag(g.get("remapped_rows.pending")):
            reasons.append(f"{name}: row remapping pending (needs a reset)")
    index = {_pci(g.get("pci.bus_id")): g.get("index") for g in gpus}
    for bus, codes in sorted((xids or {}).items()):
        critical = sorted({c for c in codes if c in CRITICAL_XIDS})
        if critical:
            gpu = index.get(_pci(bus))
            where = f"GPU {gpu} (PCI {bus})" if gpu is not None else f"PCI {bus}"
            reasons.append(f"{where}: Xid {', '.join(map(str, critical))} in the kernel log")
    return reasons


def throttled(gpus: List[Dict[str, Any]]) -> List[str]:
    """The hardware clock slowdowns active now, one line per GPU (empty: none). Pure."""
    out = []
    for g in gpus:
        active = [name for name in THROTTLE_NAMES
                  if any(flag(g.get(prefix + name)) for prefix in THROTTLE_PREFIXES)]
        if active:
            out.append(f"GPU {g.get('index')}: {', '.join(active)}")
    return out


def _run(cmd: List[str], timeout: float = 20) -> Optional[str]:
    """stdout of ``cmd``, None when it fails, is missing or prints nothing."""
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return proc.stdout if proc.returncode == 0 and proc.stdout.strip() else None


def query_gpus(smi: str = "nvidia-smi") -> Optional[List[Dict[str, Any]]]:
    """This node's GPUs per nvidia-smi (health fields where the GPU has them); None
    without nvidia-smi or when it answers nothing usable. An older driver that refuses a
    field (it prints an error and nothing else) gets the basic fields only."""
    if shutil.which(smi) is None:
        return None
    for fields in (GPU_FIELDS, BASIC_FIELDS):
        out = _run([smi, f"--query-gpu={','.join(fields)}", "--format=csv,noheader,nounits"])
        rows = parse_gpu_query(out or "", fields)
        if rows:
            break
    else:
        return None
    remap = parse_gpu_query(_run([smi, f"--query-remapped-rows={','.join(REMAP_FIELDS)}",
                                  "--format=csv,noheader,nounits"]) or "", REMAP_FIELDS)
    if not remap:  # a driver without the CSV query (or it failed): the -q form has the flags
        remap = parse_remap_q(_run([smi, "-q", "-d", "ROW_REMAPPER"]) or "")
    _join(rows, remap, REMAP_FIELDS[1:])
    for prefix in THROTTLE_PREFIXES:
        fields = ("pci.bus_id", *(prefix + name for name in THROTTLE_NAMES))
        clocks = parse_gpu_query(_run([smi, f"--query-gpu={','.join(fields)}", "--format=csv,noheader,nounits"])
                                 or "", fields)
        if clocks:
            _join(rows, [dict(c, gpu_bus_id=c["pci.bus_id"]) for c in clocks], fields[1:])
            break
    return rows


def _join(gpus: List[Dict[str, Any]], rows: List[Dict[str, Any]], fields: Sequence[str]) -> None:
    """Add ``fields`` of ``rows`` (keyed by gpu_bus_id) to the GPUs with the same PCI address."""
    by_bus = {_pci(r.get("gpu_bus_id")): r for r in rows}
    for g in gpus:
        r = by_bus.get(_pci(g.get("pci.bus_id")), {})
        g.update({k: r[k] for k in fields if k in r})


def kernel_xids() -> Optional[Dict[str, List[int]]]:
    """Xids in the kernel log (``dmesg``), None when it cannot be read (often: no
    permission). Best effort: never raises."""
    out = _run(["dmesg"], timeout=10) if shutil.which("dmesg") else None
    return None if out is None else parse_xids(out)


def gpu_health(smi: str = "nvidia-smi") -> Dict[str, Any]:
    """This node's GPU health: ``{"skipped": why}`` without GPUs, else the GPUs' counters,
    the kernel log's Xids (null: unreadable) and ``unhealthy`` reasons."""
    gpus = query_gpus(smi)
    if gpus is None:
        why = "no nvidia-smi on this node" if shutil.which(smi) is None else "nvidia-smi answered nothing"
        return {"skipped": why}
    xids = kernel_xids()
    return {"gpus": gpus, "xids": xids, "unhealthy": unhealthy_reasons(gpus, xids), "throttled": throttled(gpus)}


# Where this task's stderr goes under submitit (RUN_DIR/slurm/<job>_<task>_log.err), and
# its size when the harness started: a fault is looked for in this segment's lines only
# (the file is appended to across requeues).
def stderr_path(run_dir: str) -> Optional[str]:
    env = os.environ
    task = env.get("SLURM_PROCID")
    if task is None:
        return None
    names = [f"{env.get('SLURM_JOB_ID')}_{task}_log.err"]  # submitit's %j_%t
    if env.get("SLURM_ARRAY_JOB_ID"):  # an array element's: %A_%a_%t
        names.insert(0, f"{env['SLURM_ARRAY_JOB_ID']}_{env.get('SLURM_ARRAY_TASK_ID')}_{task}_log.err")
    for name in names:
        path = os.path.join(run_dir, "slurm", name)
        if os.path.exists(path):
            return path
    return None


def log_offset(path: Optional[str]) -> int:
    try:
        return os.path.getsize(path) if path else 0
    except OSError:
        return 0


def read_tail(path: Optional[str], start: int = 0, limit: int = 256 << 10) -> str:
    """The text of ``path`` after byte ``start`` (at most the last ``limit`` bytes)."""
    if not path:
        return ""
    try:
        with open(path, "rb") as f:
            size = f.seek(0, os.SEEK_END)
            f.seek(max(start, size - limit))
            return f.read().decode("utf-8", "replace")
    except OSError:
        return ""
