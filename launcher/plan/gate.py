"""The launcher's gate before submission: a run predicted not to fit its GPUs (or, with
offload, its hosts' memory) is refused with one line naming the shortfall and the fixes
(``launcher.allow_oom=true`` submits anyway). Imports nothing of the launcher above the
planner, so :mod:`launcher.checks` uses it without the planner's command line."""
from __future__ import annotations

import dataclasses
from typing import Optional

from launcher.plan.costmodel import NODE_FACTORS, change_overrides, nearest_runnable
from launcher.plan.memory import GB, Memory, estimate, host_budget
from spec.config import ConfigError, RunConfig
from spec.layout import Layout


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
    return (f"memory plan: {gb(mem.total_bytes)} GB per GPU of {cfg.cluster.gpu_mem_gb:g} ({verdict}; params "
            f"{gb(mem.param_bytes)}, grads {gb(mem.grad_bytes)}, optimizer {gb(mem.optimizer_bytes)}, activations "
            f"{gb(mem.activation_bytes)} with activation_checkpointing={cfg.strategy.activation_checkpointing}, "
            f"buffers+overhead {gb(mem.buffer_bytes + mem.overhead_bytes)}; python -m launcher.plan for the "
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
