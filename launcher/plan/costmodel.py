"""Predicted step time of a layout, and the feasible layouts of a cluster ranked by it.

Pure (no torch). The model, its assumptions and where it agrees with the usual decision
tree are in docs/planner.md. In short, per optimizer step on one GPU:

    compute  = FLOPs / (peak x MFU); FLOPs = flops_per_token x tokens / (tp x pp) x recompute
    bubble   = compute x (pp - 1) / (v x microbatches)                  (pipeline flush)
    dp comm  = bytes / bandwidth; all-reduce 2(n-1)/n, all-gather and reduce-scatter
               (n-1)/n of the bytes; hidden behind compute up to the compute it overlaps
    tp comm  = 4 all-reduces of the activations per block (+2 per recomputed block), and
               the logits gathered and their gradient scattered
    pp comm  = activations and their gradients once per microbatch to the next stage
    cp comm  = context parallel's all-to-alls of q, k, v and the attention output per
               block, forward and backward (+ a recomputed forward), not overlapped
    step     = compute + bubble + exposed dp comm + tp comm + pp comm + cp comm + offload traffic
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

from spec.config import ConfigError, RunConfig, StrategyConfig
from spec.layout import Layout, build_layout
from spec.context_parallel import kv_repeats
from spec.model_size import flops_per_token, head_dim
from spec.ac_modes import ac_mode
from spec.support import check_supported
from spec.validate import check_strings, validate
from launcher.plan.float8 import converted_total, effective_flops_per_token, gather_saving
from launcher.plan.memory import AC_MODES, Memory, compute_bytes, estimate, stage_params

MFU = 0.40                   # fraction of peak the matmuls reach (assumption; plan.mfu=...)
FP32_PEAK = 0.5              # fp32 runs on TF32 tensor cores: half the bf16 peak

PCIE_GBPS = 25.0             # host <-> GPU for offload (PCIe 4 x16, effective)
CPU_ADAM_PARAMS_PER_S = 2e8  # torch AdamW on the host, per rank (assumption)


def all_reduce_bytes(n: int, size: float) -> float:
    """Bytes each rank sends in a ring all-reduce of ``size`` bytes over n ranks."""
    return 2.0 * (n - 1) / n * size if n > 1 else 0.0


def all_gather_bytes(n: int, size: float) -> float:
    """Bytes each rank sends in a ring all-gather (or reduce-scatter) of ``size`` full bytes."""
    return (n - 1) / n * size if n > 1 else 0.0


def bubble_fraction(pp: int, microbatches: int, chunks: int = 1) -> float:
    """Idle share of a pipeline step: (p-1)/(v m + p-1) (GPipe/1F1B v=1; interleaved v chunks)."""
    return (pp - 1) / (chunks * microbatches + pp - 1)


def link_gbps(cfg: RunConfig, layout: Layout, size: int, stride: int) -> float:
    """Bandwidth per GPU of a group of ``size`` ranks ``stride`` apart in the rank order.

    Inside a node: NVLink. Across nodes a ring is limited by the network; with k members
    of the group on each node, k NICs (one per GPU) carry it: min(NVLink, k x inter)."""
    c, gpn = cfg.cluster, layout.gpus_per_node
    within = size * stride <= gpn
    need = "intra_node_gbps" if within else "inter_node_gbps"
    value = getattr(c, need)
    if not value:
        raise ConfigError(f"cluster.{need} is null on cluster {c.name}: the cost model needs it; set "
                          f"cluster.{need}=GB/s per GPU")
    if within:
        return float(value)
    per_node = max(1, min(size, gpn // stride))
    return min(float(c.intra_node_gbps or value * per_node), per_node * float(value))


def _dp_collectives(cfg: RunConfig, layout: Layout, psi: int, e: int) -> List[Tuple[float, int, int, bool]]:
    """(bytes each GPU sends, group size, stride, once per micro-step?) of the data-parallel
    collectives in one optimizer step."""
    s, n, tp = cfg.strategy, layout.dp * layout.cp, layout.tp  # cp ranks reduce gradients too
    if s.engine == "deepspeed":  # DeepSpeed communicates in the compute dtype
        rs, ag = all_gather_bytes(n, e * psi), all_gather_bytes(n, e * psi)
        if s.zero_stage == 0:
            return [(all_reduce_bytes(n, e * psi), n, tp, False)]
        if s.zero_stage == 1:  # full gradients accumulate locally, reduced at the boundary
            return [(rs + ag, n, tp, False)]
        if s.zero_stage == 2:  # gradients are partitioned as they are produced
            return [(rs, n, tp, True), (ag, n, tp, False)]
        return [(2 * ag + rs, n, tp, True)]  # gather for forward and backward, reduce-scatter
    if s.data_parallel != "fsdp":  # DDP: fp32 gradients all-reduced once (no_sync before)
        return [(all_reduce_bytes(n, 4.0 * psi), n, tp, False)]
    d, r = layout.dp_shard * layout.cp, layout.dp_replicate
    gathers = 2 if s.reshard_after_forward else 1
    gathered = e * psi - gather_saving(cfg, layout, e) * converted_total(cfg, layout)  # float8's weights: 1 byte
    out = [(gathers * all_gather_bytes(d, gathered) + all_gather_bytes(d, 4.0 * psi), d, tp, True)]
    if r > 1:  # HSDP: the reduce-scattered shard is all-reduced across replicas
        out.append((all_reduce_bytes(r, 4.0 * psi / d), r, tp * d, True))
    return out


@dataclass(frozen=True)
class StepTime:
    compute_s: float
    bubble_s: float
    dp_comm_s: float        # all data-parallel traffic
    exposed_dp_s: float     # the part not hidden behind compute
    tp_comm_s: float
    pp_comm_s: float
    offload_s: float
    step_s: float
    tokens_per_step: int
    tokens_per_s: float
    mfu: float              # model FLOPs (no recompute) / (bf16 peak x GPUs)
    cp_comm_s: float = 0.0  # context parallel's all-to-alls


def cp_all_to_all_bytes(cfg: RunConfig, layout: Layout) -> float:
    """Bytes each rank sends in one micro-step's context-parallel all-to-alls (train/context_parallel.py):
    per block q, k, v of the TP rank's heads (K/V heads repeated where cp exceeds them) and the attention output,
    each (cp - 1) / cp of the rank's seq/cp tokens, in the forward, again in the backward
    (their gradients) and in a recomputed forward. Whatever cp, about 2(q + kv) x tokens/cp."""
    if layout.cp == 1:
        return 0.0
    m, t, cp, tp = cfg.model, cfg.train, layout.cp, layout.tp
    kv = (m.n_kv_heads or m.n_heads) // tp  # this TP rank's heads, split again by cp
    width = (2 * m.n_heads // tp + 2 * kv * kv_repeats(kv, cp)) * head_dim(m)
    tokens = t.micro_batch_size * t.seq_len / cp
    passes = 2 + ac_mode(cfg.strategy.activation_checkpointing).share
    return passes * m.n_layers * (cp - 1) / cp * tokens * width * compute_bytes(cfg)


def step_time(cfg: RunConfig, layout: Layout, mfu: float = MFU) -> Optional[StepTime]:
    """Predicted optimizer step; None when the cluster has no peak_tflops_bf16."""
    c, s, t, m = cfg.cluster, cfg.strategy, cfg.train, cfg.model
    if not c.peak_tflops_bf16:
        return None
    e = compute_bytes(cfg)
    peak = c.peak_tflops_bf16 * 1e12 * (1.0 if e == 2 else FP32_PEAK)
    micro_tokens = t.micro_batch_size * t.seq_len
    fpt = flops_per_token(m, t.seq_len)
    ac = ac_mode(s.activation_checkpointing)
    # recomputation: one more forward (2 of the 6 N FLOPs) of every checkpointed block;
    # float8's converted matmuls at FLOAT8_SPEEDUP x the rate (launcher/plan/float8.py)
    compute = (effective_flops_per_token(cfg, layout, fpt) * micro_tokens * t.grad_accum / (layout.tp * layout.pp * layout.cp) * (1 + ac.share / 3)
               / (peak * mfu))
    bubble = 0.0
    if layout.pp > 1:
        chunks = 2 if s.pp_schedule == "interleaved_1f1b" else 1
        bubble = compute * (layout.pp - 1) / (chunks * s.pp_microbatches)
    psi = stage_params(m, layout.tp, layout.pp)[0]
    per_step, per_micro = 0.0, 0.0
    for volume, size, stride, every_micro in _dp_collectives(cfg, layout, psi, e):
        if volume:
            secs = volume / (link_gbps(cfg, layout, size, stride) * 1e9)
            per_micro += secs * t.grad_accum if every_micro else 0.0
            per_step += 0.0 if every_micro else secs
    # per-micro-step collectives overlap all compute; the once-per-step reduction only the
    # last micro-step's backward (2/3 of its compute)
    exposed = max(0.0, per_micro - compute) + max(0.0, per_step - compute * 2 / 3 / t.grad_accum)
    layers = -(-m.n_layers // layout.pp)
    tp_s = pp_s = offload = 0.0
    if layout.tp > 1:
        reduces = 4 + 2 * ac.share  # per block: 2 in forward, 2 in backward, 2 in a recomputed forward
        volume = reduces * all_reduce_bytes(layout.tp, micro_tokens * m.dim * e) * layers * t.grad_accum
        if layout.pp > 1:  # a pipeline's last stage gathers the logits, scatters their gradient
            volume += 2 * all_gather_bytes(layout.tp, micro_tokens * m.vocab_size * e) * t.grad_accum
        tp_s = volume / (link_gbps(cfg, layout, layout.tp, 1) * 1e9)
    if layout.pp > 1:
        # point-to-point to the neighbour stage, tp x dp ranks away
        gbps = link_gbps(cfg, layout, 2, layout.tp * layout.dp)
        pp_s = 2 * micro_tokens * m.dim * e * t.grad_accum / (gbps * 1e9)
    if s.engine == "deepspeed" and (s.offload_optimizer or s.offload_params):
        n = layout.dp
        # the gradient partition goes down (every micro-step at stage 3, where it is
        # accumulated on the host), the updated parameters come back once
        down = t.grad_accum if s.zero_stage == 3 else 1
        offload = (down + 1) * e * psi / n / (PCIE_GBPS * 1e9) + psi / n / CPU_ADAM_PARAMS_PER_S
        if s.offload_params:  # partitions fetched for forward and backward every micro-step
            offload += 2 * e * psi / n * t.grad_accum / (PCIE_GBPS * 1e9)
    cp_s = cp_all_to_all_bytes(cfg, layout) * t.grad_accum / (link_gbps(cfg, layout, layout.cp, layout.tp) * 1e9) \
        if layout.cp > 1 else 0.0
    step = compute + bubble + exposed + tp_s + pp_s + cp_s + offload
    tokens = micro_tokens * t.grad_accum * layout.dp
    return StepTime(compute_s=compute, bubble_s=bubble, dp_comm_s=per_micro + per_step, exposed_dp_s=exposed,
                    tp_comm_s=tp_s, pp_comm_s=pp_s, offload_s=offload, step_s=step, tokens_per_step=tokens,
                    cp_comm_s=cp_s,
                    tokens_per_s=tokens / step, mfu=fpt * tokens / step / (c.peak_tflops_bf16 * 1e12 * layout.world_size))


# Data-parallel flavours the search combines with every tp x pp; the names match
# conf/strategy/*.yaml where such a preset exists.
FLAVOURS: Dict[str, Dict[str, object]] = {
    "ddp": dict(engine="torch", data_parallel="ddp", dp_shard=1, dp_replicate=-1),
    "fsdp": dict(engine="torch", data_parallel="fsdp", dp_shard=-1, dp_replicate=1, reshard_after_forward=True),
    "fsdp_grad_op": dict(engine="torch", data_parallel="fsdp", dp_shard=-1, dp_replicate=1,
                         reshard_after_forward=False),
    "hsdp": dict(engine="torch", data_parallel="fsdp", dp_shard=0, dp_replicate=-1, reshard_after_forward=True),
    "zero1": dict(engine="deepspeed", zero_stage=1, dp_shard=1, dp_replicate=-1),
    "zero2": dict(engine="deepspeed", zero_stage=2, dp_shard=1, dp_replicate=-1),
    "zero3": dict(engine="deepspeed", zero_stage=3, dp_shard=1, dp_replicate=-1),
    "zero3_offload": dict(engine="deepspeed", zero_stage=3, dp_shard=1, dp_replicate=-1,
                          offload_optimizer=True, offload_params=True),
}


@dataclass(frozen=True)
class Candidate:
    cfg: RunConfig
    layout: Layout
    memory: Memory
    time: Optional[StepTime]

    def overrides(self, user_cp: int = 1) -> str:
        """Command-line overrides that reproduce this candidate (in place of the user's
        +strategy and strategy.* overrides; ``user_cp``: the user's strategy.cp)."""
        s, t = self.cfg.strategy, self.cfg.train
        out = [f"+strategy={s.name}", f"strategy.mixed_precision={s.mixed_precision}",
               f"strategy.tensor_parallel={s.tensor_parallel}",
               f"strategy.pipeline_parallel={s.pipeline_parallel}", f"strategy.dp_shard={s.dp_shard}",
               f"strategy.dp_replicate={s.dp_replicate}", f"strategy.activation_checkpointing={s.activation_checkpointing}",
               f"train.micro_batch_size={t.micro_batch_size}", f"train.grad_accum={t.grad_accum}"]
        if s.pipeline_parallel > 1:
            out += [f"strategy.pp_schedule={s.pp_schedule}", f"strategy.pp_microbatches={s.pp_microbatches}"]
        if s.cp != user_cp:  # context parallel: named when it differs from the user's (1 unless given)
            out.append(f"strategy.cp={s.cp}")
        if s.float8:
            gather = "null" if s.float8_all_gather is None else str(s.float8_all_gather).lower()
            out += ["strategy.float8=true", f"strategy.float8_recipe={s.float8_recipe}",
                    f"strategy.float8_skip=[{','.join(s.float8_skip)}]", f"strategy.float8_all_gather={gather}"]
        return " ".join(out)


def _pow2_divisors(n: int) -> List[int]:
    return [d for d in (1, 2, 4, 8, 16, 32, 64) if d <= n and n % d == 0]


CP_FROM_SEQ = 16384  # the search tries context parallel from this train.seq_len on (or with strategy.cp > 1)


def _splits(cfg: RunConfig) -> List[Tuple[int, int, int]]:
    """(tp, cp, pp) the search covers: tensor parallel inside an NVLink domain, context
    parallel next to it inside that domain (from CP_FROM_SEQ tokens, dividing the sequence;
    never with pipeline parallel, which it does not compose with), pipeline parallel over
    the rest (no more stages than layers)."""
    c, t = cfg.cluster, cfg.train
    world, span = c.nodes * c.gpus_per_node, min(c.gpus_per_node, c.nvlink_domain or c.gpus_per_node)
    long = t.seq_len >= CP_FROM_SEQ or cfg.strategy.cp > 1
    out = []
    for tp in _pow2_divisors(span):
        for cp in [d for d in _pow2_divisors(span // tp) if d == 1 or (long and t.seq_len % d == 0)]:
            out += [(tp, cp, pp) for pp in _pow2_divisors(min(world // (tp * cp), cfg.model.n_layers))
                    if cp == 1 or pp == 1]
    return out


def candidates(cfg: RunConfig, global_batch: Optional[int] = None, mfu: float = MFU) -> List[Candidate]:
    """Every layout the search covers (:func:`_splits`) that fits and passes every rule of
    the launcher, with the fastest activation-checkpointing mode that fits, best first: by
    predicted step time (not rounded), then by memory. The global batch (sequences per
    optimizer step) is held fixed: micro_batch_size x grad_accum x world / strategy.cp
    unless given (the cp ranks of a group share their sequences); pipeline candidates run it as one flush of
    microbatches of micro_batch_size sequences."""
    c, t = cfg.cluster, cfg.train
    world = c.nodes * c.gpus_per_node
    batch = global_batch or t.micro_batch_size * t.grad_accum * world // max(1, cfg.strategy.cp)
    out: List[Candidate] = []
    try:  # once: a layout changes no string but to the presets' (validate(strings=False) below)
        check_strings(cfg)
    except ConfigError:
        return out
    for tp, cp, pp in _splits(cfg):
        dp = world // (tp * pp * cp)
        if batch % (dp * t.micro_batch_size):
            continue
        per_replica = batch // (dp * t.micro_batch_size)
        train = dataclasses.replace(t, grad_accum=per_replica) if pp == 1 else dataclasses.replace(
            t, grad_accum=1, micro_batch_size=t.micro_batch_size * per_replica)
        for name, fields in FLAVOURS.items():
            if dp * cp == 1 and name not in ("ddp", "zero1", "zero3_offload"):
                continue  # nothing to shard: the other flavours are these again
            if cp > 1 and fields["engine"] != "torch":
                continue  # context parallel runs under DDP or FSDP only (spec/context_parallel.py)
            fields = dict(fields, name=name, tensor_parallel=tp, pipeline_parallel=pp, cp=cp,
                          pp_microbatches=per_replica if pp > 1 else cfg.strategy.pp_microbatches)
            if name == "hsdp":
                if c.nodes == 1 or pp > 1 or c.gpus_per_node // (tp * cp) in (1, dp):
                    continue  # nothing to replicate across, or the same as fsdp / ddp
                fields["dp_shard"] = c.gpus_per_node // (tp * cp)
            best = _fastest_fitting(cfg, train, fields, mfu)
            if best is not None:
                out.append(best)
    # exact ties (communication hidden behind compute): the least memory
    return sorted(out, key=lambda k: (k.time.step_s if k.time else 0.0, k.memory.total_bytes))


def _fastest_fitting(cfg: RunConfig, train, fields: dict, mfu: float) -> Optional[Candidate]:
    user = cfg.strategy  # precision and schedule are the user's; the rest is the candidate's
    for mode in AC_MODES:  # cheapest recomputation first
        strategy = StrategyConfig(mixed_precision=user.mixed_precision, pp_schedule=user.pp_schedule,
                                  compile=user.compile, activation_checkpointing=mode, float8=user.float8,
                                  float8_recipe=user.float8_recipe, float8_skip=list(user.float8_skip),
                                  float8_all_gather=user.float8_all_gather, **fields)
        trial = dataclasses.replace(cfg, strategy=strategy, train=train)
        try:  # the launcher's own rules (launcher.checks.check): a layout it refuses is no candidate
            validate(trial, strings=False)
            layout = build_layout(trial)
            check_supported(trial, layout)
        except ConfigError:
            return None
        mem = estimate(trial, layout)
        if mem.fits is False:
            continue
        return Candidate(trial, layout, mem, step_time(trial, layout, mfu))
    return None


NODE_FACTORS = (1, 2, 4, 8, 16)  # how far nearest_runnable looks: up to 16x the nodes


def nearest_runnable(cfg: RunConfig, global_batch: Optional[int] = None, mfu: float = MFU) -> Optional[Candidate]:
    """When no layout of ``cfg``'s shape fits (:func:`candidates` is empty): the nearest
    change that runs, with its best layout. First a smaller ``train.micro_batch_size``
    (halved down to 1) on the same nodes and at the same global batch, then more nodes
    (doubling, up to 16x) at the largest micro-batch that fits there, the global batch kept
    where the new world divides it. The candidate's config carries the node count (its
    ``cluster.nodes`` may differ from ``cfg``'s). None when nothing runs up to 16x the nodes."""
    c, t = cfg.cluster, cfg.train
    batch = global_batch or t.micro_batch_size * t.grad_accum * c.nodes * c.gpus_per_node // max(1, cfg.strategy.cp)
    for factor in NODE_FACTORS:
        shaped = dataclasses.replace(cfg, cluster=dataclasses.replace(c, nodes=c.nodes * factor))
        world = shaped.cluster.nodes * c.gpus_per_node
        mb = t.micro_batch_size
        while mb >= 1:
            trial = dataclasses.replace(shaped, train=dataclasses.replace(t, micro_batch_size=mb))
            found = candidates(trial, batch if batch % (mb * world) == 0 else None, mfu)
            if found:
                return found[0]
            mb //= 2
    return None


def change_overrides(cfg: RunConfig, k: Candidate) -> str:
    """The overrides that turn ``cfg`` into candidate ``k`` (its node count when it differs)."""
    nodes = [f"cluster.nodes={k.cfg.cluster.nodes}"] if k.cfg.cluster.nodes != cfg.cluster.nodes else []
    return " ".join([*nodes, k.overrides(cfg.strategy.cp)])
