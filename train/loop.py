"""The training loop: data -> engine step -> metrics. One loop for every strategy."""
from __future__ import annotations

import dataclasses
import gc
import json
import math
import time
from dataclasses import dataclass
from typing import Any, Dict, Optional, Tuple

import torch

from spec.batch import peak_lr
from spec.config import RunConfig
from spec.config_model import AUTO_VOCAB
from spec.model_size import flops_per_token
from spec.rundir import (STEPTIMES, STRAGGLERS, MetricsRow, Status, perplexity, read_run_json, shape_line,
                         update_run_json)
from spec.schedule import schedule, schedule_line
from train.checkpoint import Checkpointer
from train.evaluate import Evaluator
from train.data import ShardedLoader, build_loader
from train.harness.outcome import StragglerError
from train.harness.run import Task
from train.harness.watchdog import COLLECTIVE
from train.metrics import mfu, reset_peaks
from train.model import build_model, head_loss_chunk
from train.parallelize import parallelize
from train.profiling import StepProfiler
from train.steptimes import FIELDS, StepClock, Stragglers, breakdown, peers
from train.strategies.base import Engine
from train.torch_compat import all_gather_into
from train.tracking import Tracking

def lr_at(step: int, cfg: RunConfig, peak: float | None = None) -> float:
    """Linear warmup, then cosine decay to min_lr_ratio x the peak at the last step. The
    peak: optim.lr, scaled with the global batch by optim.lr_scaling (spec/batch.py)."""
    o, total = cfg.optim, cfg.train.steps
    peak = o.lr if peak is None else peak
    if step < o.warmup_steps:
        return peak * (step + 1) / o.warmup_steps
    span = max(1, total - o.warmup_steps)
    progress = min(1.0, (step - o.warmup_steps) / span)
    return peak * (o.min_lr_ratio + (1 - o.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def train(task: Task, ckpt: Checkpointer) -> Status:
    """Train up to cfg.train.steps, resuming from the newest committed checkpoint.

    Returns Status.COMPLETED, or Status.INTERRUPTED after a signal (checkpoint saved and committed).
    Rank 0 appends a metrics row per logged step, tagged with the segment.
    """
    cfg, layout, ctx, log = task.cfg, task.layout, task.ctx, task.log
    torch.manual_seed(cfg.train.seed)
    # markov data: rank 0..N race safely on a file lock to generate it
    loader = build_loader(cfg, layout.dp_rank(ctx.rank), layout.dp, cp_rank=layout.cp_rank(ctx.rank))
    coords = layout.coords(ctx.rank)
    if cfg.fault.trace_samples and coords["tp"] == coords["pp"] == coords["cp"] == 0:  # one rank per data-parallel share
        loader.trace = task.run_dir / "logs" / f"samples_seg{task.segment}_rank{ctx.rank}.txt"
    # Made before the build: with profile.memory, CUDA's allocator history covers the build too
    # and an out-of-memory error while building is dumped as one in a step is.
    profiler = StepProfiler(cfg.profile, task.run_dir, ctx.rank, ctx.world_size, layout.gpus_per_node, ctx.device,
                            log=log)
    try:
        engine, restored = _build_and_restore(task, ckpt)
    except torch.OutOfMemoryError as exc:
        profiler.oom(exc, "while building the model or loading its checkpoint")
        raise
    if ckpt.policy.background:
        ckpt.prepare_async()
    if restored is not None:
        loader.load_state_dict(restored["loader"])
        log(f"resumed from step {restored['step']} (segment {task.segment})")
        if "reshaped_from" in restored:  # README: Resume on another shape
            log(f"resharded: saved by {shape_line(restored['reshaped_from'])}, resumed on "
                f"{shape_line(ckpt.shape)} at global sample {loader.state.samples}")
    task.cfg = cfg = _schedule(task, loader)

    gc_every = cfg.train.gc_every_steps
    if gc_every > 0:  # see TrainConfig.gc_every_steps; re-enabled on the way out
        gc.collect()  # the imports are frozen (train.main.freeze_imports): this scans the run's objects
        gc.disable()
    tracking = Tracking(cfg, task.run_dir, loader.state.step, task.segment, ctx.is_main)
    profiler.begin_at(loader.state.step + 1)
    try:
        status = _steps(task, ckpt, engine, loader, tracking, profiler)
        task.flush_metrics()
        return status
    except torch.OutOfMemoryError as exc:  # profile.memory=true: the allocator's snapshot first
        profiler.oom(exc)
        raise
    finally:
        task.flush_metrics(quiet=True)  # after a failure: its rows too, never an error over it
        profiler.close()
        tracking.close()
        if gc_every > 0:
            gc.enable()


def _schedule(task: Task, loader: ShardedLoader) -> RunConfig:
    """The config the steps run: train.steps and optim.warmup_steps as train.epochs and
    optim.warmup_ratio derive them (spec/schedule.py), from where the loader stands."""
    cfg = task.cfg
    sched = schedule(cfg, task.layout, loader.state.step, loader.state.samples)
    if sched.samples_per_epoch != loader.num_windows:  # the launch's count is not the loader's epoch
        raise RuntimeError(f"spec.schedule.samples_per_epoch counts {sched.samples_per_epoch} samples, the loader "
                           f"{loader.num_windows} an epoch: make them agree")
    if task.ctx.is_main:
        task.log(schedule_line(cfg, sched))
        if read_run_json(task.run_dir).get("steps", sched.total_steps) != sched.total_steps:  # another global batch
            update_run_json(task.run_dir, steps=sched.total_steps)
    return sched.apply(cfg)


def _build_and_restore(task: Task, ckpt: Checkpointer) -> Tuple[Engine, Optional[Dict[str, Any]]]:
    """The engine (meta model -> parallelised, materialised once) and the checkpoint loaded into it."""
    cfg, layout, ctx, log = task.cfg, task.layout, task.ctx, task.log

    # A ZeRO checkpoint saved at another dp size / stage: the engine loads DeepSpeed's universal format.
    built = dataclasses.replace(cfg, checkpoint=dataclasses.replace(cfg.checkpoint, load_universal=True)) \
        if ckpt.plan_load() else cfg

    chunk = head_loss_chunk(cfg, ctx.device)

    def build() -> Engine:
        model = build_model(built.model, "meta")
        model.loss_chunk = chunk
        return parallelize(model, built, layout, ctx)

    engine = build()
    task.faults.after_build()
    log(f"rank {ctx.rank} coords {layout.coords(ctx.rank)} device {ctx.device} backend {ctx.backend}")
    if ctx.is_main and getattr(engine, "float8", None) is not None:  # strategy.float8: train/float8.py
        log(engine.float8.line())
        update_run_json(task.run_dir, float8=engine.float8.as_json())
    if ctx.is_main and cfg.model.vocab_size >= AUTO_VOCAB and layout.tp == 1 and layout.pp == 1:
        log(f"head + loss: {f'in chunks of {chunk} tokens' if chunk else 'whole logits'} "
            f"(model.loss_chunk_tokens={'null' if cfg.model.loss_chunk_tokens is None else cfg.model.loss_chunk_tokens}, "
            f"micro-batch of "
            f"{cfg.train.micro_batch_size * cfg.train.seq_len} tokens, vocabulary {cfg.model.vocab_size})")
    restored = ckpt.load_latest(engine, log)
    if restored is None and ckpt.engine_dirty:  # a rejected checkpoint was partly read into it
        log("no checkpoint loaded: building the model again (a rejected one was partly read into it)")
        engine = None  # freed before its replacement is built
        torch.manual_seed(cfg.train.seed)  # the global RNG as at a fresh start (weights: own generators)
        engine = build()
    return engine, restored


@dataclass
class Agreed:
    """What every rank knows after a step's all-gather: the same values everywhere."""

    loss: float  # of the global batch
    grad_norm: float
    peak_mem: int  # the busiest rank's peak
    peak_reserved: Optional[int]  # the busiest rank's allocator peak (CUDA; None elsewhere)
    preempted: bool  # some rank got a signal
    save_due: bool  # rank 0 asked for a checkpoint (minutes elapsed, or SAVE_NOW)
    times: Optional[torch.Tensor] = None  # (world, len(FIELDS)) float64 on CPU: per rank, train.steptimes.FIELDS
    profile_due: bool = False  # rank 0 saw RUN_DIR/PROFILE_NOW (train/profiling.py)


class StepTable:
    """The step's all-gather target: one (world, k) tensor kept from step to step and filled
    by one collective (:func:`train.torch_compat.all_gather_into`), so a step makes no tensor
    a rank (a list of W tensors is W allocations a step: 4,096 at 4,096 ranks). Allocated
    again only when k, the dtype or the device changes."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self.buffer: Optional[torch.Tensor] = None

    def gather(self, local: torch.Tensor) -> torch.Tensor:
        """Every rank's ``local`` (1-D, the same length everywhere), row r from rank r."""
        buf = self.buffer
        if buf is None or buf.shape[1] != local.numel() or buf.dtype != local.dtype or buf.device != local.device:
            buf = self.buffer = torch.empty(self.world_size, local.numel(), dtype=local.dtype, device=local.device)
        all_gather_into(buf, local)
        return buf


def _agree(task: Task, engine: Engine, step: int, loss: torch.Tensor, grad_norm: torch.Tensor,
           save_due: bool, clock: StepClock, profile_due: bool = False,
           gathered: Optional[StepTable] = None) -> Agreed:
    """One small all-gather per step carries each rank's loss, grad norm, peak memory,
    preemption flag, (rank 0's) "time to save" and "profile now" (RUN_DIR/PROFILE_NOW,
    train/profiling.py) decisions and step times
    (train/steptimes.py), so every rank takes the same branch after it. Sums run in rank
    order on every rank: unlike an all-reduce, whose summation order may vary, the logged
    loss is bitwise reproducible.

    The step's one read of the device by the host is the gathered table: the loss and the
    grad norm join the host's values on the device (no ``.item()`` of either), and on CUDA
    the step clock's wait for the step's last kernel (train/steptimes.py: every rank's busy
    time is its device time, what the straggler scores compare) comes first. ``gathered``:
    the loop's :class:`StepTable`, kept from step to step (None: a new one)."""
    ctx, flag = task.ctx, task.flag
    reserved = engine.peak_reserved_bytes()
    task.faults.at_step_end(step, task.watchdog)
    host = [engine.peak_memory_bytes(), flag.code, float(save_due), -1.0 if reserved is None else reserved,
            float(profile_due)] + clock.arrive()
    local = torch.cat([torch.stack([loss.detach().reshape(()), grad_norm.detach().reshape(())]).to(torch.float64),
                       torch.tensor(host, dtype=torch.float64).to(loss.device)])
    gathered = StepTable(ctx.world_size) if gathered is None else gathered
    task.watchdog.phase(COLLECTIVE, step)
    table = gathered.gather(local)
    clock.release()
    task.watchdog.progress(step + 1)
    table = table.cpu()  # the CPU buffer itself on CPU: read before the next step refills it
    flag.agreed_requeue = bool(table[:, 3].max() >= 2)  # some rank got the user signal
    # The times stay a tensor (a copy, the next step refills the table): train/steptimes.py
    # reads them with tensor operations, no Python float a rank (W x 4 of them at W ranks).
    agreed = Agreed(loss=float(table[:, 0].sum() / ctx.world_size),
                    grad_norm=float(table[:, 1].sum() / ctx.world_size), peak_mem=int(table[:, 2].max()),
                    peak_reserved=None if table[:, 5].max() < 0 else int(table[:, 5].max()),
                    preempted=bool(table[:, 3].any()), save_due=bool(table[:, 4].any()),
                    profile_due=bool(table[:, 6].any()),
                    times=table[:, 7:7 + len(FIELDS)].clone())
    if not math.isfinite(agreed.loss):
        raise FloatingPointError(f"loss is {agreed.loss} at step {step + 1}; lower optim.lr")
    return agreed


class Meter:
    """A step's metrics row from its timing and the agreed values."""

    def __init__(self, cfg: RunConfig, world_size: int, device_type: str, global_batch: int) -> None:
        self.cfg, self.world_size, self.global_batch = cfg, world_size, global_batch
        self.tokens_per_step = global_batch * cfg.train.seq_len
        self.flops_token = flops_per_token(cfg.model, cfg.train.seq_len)
        # The device the ranks run on, not the profile: a step on CPUs has no GPU peak to meet.
        self.n_gpus = world_size if device_type == "cuda" else 0
        self.peak = cfg.cluster.peak_tflops_bf16 if self.n_gpus else None

    def row(self, step: int, lr: float, agreed: Agreed, dt: float, segment: int,
            val: Optional[float] = None, epoch: Optional[float] = None) -> MetricsRow:
        return MetricsRow(
            val_loss=val, epoch=epoch, val_ppl=None if val is None else perplexity(val),
            step=step + 1, loss=agreed.loss, lr=lr, grad_norm=agreed.grad_norm, step_time_s=dt,
            tokens_per_s=self.tokens_per_step / dt, samples_per_s=self.global_batch / dt,
            peak_mem_bytes=agreed.peak_mem, peak_reserved_bytes=agreed.peak_reserved,
            mfu=mfu(self.tokens_per_step / dt, self.flops_token, self.peak, self.n_gpus),
            global_batch_size=self.global_batch, tokens_per_step=self.tokens_per_step,
            world_size=self.world_size, segment=segment, time=time.time(),
            **(breakdown(agreed.times) if agreed.times is not None else {}),
        )


def _steps(task: Task, ckpt: Checkpointer, engine: Engine, loader: ShardedLoader, tracking: Tracking,
           profiler: StepProfiler) -> Status:
    cfg, ctx, log = task.cfg, task.ctx, task.log
    meter = Meter(cfg, ctx.world_size, ctx.device.type, loader.global_batch)
    evaluator = Evaluator(cfg, task.layout, ctx)
    peak = peak_lr(cfg, task.layout)
    ckpt.policy.last_save = time.monotonic()  # the interval counts from the segment's start
    task.watchdog.begin(loader.state.step)
    first = loader.state.step
    clock = StepClock(ctx.device)
    gathered = StepTable(ctx.world_size)
    t = cfg.train
    stragglers = Stragglers(t.straggler_score, t.straggler_steps, t.straggler_min_s, groups=peers(task.layout))
    loader.pin = ctx.device.type == "cuda"
    for step in range(first, cfg.train.steps):
        if cfg.train.gc_every_steps > 0 and step % cfg.train.gc_every_steps == 0:
            gc.collect(1)
        reset_peaks(ctx.device)  # each row's memory is its own step's (not preflight's, build's, eval's)
        profiler.before(step + 1)
        t0 = time.perf_counter()
        task.watchdog.phase("compute", step)
        lr = lr_at(step, cfg, peak)
        clock.begin()
        batches = loader.next_step()
        clock.data_ready()
        loss, grad_norm = engine.train_step(batches, lr, loader.loss_share)  # train/loss.py
        clock.computed()
        if step + 1 < cfg.train.steps:
            loader.prefetch()  # while the device runs the step (train/data/loader.py)
        agreed = _agree(task, engine, step, loss, grad_norm, ckpt.policy.asked(), clock, profiler.asked(),
                        gathered)
        dt = time.perf_counter() - t0
        val = evaluator.run(engine) if evaluator.due(step + 1) else None
        if ctx.is_main:
            _report(task, meter, tracking, step, lr, agreed, dt, val, loader.state.samples / loader.num_windows)
        if stragglers.update(agreed.times, step + 1):
            _stragglers(task, stragglers, step, ckpt, engine, loader)
        if ckpt.policy.due(step + 1, cfg.train.steps, agreed.save_due, agreed.preempted):
            if agreed.preempted and ctx.is_main:  # when the signal came (bench/goodput.py); this line: save start
                received = task.flag.received_at
                log(f"signal agreed at step {step + 1}: received by rank 0 at "
                    f"{'unknown' if received is None else f'{received:.3f}'}; saving")
            _save(task, ckpt, engine, loader, step, agreed.preempted)
            if agreed.preempted:
                ckpt.close()  # old checkpoints pruned before the job is requeued
                return Status.INTERRUPTED
        ckpt.poll()
        if ckpt.policy.background and step == first and ckpt.reserve_async(engine):
            log("host buffers for async saves: being allocated in the background")
        profiler.after(step + 1, agreed.profile_due)
        task.faults.after_step()
    ckpt.close()
    if cfg.peft.verify_base and cfg.peft.method:
        _verify_base(task, engine)
    return Status.COMPLETED


def _verify_base(task: Task, engine) -> None:
    """peft.verify_base: the frozen base, gathered, bit for bit as loaded (run.json)."""
    from train.lora import changed_base
    from train.lora_io import base_source

    cfg = task.cfg
    compared, changed = changed_base(engine.module, base_source(cfg)[1], cfg.model.tie_embeddings, task.ctx.is_main)
    if task.ctx.is_main:
        update_run_json(task.run_dir, lora_base={"compared": compared, "changed": changed})
        base = cfg.model.hf_path or f"the initial weights of seed {cfg.train.seed}"
        task.log(f"LoRA base after the last step: {compared} frozen tensors compared with {base}, "
                 f"{len(changed)} changed{': ' + ', '.join(changed[:5]) if changed else ''}")


def _report(task: Task, meter: Meter, tracking: Tracking, step: int, lr: float, agreed: Agreed, dt: float,
            val: Optional[float], epoch: float) -> None:
    """Rank 0: the step's metrics row and log line (a logged step, the last, an evaluated
    one) and, with train.steptimes_file, its per-rank times."""
    cfg = task.cfg
    if (step + 1) % cfg.train.log_every == 0 or step + 1 == cfg.train.steps or val is not None:
        row = meter.row(step, lr, agreed, dt, task.segment, val, epoch=epoch)
        task.write_metrics(row)
        tracking.log(row)
        task.log(f"step {step + 1}/{cfg.train.steps} loss {agreed.loss:.4f} tokens/s "
                 f"{meter.tokens_per_step / dt:.0f} step {dt * 1000:.1f} ms")
    if cfg.train.steptimes_file:
        with open(task.run_dir / STEPTIMES, "a") as f:
            f.write(json.dumps({"step": step + 1, "segment": task.segment, "fields": FIELDS,
                                "ranks": agreed.times.tolist()}) + "\n")


def _stragglers(task: Task, stragglers: Stragglers, step: int, ckpt: Checkpointer, engine: Engine,
                loader: ShardedLoader) -> None:
    """Ranks were flagged at ``step``: rank 0 writes RUN_DIR/stragglers.json (every flagged
    rank, its node and host) and a log line; with ``train.straggler_action=restart_without``
    every rank (they agree: the same table) saves the step and raises StragglerError."""
    hosts = read_run_json(task.run_dir).get("hostnames") or []
    per_node = task.layout.gpus_per_node
    flagged = [{**f, "node": f["rank"] // per_node, "host": hosts[f["rank"] // per_node]
                if f["rank"] // per_node < len(hosts) else None} for f in stragglers.flagged.values()]
    new = [f for f in flagged if f["step"] == step + 1]
    if task.ctx.is_main:
        (task.run_dir / STRAGGLERS).write_text(json.dumps(
            {"step": step + 1, "segment": task.segment, "threshold_score": stragglers.score,
             "steps_in_a_row": stragglers.steps, "ranks": flagged}, indent=1))
        for f in new:
            task.log(f"straggler: rank {f['rank']} (node {f['node']}) score {f['score']:.2f} for {f['steps_in_a_row']} "
                     f"steps: {f['self_s'] * 1000:.0f} ms of its own a step vs its peers' median "
                     f"{f['median_self_s'] * 1000:.0f} ms (stragglers.json)")
    if task.cfg.train.straggler_action == "restart_without":
        _save(task, ckpt, engine, loader, step, preempted=True)  # nothing done is lost
        ckpt.close()
        raise StragglerError(new[0]["rank"], new[0]["host"] or "?", new[0]["score"], new[0]["steps_in_a_row"])


def _save(task: Task, ckpt: Checkpointer, engine: Engine, loader: ShardedLoader, step: int, preempted: bool) -> None:
    """The checkpoint of the step that just ran: blocking on a signal, else as configured.
    The checkpointer tells the watchdog (a save has its own bound) and the policy (the
    interval starts again, SAVE_NOW is answered)."""
    background = ckpt.policy.background and not preempted
    task.flush_metrics()  # the rows of the steps it holds are written before it commits
    ckpt.save(engine, step + 1, {"loader": loader.state_dict()}, blocking=not background)
    task.watchdog.progress(step + 1)
    task.log(f"checkpoint step {step + 1} {'started' if background else 'committed'} in {ckpt.last_save_s:.2f} s")
