"""The launcher's gate before submission: a run predicted not to fit its GPUs (or its hosts'
memory: offload, the async checkpoint's snapshot) is refused with one line naming the shortfall and the fixes
(``launcher.allow_oom=true`` submits anyway). Imports nothing of the launcher above the
planner, so :mod:`launcher.checks` uses it without the planner's command line."""
from __future__ import annotations

import dataclasses
from typing import Optional

from launcher.plan.costmodel import NODE_FACTORS, change_overrides, nearest_runnable
from launcher.plan.memory import GB, Memory, estimate, host_budget
from spec.config import ConfigError, RunConfig
from spec.layout import Layout, build_layout


def gb(x: Optional[float], unit: float = GB) -> str:
    """Bytes as GB with one decimal ("-" for unknown)."""
    return "-" if x is None else f"{x / unit:.1f}"


def check_fits(cfg: RunConfig, layout: Layout) -> None:
    """Raise ConfigError (one line) when ``cfg`` on ``layout`` is predicted not to fit its GPUs.

    Skipped when cluster.gpu_mem_gb is null (CPU and unknown clusters) or when
    ``launcher.allow_oom`` is true."""
    if not cfg.cluster.gpu_mem_gb or cfg.launcher.allow_oom:
        return
    mem = estimate(cfg, layout)
    if mem.fits:
        return
    if mem.snapshot_per_node and mem.total_bytes <= mem.gpu_bytes:  # the GPUs fit, the hosts not
        raise ConfigError(snapshot_shortfall(cfg, mem))
    s, c = cfg.strategy, cfg.cluster
    fixes = []
    if s.activation_checkpointing != "full":
        full = dataclasses.replace(cfg, strategy=dataclasses.replace(s, activation_checkpointing="full"))
        if estimate(full, layout).fits:
            fixes.append("strategy.activation_checkpointing=full")
    try:  # the best layout of this shape, else the nearest change that runs
        nearest, searched = nearest_runnable(cfg), True
    except ConfigError:  # the cost model lacks a bandwidth: rank nothing, suggest the rest
        nearest, searched = None, False
    fixes.append(f"{change_overrides(cfg, nearest)} in place of +strategy={s.name} and its strategy.* overrides "
                 f"(python -m launcher.plan +cluster={c.name} +model={cfg.model.name} ranks the layouts that fit)"
                 if nearest else f"more than {c.nodes * NODE_FACTORS[-1]} nodes (cluster.nodes={c.nodes} now: no "
                 f"layout fits up to {NODE_FACTORS[-1]}x as many at any micro-batch) or a shorter train.seq_len"
                 if searched else f"more nodes (cluster.nodes={c.nodes} now)")
    raise ConfigError(f"{_shortfall(cfg, mem)}; use {' or '.join(fixes)}, or launcher.allow_oom=true to submit "
                      "anyway")


def memory_line(cfg: RunConfig, layout: Layout) -> Optional[str]:
    """The dry run's memory plan: the planner's prediction per GPU and what makes it up
    (None where cluster.gpu_mem_gb is unknown: CPU and unknown clusters)."""
    if not cfg.cluster.gpu_mem_gb:
        return None
    mem = estimate(cfg, layout)
    verdict = "fits" if mem.fits else "does NOT fit"
    host = ""
    if mem.snapshot_per_node:
        limit = f" of {gb(mem.host_limit)}" if mem.host_limit is not None else ""
        offload = f" and offload {gb(mem.cpu_bytes * cfg.cluster.gpus_per_node)}" if mem.cpu_bytes else ""
        host = (f"; host memory {gb(mem.host_per_node)} GB per node{limit}: the async checkpoint's snapshot "
                f"{gb(mem.snapshot_per_node)}{offload}")
    return (f"memory plan: {gb(mem.total_bytes)} GB per GPU of {cfg.cluster.gpu_mem_gb:g} ({verdict}; params "
            f"{gb(mem.param_bytes)}, grads {gb(mem.grad_bytes)}, optimizer {gb(mem.optimizer_bytes)}, activations "
            f"{gb(mem.activation_bytes)} with activation_checkpointing={cfg.strategy.activation_checkpointing}, "
            f"buffers+overhead {gb(mem.buffer_bytes + mem.overhead_bytes)}{host}; python -m launcher.plan for the "
            "alternatives)")


def _shortfall(cfg: RunConfig, mem: Memory) -> str:
    """What does not fit: the GPU (field gpu_mem_gb) or, with offload, the host (mem_gb)."""
    s, c = cfg.strategy, cfg.cluster
    if mem.total_bytes > (mem.gpu_bytes or 0.0):
        return (f"cluster.gpu_mem_gb={c.gpu_mem_gb:g}: {cfg.model.name} with strategy {s.name} is predicted to need "
                f"{gb(mem.total_bytes)} GB per GPU on {c.name} (params {gb(mem.param_bytes)}, grads "
                f"{gb(mem.grad_bytes)}, optimizer {gb(mem.optimizer_bytes)}, activations "
                f"{gb(mem.activation_bytes)}, buffers+overhead {gb(mem.buffer_bytes + mem.overhead_bytes)})")
    _, source, assumed = host_budget(c)
    source += f" (assumed {gb(mem.host_limit)} GB)" if assumed else ""
    fix = "cluster.node_mem_gb to the node's memory" if c.mem_gb == 0 else "cluster.mem_gb to the memory of a node"
    return (f"{source}: {cfg.model.name} with strategy {s.name} offloads {gb(mem.host_per_node)} GB "
            f"per node to host memory on {c.name} (set {fix} if it has more)")


def snapshot_shortfall(cfg: RunConfig, mem: Memory) -> str:
    """The refusal of a run whose async checkpoint snapshot (with any offload) does not fit
    the memory of a node, with its fixes: blocking saves, the fewest more nodes that make it
    fit (the state sharded over more ranks; none where it is replicated), the node's memory."""
    c, k = cfg.cluster, cfg.checkpoint
    _, source, assumed = host_budget(c)
    given = "null (true on GPU clusters with engine torch)" if k.async_save is None else "true"
    need = -(-mem.host_per_node // GB)  # whole GB
    fixes = ["checkpoint.async_save=false (blocking saves keep no snapshot)"]
    nodes = _nodes_for_snapshot(cfg)
    if nodes:
        fixes.append(f"cluster.nodes={nodes} (the state sharded over more ranks; {c.nodes} now)")
    fixes.append({0: f"cluster.node_mem_gb={need:.0f}", None: f"cluster.mem_gb=0 cluster.node_mem_gb={need:.0f}"}
                 .get(c.mem_gb, f"cluster.mem_gb={need:.0f}") + " if the node has that much memory")
    offload = f" and offload {gb(mem.cpu_bytes * c.gpus_per_node)} GB" if mem.cpu_bytes else ""
    pinned = "pinned " if c.accelerator == "gpu" else ""
    return (f"checkpoint.async_save={given}: the async checkpoint's snapshot of {cfg.model.name} with strategy "
            f"{cfg.strategy.name} takes {gb(mem.snapshot_per_node)} GB of host memory per node on {c.name} "
            f"({gb(mem.snapshot_bytes)} GB per rank x {c.gpus_per_node} ranks: each rank's fp32 parameters and AdamW "
            f"state in {pinned}host buffers){offload}, more than the {gb(mem.host_limit)} GB a node has ({source}"
            f"{': assumed' if assumed else ''}); use {' or '.join(fixes)}, or launcher.allow_oom=true to submit anyway")


def _nodes_for_snapshot(cfg: RunConfig) -> int:
    """The fewest nodes (2x, 4x, ... up to 16x) on which ``cfg`` fits, its snapshot included;
    0 when none does (a replicated state takes as much per node at any size)."""
    c, s = cfg.cluster, cfg.strategy
    for factor in NODE_FACTORS[1:]:
        # hsdp's dp_replicate is ${cluster.nodes}: more nodes, more replicas (and other
        # replicas equal to the node count are taken for the same: no suggestion it may not keep)
        replicas = s.dp_replicate * factor if s.dp_replicate == c.nodes > 1 else s.dp_replicate
        trial = dataclasses.replace(cfg, cluster=dataclasses.replace(c, nodes=c.nodes * factor),
                                    strategy=dataclasses.replace(s, dp_replicate=replicas))
        try:
            if estimate(trial, build_layout(trial)).fits:
                return trial.cluster.nodes
        except ConfigError:  # no layout of this strategy on that many nodes
            continue
    return 0
