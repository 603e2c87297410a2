"""Preflight: a short per-rank check of compute and all-reduce bandwidth before training.

Enabled by ``train.preflight=true``. Every rank, right after joining the process group:

1. times a fixed matmul (bf16 8192^2 on GPU, fp32 512^2 on CPU) -> ``gflops``;
2. times an all-reduce of a fixed buffer (64 MiB on GPU, 4 MiB on CPU) over the whole
   world -> bus bandwidth ``bytes * 2(n-1)/n / time`` (``allreduce_gbps``, GB/s; null in a
   world of one);
3. all ranks gather every rank's numbers, so each takes the same decision.

A node's value is the minimum over its ranks (the slowest GPU sets the pace of a
synchronous step). A node is an *outlier* when its compute or bandwidth is below
``train.preflight_outlier`` x the median over nodes; ranks are compared with the median
over ranks the same way (reported, not acted upon). Local rank 0 of each node also checks
its GPUs' health when the node has ``nvidia-smi`` (uncorrected ECC errors, retired pages,
row remapping, critical Xids: :func:`train.harness.health.gpu_health`; ``skipped`` on a
node without it): a node with unhealthy GPUs is an outlier too. Rank 0 writes ``RUN_DIR/preflight.json``
and logs one line. With ``train.preflight_exclude=true`` and outlier nodes, rank 0 records
them in run.json (``failure: preflight_outlier``, ``suspect_nodes``) and every rank raises
:class:`PreflightError`; while requeues are left rank 0 first requeues the job without
those nodes (:mod:`train.harness.badnodes`), else ``python -m launcher.resume RUN_DIR``
excludes them.

The world all-reduce runs at the pace of the slowest link, so its per-rank numbers are
close to each other: it catches a slow job-wide fabric (compare with the cluster's
``inter_node_gbps``) more than a single slow node; compute is the per-node signal.
"""
from __future__ import annotations

import json
import statistics
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

PREFLIGHT_JSON = "preflight.json"
FAILURE = "preflight_outlier"  # run.json "failure" value; launcher.resume excludes suspect_nodes
METRICS = ("gflops", "allreduce_gbps")


class PreflightError(RuntimeError):
    """Outlier nodes found and train.preflight_exclude=true: the job stops before training."""


def _below(value: Optional[float], median: Optional[float], threshold: float, name: str) -> List[str]:
    if value is None or not median:
        return []
    if value < threshold * median:
        return [f"{name} {value:.3g} < {threshold} x median {median:.3g}"]
    return []


def _medians(rows: List[Dict[str, Any]]) -> Dict[str, Optional[float]]:
    out: Dict[str, Optional[float]] = {}
    for key in METRICS:
        values = [r[key] for r in rows if r.get(key) is not None]
        out[key] = statistics.median(values) if values else None
    return out


def find_outliers(ranks: List[Dict[str, Any]], threshold: float) -> Dict[str, Any]:
    """Per-node aggregates and the outlier nodes and ranks of per-rank measurements.

    ``ranks``: dicts with rank, host, gflops, allreduce_gbps (the latter may be None).
    Pure: no torch, no process group.
    """
    nodes: Dict[str, Dict[str, Any]] = {}
    for r in sorted(ranks, key=lambda r: r["rank"]):
        node = nodes.setdefault(r["host"], {"host": r["host"], "ranks": []})
        node["ranks"].append(r["rank"])
        for key in METRICS:
            if r.get(key) is not None:
                node[key] = min(node.get(key, r[key]), r[key])
    for node in nodes.values():
        for key in METRICS:
            node.setdefault(key, None)
    node_median, rank_median = _medians(list(nodes.values())), _medians(ranks)
    outliers, rank_outliers = [], []
    for host, node in nodes.items():
        reasons = [why for key in METRICS for why in _below(node[key], node_median[key], threshold, key)]
        if reasons:
            outliers.append({"host": host, "reasons": reasons})
    for r in sorted(ranks, key=lambda r: r["rank"]):
        reasons = [why for key in METRICS for why in _below(r.get(key), rank_median[key], threshold, key)]
        if reasons:
            rank_outliers.append({"rank": r["rank"], "host": r["host"], "reasons": reasons})
    return {"nodes": list(nodes.values()), "median_of_nodes": node_median, "median_of_ranks": rank_median,
            "outliers": outliers, "rank_outliers": rank_outliers}


def add_unhealthy(result: Dict[str, Any], nodes_health: Dict[str, Dict[str, Any]]) -> Dict[str, Any]:
    """``result`` of :func:`find_outliers` with the nodes whose GPUs are unhealthy
    (:func:`train.harness.health.gpu_health`) among the outliers. Pure."""
    outliers = {o["host"]: o for o in result["outliers"]}
    for host, health in sorted(nodes_health.items()):
        reasons = list(health.get("unhealthy") or [])
        if reasons:
            outliers.setdefault(host, {"host": host, "reasons": []})["reasons"].extend(reasons)
    return dict(result, outliers=list(outliers.values()))


def measure(device, world_size: int, small: bool, delay_s: float = 0.0) -> Dict[str, Optional[float]]:
    """This rank's matmul GFLOP/s and world all-reduce bus bandwidth (GB/s); ``delay_s``
    is slept inside the timed matmuls (``fault.preflight_slow_rank``)."""
    gflops = matmul_gflops(device, small, delay_s)
    bandwidth = allreduce_busbw(device, world_size, small) if world_size > 1 else None
    return {"gflops": gflops, "allreduce_gbps": bandwidth}


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def matmul_gflops(device, small: bool, delay_s: float = 0.0) -> float:
    """GFLOP/s of a fixed square matmul on ``device``: bf16 8192^2 on GPU, fp32 512^2 on CPU
    (``small``), after one warm-up; ``delay_s`` is slept inside the timed part."""
    import torch

    n, dtype, iters = (512, torch.float32, 8) if small else (8192, torch.bfloat16, 20)
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    torch.mm(a, b)  # warm-up: kernels, allocator
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(iters):
        torch.mm(a, b)
    time.sleep(delay_s)
    _sync(device)
    return 2 * n ** 3 * iters / (time.perf_counter() - t0) / 1e9


def allreduce_busbw(device, group_size: int, small: bool, group=None, numel: Optional[int] = None) -> float:
    """Bus bandwidth (GB/s) of an fp32 all-reduce in ``group`` (None: the world) of
    ``group_size`` ranks, as nccl-tests defines it: ``bytes * 2(n-1)/n / time``. Every
    rank of the group calls it. ``numel``: the buffer (default 4 MiB small, 64 MiB else)."""
    import torch
    import torch.distributed as dist

    iters = 5 if small else 10
    numel = numel or ((1 << 20) if small else (16 << 20))
    buf = torch.ones(numel, device=device, dtype=torch.float32)
    dist.all_reduce(buf, group=group)  # warm-up: connections, NCCL channels
    _sync(device)
    dist.barrier(group=group)
    t0 = time.perf_counter()
    for _ in range(iters):
        dist.all_reduce(buf, group=group)
    _sync(device)
    seconds = (time.perf_counter() - t0) / iters
    return buf.numel() * buf.element_size() * 2 * (group_size - 1) / group_size / seconds / 1e9


def run_preflight(ctx, run_dir: Path, threshold: float, exclude: bool, log: Callable[[str], None],
                  delay_s: float = 0.0) -> Dict[str, Any]:
    """Measure on every rank, write preflight.json (rank 0), stop the job on outliers if asked."""
    import torch.distributed as dist

    from train.harness.badnodes import requeue_without_suspects
    from train.harness.dist import shutdown
    from train.harness.health import gpu_health
    from train.harness.preempt import current_job_id
    from spec.rundir import Status, update_run_json

    t0 = time.time()
    mine = {"rank": ctx.rank, "host": ctx.hostname, "node": ctx.node_rank, "local_rank": ctx.local_rank,
            **measure(ctx.device, ctx.world_size, small=ctx.device.type != "cuda", delay_s=delay_s)}
    health = gpu_health() if ctx.local_rank == 0 else None  # one nvidia-smi per node
    ranks: List[Any] = [None] * ctx.world_size
    dist.all_gather_object(ranks, dict(mine, gpu_health=health))
    nodes_health = {r["host"]: r.pop("gpu_health") for r in ranks if r.get("gpu_health") is not None}
    result = add_unhealthy(find_outliers(ranks, threshold), nodes_health)
    report = {"time": t0, "seconds": time.time() - t0, "device": str(ctx.device.type), "backend": ctx.backend,
              "world_size": ctx.world_size, "threshold": threshold, "exclude": exclude, "ranks": ranks,
              **result, "gpu_health": nodes_health}
    bad = [o["host"] for o in result["outliers"]]
    if ctx.is_main:
        (run_dir / PREFLIGHT_JSON).write_text(json.dumps(report, indent=1) + "\n")
        med = result["median_of_nodes"]
        bw = f"{med['allreduce_gbps']:.2f} GB/s" if med["allreduce_gbps"] is not None else "n/a (1 rank)"
        log(f"preflight: {len(result['nodes'])} node(s), median {med['gflops']:.1f} GFLOP/s, all-reduce {bw}; "
            f"outlier nodes: {', '.join(bad) or 'none'}; outlier ranks: "
            f"{[o['rank'] for o in result['rank_outliers']] or 'none'} ({PREFLIGHT_JSON})")
    if bad and exclude:
        reasons = "; ".join(f"{o['host']}: {', '.join(o['reasons'])}" for o in result["outliers"])
        message = (f"preflight marked outlier nodes {', '.join(bad)} ({reasons}); `python -m launcher.resume "
                   f"{run_dir}` excludes them (or set train.preflight_exclude=false)")
        shutdown()
        if ctx.is_main:
            update_run_json(run_dir, status=Status.FAILED, failure=FAILURE, suspect_nodes=bad, error=message,
                            ended_at=time.time())
            requeue_without_suspects(run_dir, log, current_job_id())  # while requeues are left
        raise PreflightError(message)
    return report
