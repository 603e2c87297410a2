"""What ``python -m launcher.resume`` (:mod:`launcher.relaunch`) may change of a run's
saved config, and how: the nodes it excludes after failures, the overrides it applies,
the changes a checkpoint cannot continue (refused with one line), the global batch kept
across a data-parallel change, the record of a reshape in run.json, and the universal
conversion a DeepSpeed checkpoint needs first. Decides; starts nothing.
"""
from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any, List, Optional, Tuple

from launcher.overrides import CONF_DIR, check_key, group_options
from slurm.env import expand_hostlist
from spec.config import GROUPS, ConfigError, RunConfig, to_run_config, to_yaml
from spec.layout import build_layout
from spec.rundir import (CONFIG, EXCLUDING_FAILURES, latest_checkpoint, needs_universal, read_run_json, run_shape,
                         shape_line, update_run_json)


# What the checkpoint holds or the data position means: never changed by a resume.
FIXED_SECTIONS = {"model": "model (its parameters are the checkpoint's)",
                  "data": "data stream (the position is a sample index in it)"}
MOVABLE = {"data.cache_dir"}  # where the generated data is cached: the same stream anywhere
FIXED_FIELDS = {"train.seq_len": "the samples are windows of seq_len tokens",
                "entrypoint": "the run's code", "entrypoint_args": "the run's code",
                "launcher.run_dir": "the run's directory", "launcher.root": "the run's directory"}


def exclude_failed_nodes(cfg, run_dir: Path) -> None:
    """After a node failure, a failed preflight or a node's hardware fault, keep the suspect
    nodes out of the next allocation (with those an automatic requeue excluded before)."""
    info = read_run_json(run_dir)
    reason = EXCLUDING_FAILURES.get(info.get("failure"))
    if reason is None or cfg.cluster.backend != "slurm":
        return
    bad = set(info.get("suspect_nodes", []))
    if not bad:
        return
    current = set(expand_hostlist(cfg.cluster.exclude)) if cfg.cluster.exclude else set()
    current |= set(info.get("excluded_nodes") or [])
    cfg.cluster.exclude = ",".join(sorted(current | bad))
    (run_dir / CONFIG).write_text(to_yaml(cfg))
    update_run_json(run_dir, excluded_nodes=sorted(current | bad))
    print(f"excluding {', '.join(sorted(bad))} ({reason} in the last segment)")


def apply_overrides(cfg: RunConfig, overrides: List[str]) -> RunConfig:
    """``cfg`` with Hydra-style ``key=value`` overrides applied (``strategy=NAME``: that
    profile of conf/ over the saved section); a ConfigError names a bad one."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    try:
        parsed = OverridesParser.create().parse_overrides(overrides=overrides)
    except HydraException as exc:
        raise ConfigError(f"cannot parse overrides {' '.join(overrides)!r}: {str(exc).splitlines()[0]}") from None
    conf = OmegaConf.structured(cfg)
    for o in parsed:
        key, text = o.key_or_group.lstrip("+"), o.input_line or o.key_or_group
        if o.is_sweep_override() or o.is_delete():
            raise ConfigError(f"{text}: a resume takes one value per field (no sweep, no deletion); "
                              f"give key=value")
        try:
            if key in GROUPS:
                name = o.get_value_element_as_str()
                if name not in group_options(key):
                    raise ConfigError(f"{text}: unknown {key} {name!r}; options: {', '.join(group_options(key))}")
                # strategy=NAME is that profile as `+strategy=NAME` composes it (over the schema's
                # defaults: zero3_offload -> zero2 leaves no offload behind); cluster=NAME goes over
                # the saved section, which keeps what the run learnt of its nodes (cluster.exclude).
                base = OmegaConf.structured(type(getattr(cfg, key))()) if key == "strategy" else conf[key]
                conf[key] = OmegaConf.merge(base, OmegaConf.load(CONF_DIR / key / f"{name}.yaml"))
            else:
                check_key(key)
                OmegaConf.update(conf, key, o.value(), merge=True)
        except OmegaConfBaseException as exc:
            raise ConfigError(f"{text}: {str(exc).splitlines()[0]}; give a value of the field's type") from None
    return to_run_config(conf)


def _value(cfg: RunConfig, dotted: str) -> Any:
    value: Any = cfg
    for part in dotted.split("."):
        value = getattr(value, part)
    return value


def refuse_unresumable(old: RunConfig, new: RunConfig) -> None:
    """A ConfigError for a change the checkpoint cannot be resumed with."""
    for section, what in FIXED_SECTIONS.items():
        a, b = dataclasses.asdict(getattr(old, section)), dataclasses.asdict(getattr(new, section))
        for key in a:
            if a[key] != b[key] and f"{section}.{key}" not in MOVABLE:
                raise ConfigError(f"{section}.{key}={b[key]}: a resume keeps the saved run's {what}, "
                                  f"{section}.{key}={a[key]}; keep it, or start a new run (launcher.run_dir=NEW_DIR)")
    for key, why in FIXED_FIELDS.items():
        if _value(old, key) != _value(new, key):
            raise ConfigError(f"{key}={_value(new, key)}: a resume keeps {key}={_value(old, key)} ({why}); "
                              "keep it, or start a new run (launcher.run_dir=NEW_DIR)")
    s, t = old.strategy, new.strategy
    if s.engine != t.engine:
        raise ConfigError(f"strategy.engine={t.engine} (strategy={t.name}): the checkpoint was saved by the "
                          f"{s.engine} engine (strategy={s.name}) and does not load in the other; pick a strategy "
                          f"of the {s.engine} engine, or start a new run")
    if s.engine == "deepspeed" and (s.zero_stage == 0) != (t.zero_stage == 0):
        raise ConfigError(f"strategy.zero_stage={t.zero_stage}: a stage-0 checkpoint (no ZeRO partitions) and a "
                          f"ZeRO one do not convert into each other (saved: stage {s.zero_stage}); keep the stage")
    lo, ln = build_layout(old), build_layout(new)
    if old.entrypoint and (run_shape(old, lo) != run_shape(new, ln)):
        raise ConfigError(f"entrypoint={old.entrypoint}: a user's code restores its own checkpoints; the launcher "
                          "reshapes only the built-in trainer's runs; resume it on its own shape")


def keep_global_batch(old: RunConfig, new: RunConfig, given: List[str]) -> Optional[str]:
    """When the data-parallel degree changed and the batch fields were not given: the same
    global batch, the new per-rank share split into micro-batch x accumulation (the
    largest micro-batch up to the saved one that divides it). A note of what changed."""
    dp_old, dp_new = build_layout(old).dp, build_layout(new).dp
    if dp_old == dp_new or any(k in given for k in ("train.micro_batch_size", "train.grad_accum")):
        return None
    t = old.train
    batch = t.micro_batch_size * t.grad_accum * dp_old
    if batch % dp_new:
        raise ConfigError(f"cluster.nodes={new.cluster.nodes} x cluster.gpus_per_node={new.cluster.gpus_per_node}: "
                          f"data-parallel degree {dp_new} does not divide the global batch of {batch} sequences; "
                          "pick a shape whose degree divides it, or set train.micro_batch_size and train.grad_accum "
                          "(a new global batch)")
    share = batch // dp_new
    micro = max(d for d in range(1, min(share, t.micro_batch_size) + 1) if share % d == 0)
    new.train.micro_batch_size, new.train.grad_accum = micro, share // micro
    return (f"global batch kept at {batch} sequences: dp {dp_old} -> {dp_new}, train.micro_batch_size "
            f"{t.micro_batch_size} -> {micro}, train.grad_accum {t.grad_accum} -> {share // micro}")


def reshape(cfg: RunConfig, overrides: List[str]) -> Tuple[RunConfig, List[str]]:
    """The saved config with ``overrides`` applied and checked for a resume; notes to print."""
    new = apply_overrides(cfg, overrides)
    refuse_unresumable(cfg, new)
    given = [o.split("=", 1)[0].lstrip("+") for o in overrides]
    note = keep_global_batch(cfg, new, given)
    return new, [note] if note else []


def record_reshape(run_dir: Path, old: RunConfig, new: RunConfig, overrides: List[str]) -> None:
    """run.json ``reshaped`` (a list: one entry per resume on another shape) and the new config.yaml."""
    before, after = run_shape(old, build_layout(old)), run_shape(new, build_layout(new))
    (run_dir / CONFIG).write_text(to_yaml(new))
    if before == after:
        return
    saved = latest_checkpoint(run_dir)
    at_step = saved["step"] if saved else 0
    entry = {"from": before, "to": after, "at_step": at_step, "overrides": overrides, "time": time.time()}
    update_run_json(run_dir, reshaped=read_run_json(run_dir).get("reshaped", []) + [entry])
    where = f"the checkpoint of step {at_step}" if saved else "step 0 (no committed checkpoint)"
    print(f"reshaped: {shape_line(before)} -> {shape_line(after)}; resuming from {where}")


def conversion_stage(run_dir: Path, new: RunConfig) -> Optional[int]:
    """The ZeRO stage to convert the newest checkpoint for before the job (it was saved at
    another data-parallel size or stage: DeepSpeed's universal format), else None."""
    saved = latest_checkpoint(run_dir)
    if saved and needs_universal(saved.get("shape"), run_shape(new, build_layout(new))):
        return new.strategy.zero_stage
    return None
