"""The rules a composed config must pass before anything is submitted (and again in the
job, which loads the same config): choices, positive numbers and ranges, strings safe to
put in an sbatch script or a shell line, and the cross-field checks. Every failure is one
:class:`~spec.config.ConfigError` line naming the field, the value and the fix.
"""
from __future__ import annotations

import dataclasses
import functools
import re
from typing import Any

from spec.ac_modes import NAMES
from spec.config import ConfigError, RunConfig
from spec.float8 import check_float8
from spec.model_size import check_model
from spec.peft import check_peft
from spec.schedule import check_length

_CHOICES = {
    "fault.hang_in": ("step", "save"),
    "cluster.backend": ("local", "slurm"),
    "cluster.accelerator": ("cpu", "gpu"),
    "cluster.gpu_binding": ("node", "task"), "cluster.allocation": ("never", "auto"),
    "cluster.cpu_bind": ("gpu", "none"),
    "strategy.engine": ("torch", "deepspeed"),
    "strategy.data_parallel": ("ddp", "fsdp", "none"),
    "strategy.mixed_precision": ("auto", "fp32", "bf16"),
    "strategy.activation_checkpointing": NAMES,
    "strategy.pp_schedule": ("gpipe", "1f1b", "interleaved_1f1b"),
    "data.source": ("markov", "file", "tokens", "chat"),
    "tracking.wandb.mode": ("offline", "online", "disabled"),
    "optim.lr_scaling": ("none", "linear", "sqrt"),
    "train.straggler_action": ("log", "restart_without"),
}

_POSITIVE = (
    "cluster.nodes", "cluster.gpus_per_node", "cluster.time_min",
    "model.dim", "model.n_layers", "model.n_heads", "model.vocab_size", "model.max_seq_len",
    "model.multiple_of", "train.steps", "train.micro_batch_size", "train.seq_len", "train.grad_accum",
    "train.log_every", "train.dist_timeout_s", "train.straggler_steps", "strategy.pp_microbatches", "data.num_tokens",
    "data.branching", "checkpoint.keep", "profile.active",
)

# Must be >= 0: 0 means "off" / "none" where the field's comment says so; null is skipped.
_NON_NEGATIVE = (
    "cluster.signal_delay_s", "cluster.max_requeues", "cluster.in_job_restarts", "cluster.spare_nodes",
    "cluster.hang_timeout_s", "cluster.nvlink_domain",
    "cluster.mem_gb", "cluster.cpus_per_task", "checkpoint.every_steps", "checkpoint.every_minutes",
    "checkpoint.save_timeout_s",
    "optim.lr", "optim.warmup_steps", "optim.weight_decay", "optim.grad_clip", "data.seed", "fault.step_delay_s", "fault.kill_in_save_at_step",
    "fault.hang_at_step", "fault.hang_s", "fault.raise_at_step", "fault.raise_every_steps", "fault.slow_async_save_s", "train.gc_every_steps",
    "fault.slow_save_s", "fault.slow_save_at_step",
    "launcher.max_parallel", "train.straggler_min_s", "fault.oom_at_step", "profile.every",
    "train.epochs", "model.loss_chunk_tokens",
)

# Must be > 0 (and finite): a zero or negative value is meaningless or divides by zero.
# (optim.lr may be 0, as torch allows: a frozen-weights check or an evaluation run.)
_POSITIVE_REAL = ("optim.eps", "model.norm_eps", "model.rope_theta", "model.ffn_dim_multiplier")

# null = unknown / derived; otherwise > 0.
_OPTIONAL_POSITIVE = ("cluster.peak_tflops_bf16", "cluster.gpu_mem_gb", "cluster.intra_node_gbps",
                      "cluster.inter_node_gbps", "cluster.cpus_per_node", "cluster.node_mem_gb", "model.n_kv_heads",
                      "cluster.fs_write_gbps", "cluster.fs_read_gbps", "cluster.fs_total_write_gbps",
                      "cluster.fs_total_read_gbps", "cluster.checkpoint_quota_gb", "cluster.failures_per_node_hour",
                      "cluster.gpu_capability")

# field: (low, high, high included)
_RANGES = {
    "optim.beta1": (0.0, 1.0, False),
    "optim.beta2": (0.0, 1.0, False),
    "optim.min_lr_ratio": (0.0, 1.0, True),
    "train.straggler_score": (0.0, 1.0, False),
}

# Characters that end a line of the sbatch script (C0/C1 controls: newline, CR, tab, ...,
# and Unicode line/paragraph separators); none is ever sensible in a name or a path.
_CONTROL = frozenset(map(chr, [*range(0x20), *range(0x7F, 0xA0), 0x2028, 0x2029]))
_CONTROL_RE = re.compile("[" + "".join(sorted(re.escape(ch) for ch in _CONTROL)) + "]")

# Shell lines by design (each item may hold several lines): not checked, see validate().
_SHELL_FIELDS = ("cluster.setup",)

# Fields written into `#SBATCH --flag=VALUE` lines (model and strategy name the default job
# name). sbatch's own parser of those lines treats a backslash as an escape even inside
# quotes, so the value Slurm sees would differ from the one configured.
_SBATCH_FIELDS = ("launcher.job_name", "model.name", "strategy.name", "cluster.partition", "cluster.account",
                  "cluster.qos", "cluster.constraint", "cluster.exclude")

# Directories the job's log paths (--output/--error) are made under: Slurm expands %j, %t,
# ... there, and a backslash turns that expansion off, so the logs would land elsewhere.
_LOG_DIR_FIELDS = ("launcher.root", "launcher.run_dir")

# Slurm host lists, e.g. "node[1-3,7],gpu12".
_HOSTLIST_FIELDS = ("cluster.exclude",)
_HOSTLIST_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_.,[]")

# sbatch options the toolkit sets itself (from these fields): not settable through
# cluster.sbatch_extra / cluster.srun_args, which would contradict them.
OWNED_SBATCH = {
    "nodes": "cluster.nodes", "ntasks": "cluster.nodes and cluster.gpus_per_node",
    "ntasks-per-node": "cluster.gpus_per_node", "gpus-per-node": "cluster.gpus_per_node",
    "gpus": "cluster.gpus_per_node", "gpus-per-task": "cluster.gpu_binding=task",
    "gpu-bind": "cluster.gpu_binding (node: every task sees the node's GPUs; task: each its own)",
    "cpus-per-task": "cluster.cpus_per_task", "cpus-per-gpu": "cluster.cpus_per_task", "time": "cluster.time_min", "signal": "cluster.signal_delay_s",
    "requeue": "cluster.max_requeues", "no-requeue": "cluster.max_requeues=0",
    "output": "launcher.run_dir (logs go to RUN_DIR/slurm)", "error": "launcher.run_dir (logs go to RUN_DIR/slurm)",
    "open-mode": "launcher.run_dir (logs are appended)", "job-name": "launcher.job_name",
    "partition": "cluster.partition", "account": "cluster.account", "qos": "cluster.qos",
    "constraint": "cluster.constraint", "exclude": "cluster.exclude", "mem": "cluster.mem_gb",
    "array": "a sweep (-m), whose identical points become one job array",
    "container-image": "cluster.container_image", "container-mounts": "cluster.container_mounts",
    "container-workdir": "cluster.container_workdir",
    "container-name": "cluster.container_image (the container's name follows the image)",
    "kill-on-bad-exit": "nothing: a task that dies ends the step at once, and the step loop restarts it "
                        "(cluster.in_job_restarts)",
}
_SHORT = {"N": "nodes", "n": "ntasks", "c": "cpus-per-task", "t": "time", "o": "output", "e": "error",
          "J": "job-name", "p": "partition", "A": "account", "q": "qos", "C": "constraint", "x": "exclude",
          "u": "unbuffered", "K": "kill-on-bad-exit", "m": "distribution"}
# srun(1) --distribution's first parts that number ranks otherwise than node by node (block):
# the layout keeps tensor parallel groups inside a node; each task's rank is SLURM_PROCID.
_NOT_BLOCK = ("cyclic", "plane", "arbitrary")
_OPTION_NAME = re.compile(r"^[a-z][a-z0-9]*(?:[-_][a-z0-9]+)*$")

# The hang watchdog checks once a second and, once it fires, waits 3 s for every rank to
# dump its stack (train/harness/watchdog.py): it needs this much before the collective timeout.
WATCHDOG_GRACE_S = 5


def _get(cfg: RunConfig, dotted: str) -> Any:
    obj: Any = cfg
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj


def _finite(value: float) -> bool:
    return value == value and abs(value) != float("inf")  # NaN != NaN


@functools.lru_cache(maxsize=None)
def field_names(cls: type) -> tuple:
    """A dataclass's field names (cached: the planner validates thousands of configs)."""
    return tuple(f.name for f in dataclasses.fields(cls))


def _strings(obj: Any, prefix: str):
    """(dotted field, value) of every string in the config, env values included. (The
    planner validates every layout it weighs: thousands of configs for one refusal.)"""
    for name in field_names(type(obj)):
        key, value = prefix + name, getattr(obj, name)
        if hasattr(value, "__dataclass_fields__"):
            yield from _strings(value, key + ".")
        elif key in _SHELL_FIELDS:
            continue
        elif isinstance(value, str):
            yield key, value
        elif isinstance(value, dict):
            yield from ((f"{key}.{k}", v) for k, v in value.items() if isinstance(v, str))
        elif isinstance(value, (list, tuple)):
            yield from ((f"{key}[{i}]", v) for i, v in enumerate(value) if isinstance(v, str))


def check_strings(cfg: RunConfig) -> None:
    for name in cfg.cluster.env:
        if not (isinstance(name, str) and name.isascii() and name.isidentifier()):
            raise ConfigError(f"cluster.env has the variable name {name!r}, which is not a shell identifier; "
                              "use letters, digits and _ only, not starting with a digit (e.g. NCCL_DEBUG)")
    for key, value in _strings(cfg, ""):
        found = _CONTROL_RE.search(value)
        if found is not None:
            bad = found.group()
            raise ConfigError(f"{key}={value!r} contains the control character {bad!r}, which would split a "
                              "line of the sbatch script; remove it")
    for key in _SBATCH_FIELDS:
        value = _get(cfg, key)
        if value and "\\" in value:
            raise ConfigError(f"{key}={value!r} contains a backslash, which sbatch's #SBATCH parser drops "
                              "(it escapes the next character); remove it")
    for key in _LOG_DIR_FIELDS:
        value = _get(cfg, key)
        bad = next((ch for ch in value or "" if ch in "%\\"), None)
        if bad is not None:
            raise ConfigError(f"{key}={value!r} contains {bad!r}: Slurm expands %j, %t, ... in the job's log "
                              "paths under it (a backslash turns that off), so the logs would land elsewhere; "
                              "pick a directory without % or \\")
    for key in _HOSTLIST_FIELDS:
        value = _get(cfg, key)
        if value and not set(value) <= _HOSTLIST_CHARS:
            raise ConfigError(f"{key}={value!r} is not a Slurm host list (letters, digits, - _ . , [ ] only); "
                              f"write it like {key}='node[3-4],gpu7'")


def _check_numbers(cfg: RunConfig) -> None:
    for key in _POSITIVE:
        value = _get(cfg, key)
        if value < 1:
            raise ConfigError(f"{key}={value} must be >= 1; set {key}=1 or more")
    for key in _NON_NEGATIVE:
        value = _get(cfg, key)
        if value is not None and not (_finite(value) and value >= 0):
            raise ConfigError(f"{key}={value} must be >= 0; set e.g. {key}={_get(RunConfig(), key) or 0}")
    for key in _POSITIVE_REAL:
        value = _get(cfg, key)
        if not (_finite(value) and value > 0):
            raise ConfigError(f"{key}={value} must be a positive number; set e.g. {key}={_get(RunConfig(), key)}")
    for key in _OPTIONAL_POSITIVE:
        value = _get(cfg, key)
        if value is not None and not (_finite(value) and value > 0):
            raise ConfigError(f"{key}={value} must be > 0 or null; set a positive value or {key}=null")
    for key, (low, high, closed) in _RANGES.items():
        value = _get(cfg, key)
        if not (_finite(value) and low <= value and (value <= high if closed else value < high)):
            interval = f"[{low}, {high}{']' if closed else ')'}"
            raise ConfigError(f"{key}={value} must be in {interval}; set e.g. {key}={_get(RunConfig(), key)}")
    for key, allowed in _CHOICES.items():
        value = _get(cfg, key)
        if value not in allowed:
            raise ConfigError(f"{key}={value!r} is not one of {', '.join(allowed)}; pick one of them")
    hang, dist = cfg.cluster.hang_timeout_s, cfg.train.dist_timeout_s
    if hang > 0 and hang + WATCHDOG_GRACE_S > dist:
        raise ConfigError(f"cluster.hang_timeout_s={hang} must be at most train.dist_timeout_s - "
                          f"{WATCHDOG_GRACE_S} = {dist - WATCHDOG_GRACE_S}: the collective timeout "
                          f"(train.dist_timeout_s={dist}) would abort the job before the hang watchdog names the "
                          f"stuck ranks (it needs ~{WATCHDOG_GRACE_S} s to dump every rank's stack); lower "
                          "cluster.hang_timeout_s (0 disables it) or raise train.dist_timeout_s")


def _check_slurm_options(cfg: RunConfig) -> None:
    """cluster.sbatch_extra / srun_args / container_*: passed through, shell-quoted, but
    never an option the toolkit sets itself, and nothing sbatch's parser would change."""
    c = cfg.cluster
    for key, value in c.sbatch_extra.items():
        name = str(key).replace("_", "-")
        if not _OPTION_NAME.match(str(key)):
            raise ConfigError(f"cluster.sbatch_extra has the key {key!r}, which is not an sbatch long option name; "
                              "write it without dashes, e.g. cluster.sbatch_extra.mail-type=END")
        if name in OWNED_SBATCH:
            raise ConfigError(f"cluster.sbatch_extra.{key}={value!r}: the toolkit sets --{name} itself; "
                              f"use {OWNED_SBATCH[name]} instead")
        if value is None or value is False or isinstance(value, (dict, list)):
            raise ConfigError(f"cluster.sbatch_extra.{key}={value!r} is not an option value; give a string or "
                              f"number, true for a flag without value, or remove the key")
        if "\\" in str(value):
            raise ConfigError(f"cluster.sbatch_extra.{key}={value!r} contains a backslash, which sbatch's #SBATCH "
                              "parser drops (it escapes the next character); remove it")
    for i, arg in enumerate(c.srun_args):
        if not arg.startswith("-"):
            raise ConfigError(f"cluster.srun_args[{i}]={arg!r} is not an option (srun's arguments before the "
                              "command); write it as --option=value")
        name = arg[2:].split("=", 1)[0] if arg.startswith("--") else _SHORT.get(arg[1:2], "")
        if name in OWNED_SBATCH or name == "unbuffered":
            use = OWNED_SBATCH.get(name, "nothing: the toolkit sets it")
            raise ConfigError(f"cluster.srun_args[{i}]={arg!r}: the toolkit sets --{name} itself; use {use} instead")
        if name == "distribution" and not c.agent():  # node agents number their ranks themselves
            check_distribution(f"cluster.srun_args[{i}]", arg, arg.partition("=")[2] if arg.startswith("--")
                               else arg[2:].lstrip("="))
    for i, mount in enumerate(c.container_mounts):
        if "," in mount or not mount:
            raise ConfigError(f"cluster.container_mounts[{i}]={mount!r}: one mount per item, SRC:DST[:FLAGS] "
                              "without commas")
    _check_python(cfg)


def check_distribution(key: str, given: str, value: str) -> None:
    """srun's ``--distribution`` ``value`` (``key`` gives it as ``given``): block only (srun's default)."""
    first = value.split(":", 1)[0].split(",", 1)[0].split("=", 1)[0].strip().lower()
    if first in _NOT_BLOCK:
        raise ConfigError(f"{key}={given!r}: {first} distribution numbers ranks across nodes, but the layout needs "
                          "them node by node (SLURM_PROCID = SLURM_NODEID x tasks per node + SLURM_LOCALID: tensor "
                          "parallel groups inside a node, one srun task a rank with cluster.gpu_binding=task); "
                          "remove it, use --distribution=block, or cluster.gpu_binding=node (node agents)")


def _check_python(cfg: RunConfig) -> None:
    """cluster.python: a Slurm job's, an absolute path or a command the tasks' PATH finds."""
    python = cfg.cluster.python
    if python is None:
        return
    if cfg.cluster.backend != "slurm":
        raise ConfigError(f"cluster.python={python!r} is the interpreter of a Slurm job's tasks, but "
                          f"cluster.backend={cfg.cluster.backend} runs them with the launcher's own; remove it")
    if not python.strip() or python != python.strip() or ("/" in python and not python.startswith("/")):
        raise ConfigError(f"cluster.python={python!r} is not an interpreter every task finds alike; give an absolute "
                          "path (/opt/conda/bin/python) or a command on the tasks' PATH (python3), or null")


def _check_resources(cfg: RunConfig) -> None:
    """What a node is asked for (CPUs, memory) against what it has (cluster.cpus_per_node,
    node_mem_gb): Slurm refuses such a job, or holds it pending for ever."""
    c = cfg.cluster
    if c.cpus_per_task == 0 and not c.cpus_per_node:
        raise ConfigError("cluster.cpus_per_task=0 derives each task's CPUs from cluster.cpus_per_node, which is null; "
                          "set cluster.cpus_per_node to the CPUs Slurm schedules on one node (scontrol show node: "
                          "CPUTot) or cluster.cpus_per_task>=1")
    if c.cpus_per_node:
        n, g, per_task = c.cpus_per_node, c.gpus_per_node, c.task_cpus()
        if per_task < 1:
            raise ConfigError(f"cluster.cpus_per_node={n} leaves no whole CPU to each of the cluster.gpus_per_node={g} "
                              f"tasks of a node (cluster.cpus_per_task=0 derives {n} // {g} = 0); set "
                              f"cluster.cpus_per_node>={g} or run fewer tasks per node")
        if per_task * g > n:
            raise ConfigError(f"cluster.cpus_per_task={per_task} x cluster.gpus_per_node={g} = {per_task * g} CPUs per "
                              f"node exceeds cluster.cpus_per_node={n}, which Slurm would refuse or hold pending; use "
                              f"cluster.cpus_per_task<={n // g}, or cluster.cpus_per_task=0 to derive it")
    if c.mem_gb and c.node_mem_gb and c.mem_gb > c.node_mem_gb:
        raise ConfigError(f"cluster.mem_gb={c.mem_gb} exceeds cluster.node_mem_gb={c.node_mem_gb}, the memory of one "
                          f"node; use cluster.mem_gb<={c.node_mem_gb}, or cluster.mem_gb=0 for all of each node's")
    if c.spare_nodes > 0 and c.backend != "slurm":
        raise ConfigError(f"cluster.spare_nodes={c.spare_nodes} with cluster.backend={c.backend}: spare nodes are "
                          "asked of Slurm; use a Slurm cluster profile or cluster.spare_nodes=0")
    if c.spare_nodes > 0 and c.in_job_restarts < 1:
        raise ConfigError(f"cluster.spare_nodes={c.spare_nodes} with cluster.in_job_restarts=0: a spare takes a "
                          "dead node's place at an in-job restart; set cluster.in_job_restarts>=1 or "
                          "cluster.spare_nodes=0")
    for key in c.sbatch_extra:
        name = str(key).replace("_", "-")
        if name in ("mem-per-cpu", "mem-per-gpu") and c.mem_gb is not None:
            raise ConfigError(f"cluster.sbatch_extra.{key} with cluster.mem_gb={c.mem_gb}: sbatch takes one of --mem "
                              f"and --{name} (mutually exclusive); set cluster.mem_gb=null to use --{name}, or remove "
                              f"cluster.sbatch_extra.{key}")


def _check_profile(cfg: RunConfig) -> None:
    """profile.*: a window of two 1-based steps in order, windows that do not overlap,
    ranks of the job."""
    p, c = cfg.profile, cfg.cluster
    if p.steps is not None:
        steps = list(p.steps)
        if len(steps) != 2:
            raise ConfigError(f"profile.steps={steps} must be [START, END], two optimizer steps (1-based, both "
                              "profiled); write e.g. profile.steps=[2,3], or null for none")
        if steps[0] < 1:
            raise ConfigError(f"profile.steps={steps} starts at {steps[0]}, but steps count from 1; "
                              f"write e.g. profile.steps=[1,{max(1, steps[1])}]")
        if steps[0] > steps[1]:
            raise ConfigError(f"profile.steps={steps}: START {steps[0]} is after END {steps[1]}; "
                              f"write profile.steps=[{steps[1]},{steps[0]}]")
    if p.every > 0 and p.active > p.every:
        raise ConfigError(f"profile.active={p.active} exceeds profile.every={p.every}: its windows would overlap; "
                          f"set profile.active<={p.every} or a larger profile.every")
    if p.ranks is not None:
        world = c.nodes * c.gpus_per_node
        bad = [r for r in p.ranks if not 0 <= r < world]
        if bad or not p.ranks:
            raise ConfigError(f"profile.ranks={list(p.ranks)} " + (f"names rank {bad[0]}, outside" if bad else
                              "names no rank of") + f" the job's {world} (cluster.nodes={c.nodes} x "
                              f"cluster.gpus_per_node={c.gpus_per_node}); list ranks from 0 to {world - 1}, or "
                              "null for local rank 0 of each node")


def validate(cfg: RunConfig, strings: bool = True) -> None:
    """Check field values that do not depend on the layout; raise ConfigError (one line:
    field, value, fix).

    Strings: every string field (env values included) is refused if it holds a control
    character (newline, CR, tab, ...): one in a value written into the sbatch script would
    start a new line there, e.g. an injected ``#SBATCH`` directive. ``cluster.env`` keys
    must be shell identifiers; fields written into ``#SBATCH`` lines may not hold a
    backslash (sbatch's parser drops it); ``launcher.root``/``launcher.run_dir`` may not
    hold ``%`` or a backslash (Slurm's log path patterns); ``cluster.exclude`` is a host
    list. Everything else (spaces, quotes, ``$()``, ``;``, unicode) is allowed: the
    renderer shell-quotes it. ``cluster.setup`` is NOT checked: its items are shell lines
    by design, run as written before srun (an item may hold several lines); whoever writes
    the config runs them, so quote inside them yourself. ``strings=False`` leaves the strings
    out: the planner checks them once for the thousands of layouts it weighs, whose strings
    are the user's config's or its own presets' (launcher/plan/costmodel.py).
    """
    if strings:
        check_strings(cfg)
    _check_numbers(cfg)
    _check_slurm_options(cfg)
    _check_resources(cfg)
    _check_profile(cfg)
    check_length(cfg)
    check_model(cfg.model)
    check_peft(cfg)
    check_float8(cfg)
    m = cfg.model
    if cfg.train.seq_len > m.max_seq_len:
        raise ConfigError(f"train.seq_len={cfg.train.seq_len} exceeds model.max_seq_len={m.max_seq_len}; "
                          f"use train.seq_len<={m.max_seq_len}")
    if cfg.optim.lr_scaling != "none" and not (cfg.optim.base_global_batch or 0) > 0:
        raise ConfigError(f"optim.lr_scaling={cfg.optim.lr_scaling} needs optim.base_global_batch (the global batch "
                          f"in sequences that optim.lr was tuned for), got {cfg.optim.base_global_batch}; set it, "
                          "e.g. optim.base_global_batch=256")
    if cfg.data.source == "file" and not cfg.data.path:
        raise ConfigError(f"data.source=file needs a token file but data.path={cfg.data.path!r}; "
                          "set data.path=PATH to a binary token file")
