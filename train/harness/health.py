"""Node health: hardware faults named in a crash's text, and the GPUs' own health counters.

Two pure parts, tested on captured text, and the thin calls that feed them:

- :func:`hardware_fault` reads an error message and log lines for what names a hardware
  fault: a GPU's Xid, an uncorrectable ECC error, NCCL's "unhandled system error" (the
  local NIC or driver), NCCL's "remote process exited" (a peer, not this node). A fault
  of this node's own hardware makes :mod:`train.harness.outcome` record
  ``failure: hardware_fault`` with this node as suspect, so the requeued job avoids it
  (:mod:`train.harness.badnodes`).
- :func:`parse_gpu_query` / :func:`unhealthy_reasons` read ``nvidia-smi
  --query-gpu=...`` (ECC counts since the driver loaded, retired pages, remapped rows)
  and :func:`parse_xids` the kernel log's ``NVRM: Xid`` lines. :func:`gpu_health` runs
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
# Xids that mean the GPU needs a reset or a replacement (NVIDIA's Xid catalogue): 48 DBE,
# 63/64 row remapping, 74 NVLink, 79 fallen off the bus, 92 high SBE rate, 94/95 ECC
# contained/uncontained, 119/120 GSP.
CRITICAL_XIDS = frozenset({48, 63, 64, 74, 79, 92, 94, 95, 119, 120})
_XID_LINE = re.compile(r"NVRM: Xid \((?:PCI:)?([0-9A-Fa-f:.]+)\): (\d+)")
_NOT_A_VALUE = {"", "n/a", "[n/a]", "[not supported]", "not supported", "[unknown error]", "[insufficient permissions]"}


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
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return text


def parse_gpu_query(out: str, fields: Sequence[str]) -> List[Dict[str, Any]]:
    """``nvidia-smi --query-gpu=FIELDS --format=csv,noheader,nounits`` -> one dict per GPU. Pure.
    Rows with another number of cells than fields (an error text) are dropped."""
    rows = []
    for line in out.splitlines():
        cells = [c for c in line.split(",")]
        if len(cells) == len(fields) and line.strip():
            rows.append({f: _value(c) for f, c in zip(fields, cells)})
    return rows


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
        if (g.get("ecc.errors.uncorrected.volatile.total") or 0) > 0:
            reasons.append(f"{name}: {g['ecc.errors.uncorrected.volatile.total']} uncorrected ECC errors")
        if g.get("retired_pages.pending") is True:
            reasons.append(f"{name}: retired pages pending (needs a reset)")
        if g.get("remapped_rows.failure") is True:
            reasons.append(f"{name}: row remapping failed")
        if g.get("remapped_rows.pending") is True:
            reasons.append(f"{name}: row remapping pending (needs a reset)")
    for bus, codes in sorted((xids or {}).items()):
        critical = sorted({c for c in codes if c in CRITICAL_XIDS})
        if critical:
            reasons.append(f"PCI {bus}: Xid {', '.join(map(str, critical))} in the kernel log")
    return reasons


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
    by_bus = {str(r["gpu_bus_id"]).lower(): r for r in remap}
    for g in rows:
        r = by_bus.get(str(g.get("pci.bus_id")).lower(), {})
        g.update({k: r[k] for k in REMAP_FIELDS[1:] if k in r})
    return rows


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
    return {"gpus": gpus, "xids": xids, "unhealthy": unhealthy_reasons(gpus, xids)}


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
