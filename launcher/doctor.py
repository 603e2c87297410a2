"""``python -m launcher.doctor +cluster=C [cluster.nodes=N] [overrides]``: check a cluster before trusting it.

A short job on the cluster, submitted like any training run (the same composition, checks,
sbatch script, rendezvous, device choice and run directory) with its entry point set to
:data:`spec.doctor.ENTRYPOINT` (:mod:`train.doctor`). It waits for the job and prints,
per node and rank: the device each rank got and the binding, the CPUs each task may use
(which, their NUMA node(s) and its GPU's), torch / CUDA / NCCL / driver versions, GPU
health, matmul TFLOP/s, and the intra- and inter-node all-reduce bus bandwidth, then one
verdict per node:

- ``fault``: unhealthy GPUs (health.py), no CUDA on a GPU profile, two ranks on one GPU,
  a binding other than the profile's, versions that differ from the other nodes';
- ``slow``: matmul or bandwidth under :data:`SLOW_FRACTION` of the profile's
  ``peak_tflops_bf16`` / ``intra_node_gbps`` / ``inter_node_gbps`` (the planner's inputs),
  matmul under :data:`OUTLIER` x the median of the nodes, fewer CPUs than
  ``cluster.cpus_per_task``, a rank whose CPUs are not all on its GPU's NUMA node, a GPU
  whose clocks the hardware slows down now;
- ``ok``.

A node whose inter-node bandwidth is under :data:`SLOW_FRACTION` of ``inter_node_gbps``
gets network advice under its verdict: what NCCL said it chose (its ``NCCL_DEBUG=INFO``
network lines, kept by the node's first rank) and the variable to look at
(:mod:`launcher.netdiag`).

On a CPU cluster the job runs over gloo; its bandwidth is informative only (no verdict
against GPU figures). Exit status: 0 when no node is faulty, 1 when one is or the job
failed, 2 for bad input. ``launcher.dry_run=true`` prints the sbatch script and submits
nothing. Imports no torch.
"""
from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

from launcher.netdiag import diagnose
from spec.doctor import DOCTOR_JSON, ENTRYPOINT, RANKS_DIR

# A GPU reaching less than half the profile's figure is slow: NVIDIA's large matmuls reach
# ~70 % of dense peak, NCCL's all-reduce ~80 % of the link bandwidth (nccl-tests busbw).
SLOW_FRACTION = 0.5
# A node whose matmul is below this fraction of the median of the nodes is slow (the
# preflight's default outlier threshold, train.preflight_outlier).
OUTLIER = 0.7
VERSION_KEYS = ("torch", "cuda", "nccl", "driver", "python")


def _by_node(ranks: List[Dict[str, Any]]) -> Dict[str, List[Dict[str, Any]]]:
    nodes: Dict[str, List[Dict[str, Any]]] = {}
    for r in sorted(ranks, key=lambda r: (r.get("node", 0), r["rank"])):
        nodes.setdefault(r["host"], []).append(r)
    return nodes


def _min(rows: List[Dict[str, Any]], key: str) -> Optional[float]:
    values = [r[key] for r in rows if r.get(key) is not None]
    return min(values) if values else None


def version_faults(nodes: Dict[str, List[Dict[str, Any]]]) -> Dict[str, List[str]]:
    """Per node, the versions that differ from those of most nodes (a node whose ranks
    disagree among themselves counts each value)."""
    out: Dict[str, List[str]] = {host: [] for host in nodes}
    for key in VERSION_KEYS:
        seen = {host: sorted({str(r[key]) for r in rows if key in r}) for host, rows in nodes.items()}
        counts: Dict[str, int] = {}
        for values in seen.values():
            for v in values:
                counts[v] = counts.get(v, 0) + 1
        if len(counts) < 2:
            continue
        top = max(counts.values())
        common = sorted(v for v, c in counts.items() if c == top)
        for host, values in seen.items():
            odd = [v for v in values if v not in common] if len(common) == 1 else values
            if odd:
                out[host].append(f"{key} {', '.join(odd)} here, {' / '.join(v for v in counts if v not in odd)} "
                                 "on other nodes")
    return out


def _device_faults(rows: List[Dict[str, Any]]) -> List[str]:
    """No CUDA on a GPU profile, two ranks on one GPU, a binding other than the profile's."""
    reasons = []
    for r in rows:
        if r.get("accelerator") == "gpu" and not str(r.get("device", "")).startswith("cuda"):
            reasons.append(f"rank {r['rank']} has no CUDA (torch {r.get('torch')}, CUDA {r.get('cuda')})")
    seen: Dict[str, List[int]] = {}
    for r in rows:
        gpu = r.get("gpu_uuid") or r.get("pci_bus_id")
        if gpu:
            seen.setdefault(gpu, []).append(r["rank"])
    reasons += [f"ranks {', '.join(map(str, rs))} share GPU {gpu}" for gpu, rs in seen.items() if len(rs) > 1]
    for r in rows:
        if r.get("accelerator") != "gpu" or not r.get("visible_gpus"):
            continue
        if r.get("gpu_binding") == "task" and r["visible_gpus"] > 1:
            reasons.append(f"rank {r['rank']} sees {r['visible_gpus']} GPUs under gpu_binding=task")
        if r.get("gpu_binding") == "node" and r["visible_gpus"] < len(rows):
            reasons.append(f"rank {r['rank']} sees {r['visible_gpus']} GPU(s) for {len(rows)} tasks under "
                           "gpu_binding=node")
    return reasons


def _slow(rows: List[Dict[str, Any]], cluster, gpu: bool, median_tflops: Optional[float]) -> List[str]:
    reasons = []
    tflops = _min(rows, "matmul_tflops")
    if gpu and tflops is not None and cluster.peak_tflops_bf16 and tflops < SLOW_FRACTION * cluster.peak_tflops_bf16:
        reasons.append(f"matmul {tflops:.0f} TFLOP/s < {SLOW_FRACTION} x peak_tflops_bf16 {cluster.peak_tflops_bf16:g}")
    if tflops is not None and median_tflops and tflops < OUTLIER * median_tflops:
        reasons.append(f"matmul {tflops:.3g} TFLOP/s < {OUTLIER} x median of nodes {median_tflops:.3g}")
    for key, field in (("intra_gbps", "intra_node_gbps"), ("inter_gbps", "inter_node_gbps")):
        value, expected = _min(rows, key), getattr(cluster, field)
        if gpu and value is not None and expected and value < SLOW_FRACTION * expected:
            reasons.append(f"{key.split('_')[0]}-node all-reduce {value:.1f} GB/s < {SLOW_FRACTION} x "
                           f"{field} {expected:g}")
    for r in rows:
        if r.get("cpus") is not None and r["cpus"] < cluster.cpus_per_task:
            reasons.append(f"rank {r['rank']} may use {r['cpus']} CPU(s), cpus_per_task={cluster.cpus_per_task}")
    reasons += [why for why in map(_away_from_gpu, rows) if why]
    for r in rows:
        reasons += [f"clocks slowed: {t}" for t in (r.get("health") or {}).get("throttled") or []]
    return reasons


def _away_from_gpu(r: Dict[str, Any]) -> Optional[str]:
    """A rank whose CPUs are not all on its GPU's NUMA node (train/harness/affinity.py's
    facts; None when they are, or either is unknown)."""
    gpu, cpus = r.get("gpu_numa"), r.get("cpu_numa")
    if gpu is None or not cpus or set(cpus) == {gpu}:
        return None
    why = r.get("cpu_bind_reason")
    return (f"rank {r['rank']} runs on CPUs {r.get('cpu_list')} of NUMA node(s) {','.join(map(str, cpus))}, its GPU "
            f"on NUMA node {gpu}" + (f" ({why})" if why else ""))


def network_advice(rows: List[Dict[str, Any]], cluster) -> List[str]:
    """A node's advice on a slow network (:func:`launcher.netdiag.diagnose`): its ranks'
    NCCL lines, its slowest inter-node bandwidth, the variables its ranks started with (the
    profile's ``cluster.env`` where a report has none)."""
    lines = list(dict.fromkeys(line for r in rows for line in r.get("nccl_lines") or []))
    env = dict(cluster.env or {})
    for r in rows:
        env.update(r.get("net_env") or {})
    return diagnose(lines, _min(rows, "inter_gbps"), cluster.inter_node_gbps, env, SLOW_FRACTION)


def verdicts(report: Dict[str, Any], cluster) -> Dict[str, Dict[str, Any]]:
    """host -> {"verdict": ok|slow|fault, "reasons": [...]}, with "network": [advice] on a
    GPU node whose network is slow. Pure. ``cluster``: the run's ClusterConfig (the
    profile's figures)."""
    nodes = _by_node(report["ranks"])
    gpu = report.get("backend") == "nccl"
    per_node = [t for t in (_min(rows, "matmul_tflops") for rows in nodes.values()) if t is not None]
    median = statistics.median(per_node) if len(per_node) > 1 else None
    versions = version_faults(nodes)
    out = {}
    for host, rows in nodes.items():
        faults = [why for r in rows for why in (r.get("health") or {}).get("unhealthy") or []]
        faults += _device_faults(rows) + versions[host]
        slow = _slow(rows, cluster, gpu, median)
        verdict = "fault" if faults else "slow" if slow else "ok"
        out[host] = {"verdict": verdict, "reasons": faults or slow}
        advice = network_advice(rows, cluster) if gpu else []
        if advice:
            out[host]["network"] = advice
    return out


def _num(value: Any, spec: str = ".3g") -> str:
    return "-" if value is None else format(value, spec)


def _cells(r: Dict[str, Any]) -> List[str]:
    gpu = r.get("pci_bus_id") or ""
    seen = f"{r.get('gpu_binding')}/{r.get('visible_gpus')}" if r.get("accelerator") == "gpu" else "-"
    slurm = r.get("slurm_cpus_per_task")
    numa = f"{','.join(map(str, r.get('cpu_numa') or [])) or '-'}/{_num(r.get('gpu_numa'), 'd')}"
    return [r["host"], str(r["rank"]), str(r["local_rank"]), f"{r['device']} {gpu}".strip(), seen,
            f"{r.get('cpus')}/{slurm if slurm is not None else '-'}", r.get("cpu_list") or "-", numa,
            _num(r.get("matmul_tflops")), _num(r.get("intra_gbps")), _num(r.get("inter_gbps"))]


# cpu list: the CPUs the rank runs on; numa cpu/gpu: their NUMA node(s) / its GPU's
HEADER = ["node", "rank", "local", "device", "binding/seen", "cpus/slurm", "cpu list", "numa cpu/gpu",
          "matmul TFLOP/s", "intra GB/s", "inter GB/s"]


def render(report: Dict[str, Any], cluster, judged: Dict[str, Dict[str, Any]]) -> str:
    """The report: a row per rank, a line per node (versions, health, verdict)."""
    rows = [HEADER] + [_cells(r) for r in sorted(report["ranks"], key=lambda r: r["rank"])]
    widths = [max(len(row[i]) for row in rows) for i in range(len(HEADER))]
    lines = [f"doctor: {report['world_size']} rank(s) on {len(judged)} node(s), {report['backend']}, "
             f"{report.get('seconds', 0):.1f} s; profile {cluster.name}: peak_tflops_bf16 "
             f"{_num(cluster.peak_tflops_bf16, 'g')}, intra_node_gbps {_num(cluster.intra_node_gbps, 'g')}, "
             f"inter_node_gbps {_num(cluster.inter_node_gbps, 'g')}"]
    lines += ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows]
    for host, ranks in _by_node(report["ranks"]).items():
        first = ranks[0]
        health = first.get("health") or {}
        state = (f"skipped ({health['skipped']})" if "skipped" in health else
                 f"{health.get('gpus')} GPU(s), {len(health.get('unhealthy') or [])} fault(s)")
        lines.append(f"{host}: torch {first.get('torch')}, CUDA {first.get('cuda') or '-'}, NCCL "
                     f"{first.get('nccl') or '-'}, driver {first.get('driver') or '-'}; GPU health: {state}")
    if report.get("backend") != "nccl":
        lines.append("gloo on CPU: bandwidths are informative only (no verdict against GPU figures)")
    for host, v in judged.items():
        lines.append(f"verdict {host}: {v['verdict']}" + (f" ({'; '.join(v['reasons'])})" if v["reasons"] else ""))
        lines += [f"  network: {advice}" for advice in v.get("network", [])]
    return "\n".join(lines)


def _value(args: Sequence[str], key: str) -> Optional[str]:
    """The value of override ``key`` (``key=V`` or ``+key=V``) in ``args``; the last wins."""
    found = None
    for a in args:
        name, sep, value = a.partition("=")
        if sep and name.lstrip("+") == key:
            found = value
    return found


def doctor_args(args: Sequence[str], now: Optional[float] = None) -> List[str]:
    """The launcher's arguments for the doctor job of ``args``: its entry point, waiting,
    and a fresh run directory (a doctor run is never resumed: each call measures anew).
    Raises ValueError for what the doctor cannot take."""
    if any(a in ("-m", "--multirun") for a in args):
        raise ValueError("-m: the doctor checks one cluster shape at a time; run it once per cluster.nodes")
    given = _value(args, "entrypoint")
    if given is not None and given != ENTRYPOINT:
        raise ValueError(f"entrypoint={given}: the doctor runs its own entry point ({ENTRYPOINT}); drop entrypoint=")
    extra = [f"entrypoint={ENTRYPOINT}"]
    if _value(args, "launcher.wait") is None:
        extra.append("launcher.wait=true")
    if _value(args, "launcher.job_name") is None:
        extra.append("launcher.job_name=sto-doctor")
    if _value(args, "launcher.run_dir") is None:
        stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(now))
        root = _value(args, "launcher.root") or "runs"
        cluster, nodes = _value(args, "cluster") or "local", _value(args, "cluster.nodes")
        extra.append(f"launcher.run_dir={root}/doctor/{cluster}{'-' + nodes + 'n' if nodes else ''}-{stamp}")
    return [a for a in args if a.partition("=")[0].lstrip("+") != "entrypoint"] + extra


def _launch(args: List[str]) -> int:
    """``python -m launcher ARGS`` (its output goes to ours); its exit status. A child
    process: Hydra finds the config tree from the module run as ``__main__``."""
    import subprocess

    return subprocess.run([sys.executable, "-m", "launcher", *args]).returncode


def read_report(run_dir: Path) -> Optional[Dict[str, Any]]:
    """doctor.json; else what the ranks wrote before the job ended (None: nothing)."""
    path = run_dir / DOCTOR_JSON
    if path.exists():
        return json.loads(path.read_text())
    ranks = [json.loads(p.read_text()) for p in sorted((run_dir / RANKS_DIR).glob("rank*.json"))]
    if not ranks:
        return None
    backend = ranks[0].get("backend")
    return {"world_size": len(ranks), "backend": backend, "ranks": ranks, "partial": True}


def main(argv: Optional[List[str]] = None) -> int:
    from spec.config import to_run_config
    from spec.rundir import CONFIG

    args = list(sys.argv[1:] if argv is None else argv)
    if any(a in ("-h", "--help") for a in args):
        print(__doc__)
        return 0
    try:
        launch_args = doctor_args(args)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    code = _launch(launch_args)
    run_dir = Path(_value(launch_args, "launcher.run_dir") or "")
    if code == 2 or _value(args, "launcher.dry_run") in ("true", "True") or not (run_dir / CONFIG).exists():
        return code
    report = read_report(run_dir)
    if report is None:
        print(f"doctor: the job wrote no facts (see {run_dir}/logs and {run_dir}/slurm)", file=sys.stderr)
        return 1
    cluster = to_run_config(run_dir / CONFIG).cluster
    judged = verdicts(report, cluster)
    print("\n" + render(report, cluster, judged))
    if report.get("partial"):
        print(f"doctor: the job ended before rank 0 gathered every rank's facts: {len(report['ranks'])} rank(s) "
              "above, no bandwidth")
    if any("network" in v for v in judged.values()):
        print(f"doctor: NCCL's output, a node's first rank each: {run_dir}/{RANKS_DIR}/nccl-rank*.log")
    print(f"run_dir: {run_dir.resolve()}")
    faulty = any(v["verdict"] == "fault" for v in judged.values())
    return 1 if faulty or code or report.get("partial") else 0


if __name__ == "__main__":
    raise SystemExit(main())
