"""``python -m launcher.plan [--config-dir DIR] +cluster=C +model=M [+strategy=S] [overrides] [plan.*] [-m]``

Predicted memory per GPU (and step time) for the given strategy or for every preset in
conf/strategy/, then the best layouts for the cluster; with ``-m`` once per point of a
sweep (``cluster.nodes=1,2,4 -m``; JSON objects then carry the point's overrides). Options of the planner itself
(not config fields, so parsed here before Hydra composes):

    plan.format=table|json   json: a list with one object per strategy on stdout
    plan.top=5               how many recommended layouts to print (0: none)
    plan.recommend=true      with json: print the recommended layouts instead
    plan.mfu=0.4             assumed model FLOPs utilisation of the cost model
    plan.global_batch=N      sequences per optimizer step the recommendations keep

``--config-dir DIR`` (or ``hydra.searchpath=[file://DIR]``) adds a team's own config
groups, as for ``python -m launcher``; the printed #1 command carries it. Bad input exits
2 with one line, as ``python -m launcher`` does. Where no layout fits and runs (with
``plan.top`` > 0) it exits 1 with the reason on stderr, in text and JSON alike (the JSON
still printed). The launcher's gate before submission is :mod:`launcher.plan.gate`.
Pure: no torch import (see docs/planner.md).
"""
from __future__ import annotations

import json
import sys
from typing import Dict, List, Optional, Tuple

from launcher.plan.costmodel import (MFU, NODE_FACTORS, Candidate, StepTime, candidates, change_overrides,
                                     nearest_runnable, step_time)
from launcher.plan.gate import check_fits  # noqa: F401  (the gate, for callers of the planner)
from launcher.plan.gate import gb as _gb
from launcher.plan.memory import (AC_MODES, CUDA_OVERHEAD, FRAGMENTATION, GB, Memory, compute_bytes, estimate,
                                  host_budget)
from launcher.plan.state_bytes import state_bytes_per_rank
from launcher.compose import PointComposer, expand, standalone
from launcher.overrides import CONF_DIR, check_overrides, group_options, group_prefix, split_args
from spec.config import ConfigError, RunConfig
from spec.validate import validate
from spec.layout import Layout, build_layout
from spec.model_size import count_params

OPTIONS = {"format": ("table", "json"), "top": int, "recommend": bool, "mfu": float, "global_batch": int}
DEFAULTS = {"format": "table", "top": 5, "recommend": False, "mfu": MFU, "global_batch": None}


def parse_plan_args(args: List[str]) -> Tuple[Dict[str, object], List[str]]:
    """Split ``plan.*`` options from the config overrides; ConfigError on a bad one."""
    opts, rest = dict(DEFAULTS), []
    for arg in args:
        if not arg.startswith("plan."):
            rest.append(arg)
            continue
        key, _, value = arg[len("plan."):].partition("=")
        kind = OPTIONS.get(key)
        if kind is None or not value:
            raise ConfigError(f"{arg}: unknown planner option; known: "
                              f"{', '.join(f'plan.{k}=...' for k in OPTIONS)}")
        if isinstance(kind, tuple):
            if value not in kind:
                raise ConfigError(f"{arg}: plan.{key} must be one of {', '.join(kind)}")
            opts[key] = value
        elif kind is bool:
            if value.lower() not in ("true", "false"):
                raise ConfigError(f"{arg}: plan.{key} must be true or false")
            opts[key] = value.lower() == "true"
        else:
            try:
                number = kind(value)
            except ValueError:
                raise ConfigError(f"{arg}: plan.{key} must be a {kind.__name__}") from None
            low = 0 if key == "top" else 1e-9  # top=0 prints no ranking
            if number < low or (key == "mfu" and number > 1):
                raise ConfigError(f"{arg}: plan.{key} must be " + ("0 or more" if key == "top" else "> 0")
                                  + (" and <= 1" if key == "mfu" else ""))
            opts[key] = number
    return opts, rest


def compose_with(composer: PointComposer, overrides: List[str]) -> RunConfig:
    """conf/ + overrides -> RunConfig, composed as ``python -m launcher ... -m`` composes a point."""
    point = composer.point(0, overrides)
    if point.error is not None:
        raise ConfigError(f"cannot compose {' '.join(overrides)!r}: {point.error}")
    return point.cfg


def compose(overrides: List[str]) -> RunConfig:
    """One config (benches and scripts); the planner itself keeps one composer for all points."""
    with standalone(CONF_DIR) as composer:
        return compose_with(composer, overrides)


def plan_one(cfg: RunConfig, mfu: float = MFU) -> Tuple[Layout, Memory, Optional[StepTime]]:
    layout = build_layout(cfg)
    return layout, estimate(cfg, layout), step_time(cfg, layout, mfu)


def to_json(cfg: RunConfig, layout: Layout, mem: Memory, time: Optional[StepTime]) -> Dict[str, object]:
    """One strategy's plan; the first ten keys are a contract with scripts outside the project."""
    out: Dict[str, object] = {
        "strategy": mem.strategy, "params": mem.params, "dp_degree": mem.dp_degree,
        "param_bytes": mem.param_bytes, "grad_bytes": mem.grad_bytes, "optimizer_bytes": mem.optimizer_bytes,
        "activation_bytes": mem.activation_bytes, "total_bytes": mem.total_bytes, "gpu_bytes": mem.gpu_bytes,
        "fits": mem.fits,
        "buffer_bytes": mem.buffer_bytes, "overhead_bytes": mem.overhead_bytes, "init_bytes": mem.init_bytes,
        "cpu_bytes": mem.cpu_bytes, "host_bytes_per_node": mem.host_per_node, "host_limit_bytes": mem.host_limit,
        "host_fits": mem.host_fits, "snapshot_bytes_per_rank": mem.snapshot_bytes,
        "snapshot_bytes_per_node": mem.snapshot_per_node, "state_bytes_per_rank": state_bytes_per_rank(cfg, layout),
        "margin_bytes": mem.margin_bytes, "stage_params": mem.stage_params,
        "shard_degree": mem.shard_degree, "activation_checkpointing": cfg.strategy.activation_checkpointing,
        "activations_by_mode": mem.activations_by_mode, "engine": cfg.strategy.engine,
        "zero_stage": cfg.strategy.zero_stage, "layout": {"pp": layout.pp, "dp_replicate": layout.dp_replicate,
                                                        "dp_shard": layout.dp_shard, "cp": layout.cp, "tp": layout.tp},
        "notes": list(mem.notes),
    }
    if time is not None:
        out.update(step_s=time.step_s, tokens_per_s=time.tokens_per_s, mfu=time.mfu)
    return out


def _fits(mem: Memory) -> str:
    if mem.fits is None:
        return "?"
    if not mem.host_fits and mem.margin_bytes >= 0:  # the GPU's shortfall first, where both fall short
        return "NO (host)"
    return f"yes (+{_gb(mem.margin_bytes)})" if mem.fits else f"NO ({_gb(mem.margin_bytes)})"


def _unit(totals: List[float]) -> Tuple[float, str]:
    """GB, or MB for models whose plan would print only zeros in GB."""
    return (GB, "GB") if max(totals, default=0.0) >= GB else (1e6, "MB")


def header_line(cfg: RunConfig) -> str:
    c, m, t = cfg.cluster, cfg.model, cfg.train
    gpu = f"{c.gpu_mem_gb:g} GB" if c.gpu_mem_gb else "unknown memory"
    slots = "GPUs" if c.accelerator == "gpu" else "CPU ranks"
    return (f"{m.name} ({count_params(m) / 1e6:,.1f} M params) on {c.name}: {c.nodes} node(s) x "
            f"{c.gpus_per_node} {slots} of {gpu}; micro-batch {t.micro_batch_size} x {t.seq_len} tokens, "
            f"grad accum {t.grad_accum}, {'bf16' if compute_bytes(cfg) == 2 else 'fp32'}")


def strategy_table(rows: List[Tuple[str, RunConfig, object]]) -> List[str]:
    unit, label = _unit([r[2][1].total_bytes for r in rows if not isinstance(r[2], ConfigError)])

    def f(x: Optional[float]) -> str:
        return _gb(x, unit)

    lines = [f"memory per GPU in {label}; activations for the configured mode, then {'/'.join(AC_MODES)}",
             f"{'strategy':<15}{'pp':>3}{'dp_r':>5}{'dp_s':>5}{'tp':>3}{'params':>8}{'grads':>7}{'optim':>7}"
             f"{'activ':>7} {'none/other/full':<17}{'buffers':>8}{'overh':>6}{'total':>7}  {'fits (GB)':<14}{'step s':>7}"]
    for name, cfg, res in rows:
        if isinstance(res, ConfigError):
            lines.append(f"{name:<15}n/a: {res}")
            continue
        layout, mem, time = res
        acts = "/".join(f(mem.activations_by_mode[k]) for k in AC_MODES)
        step = f"{time.step_s:.2f}" if time else "-"
        lines.append(f"{name:<15}{layout.pp:>3}{layout.dp_replicate:>5}{layout.dp_shard:>5}{layout.tp:>3}"
                     f"{f(mem.param_bytes):>8}{f(mem.grad_bytes):>7}{f(mem.optimizer_bytes):>7}"
                     f"{f(mem.activation_bytes):>7} {acts:<17}{f(mem.buffer_bytes):>8}"
                     f"{f(mem.overhead_bytes):>6}{f(mem.total_bytes):>7}  {_fits(mem):<14}{step:>7}")
        if mem.cpu_bytes:
            node = mem.cpu_bytes * cfg.cluster.gpus_per_node
            _, source, assumed = host_budget(cfg.cluster)
            source += ": assumed" if assumed else ""
            have = f" of {_gb(mem.host_limit, unit)} {label} ({source})" if mem.host_limit else ""
            lines.append(f"{'':<15}offload: host memory {f(mem.cpu_bytes)} {label} per rank, {f(node)} {label} "
                         f"per node{have}")
        if mem.snapshot_bytes:
            lines.append(f"{'':<15}{snapshot_line(cfg, layout, mem, f, label)}")
        if mem.init_bytes >= mem.total_bytes:  # the start-up peak is the larger one
            lines.append(f"{'':<15}peak at start-up: {'; '.join(mem.notes) or 'model materialised'}")
    if any(cfg.cluster.accelerator == "gpu" for _, cfg, _ in rows):
        lines.append(f"overh: {CUDA_OVERHEAD / GB:g} GB a GPU for the CUDA context, cuBLAS and NCCL + "
                     f"{FRAGMENTATION:.0%} for fragmentation: assumptions, not yet measured on a GPU")
    return lines


def snapshot_line(cfg: RunConfig, layout: Layout, mem: Memory, f, label: str) -> str:
    """The async checkpoint's snapshot in host memory (docs/planner.md, "Host memory per node")."""
    _, source, assumed = host_budget(cfg.cluster)
    have = f" of {f(mem.host_limit)} {label}{f' ({source}: assumed)' if assumed else ''}" if mem.host_limit else ""
    pinned = ", pinned" if cfg.cluster.accelerator == "gpu" else ""
    return (f"async checkpoint snapshot: host memory {f(mem.snapshot_bytes)} {label} per rank "
            f"({f(state_bytes_per_rank(cfg, layout))} {label} of state{pinned}), {f(mem.snapshot_per_node)} {label} "
            f"per node{have}")


def recommend_table(cands: List[Candidate], top: int, cfg: RunConfig, global_batch: int,
                    launch: str = "python -m launcher", reason: str = "") -> List[str]:
    """The ranked layouts; with none, ``reason`` (:func:`nothing_runnable`)."""
    world = cfg.cluster.nodes * cfg.cluster.gpus_per_node
    lines = [f"best layouts for {cfg.cluster.nodes} x {cfg.cluster.name} (global batch {global_batch} sequences "
             f"= {global_batch * cfg.train.seq_len} tokens per step; checkpointing: the cheapest mode that fits)"]
    if not cands:
        return lines + [f"  {reason or nothing_runnable(cfg, global_batch)}"]
    if cands[0].time is None:
        return lines + [f"  no ranking: cluster.peak_tflops_bf16 is null on {cfg.cluster.name}; the cost model "
                        "needs the peak (set cluster.peak_tflops_bf16=TFLOP/s)"]
    cps = any(k.layout.cp > 1 for k in cands[:top])  # a cp column where context parallel is ranked
    lines.append(f"{'#':>3} {'strategy':<14}{'pp':>3}{'dp':>5}" + (f"{'cp':>3}" if cps else "") +
                 f"{'tp':>3}  {'checkpoint':<10}{'GB/GPU':>7}{'step s':>8}{'tok/s/GPU':>10}{'MFU':>6}")
    for i, k in enumerate(cands[:top], 1):
        t = k.time
        step, tps, mfu = (f"{t.step_s:.2f}", f"{t.tokens_per_s / world:.0f}", f"{t.mfu:.0%}") if t else ("-",) * 3
        lines.append(f"{i:>3} {k.cfg.strategy.name:<14}{k.layout.pp:>3}{k.layout.dp:>5}" +
                     (f"{k.layout.cp:>3}" if cps else "") + f"{k.layout.tp:>3}  "
                     f"{k.cfg.strategy.activation_checkpointing:<10}{_gb(k.memory.total_bytes):>7}{step:>8}{tps:>10}"
                     f"{mfu:>6}")
    lines.append(f"#1: {launch} +cluster={cfg.cluster.name} +model={cfg.model.name} "
                 f"cluster.nodes={cfg.cluster.nodes} train.seq_len={cfg.train.seq_len} "
                 f"{cands[0].overrides(cfg.strategy.cp)}")
    return lines


def nothing_runnable(cfg: RunConfig, global_batch: Optional[int] = None, mfu: float = MFU) -> str:
    """Why no layout is recommended (one line, with the fix: the nearest change that runs)."""
    c = cfg.cluster
    if not c.gpu_mem_gb:
        return f"no layout of {cfg.model.name} on {c.name} runs in this version"
    why = (f"cluster.nodes={c.nodes}: no layout of {cfg.model.name} on {c.nodes} x {c.name} both fits "
           f"{c.gpu_mem_gb:g} GB per GPU (and its host memory per node: offload, the async checkpoint snapshot) and "
           f"runs in this version (micro-batch {cfg.train.micro_batch_size} x train.seq_len={cfg.train.seq_len})")
    nearest = nearest_runnable(cfg, global_batch, mfu)
    if nearest is None:
        return (f"{why}; nothing fits up to {NODE_FACTORS[-1]}x the nodes at any micro-batch: use a shorter "
                "train.seq_len or more nodes")
    return f"{why}; the nearest that runs: {change_overrides(cfg, nearest)}"


def plan_point(composer: PointComposer, overrides: List[str], opts: Dict[str, object]):
    """(rows of (name, cfg, plan or ConfigError), base config, global batch, candidates)."""
    given = any(a.lstrip("+").startswith("strategy=") for a in overrides)
    prefix = group_prefix("strategy", overrides)  # a recipe's strategy is overridden without +
    rows = []
    for name in [None] if given else group_options("strategy"):
        cfg = compose_with(composer, overrides if name is None else [f"{prefix}{name}", *overrides])
        validate(cfg)  # field errors are the user's, whatever the strategy: exit 2
        try:
            rows.append((cfg.strategy.name, cfg, plan_one(cfg, float(opts["mfu"]))))
        except ConfigError as exc:
            if given:
                raise
            rows.append((cfg.strategy.name, cfg, exc))
    if all(isinstance(res, ConfigError) for _, _, res in rows):  # no preset plans here: the cluster's fault
        raise rows[0][2]
    base = rows[0][1]
    batch = int(opts["global_batch"] or base.train.micro_batch_size * base.train.grad_accum
                * base.cluster.nodes * base.cluster.gpus_per_node // max(1, base.strategy.cp))  # cp: shared sequences
    return rows, base, batch, candidates(base, batch, float(opts["mfu"])) if ranking_wanted(opts) else []


def ranking_wanted(opts: Dict[str, object]) -> bool:
    """Whether the layouts are ranked: ``plan.top`` > 0 in either format (so that where
    nothing fits and runs both exit 1), or JSON's ``plan.recommend=true``."""
    return bool(opts["top"]) or (opts["format"] == "json" and bool(opts["recommend"]))


def with_config_dirs(args: List[str]) -> Tuple[List[str], str]:
    """``--config-dir DIR`` (as ``python -m launcher`` takes it) as Hydra's
    ``hydra.searchpath`` override; and the launch command the #1 line prints, with the same
    directories. ConfigError when both are given."""
    overrides, dirs = split_args(args)
    if not dirs:
        return args, "python -m launcher"
    if any(a.startswith("hydra.searchpath=") for a in overrides):
        raise ConfigError("--config-dir with hydra.searchpath=...: give one of them (hydra.searchpath=[file://DIR,...] "
                          "takes several directories)")
    paths = [str(d.resolve()) for d in dirs]
    search = f"hydra.searchpath=[{','.join('file://' + p for p in paths)}]"
    return [*overrides, search], " ".join(["python -m launcher", *(f"--config-dir {p}" for p in paths)])


def run(args: List[str]) -> int:
    opts, rest = parse_plan_args(args)
    multirun = any(a in ("-m", "--multirun") for a in rest)
    rest = [a for a in rest if a not in ("-m", "--multirun")]
    rest, opts["launch"] = with_config_dirs(rest)
    check_overrides(rest, multirun)
    points = expand(rest) if multirun else [rest]
    out: List[Dict[str, object]] = []
    failed: List[str] = []  # points where nothing fits and runs: their reason
    with standalone(CONF_DIR) as composer:
        for i, point in enumerate(points):
            out += _plan_and_print(composer, i, point, opts, multirun, failed)
    if opts["format"] == "json":
        print(json.dumps(out, indent=1))
    for reason in failed:
        print(f"error: {reason}", file=sys.stderr)
    return 1 if failed else 0


def _plan_and_print(composer: PointComposer, i: int, point: List[str], opts: Dict[str, object],
                    multirun: bool, failed: List[str]) -> List[Dict[str, object]]:
    """Print one point's tables (text format), or return its JSON rows (json format); a point
    whose recommendations were asked for and where nothing fits and runs adds its reason
    to ``failed`` (and, in JSON, an object {"error": reason})."""
    rows, base, batch, cands = plan_point(composer, point, opts)
    tag = {"point": " ".join(point)} if multirun else {}
    reason = nothing_runnable(base, batch, float(opts["mfu"])) if ranking_wanted(opts) and not cands else ""
    if reason:
        failed.append(reason + (f" ({' '.join(point)})" if multirun else ""))
    if opts["format"] == "json":
        if opts["recommend"]:
            if not cands:
                return [{"error": reason} | tag]
            return [to_json(k.cfg, k.layout, k.memory, k.time) | {"overrides": k.overrides()} | tag
                    for k in cands[:int(opts["top"])]]
        for name, _, res in rows:
            if isinstance(res, ConfigError):
                print(f"skipped strategy {name}: {res}", file=sys.stderr)
        return [to_json(cfg, *res) | tag for _, cfg, res in rows if not isinstance(res, ConfigError)]
    if multirun:
        print(f"{chr(10) if i else ''}== {' '.join(point)}")
    print(header_line(base))
    print("\n".join(strategy_table(rows)))
    if opts["top"]:
        print()
        print("\n".join(recommend_table(cands, int(opts["top"]), base, batch, str(opts["launch"]), reason)))
    return []


def main() -> None:
    if any(a in ("-h", "--help") for a in sys.argv[1:]):
        print(__doc__.strip())
        print(f"\ngroups: cluster={','.join(group_options('cluster'))}  model={','.join(group_options('model'))}  "
              f"strategy={','.join(group_options('strategy'))}")
        sys.exit(0)
    try:
        code = run(sys.argv[1:])
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)
    sys.exit(code)
