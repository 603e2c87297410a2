"""The typed schema of the whole run configuration.

Pure module (no torch): the launcher validates with it on the login node and every
Slurm task loads the very same schema from the run directory. Hydra composes YAML
files of ``conf/`` over these dataclasses; the entry points convert the result to
real dataclasses once (:func:`to_run_config`), and nothing below them sees a
``DictConfig``.

The schema's own defaults are the embedded default run: cluster ``local``, model
``tiny``, strategy ``ddp``. ``conf/cluster/local.yaml`` etc. only restate the name, so
``+cluster=local`` and no cluster group compose to the same config (tested).
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional

from spec.cluster import ClusterConfig  # the cluster section lives in its own module (re-exported here)


class ConfigError(ValueError):
    """A user-facing configuration error: one line naming the field, the value and the fix."""


@dataclass
class RopeScaling:
    """Llama 3.1's scaling of the rotary frequencies (null type = none)."""

    type: Optional[str] = None  # "llama3"
    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_seq_len: int = 8192


@dataclass
class ModelConfig:
    """A Llama-style decoder (RMSNorm, RoPE, SwiGLU, grouped-query attention)."""

    name: str = "tiny"
    dim: int = 64
    n_layers: int = 2
    n_heads: int = 4
    # Key/value heads (grouped-query attention); null = n_heads (plain multi-head).
    n_kv_heads: Optional[int] = None
    vocab_size: int = 256
    # SwiGLU hidden size: int(8/3 * dim * ffn_dim_multiplier) rounded up to multiple_of.
    ffn_dim_multiplier: float = 1.0
    multiple_of: int = 32
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_seq_len: int = 256
    # Share the token embedding with the output head (GPT-2 does, Llama does not).
    tie_embeddings: bool = False
    # SwiGLU hidden size given outright (Hugging Face's intermediate_size); null = from
    # ffn_dim_multiplier and multiple_of as above.
    ffn_hidden_dim: Optional[int] = None
    # Llama 3's RoPE frequency scaling (Hugging Face's rope_scaling, rope_type "llama3").
    rope_scaling: RopeScaling = field(default_factory=lambda: RopeScaling())
    # A Hugging Face Llama directory (config.json + safetensors): the dimensions above are
    # read from its config.json at launch and the weights replace the random init
    # (README "Start from Hugging Face weights"). Nothing is downloaded.
    hf_path: Optional[str] = None


@dataclass
class StrategyConfig:
    """How the model is parallelised. Degrees multiply to the world size.

    ``-1`` in a degree means "fill the ranks the other degrees leave". The mesh is
    (pipeline_parallel, dp_replicate, dp_shard, tensor_parallel), tensor parallel innermost.
    """

    name: str = "ddp"
    # "torch" (DDP/FSDP/TP/PP from torch.distributed) or "deepspeed".
    engine: str = "torch"
    # Data-parallel flavour of the torch engine: "ddp" | "fsdp" | "none".
    data_parallel: str = "ddp"
    tensor_parallel: int = 1
    pipeline_parallel: int = 1
    # Ranks each parameter is sharded over (FSDP / ZeRO); 1 = not sharded.
    dp_shard: int = 1
    # Ranks holding full replicas (DDP, HSDP's outer axis); -1 = the rest.
    dp_replicate: int = -1
    # DeepSpeed ZeRO stage 0-3 (engine=deepspeed only).
    zero_stage: int = 0
    offload_optimizer: bool = False
    offload_params: bool = False
    # FSDP: free gathered parameters after forward (full shard) or keep them (grad-op).
    reshard_after_forward: bool = True
    # "auto" = bf16 on GPU, fp32 on CPU; or "fp32" / "bf16".
    mixed_precision: str = "auto"
    # Blocks recomputed in backward (spec/ac_modes.py): "none" | "every_other" (blocks 0,
    # 2, ...; "selective" is its old name) | "full".
    activation_checkpointing: str = "none"
    # Pipeline schedule: "gpipe" | "1f1b" | "interleaved_1f1b"; microbatches per step.
    pp_schedule: str = "1f1b"
    pp_microbatches: int = 4
    # torch.compile the model (GPU).
    compile: bool = False
    # fp32 matmuls on CUDA in TF32 (torch.set_float32_matmul_precision("high"): Ampere and
    # later, a 10-bit mantissa at several times fp32's rate); false keeps IEEE fp32
    # ("highest"), e.g. for mixed_precision=fp32 runs compared bit for bit. Under bf16 it
    # touches only what stays fp32. CPU runs are IEEE fp32 either way.
    tf32: bool = True


@dataclass
class DataConfig:
    # "markov": a seeded synthetic token stream generated on first use (learnable, so the
    # loss falls); "file": a flat binary file of token ids at `path` (uint16 when
    # model.vocab_size <= 65536, else uint32), e.g. written by numpy's tofile();
    # "tokens": the directory `python -m train.data.prepare` wrote (train/val split).
    source: str = "markov"
    path: Optional[str] = None
    # Tokens generated for the markov source.
    num_tokens: int = 2_000_000
    # Successors per token in the markov chain: the loss floor is about ln(branching).
    branching: int = 4
    # Where generated data is cached; null = ~/.cache/slurm-torch-orchestrator.
    cache_dir: Optional[str] = None
    seed: int = 1234


@dataclass
class OptimConfig:
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 2
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    # Clip the global gradient norm to this value; 0 disables clipping.
    grad_clip: float = 1.0
    # Scale lr with the global batch (spec/batch.py): none | linear | sqrt, against the
    # global batch (sequences) that lr was tuned for.
    lr_scaling: str = "none"
    base_global_batch: Optional[int] = None


@dataclass
class TrainConfig:
    steps: int = 50
    # Sequences per rank per micro-step.
    micro_batch_size: int = 8
    seq_len: int = 64
    # Micro-steps per optimizer step.
    grad_accum: int = 1
    seed: int = 0
    log_every: int = 1
    # Validation loss (and perplexity) every N optimizer steps and after the last; 0 = off.
    eval_every: int = 0
    # Global batches of the validation split per evaluation (the same ones every time).
    eval_batches: int = 2
    # Python's automatic garbage collection is off during training and a young-generation
    # collection runs every this many steps (as torchtitan's training.gc_freq): the
    # automatic one stops the step at random times to scan every object. 0 = leave it on.
    gc_every_steps: int = 50
    # Stragglers (train/steptimes.py): a rank whose score (its peers' median self time /
    # its own: 1.0 as fast, 0.5 twice as slow) stays under straggler_score, at least
    # straggler_min_s above their median, for straggler_steps steps in a row is named in
    # RUN_DIR/stragglers.json and rank 0's log.
    # straggler_score 0: off. straggler_action: "log", or "restart_without" (its node is
    # treated as a bad node: a hot spare takes it, else the job is requeued without it).
    straggler_score: float = 0.67
    straggler_steps: int = 10
    straggler_min_s: float = 0.05
    straggler_action: str = "log"
    # Rank 0 also writes every step's per-rank times (train/steptimes.py FIELDS, one row per
    # rank) to RUN_DIR/steptimes.jsonl: the metrics rows keep only min/median/max.
    steptimes_file: bool = False
    # Gloo/NCCL collective timeout in seconds. Keep it above cluster.hang_timeout_s: the
    # watchdog then reports a hang (stacks, NCCL flight recorder) before NCCL aborts.
    dist_timeout_s: int = 600
    # Before training, time a matmul and an all-reduce on every rank and write
    # preflight.json (train/harness/preflight.py); takes a few seconds.
    preflight: bool = False
    # A node (or rank) below this fraction of the median over nodes (ranks) is an outlier.
    preflight_outlier: float = 0.7
    # Outlier nodes fail the job before training; run.json lists them as suspect_nodes and
    # `python -m launcher.resume RUN_DIR` excludes them. false: only report them.
    preflight_exclude: bool = False


@dataclass
class CheckpointConfig:
    # Save every N optimizer steps; 0 = only on preemption / time limit.
    every_steps: int = 0
    # Also save when this many minutes passed since the last save; 0 = off.
    every_minutes: float = 0.0
    # Committed checkpoints kept (older ones are deleted after a new one commits).
    keep: int = 2
    # Periodic saves write in the background (torch engines; the loop stalls only to copy
    # the state to memory). Saves on preemption are always synchronous.
    async_save: bool = False
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


@dataclass
class RunConfig:
    # What every task runs. null: the built-in trainer. "path/to/script.py": the file runs
    # as __main__ in every task, with entrypoint_args as its argv and the torchrun
    # environment (as `torchrun script.py ARGS`). "package.module:function": the function
    # is called in every task with the composed config (an OmegaConf DictConfig).
    # Either way train/harness/user.py runs it under the task harness (README: "Run your
    # own training script").
    entrypoint: Optional[str] = None
    entrypoint_args: List[str] = field(default_factory=list)
    # The user's own settings, free-form (`+user.lr=3e-4`): the toolkit passes them on.
    user: Dict[str, Any] = field(default_factory=dict)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    strategy: StrategyConfig = field(default_factory=StrategyConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    fault: FaultConfig = field(default_factory=FaultConfig)
    profile: ProfileConfig = field(default_factory=ProfileConfig)
    launcher: LauncherConfig = field(default_factory=LauncherConfig)


GROUPS = ("cluster", "model", "strategy")

def read_json_in(directory: Path, name: str, field: str, fix: str) -> Dict[str, Any]:
    """``directory/name`` as JSON, or a ConfigError naming ``field`` and the ``fix``."""
    f = Path(directory) / name
    if not f.is_file():
        raise ConfigError(f"{field}={directory}: no {name} there; {fix}")
    try:
        return json.loads(f.read_text())
    except ValueError as exc:
        raise ConfigError(f"{field}={directory}: {name} is not JSON ({exc}); {fix}") from None


def to_run_config(cfg: Any) -> RunConfig:
    """DictConfig (or mapping / YAML path) -> RunConfig dataclass, type-checked by OmegaConf."""
    from omegaconf import OmegaConf

    if isinstance(cfg, (str, Path)):
        cfg = OmegaConf.load(str(cfg))
    schema = OmegaConf.structured(RunConfig)
    merged = OmegaConf.merge(schema, cfg)
    obj = OmegaConf.to_object(merged)
    if not isinstance(obj, RunConfig):  # pragma: no cover - OmegaConf contract
        raise TypeError(f"expected RunConfig, got {type(obj).__name__}")
    return obj


def to_yaml(cfg: RunConfig) -> str:
    from omegaconf import OmegaConf

    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


def as_dict(cfg: RunConfig) -> Dict[str, Any]:
    return dataclasses.asdict(cfg)


def register_configs() -> None:
    """Register the schema with Hydra's ConfigStore (conf/config.yaml extends it)."""
    from hydra.core.config_store import ConfigStore

    cs = ConfigStore.instance()
    cs.store(name="run_schema", node=RunConfig)
