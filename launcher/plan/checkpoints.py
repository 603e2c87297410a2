"""Checkpoints sized to the filesystem and the failure rate (pure, no torch): how big a
save is, how long it takes, how often to save, and whether the signal-time save fits.

Sizes. A checkpoint holds every parameter in fp32 and AdamW's two fp32 moments: 12 bytes
a parameter in all, whatever the sharding (DCP writes a replicated tensor once,
spreading the replicas' writes over the ranks, so a node writes its share: all / nodes).
DeepSpeed adds the module's own weights (2 bytes a parameter in bf16, 4 in fp32), which
rank 0 writes alone under ZeRO 1-2 (every rank its partition under ZeRO-3).

Seconds. A node writes at ``cluster.fs_write_gbps`` and all of them together at most at
``cluster.fs_total_write_gbps``: a save takes max(bytes of the busiest node / the node's
speed, all bytes / the aggregate), plus :data:`COMMIT_S` for the barriers, the manifest
and the renames. An async save stalls the loop only to copy each rank's state to host
memory (:data:`SNAPSHOT_GBPS`); its write goes on in the background.

Interval (Young 1974, Daly 2006): a job of N nodes fails every M = 1 / (N x
``cluster.failures_per_node_hour``) hours on average; saving every
tau = sqrt(2 x delta x M), delta the loop's cost of one save, minimises the time lost to
saves (delta / tau) plus the work redone after a failure (tau / 2 on average). The
derived interval is never under :data:`MIN_INTERVAL_S`, nor, async, under
:data:`WRITE_SHARE` writes.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import List, Optional

from launcher.plan.state_bytes import state_bytes_per_rank
from launcher.plan.states import ADAM, MASTER, compute_bytes
from spec.checkpointing import default_save_timeout_s, saves_async
from spec.config import ConfigError, RunConfig
from spec.layout import Layout
from spec.model_size import count_params

GB = 1e9
STATE = MASTER + ADAM  # 12 bytes a parameter: the fp32 value + AdamW's two fp32 moments
COMMIT_S = 10.0       # barriers, the manifest, fsyncs and renames of one save (assumption)
# GB/s one rank copies its state into host memory at (async snapshot: GPU -> pinned host;
# eight GPUs of a node share its memory bandwidth). An assumption, not measured here.
SNAPSHOT_GBPS = 10.0
SIGNAL_MARGIN_S = 15.0  # after the save: exit, requeue, Slurm's clean-up (assumption)
# A derived interval is at least MIN_INTERVAL_S, and with async saves at least WRITE_SHARE
# times the write: an async save costs the loop little, so Young/Daly alone would save
# every minute or two at scale, keeping the shared filesystem (and its metadata servers)
# busy with one job's checkpoints; this keeps the job's writes to a quarter of its time.
MIN_INTERVAL_S = 300.0
WRITE_SHARE = 4


@dataclass(frozen=True)
class SavePlan:
    """One run's checkpoint figures; ``None`` where the profile lacks what it needs."""

    total_bytes: float            # one checkpoint, all ranks
    node_bytes: float             # what the busiest node writes
    rank_bytes: float             # one rank's state (the async snapshot)
    save_s: Optional[float]       # a blocking save (the signal-time one), commit included
    restore_s: Optional[float]    # reading it back (the restart after a failure)
    stall_s: Optional[float]      # the loop's cost of one periodic save
    mtbf_h: Optional[float]       # the job's mean time between failures
    interval_s: Optional[float]   # the derived interval, when derivable
    young_daly_s: Optional[float]  # sqrt(2 x stall x MTBF), before the floors
    asynchronous: bool
    derived: bool = False         # the launch set checkpoint.every_minutes to interval_s


def checkpoint_bytes(cfg: RunConfig, layout: Layout) -> tuple:
    """(all bytes, the busiest node's, one rank's) of one checkpoint of the built-in trainer."""
    psi = count_params(cfg.model)
    state = STATE * psi
    nodes, rank = cfg.cluster.nodes, state_bytes_per_rank(cfg, layout)
    if cfg.strategy.engine == "deepspeed":
        module = compute_bytes(cfg) * psi
        total = state + module
        return total, total / nodes if cfg.strategy.zero_stage == 3 else state / nodes + module, rank
    return state, state / nodes, rank


def _seconds(node_bytes: float, total_bytes: float, per_node: Optional[float], total: Optional[float]
             ) -> Optional[float]:
    if not per_node:
        return None
    t = node_bytes / (per_node * GB)
    if total:
        t = max(t, total_bytes / (total * GB))
    return t + COMMIT_S


def plan_saves(cfg: RunConfig, layout: Layout) -> SavePlan:
    """The checkpoint figures of ``cfg`` on ``layout`` (nothing derived where unknown)."""
    c = cfg.cluster
    total, node, rank = checkpoint_bytes(cfg, layout)
    save_s = _seconds(node, total, c.fs_write_gbps, c.fs_total_write_gbps)
    restore_s = _seconds(node, total, c.fs_read_gbps, c.fs_total_read_gbps)
    asynchronous = saves_async(cfg)
    stall_s = (rank / (SNAPSHOT_GBPS * GB) if asynchronous else save_s) if save_s is not None else None
    mtbf_h = 1.0 / (c.failures_per_node_hour * c.nodes) if c.failures_per_node_hour else None
    interval = young_daly = None
    if stall_s is not None and mtbf_h is not None:
        young_daly = math.sqrt(2 * stall_s * mtbf_h * 3600)
        interval = max(young_daly, MIN_INTERVAL_S, WRITE_SHARE * save_s if asynchronous else 0.0)
    return SavePlan(total, node, rank, save_s, restore_s, stall_s, mtbf_h, interval, young_daly, asynchronous)


def derives_interval(cfg: RunConfig) -> bool:
    """Whether the launch picks the interval: neither checkpoint.every_steps nor
    every_minutes given, a GPU run of the built-in trainer."""
    k = cfg.checkpoint
    return (k.every_steps is None and k.every_minutes is None and cfg.cluster.accelerator == "gpu"
            and not cfg.entrypoint)


def resolve(cfg: RunConfig, layout: Layout) -> Optional[SavePlan]:
    """Fill the checkpoint section's nulls in place (what the run's config.yaml then holds)
    and check the save against the signal window and the quota (ConfigError). Returns the
    plan printed at launch; None for users' own entry points (they save themselves)."""
    k = cfg.checkpoint
    if cfg.entrypoint:
        if k.save_timeout_s is None:
            k.save_timeout_s = default_save_timeout_s(cfg.cluster.hang_timeout_s)
        return None
    plan = plan_saves(cfg, layout)
    if derives_interval(cfg) and plan.interval_s is not None:
        k.every_minutes = round(plan.interval_s / 60, 1)
        k.every_steps = 0
        plan = dataclasses.replace(plan, derived=True)
    k.every_steps = k.every_steps or 0
    k.every_minutes = k.every_minutes or 0.0
    if k.async_save is None:
        k.async_save = plan.asynchronous
    if k.save_timeout_s is None:
        k.save_timeout_s = default_save_timeout_s(cfg.cluster.hang_timeout_s, plan.save_s)
    check_signal_window(cfg, plan)
    check_quota(cfg, plan)
    return plan


def _num(x: Optional[float]) -> str:
    return "-" if x is None else f"{x:g}"


def _gb(x: float) -> str:
    return f"{x / GB:,.0f}" if x >= 10 * GB else f"{x / GB:.2g}"


def _size(cfg: RunConfig, plan: SavePlan) -> str:
    return (f"{cfg.model.name}'s checkpoint ({_gb(plan.total_bytes)} GB in all, {_gb(plan.node_bytes)} GB from the "
            f"busiest of {cfg.cluster.nodes} node(s))")


def check_signal_window(cfg: RunConfig, plan: SavePlan) -> None:
    """A Slurm job whose signal-time save (blocking) cannot commit inside
    cluster.signal_delay_s is refused: it would be SIGKILLed and the segment lost."""
    c = cfg.cluster
    if c.backend != "slurm" or plan.save_s is None:
        return
    need = plan.save_s + SIGNAL_MARGIN_S
    if need <= c.signal_delay_s:
        return
    fixes = [f"cluster.signal_delay_s={math.ceil(need / 10) * 10}"]
    per_node = plan.node_bytes / (c.fs_write_gbps * GB)
    aggregate = plan.total_bytes / (c.fs_total_write_gbps * GB) if c.fs_total_write_gbps else 0.0
    if per_node > aggregate and cfg.strategy.engine == "torch":  # more nodes write less each
        room = c.signal_delay_s - SIGNAL_MARGIN_S - COMMIT_S
        if room > aggregate:
            nodes = math.ceil(plan.total_bytes / (c.fs_write_gbps * GB) / room)
            fixes.append(f"cluster.nodes={nodes} (each node writes less)")
    fixes.append(f"cluster.fs_write_gbps / fs_total_write_gbps if the filesystem is faster than "
                 f"{c.fs_write_gbps:g} / {_num(c.fs_total_write_gbps)} GB/s")
    raise ConfigError(
        f"cluster.signal_delay_s={c.signal_delay_s}: the save on Slurm's signal is predicted to take "
        f"{plan.save_s:.0f} s ({_size(cfg, plan)} at cluster.fs_write_gbps={c.fs_write_gbps:g} a node, "
        f"fs_total_write_gbps={_num(c.fs_total_write_gbps)}) + {SIGNAL_MARGIN_S:.0f} s to requeue: it would be "
        f"killed before it commits; use {' or '.join(fixes)}")


def check_quota(cfg: RunConfig, plan: SavePlan) -> None:
    """checkpoint.keep checkpoints, and the one being written before the oldest is pruned,
    must fit cluster.checkpoint_quota_gb."""
    quota, keep = cfg.cluster.checkpoint_quota_gb, cfg.checkpoint.keep
    if not quota or (keep + 1) * plan.total_bytes <= quota * GB:
        return
    fits = int(quota * GB // plan.total_bytes) - 1
    fix = f"checkpoint.keep={fits}" if fits >= 1 else "a larger quota: not even one checkpoint and the next fit"
    raise ConfigError(
        f"checkpoint.keep={keep}: {keep} checkpoints and the one being saved before the oldest is deleted take "
        f"{_gb((keep + 1) * plan.total_bytes)} GB ({_size(cfg, plan)}), above cluster.checkpoint_quota_gb="
        f"{quota:g}; use {fix} or raise cluster.checkpoint_quota_gb if the space is there")


def describe(cfg: RunConfig, plan: SavePlan, step_s: Optional[float] = None) -> List[str]:
    """The launch's and the dry run's lines about checkpoints."""
    c, k = cfg.cluster, cfg.checkpoint
    lines = []
    how = "async (the loop stalls for the host copy)" if k.async_save else "blocking"
    if k.every_minutes or k.every_steps:
        every = (f"every {k.every_minutes:g} min" if k.every_minutes else "") + \
                (" and " if k.every_minutes and k.every_steps else "") + \
                (f"every {k.every_steps} steps" if k.every_steps else "")
        source = "" if not plan.derived else _derivation(cfg, plan)
        lines.append(f"checkpoints: {every}, {how}{source}")
        lost = _lost_s(k, step_s)
        if lost is None:  # every_steps alone, no predicted step time
            lines.append(f"checkpoints: work lost per failure ~{k.every_steps / 2:g} steps on average (half the "
                         "interval) + the restart")
        else:
            restart = f" + the restart (restore {plan.restore_s:.0f} s)" if plan.restore_s is not None else \
                " + the restart"
            lines.append(f"checkpoints: work lost per failure ~{_dur(lost)} on average (half the interval){restart}"
                         + (f"; the job fails every {plan.mtbf_h:.1f} h on average" if plan.mtbf_h else ""))
    else:
        derive = ", or the profile's fs_* and failures_per_node_hour to derive it" if c.accelerator == "gpu" else ""
        lines.append("checkpoints: only on a signal (preemption, time limit): a crash or a dead node loses the "
                     f"segment; set checkpoint.every_minutes or checkpoint.every_steps{derive}")
    if plan.save_s is not None:
        window = f" (the one on Slurm's signal: within cluster.signal_delay_s={c.signal_delay_s})" \
            if c.backend == "slurm" else ""
        lines.append(f"checkpoints: {_size(cfg, plan)}, a blocking save predicted {plan.save_s:.0f} s{window}; "
                     f"a save is a hang after checkpoint.save_timeout_s={k.save_timeout_s:g}")
    return lines


def _derivation(cfg: RunConfig, plan: SavePlan) -> str:
    c = cfg.cluster
    text = (f" (derived: Young/Daly sqrt(2 x {plan.stall_s:.1f} s a save x {plan.mtbf_h:.1f} h between failures of "
            f"{c.nodes} node(s) at cluster.failures_per_node_hour={c.failures_per_node_hour:g}) = "
            f"{_dur(plan.young_daly_s)}")
    if plan.interval_s > plan.young_daly_s:
        floor = "the 5 min floor" if plan.interval_s == MIN_INTERVAL_S else f"{WRITE_SHARE} x the {plan.save_s:.0f} s write"
        text += f", raised to {floor}"
    return text + ")"


def predicted_step_s(cfg: RunConfig, layout: Layout) -> Optional[float]:
    """The cost model's optimizer step (what checkpoint.every_steps is worth in time), or None."""
    from launcher.plan.costmodel import step_time

    try:
        t = step_time(cfg, layout)
    except ConfigError:  # a bandwidth the profile lacks
        return None
    return t.step_s if t is not None else None


def _lost_s(k, step_s: Optional[float]) -> Optional[float]:
    spans = [k.every_minutes * 60] if k.every_minutes else []
    if k.every_steps and step_s:
        spans.append(k.every_steps * step_s)
    return min(spans) / 2 if spans else None


def _dur(s: float) -> str:
    return f"{s / 60:.1f} min" if s >= 90 else f"{s:.0f} s"
