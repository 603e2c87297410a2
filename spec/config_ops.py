"""The operational sections of the run configuration: ``checkpoint.*``, ``fault.*``,
``profile.*``, ``launcher.*`` and ``tracking.*``. Pure; :mod:`spec.config` re-exports them
as parts of ``RunConfig``.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional


@dataclass
class CheckpointConfig:
    # Save every N optimizer steps; 0 = not by steps. null (the default): 0, and with
    # every_minutes null too a GPU run saves by time at the interval derived at launch
    # (launcher/plan/checkpoint.py: Young/Daly from the predicted save time and the job's
    # failure rate, docs/checkpoints.md); a CPU run, or a profile without filesystem
    # figures, saves only on preemption / time limit.
    every_steps: Optional[int] = None
    # Also save when this many minutes passed since the last save; 0 = not by time. null:
    # derived at launch as above (written into the run's config.yaml), else 0.
    every_minutes: Optional[float] = None
    # Committed checkpoints kept (older ones are deleted after a new one commits).
    keep: int = 2
    # Periodic saves write in the background (torch engines; the loop stalls only to copy
    # the state to host memory, which the planner counts per node). Saves on preemption are
    # always synchronous. null (the default): true on GPU clusters where the engine allows
    # (torch), false elsewhere (spec/checkpointing.py saves_async).
    async_save: Optional[bool] = None
    # Seconds a save may take before it is a hang (the watchdog's bound while a rank saves or
    # waits at the save's barriers, in place of cluster.hang_timeout_s). null: derived at
    # launch (launcher/plan/checkpoints.py): 3 x the predicted blocking save + 60 s, at
    # least cluster.hang_timeout_s; 2 x hang_timeout_s when the save cannot be predicted.
    # The run's collective timeout is raised to cover it (train.dist_timeout_s). 0 = the
    # hang timeout applies to saves too.
    save_timeout_s: Optional[float] = None
    # Also save after the last step (what `python -m launcher.export` then exports).
    # null (the default): yes whenever periodic checkpoints are on (every_steps or
    # every_minutes > 0), so a finished run's last steps are in a checkpoint; true / false:
    # always / never.
    save_final: Optional[bool] = None
    # DeepSpeed: load the checkpoint in DeepSpeed's universal format. Set by the trainer
    # itself when it resumes a ZeRO checkpoint saved at another data-parallel size or
    # stage (launcher.resume RUN_DIR cluster.nodes=M); leave it false.
    load_universal: bool = False


@dataclass
class FaultConfig:
    """Fault injection for tests and benchmarks; all off by default."""

    # Sleep this long after every step, so a run lasts long enough to be interrupted.
    step_delay_s: float = 0.0
    # The rank that sleeps step_delay_s (-1: every rank): one slow rank, a straggler.
    step_delay_rank: int = -1
    # SIGKILL every rank in the middle of the save at this step (after the shards are
    # written, before the commit); 0 = off.
    kill_in_save_at_step: int = 0
    # This rank sleeps hang_s seconds at step hang_at_step, just before the step's
    # collective, so the others wait inside it: a hang (once per run: see repeat). -1 / 0 = off.
    hang_rank: int = -1
    hang_at_step: int = 0
    hang_s: float = 3600.0
    # Where hang_rank sleeps: "step" (before the step's collective) or "save" (in the
    # blocking save of step hang_at_step, its files written, before the save's barrier: a
    # writer that never returns, which the watchdog must name after checkpoint.save_timeout_s).
    hang_in: str = "step"
    # Rank raise_rank (-1: every rank) raises RuntimeError at this step (after its
    # backward, before the step's collective), as a bug or an out-of-memory error would: a
    # failing run; 0 = off.
    raise_at_step: int = 0
    raise_rank: int = -1
    # Rank raise_rank raises the same way at every multiple of this step (N, 2N, 3N, ...):
    # a run that fails again and again (bench/goodput.py --mode fault); 0 = off.
    raise_every_steps: int = 0
    # raise_at_step, raise_every_steps (each of its steps), hang_at_step and
    # kill_in_save_at_step fire once per run: the first time a start of the run reaches
    # their step (recorded in RUN_DIR/faults/), so a restarted, requeued or resumed
    # segment passes it. true: every time (a crash loop).
    repeat: bool = False
    # The checkpoint thread of an async save sleeps this long before its snapshot and
    # again before its write, so the training thread runs ahead of it (tests: what is
    # saved must still be the state of the step saved).
    slow_async_save_s: float = 0.0
    # Rank slow_save_rank (-1: every rank) sleeps this long in a blocking save, after
    # writing its files and before the save's barrier: a save slower than
    # cluster.hang_timeout_s, which must not be called a hang (checkpoint.save_timeout_s).
    # Only the save of step slow_save_at_step (once per run, as the step faults), or with
    # 0 every blocking save.
    slow_save_s: float = 0.0
    slow_save_rank: int = -1
    slow_save_at_step: int = 0
    # Every rank appends the window ids of each step's data to
    # logs/samples_seg{S}_rank{R}.txt ("step id id ..."): tests count the samples a run
    # saw across segments (a step replayed after a crash: the later segment's counts).
    # Under tensor or pipeline parallel only the ranks of tp and pp coordinate 0 write.
    trace_samples: bool = False
    # Rank preflight_slow_rank sleeps preflight_slow_s inside its timed preflight matmuls,
    # so its node measures as a slow one would (train.preflight); -1 = off.
    preflight_slow_rank: int = -1
    preflight_slow_s: float = 2.0
    # Rank hardware_fault_rank raises CUDA's error for an uncorrectable ECC error at step
    # hardware_fault_at_step: its node's hardware is blamed (train/harness/health.py); 0 = off.
    hardware_fault_rank: int = -1
    hardware_fault_at_step: int = 0
    # These two fire only in the run's segment with this number (how many times the run
    # started before it: 0 its first start, 1 after one requeue or restart; -1: every
    # segment), so a requeued, restarted or resumed run runs clean (train/harness/faults.py).
    preflight_slow_restart: int = 0
    hardware_fault_restart: int = 0
    oom_at_step: int = 0  # raise_rank raises torch.OutOfMemoryError at this step, once per run; 0 = off
    # raise_rank SIGKILLs itself at this step (after its backward, before the step's
    # collective), once per run: a rank that dies without a word (the OOM killer, a
    # segfault), which only its node's agent sees at once; 0 = off.
    kill_at_step: int = 0
    oom_in_build: bool = False  # ... and this: once the model is built, before a checkpoint loads (once per run)
    # Rank 0 finds the job's rendezvous port taken (another process listens on it) in the
    # start of the job's step with this number (STO_IN_JOB_RESTART: 0 the first srun, 1
    # the first restart inside the job), as an ephemeral port of another connection could
    # be: the rendezvous fails there (train/harness/faults.py take_rendezvous_port); -1 = off.
    port_taken_in_srun: int = -1


@dataclass
class ProfileConfig:
    """torch.profiler over chosen steps on chosen ranks (train/profiling.py, docs/observing.md)."""
    steps: Optional[List[int]] = None  # [START, END]: optimizer steps, 1-based, inclusive; null = none
    every: int = 0  # also `active` steps from every N-th step (N .. N+active-1, 2N ...); 0 = off
    active: int = 3  # and what `touch RUN_DIR/PROFILE_NOW` profiles: the next `active` steps
    ranks: Optional[List[int]] = None  # null: local rank 0 of each node (0, gpus_per_node, ...)
    shapes: bool = False  # torch's record_shapes
    memory: bool = False  # profile_memory; on CUDA also the allocator's history all run, every rank
    with_stack: bool = False  # each op's Python stack


@dataclass
class LauncherConfig:
    # Print the sbatch script and the rank map, submit nothing.
    dry_run: bool = False
    # Block until the job ends and print its summary (local runs always wait).
    wait: bool = False
    # While waiting, Slurm is asked again after a tenth of the time waited so far, between
    # these bounds (seconds): a short job is seen ending at once, a long one costs slurmdbd
    # one query per wait_max_poll_s.
    wait_poll_s: float = 1.0
    wait_max_poll_s: float = 30.0
    # Directory under which run directories are made (relative to the current directory).
    root: str = "runs"
    # Explicit run directory; null = derived from the overrides, so re-running the same
    # command finds the same directory.
    run_dir: Optional[str] = None
    # Job name in Slurm; null = "sto-" + model + strategy.
    job_name: Optional[str] = None
    # Submit even when the planner predicts the config does not fit the GPUs' memory.
    allow_oom: bool = False
    # What a Slurm job's tasks import (launcher/snapshot.py). "true": at submission the
    # project's git-tracked and untracked-not-ignored files as they are (and an
    # entrypoint='s repository, or its directory outside git) are copied into .code/<hash>
    # beside the run directory (a sweep's points share one copy), and every segment,
    # requeued or restarted, imports that copy: edits made after submission do not reach
    # the job. "false": the tasks import the checkout as it is when they start. "refresh":
    # `launcher.resume RUN_DIR` freezes the code anew (a resume keeps the run's copy
    # otherwise). More than 200 MB or 20,000 files to freeze is refused. Local runs import
    # the checkout (they run while the command waits).
    snapshot: str = "true"
    # A sweep (-m) runs at most this many of its points at once, a cap Slurm holds after
    # the launcher exits: points that share one job array get `--array=...%K`, other jobs
    # wait for earlier ones with `--dependency=afterany:...` (launcher/sweep.py). 0: no cap.
    max_parallel: int = 0
    # Jobs after the training job (launcher/chain.py), each waiting on the one before:
    # "export" (the newest checkpoint as a Hugging Face directory, RUN_DIR/export) or
    # "cmd:COMMAND" ({run_dir} and {export_dir} replaced). [] = none.
    then: List[str] = field(default_factory=list)
    # Their dependency: "afterok" (only after a completed training; Slurm cancels them
    # otherwise) or "afterany" (whatever its end).
    then_dependency: str = "afterok"
    then_time_min: int = 60  # each chained job's time limit (sbatch --time)


@dataclass
class WandbConfig:
    # A W&B project name turns logging on; null = off.
    project: Optional[str] = None
    # "offline" (files under RUN_DIR/wandb, `wandb sync` them later), "online" or "disabled".
    mode: str = "offline"
    entity: Optional[str] = None
    tags: List[str] = field(default_factory=list)


@dataclass
class TrackingConfig:
    """Where the metrics rows go besides metrics.jsonl (rank 0 writes them)."""

    # TensorBoard event files under RUN_DIR/tensorboard.
    tensorboard: bool = False
    wandb: WandbConfig = field(default_factory=WandbConfig)
