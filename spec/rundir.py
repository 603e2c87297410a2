"""The run directory's contract: its file names, ``run.json`` and ``metrics.jsonl``.

Pure standard library; written by the launcher (submission) and by rank 0 of the job,
read by the trackers. ``run.json`` fields relied on outside the project: job_id, status,
strategy, nodes, world_size, hostnames (plus segments, run_dir, times). Writes are atomic
(temp file + rename) so a reader never sees half a file. :class:`Status` holds every
status the project writes; :class:`MetricsRow` is the one writer and reader of
``metrics.jsonl`` rows; :func:`steady` is the one definition of the steady-state steps.
"""
from __future__ import annotations

import dataclasses
import fcntl
import json
import math
import os
import time
from dataclasses import dataclass, field
from collections.abc import Mapping as MappingABC
from enum import Enum
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Mapping, Optional, Sequence

RUN_JSON = "run.json"
METRICS = "metrics.jsonl"
CONFIG = "config.yaml"
SBATCH = "sbatch.sh"
ENTRYPOINT = "entrypoint.json"  # a user's entry point: what every task runs (launcher/entrypoint.py)
LOGS = "logs"
CHECKPOINTS = "checkpoints"
REGISTRY = "registry.jsonl"  # SWEEP_DIR/registry.jsonl: a sweep's points (launcher/track/registry.py)
TENSORBOARD = "tensorboard"  # tracking.tensorboard: event files
WANDB = "wandb"  # tracking.wandb: W&B's own files (offline runs to sync)
SAVE_NOW = "SAVE_NOW"  # touch RUN_DIR/SAVE_NOW: a checkpoint at the next step boundary
# touch RUN_DIR/STACK_NOW: within a second every rank writes its threads' Python stacks to
# RUN_DIR/stacks/rank{R}.txt (on NCCL its flight recorder beside them) and goes on
# (train/harness/watchdog.py; `python -m launcher.stacks RUN_DIR` touches and reads them).
STACK_NOW = "STACK_NOW"
STACKS = "stacks"
# touch RUN_DIR/PROFILE_NOW: the next profile.active steps run under torch.profiler on
# profile.ranks (rank 0 sees the file at a step boundary and removes it once the window
# starts); traces and memory snapshots go to RUN_DIR/profile/ (train/profiling.py).
PROFILE_NOW = "PROFILE_NOW"
PROFILE = "profile"
# Ranks persistently slower than their peers (train/steptimes.py), written by rank 0 of the
# built-in trainer when one is flagged: step, segment, threshold and each rank's score.
STRAGGLERS = "stragglers.json"
STEPTIMES = "steptimes.jsonl"  # train.steptimes_file: {"step", "fields", "ranks": [[...] per rank]} per step
# Written by a task whose failure the job restarts inside its allocation (run.json's last
# ``in_job_restarts`` entry, as JSON); the batch script removes it before each srun and
# starts the ranks again when the step leaves it behind (train/harness/restart.py).
RESTART = "RESTART"
# Written by a task that asks Slurm for its job (a requeue, a requeue without nodes, a
# cancel: KEY=VALUE lines); the batch script, outside any container, does it and the
# task needs no Slurm client (slurm/request.py). Removed before each srun, like RESTART.
SLURM_REQUEST = "SLURM_REQUEST"
# The batch script's view of its job at the segment's start, for the tasks: `scontrol show
# job -o` (EndTime as epoch seconds) and its partition's nodes (`sinfo -N`) (slurm/request.py).
SLURM_JOB = "slurm_job.txt"
FAULTS = "faults"  # RUN_DIR/faults/NAME.json: an injected fault (fault.*) fired, and in which segment
# run.json "failure" values whose suspect_nodes the next allocation avoids: the automatic
# requeue (train/harness/badnodes.py) and launcher.resume (launcher/track/resume.py).
EXCLUDING_FAILURES = {"node_failure": "node failure", "preflight_outlier": "preflight outlier",
                      "hardware_fault": "hardware fault", "straggler": "straggler"}
# run.json "failure" values of a task that refused to start, before any collective
# (spec/device.py): no usable CUDA for cluster.accelerator=gpu, or GPUs shown to the task
# otherwise than cluster.gpu_binding says, or a torch older than the floor
# (train/torch_compat.py), or strategy.float8 on a device without float8 matmuls
# (train/float8.py). Not a node's fault: the job ends, no requeue.
NO_CUDA = "no_cuda"
GPU_BINDING = "gpu_binding"
TORCH_VERSION = "torch_version"
FLOAT8_DEVICE = "float8_device"
START_REFUSALS = (NO_CUDA, GPU_BINDING, TORCH_VERSION, FLOAT8_DEVICE)
# run.json "failure" of a task that could not join the job's process group (rank 0's port
# taken, a peer unreachable in time): restarted inside the job on the next step's port,
# else the job ends (train/harness/outcome.py rendezvous_failed).
RENDEZVOUS = "rendezvous"
# run.json fields that describe the last segment's failure: cleared when a segment starts
# (what was excluded for it stays in excluded_nodes / node_exclusions).
# failed_rank / failed_node: the rank whose own error (not a peer's broken connection)
# failed the segment, and its host; in_job_restart: whether the job restarted it, or why not.
SEGMENT_FAILURE = {key: None for key in ("error", "failure", "suspect_nodes", "dead_ranks", "dead_hosts", "fault",
                                         "slurmd_down", "failed_rank", "failed_node", "in_job_restart")}


class Status(str, Enum):
    """``run.json``'s ``status``. A ``str``: run.json holds the plain value."""

    SUBMITTED = "submitted"  # the launcher handed the job to Slurm
    STARTING = "starting"  # a local run's ranks are starting (no Slurm)
    RUNNING = "running"  # rank 0 joined the process group
    REQUEUED = "requeued"  # checkpointed after a signal; Slurm runs it again (same job id)
    INTERRUPTED = "interrupted"  # stopped by a signal without a requeue (SIGTERM, local run, failed requeue)
    COMPLETED = "completed"  # every step done: never retrained
    FAILED = "failed"  # an error, a hang, a dead node: `python -m launcher.resume` continues it
    RESTARTING = "restarting"  # failed, and the job starts its ranks again in its allocation (cluster.in_job_restarts)
    STOPPED = "stopped"  # the requeue cap (cluster.max_requeues) ended it

    def __str__(self) -> str:
        return self.value

    @property
    def final(self) -> bool:
        """Never started again by a re-run of the same command (resume says so instead)."""
        return self in (Status.COMPLETED, Status.STOPPED)

    @property
    def ended(self) -> bool:
        """The job will not run again by itself (no requeue pending)."""
        return self in (Status.COMPLETED, Status.FAILED, Status.STOPPED)


def status_of(info: Dict[str, Any]) -> Optional[Status]:
    """The Status in a run.json mapping; None when absent or unknown (an older file)."""
    try:
        return Status(info.get("status"))
    except ValueError:
        return None


def perplexity(loss: float) -> float:
    """A row's ``val_ppl``: exp of the validation loss (inf past what a float holds)."""
    return math.exp(loss) if loss < 700 else float("inf")


@dataclass(eq=True)
class MetricsRow(MappingABC):
    """One line of ``metrics.jsonl``: one optimizer step of the run (rank 0 writes it).

    The built-in trainer fills every field; a user's workload may leave any but ``step``
    unset (None, not written). Keys this version does not know are kept in ``extra`` and
    written back flat. Rows read like the JSON records they are (``row["loss"]``,
    ``row.get("mfu")``), so scripts that read the file with ``json`` and code that reads
    rows agree.
    """

    step: int
    loss: Optional[float] = None
    lr: Optional[float] = None
    grad_norm: Optional[float] = None
    step_time_s: Optional[float] = None
    tokens_per_s: Optional[float] = None
    samples_per_s: Optional[float] = None
    # the busiest rank's peak: on CUDA allocated during this step, on CPU the RSS high-water mark
    peak_mem_bytes: Optional[int] = None
    # on CUDA: the busiest rank's peak held by the caching allocator during this step (what runs out)
    peak_reserved_bytes: Optional[int] = None
    mfu: Optional[float] = None  # written as null when the cluster has no peak FLOP/s
    global_batch_size: Optional[int] = None
    tokens_per_step: Optional[int] = None
    world_size: Optional[int] = None
    segment: Optional[int] = None
    time: Optional[float] = None
    compute_time_s: Optional[float] = None
    comm_time_s: Optional[float] = None
    val_loss: Optional[float] = None  # train.eval_every: loss on the held-out split after this step
    val_ppl: Optional[float] = None   # exp(val_loss): perplexity()
    # Where the step's time went (train/steptimes.py), each {min, median, max, max_rank} over
    # ranks: the loader, forward + backward, clipping + optimizer, all the rank did between
    # two step collectives, and its wait at the step's collective (slowest busy - own).
    data_s: Optional[Dict[str, float]] = None
    fwd_bwd_s: Optional[Dict[str, float]] = None
    optim_s: Optional[Dict[str, float]] = None
    busy_s: Optional[Dict[str, float]] = None
    wait_s: Optional[Dict[str, float]] = None
    # Epochs done after this step: samples of the global stream seen / samples per epoch
    # (spec/schedule.py), whatever train.epochs or train.steps set the run's length.
    epoch: Optional[float] = None
    extra: Dict[str, Any] = field(default_factory=dict)

    _ALWAYS = ("mfu",)  # written even when None (readers tell "no peak" from "not measured")
    __hash__ = None  # type: ignore[assignment]  # mutable, like the dict it stands for

    @classmethod
    def names(cls) -> List[str]:
        return [f.name for f in dataclasses.fields(cls) if f.name != "extra"]

    def as_dict(self) -> Dict[str, Any]:
        out = {k: v for k in self.names() if (v := getattr(self, k)) is not None or k in self._ALWAYS}
        out.update(self.extra)
        return out

    @classmethod
    def from_dict(cls, data: Dict[str, Any]) -> "MetricsRow":
        known = set(cls.names())
        return cls(**{k: v for k, v in data.items() if k in known},
                   extra={k: v for k, v in data.items() if k not in known})

    # Read access as the JSON record it is (collections.abc.Mapping over as_dict()).
    def __getitem__(self, key: str) -> Any:
        return self.as_dict()[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self.as_dict())

    def __len__(self) -> int:
        return len(self.as_dict())


def steady(rows: Sequence[Any]) -> List[Any]:
    """The steady-state steps of a run: drop the first quarter, and at least the first step
    (it pays for lazy initialisation, allocator warm-up and compilation). The summary and
    the scaling report both measure throughput over these."""
    if len(rows) < 2:
        return list(rows)
    return list(rows[max(1, len(rows) // 4):])


def read_run_json(run_dir: str | Path) -> Dict[str, Any]:
    path = Path(run_dir) / RUN_JSON
    if not path.exists():
        return {}
    return json.loads(path.read_text())


def update_run_json(run_dir: str | Path, /, unless: Optional[Callable[[Dict[str, Any]], bool]] = None,
                    **fields: Any) -> Dict[str, Any]:
    """Merge ``fields`` into run.json atomically and return the new content; nothing is
    written when ``unless(current content)`` holds. Writers are serialised by an
    exclusive ``flock`` on ``.run.json.lock``: ranks, the launcher and the watchdog
    update it from several processes, and a read-modify-write without the lock lost a
    field another process wrote in between (a hang's ``failure`` overwritten by a
    rank's own error a moment later)."""
    return change_run_json(run_dir, lambda data: None if unless is not None and unless(data) else fields)


def change_run_json(run_dir: str | Path, change: Callable[[Dict[str, Any]], Optional[Mapping[str, Any]]]
                    ) -> Dict[str, Any]:
    """Merge ``change(current content)`` into run.json under the lock of
    :func:`update_run_json` (fields computed from what is there, e.g. an entry appended to
    a list); None writes nothing. The new content."""
    path = Path(run_dir) / RUN_JSON
    with open(path.with_name(f".{RUN_JSON}.lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        data = read_run_json(run_dir)
        fields = change(data)
        if fields is None:
            return data
        data.update(fields)
        data["updated_at"] = time.time()
        tmp = path.with_name(f".{RUN_JSON}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
        os.replace(tmp, path)
    return data


def append_metrics(run_dir: str | Path, row: MetricsRow | Mapping[str, Any]) -> None:
    """Append one row to metrics.jsonl (never overwrites earlier segments). A mapping is
    read as a MetricsRow first (it must have an int ``step``), so every row has one form."""
    if not isinstance(row, MetricsRow):
        if not isinstance(row.get("step"), int):
            raise ValueError(f"a metrics row needs an int 'step', got {row.get('step')!r}")
        row = MetricsRow.from_dict(dict(row))
    with open(Path(run_dir) / METRICS, "a") as f:
        f.write(json.dumps(row.as_dict()) + "\n")
        f.flush()


def read_metrics(run_dir: str | Path) -> List[MetricsRow]:
    path = Path(run_dir) / METRICS
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        line = line.strip()
        if line:
            try:
                data = json.loads(line)
            except json.JSONDecodeError:  # a torn last line after a kill
                continue
            if isinstance(data, dict) and isinstance(data.get("step"), int):
                rows.append(MetricsRow.from_dict(data))
    return rows


def run_shape(cfg: Any, layout: Any) -> Dict[str, Any]:
    """The shape of a run (``cfg``: RunConfig, ``layout``: spec.layout.Layout), what each
    checkpoint's manifest records of the run that saved it (``shape``) and what
    ``launcher.resume`` compares and records (``reshaped`` in run.json); a LoRA run's
    also names the base its adapters belong to (:func:`spec.peft.base_identity`)."""
    from spec.peft import base_identity

    t, s = cfg.train, cfg.strategy
    return {"nodes": layout.nodes, "gpus_per_node": layout.gpus_per_node, "world_size": layout.world_size,
            "strategy": s.name, "engine": s.engine, "zero_stage": s.zero_stage, "dp": layout.dp,
            "dp_replicate": layout.dp_replicate, "dp_shard": layout.dp_shard, "tp": layout.tp, "pp": layout.pp,
            "micro_batch_size": t.micro_batch_size, "grad_accum": t.grad_accum,
            "global_batch": t.micro_batch_size * t.grad_accum * layout.dp, **base_identity(cfg)}


def latest_checkpoint(run_dir: str | Path) -> Optional[Dict[str, Any]]:
    """The manifest (``step``, ``shape``, ``files``) of the checkpoint that
    ``checkpoints/latest`` names, or None (no committed checkpoint)."""
    root = Path(run_dir) / CHECKPOINTS
    try:
        name = (root / "latest").read_text().strip()
        return json.loads((root / name / "COMMITTED").read_text())
    except (OSError, ValueError):
        return None


def latest_checkpoint_dir(run_dir: str | Path) -> Optional[Path]:
    """The directory of the checkpoint that ``checkpoints/latest`` names, or None."""
    root = Path(run_dir) / CHECKPOINTS
    try:
        path = root / (root / "latest").read_text().strip()
    except OSError:
        return None
    return path if (path / "COMMITTED").is_file() else None


def needs_universal(saved: Optional[Mapping[str, Any]], current: Mapping[str, Any]) -> bool:
    """A ZeRO checkpoint saved at another data-parallel size or ZeRO stage than this run's
    (shapes: :func:`run_shape`): it loads through DeepSpeed's universal format. Stage 0
    keeps whole optimizer states in one file, which loads at any size (the launcher
    refuses a change to or from stage 0)."""
    if not saved or current.get("engine") != "deepspeed" or saved.get("engine") != "deepspeed":
        return False
    if not (saved.get("zero_stage") and current.get("zero_stage")):
        return False
    return (saved.get("dp"), saved.get("zero_stage")) != (current.get("dp"), current.get("zero_stage"))


def shape_line(shape: Mapping[str, Any]) -> str:
    """A :func:`run_shape` in words, for logs and the launcher's output."""
    stage = f" stage {shape.get('zero_stage')}" if shape.get("engine") == "deepspeed" else ""
    return (f"{shape.get('strategy')}{stage} on {shape.get('nodes')} x {shape.get('gpus_per_node')} = "
            f"{shape.get('world_size')} ranks (dp {shape.get('dp')}, global batch {shape.get('global_batch')})")
