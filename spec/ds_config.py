"""The DeepSpeed config, generated from the run config (never a hand-kept JSON).

Pure (no torch or deepspeed import): the launcher checks and prints it before
submission, and the job builds its engine from the very same function, so the batch
sizes, clipping, precision and ZeRO settings cannot drift from the rest of the config.

Bucket sizes follow the model instead of DeepSpeed's defaults (5e8 elements, i.e.
buffers of hundreds of MB to GBs whatever the model): the rule of Hugging Face's
DeepSpeed integration ("auto" values), with d = model.dim:

- reduce / all-gather bucket = d^2 elements (one attention projection),
- ZeRO-3 prefetch bucket = 0.9 d^2,
- ZeRO-3 parameters of fewer than 10 d elements (norms, biases) are not partitioned
  (gathering them would cost more in latency than they save in memory).

All capped at DeepSpeed's defaults, which large models reach anyway.
"""
from __future__ import annotations

from typing import Any, Dict

from spec.config import ConfigError, RunConfig

DEFAULT_BUCKET = 500_000_000  # DeepSpeed's default reduce/all-gather/prefetch bucket
DEFAULT_PERSISTENCE = 100_000  # DeepSpeed's default stage3_param_persistence_threshold


def check(cfg: RunConfig) -> None:
    """Refuse, before submission, settings DeepSpeed would reject (or ignore) in the job."""
    s = cfg.strategy
    if s.engine != "deepspeed":
        if s.zero_stage or s.offload_optimizer or s.offload_params:
            raise ConfigError(f"strategy.zero_stage={s.zero_stage} / offload_optimizer={s.offload_optimizer} / "
                              f"offload_params={s.offload_params} need strategy.engine=deepspeed (engine="
                              f"{s.engine}); use +strategy=zero1|zero2|zero3|zero3_offload")
        return
    if s.zero_stage not in (0, 1, 2, 3):
        raise ConfigError(f"strategy.zero_stage={s.zero_stage} is not a ZeRO stage; use 0, 1, 2 or 3")
    if s.offload_params and s.zero_stage != 3:
        raise ConfigError(f"strategy.offload_params=true with zero_stage={s.zero_stage}: DeepSpeed offloads "
                          "parameters only in ZeRO stage 3; set strategy.zero_stage=3 or offload_params=false")
    if s.offload_optimizer and s.zero_stage == 0:
        raise ConfigError("strategy.offload_optimizer=true with zero_stage=0: optimizer offload needs ZeRO "
                          "stage 1-3; set strategy.zero_stage>=1 or offload_optimizer=false")


def use_bf16(mixed_precision: str, device_type: str) -> bool:
    """``auto`` = bf16 on GPU, fp32 on CPU (as base.compute_dtype decides for torch)."""
    if mixed_precision == "auto":
        return device_type == "cuda"
    return mixed_precision == "bf16"


def deepspeed_config(cfg: RunConfig, dp_size: int, device_type: str) -> Dict[str, Any]:
    """The ``config`` dict for ``deepspeed.initialize`` of a run with ``dp_size`` data ranks."""
    check(cfg)
    s, t, d = cfg.strategy, cfg.train, cfg.model.dim
    on_gpu = device_type == "cuda"
    bucket = min(DEFAULT_BUCKET, d * d)
    zero: Dict[str, Any] = {"stage": s.zero_stage}
    if s.zero_stage >= 1:
        zero.update(
            reduce_bucket_size=bucket,
            allgather_bucket_size=bucket,
            contiguous_gradients=True,
            # Overlap needs extra buffers and only pays with asynchronous GPU streams.
            overlap_comm=on_gpu,
        )
    if s.zero_stage == 3:
        zero.update(
            stage3_prefetch_bucket_size=int(0.9 * bucket),
            stage3_param_persistence_threshold=min(DEFAULT_PERSISTENCE, 10 * d),
        )
    if s.offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": on_gpu}
    if s.offload_params:
        zero["offload_param"] = {"device": "cpu", "pin_memory": on_gpu}
    return {
        "train_micro_batch_size_per_gpu": t.micro_batch_size,
        "gradient_accumulation_steps": t.grad_accum,
        "train_batch_size": t.micro_batch_size * t.grad_accum * dp_size,
        # 0 disables clipping, as optim.grad_clip=0 does for the torch engine.
        "gradient_clipping": float(cfg.optim.grad_clip),
        "bf16": {"enabled": use_bf16(s.mixed_precision, device_type)},
        # Gradients reduced (ZeRO-1/2's all-reduce or reduce-scatter, ZeRO-3's reduce-scatter)
        # in fp32, as FSDP's reduce_dtype (train/strategies/fsdp.py): DeepSpeed's default under
        # bf16 is bf16, whose sum over many ranks loses precision. Twice the bytes on the wire.
        "communication_data_type": "fp32",
        "zero_optimization": zero,
        # The client optimizer is torch AdamW (same maths as the torch strategies, no
        # compiled extension); ZeRO calls it "untested" and offload would insist on its
        # own CPUAdam (a C++ build on first use) without these two switches.
        "zero_allow_untested_optimizer": True,
        "zero_force_ds_cpu_optimizer": False,
        # The training loop logs; DeepSpeed's own periodic prints would only duplicate it.
        "steps_per_print": 1 << 30,
        "wall_clock_breakdown": False,
        # A resume at another data-parallel size or ZeRO stage loads the universal
        # conversion of the checkpoint (train/checkpoint/deepspeed_io.py).
        "checkpoint": {"load_universal": bool(cfg.checkpoint.load_universal)},
    }
