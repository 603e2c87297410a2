"""The training loop: data -> engine step -> metrics. One loop for every strategy."""
from __future__ import annotations

import gc
import math
import time
from pathlib import Path

import torch
import torch.distributed as dist

from spec.config import RunConfig
from train.data import ShardedLoader, token_file
from train.harness.dist import DistContext
from spec.layout import Layout
from train.metrics import mfu, peak_memory_bytes
from spec.model_size import flops_per_token
from train.model import build_model
from train.checkpoint import Checkpointer
from train.parallelize import parallelize
from train.harness.preempt import PreemptionFlag
from train.harness.watchdog import COLLECTIVE, Watchdog
from spec.rundir import MetricsRow, append_metrics


# A checkpoint on demand: `touch RUN_DIR/SAVE_NOW`; the next step boundary saves it.
SAVE_REQUEST = "SAVE_NOW"


def lr_at(step: int, cfg: RunConfig) -> float:
    """Linear warmup, then cosine decay to min_lr_ratio x lr at the last step."""
    o, total = cfg.optim, cfg.train.steps
    if step < o.warmup_steps:
        return o.lr * (step + 1) / o.warmup_steps
    span = max(1, total - o.warmup_steps)
    progress = min(1.0, (step - o.warmup_steps) / span)
    return o.lr * (o.min_lr_ratio + (1 - o.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def train(cfg: RunConfig, layout: Layout, ctx: DistContext, run_dir: Path, segment: int, log,
          flag: PreemptionFlag, ckpt: Checkpointer, watchdog: Watchdog) -> str:
    """Train up to cfg.train.steps, resuming from the newest committed checkpoint.

    Returns "completed", or "interrupted" after a signal (checkpoint saved and committed).
    Rank 0 appends a metrics row per logged step, tagged with the segment.
    """
    torch.manual_seed(cfg.train.seed)
    coords = layout.coords(ctx.rank)
    dp_rank = layout.dp_rank(ctx.rank)
    path = token_file(cfg.data, cfg.model.vocab_size)  # rank 0..N race safely on a file lock
    loader = ShardedLoader(path, cfg.model.vocab_size, cfg.train.seq_len, cfg.train.micro_batch_size,
                           cfg.train.grad_accum, dp_rank, layout.dp, seed=cfg.data.seed)
    def build():
        return parallelize(build_model(cfg.model, "meta"), cfg, layout, ctx)

    engine = build()
    log(f"rank {ctx.rank} coords {coords} device {ctx.device} backend {ctx.backend}")
    restored = ckpt.load_latest(engine, log)
    if restored is None and ckpt.engine_dirty:  # a rejected checkpoint was partly read into it
        log("no checkpoint loaded: building the model again (a rejected one was partly read into it)")
        engine = None  # freed before its replacement is built
        torch.manual_seed(cfg.train.seed)  # the global RNG as at a fresh start (weights: own generators)
        engine = build()
    if cfg.checkpoint.async_save:
        ckpt.prepare_async(engine)
    if restored is not None:
        loader.load_state_dict(restored["loader"])
        log(f"resumed from step {restored['step']} (segment {segment})")

    gc_every = cfg.train.gc_every_steps
    if gc_every > 0:  # see TrainConfig.gc_every_steps; re-enabled on the way out
        gc.collect()
        gc.freeze()  # the model, optimizer and imports: never scanned again
        gc.disable()
    try:
        return _steps(cfg, ctx, run_dir, segment, log, flag, ckpt, watchdog, engine, loader)
    finally:
        if gc_every > 0:
            gc.enable()
            gc.unfreeze()


def _steps(cfg: RunConfig, ctx: DistContext, run_dir: Path, segment: int, log, flag: PreemptionFlag,
           ckpt: Checkpointer, watchdog: Watchdog, engine, loader: ShardedLoader) -> str:
    last_save = time.monotonic()
    tokens_per_step = loader.global_batch * cfg.train.seq_len
    flops_token = flops_per_token(cfg.model, cfg.train.seq_len)
    n_gpus = ctx.world_size if ctx.device.type == "cuda" or cfg.cluster.accelerator == "gpu" else 0
    peak = cfg.cluster.peak_tflops_bf16 if n_gpus else None
    watchdog.begin(loader.state.step)
    first = loader.state.step
    for step in range(first, cfg.train.steps):
        if cfg.train.gc_every_steps > 0 and step % cfg.train.gc_every_steps == 0:
            gc.collect(1)
        t0 = time.perf_counter()
        watchdog.phase("compute", step)
        lr = lr_at(step, cfg)
        loss, grad_norm = engine.train_step(loader.next_step(), lr)
        # One small all-gather per step carries each rank's loss, grad norm, peak memory,
        # preemption flag and (rank 0's) "time to save" decision, so every rank takes the
        # same branch below. Sums run in rank order on every rank: unlike an all-reduce,
        # whose summation order may vary, the logged loss is bitwise reproducible.
        minutes_due = cfg.checkpoint.every_minutes > 0 and ctx.is_main and \
            time.monotonic() - last_save >= cfg.checkpoint.every_minutes * 60
        requested = ctx.is_main and (run_dir / SAVE_REQUEST).exists()  # on demand: touch RUN_DIR/SAVE_NOW
        minutes_due = minutes_due or requested
        local = torch.tensor([loss.item(), grad_norm.item(), peak_memory_bytes(ctx.device), flag.code,
                              float(minutes_due)], dtype=torch.float64, device=loss.device)
        gathered = [torch.empty_like(local) for _ in range(ctx.world_size)]
        if step + 1 == cfg.fault.raise_at_step:
            raise RuntimeError(f"fault.raise_at_step={step + 1}: injected failure")
        if ctx.rank == cfg.fault.hang_rank and step + 1 == cfg.fault.hang_at_step:
            watchdog.phase("fault: sleeping before the collective", step)
            time.sleep(cfg.fault.hang_s)
        watchdog.phase(COLLECTIVE, step)
        dist.all_gather(gathered, local)
        watchdog.progress(step + 1)
        table = torch.stack(gathered).cpu()
        loss_value = float(table[:, 0].sum() / ctx.world_size)  # = loss of the global batch
        norm_value = float(table[:, 1].sum() / ctx.world_size)
        peak_mem = int(table[:, 2].max())  # the busiest rank's peak
        preempted, save_due = bool(table[:, 3].any()), bool(table[:, 4].any())
        flag.agreed_requeue = bool(table[:, 3].max() >= 2)  # some rank got the user signal
        if not math.isfinite(loss_value):
            raise FloatingPointError(f"loss is {loss_value} at step {step + 1}; lower optim.lr")
        dt = time.perf_counter() - t0
        row = MetricsRow(
            step=step + 1, loss=loss_value, lr=lr, grad_norm=norm_value, step_time_s=dt,
            tokens_per_s=tokens_per_step / dt, samples_per_s=loader.global_batch / dt,
            peak_mem_bytes=peak_mem, mfu=mfu(tokens_per_step / dt, flops_token, peak, n_gpus),
            global_batch_size=loader.global_batch, tokens_per_step=tokens_per_step,
            world_size=ctx.world_size, segment=segment, time=time.time(),
        )
        if ctx.is_main and ((step + 1) % cfg.train.log_every == 0 or step + 1 == cfg.train.steps):
            append_metrics(run_dir, row)
            log(f"step {step + 1}/{cfg.train.steps} loss {loss_value:.4f} tokens/s {row.tokens_per_s:.0f} "
                f"step {dt * 1000:.1f} ms")
        every = cfg.checkpoint.every_steps
        if preempted or save_due or (every and (step + 1) % every == 0 and step + 1 < cfg.train.steps):
            fault_kill = cfg.fault.kill_in_save_at_step == step + 1
            watchdog.phase("checkpoint", step + 1)
            background = cfg.checkpoint.async_save and not preempted
            ckpt.save(engine, step + 1, {"loader": loader.state_dict()}, kill_before_commit=fault_kill,
                      blocking=not background)
            last_save = time.monotonic()
            watchdog.progress(step + 1)
            if ctx.is_main:
                (run_dir / SAVE_REQUEST).unlink(missing_ok=True)
            log(f"checkpoint step {step + 1} {'started' if background else 'committed'} in "
                f"{ckpt.last_save_s:.2f} s")
            if preempted:
                ckpt.close()  # old checkpoints pruned before the job is requeued
                return "interrupted"
        ckpt.poll()
        if cfg.checkpoint.async_save and step == first and ckpt.reserve_async(engine):
            log("host buffers for async saves: being allocated in the background")
        if cfg.fault.step_delay_s:
            time.sleep(cfg.fault.step_delay_s)
    ckpt.close()
    return "completed"
