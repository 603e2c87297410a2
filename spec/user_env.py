"""What a user's entry point receives in every task, besides the torchrun variables.

``STO_RUN_DIR`` (the run directory) and what ``accelerate launch`` would have given a
script for the run's strategy, so that ``Accelerator()`` builds the engine the strategy
group names with no Accelerate config file written by hand:

- ``ddp`` (and any torch data-parallel strategy without sharding): Accelerate's
  multi-GPU variables (``prepare_multi_gpu_env``);
- ``fsdp`` / ``fsdp_grad_op`` / ``hsdp``: the same plus ``ACCELERATE_USE_FSDP`` and the
  sharding (FULL_SHARD / SHARD_GRAD_OP / HYBRID_SHARD, reshard after forward);
- ``zero1``-``zero3`` and offload: ``prepare_deepspeed_cmd_env``'s variables, with the
  DeepSpeed JSON generated from the strategy (:func:`accelerate_ds_config`, written to
  ``RUN_DIR/accelerate_ds_config.json``) as ``ACCELERATE_DEEPSPEED_CONFIG_FILE``.

Accelerate has no DeepSpeed or FSDP path without an accelerator: with
``cluster.accelerator=cpu`` every task gets ``ACCELERATE_USE_CPU=true`` instead of the
strategy's variables, so the script runs as MULTI_CPU over gloo with the whole world;
the engine the strategy names is built where CUDA exists (``cluster.accelerator=gpu``).

Which device is the task's: ``STO_DEVICE`` ("cpu", or "cuda:N" by
:func:`spec.device.task_device`) and ``STO_GPU_BINDING`` (``cluster.gpu_binding``). On a
GPU profile the harness makes ``STO_DEVICE`` the current CUDA device before the code
runs (or refuses the task), so ``torch.device(os.environ["STO_DEVICE"])``, or plain
``"cuda"`` tensors, are the task's own under either binding. Code that picks its GPU
from ``LOCAL_RANK`` itself, as Accelerate and DeepSpeed do (``cuda:LOCAL_RANK``), needs
binding ``node``: under ``task`` each task sees one GPU and local ranks >= 1 would ask
for a device that does not exist ("invalid device ordinal").
Pure standard library.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, Optional

from spec.config import RunConfig
from spec.device import task_device
from spec.ds_config import use_bf16
from spec.identity import TaskIdentity
from spec.layout import Layout

RUN_DIR_ENV = "STO_RUN_DIR"
DEVICE_ENV = "STO_DEVICE"
BINDING_ENV = "STO_GPU_BINDING"
ACCELERATE_DS_CONFIG = "accelerate_ds_config.json"

# What `accelerate launch` sets for every distributed type (its defaults: no dynamo).
_COMMON = {
    "ACCELERATE_DYNAMO_BACKEND": "NO",
    "ACCELERATE_DYNAMO_MODE": "default",
    "ACCELERATE_DYNAMO_USE_FULLGRAPH": "False",
    "ACCELERATE_DYNAMO_USE_DYNAMIC": "False",
    "ACCELERATE_DYNAMO_USE_REGIONAL_COMPILATION": "False",
}


def mixed_precision(cfg: RunConfig) -> str:
    """Accelerate's spelling of the strategy's precision: "bf16" or "no"."""
    return "bf16" if use_bf16(cfg.strategy.mixed_precision, "cuda" if cfg.cluster.accelerator == "gpu" else "cpu") \
        else "no"


def accelerate_ds_config(cfg: RunConfig) -> Dict[str, Any]:
    """The DeepSpeed JSON for a user's Accelerate script: the strategy's ZeRO stage and
    offload; batch sizes, clipping and precision are "auto" (Accelerate fills them from
    the script's own dataloader, ``gradient_accumulation_steps`` and clipping)."""
    s = cfg.strategy
    on_gpu = cfg.cluster.accelerator == "gpu"
    zero: Dict[str, Any] = {"stage": s.zero_stage, "overlap_comm": on_gpu, "contiguous_gradients": True}
    if s.offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": on_gpu}
    if s.offload_params:
        zero["offload_param"] = {"device": "cpu", "pin_memory": on_gpu}
    return {
        "train_micro_batch_size_per_gpu": "auto",
        "train_batch_size": "auto",
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
        "bf16": {"enabled": "auto"},
        "zero_optimization": zero,
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 1 << 30,
    }


def fsdp_sharding(cfg: RunConfig, layout: Layout) -> str:
    if layout.dp_replicate > 1 and layout.dp_shard > 1:
        return "HYBRID_SHARD" if cfg.strategy.reshard_after_forward else "HYBRID_SHARD_ZERO2"
    return "FULL_SHARD" if cfg.strategy.reshard_after_forward else "SHARD_GRAD_OP"


def accelerate_env(cfg: RunConfig, layout: Layout, run_dir: Path) -> Dict[str, str]:
    """Accelerate's variables for this run's strategy (the same in every task)."""
    s = cfg.strategy
    env = dict(_COMMON, ACCELERATE_MIXED_PRECISION=mixed_precision(cfg))
    if cfg.cluster.accelerator == "cpu":
        # No DeepSpeed or FSDP path without an accelerator (Accelerate 1.15 raises "no
        # available devices" for FSDP, runs DeepSpeed as one process): MULTI_CPU over
        # gloo with the whole world.
        env["ACCELERATE_USE_CPU"] = "true"
        return env
    if s.engine == "deepspeed":
        env.update(ACCELERATE_USE_DEEPSPEED="true", ACCELERATE_CONFIG_DS_FIELDS="",
                   ACCELERATE_DEEPSPEED_CONFIG_FILE=str(run_dir / ACCELERATE_DS_CONFIG))
        for key in ("ACCELERATE_DYNAMO_BACKEND", "ACCELERATE_DYNAMO_MODE", "ACCELERATE_DYNAMO_USE_FULLGRAPH",
                    "ACCELERATE_DYNAMO_USE_DYNAMIC", "ACCELERATE_DYNAMO_USE_REGIONAL_COMPILATION"):
            env.pop(key)  # prepare_deepspeed_cmd_env does not set them
    elif s.data_parallel == "fsdp":
        sharding = fsdp_sharding(cfg, layout)
        # accelerate launch's defaults but the sharding (FSDP1 reads FSDP_SHARDING_STRATEGY;
        # the reshard variable takes the same name there). No auto-wrap policy: the user's
        # script sets its own (a transformer-based one needs the model's layer class).
        env.update(ACCELERATE_USE_FSDP="true", FSDP_VERSION="1", FSDP_SHARDING_STRATEGY=sharding,
                   FSDP_RESHARD_AFTER_FORWARD=sharding.lower(), FSDP_OFFLOAD_PARAMS=str(s.offload_params).lower(),
                   FSDP_MIN_NUM_PARAMS="100000000", FSDP_FORWARD_PREFETCH="false", FSDP_USE_ORIG_PARAMS="true",
                   FSDP_CPU_RAM_EFFICIENT_LOADING="true", FSDP_SYNC_MODULE_STATES="true",
                   FSDP_ACTIVATION_CHECKPOINTING=str(s.activation_checkpointing != "none").lower(),
                   FSDP_ACTIVATION_CHECKPOINTING_OFFLOAD="false")
    return env


def task_environment(cfg: RunConfig, layout: Layout, run_dir: Path, rank: int = 0,
                     task: Optional[TaskIdentity] = None) -> Dict[str, str]:
    """Every variable a user's entry point gets in the task ``task`` (its identity, read
    from its environment). Without one (the dry run): in task ``rank`` of ``layout``, the
    master address and port shown as placeholders, as they exist only in the job."""
    placed = task or TaskIdentity.placed(layout, rank, "<first node of the job>", 0)
    env = placed.torchrun_vars()
    if task is None:
        env["MASTER_PORT"] = "<from the job id>"
    env.update({RUN_DIR_ENV: str(run_dir), BINDING_ENV: cfg.cluster.gpu_binding,
                DEVICE_ENV: task_device(cfg.cluster.accelerator, cfg.cluster.gpu_binding, placed.local_rank)})
    env.update(accelerate_env(cfg, layout, run_dir))
    return env
