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

# Sections that live in their own modules (re-exported here).
from spec.cluster import ClusterConfig
from spec.config_eval import EvalConfig
from spec.config_model import ModelConfig, RopeScaling  # noqa: F401
from spec.config_peft import PeftConfig
from spec.config_ops import (CheckpointConfig, FaultConfig, LauncherConfig, ProfileConfig,  # noqa: F401
                             TrackingConfig, WandbConfig)


class ConfigError(ValueError):
    """A user-facing configuration error: one line naming the field, the value and the fix."""


@dataclass
class StrategyConfig:
    """How the model is parallelised. Degrees multiply to the world size.

    ``-1`` in a degree means "fill the ranks the other degrees leave". The mesh is
    (pipeline_parallel, dp_replicate, dp_shard, cp, tensor_parallel), tensor parallel
    innermost and context parallel next to it, both inside a node first.
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
    # Context parallel: each sequence split over this many ranks, DeepSpeed-Ulysses'
    # all-to-all over attention heads (train/context_parallel.py, docs/finetune.md "Long
    # sequences"). The ranks it takes come out of the data-parallel degree (world / (pp x tp
    # x cp)): multiply train.grad_accum by cp to keep the global batch. 1 = off.
    cp: int = 1
    # Float8 training (torchao's convert_to_float8_training; docs/strategies.md "Float8"): the
    # Linears of the blocks multiply in float8 on GPUs of compute capability 8.9 or later;
    # refused on CPU, older GPUs, DeepSpeed, tensor or pipeline parallel and LoRA (spec/float8.py).
    float8: bool = False
    # "tensorwise" (one scale a tensor) | "rowwise" (one a row; more accurate, slower).
    float8_recipe: str = "tensorwise"
    # Linears left in bf16: those whose name contains one of these (torchtitan's filter_fqns);
    # besides, any whose in/out features are not multiples of 16, and a head tied to the embedding.
    float8_skip: List[str] = field(default_factory=lambda: ["output"])
    # FSDP all-gathers the converted weights in float8 (1 byte, not 2); null: where torchao
    # gives it (tensorwise), false: never; rowwise has none.
    float8_all_gather: Optional[bool] = None


@dataclass
class DataConfig:
    # "markov": a seeded synthetic token stream generated on first use (learnable, so the
    # loss falls); "file": a flat binary file of token ids at `path` (uint16 when
    # model.vocab_size <= 65536, else uint32), e.g. written by numpy's tofile();
    # "tokens": the directory `python -m train.data.prepare` wrote (train/val split);
    # "chat": the directory `python -m train.data.prepare --chat` wrote: one conversation
    # per sample, padded to train.seq_len + 1, loss only on its mask's tokens (docs/finetune.md).
    source: str = "markov"
    path: Optional[str] = None
    # data.source=chat: pack whole conversations into each sequence of train.seq_len (best
    # fit decreasing, spec/packing.py), positions restarting and attention confined to each
    # conversation (flex attention, train/packed_attention.py); the training split only.
    # false (default): one conversation a padded sequence, SDPA as before; what TRL's
    # SFTConfig and open-r1's distillation recipe (+experiment=r1_distill_sft) do.
    packing: bool = False
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
    # Linear warmup over this many steps, then cosine decay to min_lr_ratio x the peak.
    warmup_steps: int = 2
    # Warmup as a fraction of the run's steps, in [0, 1): ceil(ratio x steps), as Hugging
    # Face's Trainer counts it. null = optim.warmup_steps; set one of the two, not both.
    warmup_ratio: Optional[float] = None
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
    # Optimizer steps of the run (ignored, and must stay 50, when train.epochs is set).
    steps: int = 50
    # Passes over the training data; 0 = off (train.steps counts). > 0: the steps are
    # ceil(epochs x samples per epoch / global batch in samples) (spec/schedule.py),
    # fractional epochs allowed (0.5: half a pass); printed at launch and in the dry run.
    epochs: float = 0.0
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
    peft: PeftConfig = field(default_factory=PeftConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)


GROUPS = ("cluster", "model", "strategy", "peft")

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
