"""Pipeline bubble: the measured idle fraction of torch's pipeline schedules against the formula.

p processes (gloo, torch.multiprocessing) each hold one pipeline rank of a model whose
stages do work of known duration: every stage's forward sleeps t_f per microbatch and its
backward sleeps t_b = 2 t_f (a custom autograd Function; time.sleep takes no CPU, so 4
ranks fit on 2 cores, and the tensors are (2, 8) so communication is negligible). For
ScheduleGPipe ("gpipe"), Schedule1F1B ("1f1b") and ScheduleInterleaved1F1B
("interleaved_1f1b", v = 2 stages per rank: stage ids rank and rank + p) of
torch.distributed.pipelining, at p ranks and m microbatches, it measures:

- busy_r: the time rank r spends inside the stage work (the sleeps, timed in the Function);
- the step's makespan T: from the common start (barrier, then every rank calls
  schedule.step()) to the moment the last rank returns from it. The clocks are
  comparable: time.perf_counter is CLOCK_MONOTONIC, one clock for every process here;
- idle fraction = mean over ranks of 1 - busy_r / T (also its max over ranks). The
  "own wall" column uses each rank's own step time instead of T: ranks that return early
  (the last ones, whose final backward comes first) look less idle that way.

Every rank does the same total work per step in every schedule, m (t_f + t_b): with v
chunks per rank each chunk's forward sleeps t_f / v and its backward t_b / v.

The formula. Ideal time (no bubble): m (t_f + t_b). GPipe and 1F1B: the first forward
reaches the last rank after (p - 1) t_f and the last backward returns to the first rank
(p - 1) t_b after the last rank's, so every rank waits (p - 1)(t_f + t_b) in all (1F1B
only reorders the steady state to bound the activations in flight, not the fill and the
drain), T = (m + p - 1)(t_f + t_b) and

    idle = (p - 1) / (m + p - 1).

Interleaved with v chunks per rank (Narayanan et al. 2021, arXiv 2104.04473): the fill
and drain move through chunks of t_f / v and t_b / v, so the bubble is
(p - 1)(t_f + t_b) / v while the ideal time stays m (t_f + t_b):

    idle = ((p - 1) / v) / (m + (p - 1) / v) = (p - 1) / (v m + p - 1).

The goal is measured / formula within 10 % (0.9 .. 1.1). torch's interleaved schedule
runs microbatches in rounds of min(m, p) ("flex" PP: rounds = max(1, m // p), m must be
a multiple of the rounds); the paper's schedule (and this formula) assumes m % p == 0.
Schedule1F1B requires m >= p. A configuration the schedule refuses is printed as skipped.

Each action of the schedule also costs a few ms of Python and gloo send/recv here (the
"excess" column: makespan beyond what the action order gives for the measured work), so
t_f is 200 ms by default: at 40 ms that fixed cost alone puts most rows 10-90 % above the
formula, more for interleaved (twice the actions, each half as long). About 4 minutes.

    .venv/bin/python bench/pipeline.py [--ranks 2,4] [--microbatches 4,8] [--tf-ms 200] [--steps 2]
                                       [--schedules gpipe,1f1b,interleaved_1f1b] [--chunks 2]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
os.environ.setdefault("OMP_NUM_THREADS", "1")  # inherited by the spawned ranks

SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b")
DIM = 8  # features per row: tiny tensors, communication is negligible
MB_ROWS = 2  # rows per microbatch

BUSY = [0.0]  # seconds inside the stage work on this rank since the last reset


def formula(schedule: str, p: int, m: int, v: int) -> float:
    """Idle fraction of the ideal schedule: (p - 1) / (v m + p - 1), v = 1 unless interleaved."""
    v = v if schedule == "interleaved_1f1b" else 1
    return (p - 1) / (v * m + p - 1)


def orders(schedule: str, sched, p: int, m: int) -> dict[int, list[tuple[str, int, int]]]:
    """rank -> its compute actions (kind "F" | "B", stage, microbatch) in the order step() runs them.
    Interleaved and GPipe: the schedule's ``pipeline_order``. 1F1B: the order of
    Schedule1F1B._step_microbatches (warmup of p - rank forwards, then backward / forward
    pairs, then the remaining backwards), since its ``pipeline_order`` in torch 2.13 is not
    what step() runs (the last rank's list starts with F1 and reaches F8 at m = 8)."""
    if schedule != "1f1b":
        return {r: [(a.computation_type.value, a.stage_index, a.microbatch_index) for a in acts
                    if a is not None and a.computation_type.value in ("F", "B")]
                for r, acts in sched.pipeline_order.items()}
    out = {}
    for r in range(p):
        warmup = min(m, p - r)
        acts = [("F", r, i) for i in range(warmup)]
        for b in range(m):
            acts.append(("B", r, b))
            if warmup + b < m:
                acts.append(("F", r, warmup + b))
        out[r] = acts
    return out


def simulate(order: dict, num_stages: int, t_f: float, t_b: float) -> float:
    """Idle fraction of an action order (see ``orders``) with forwards of t_f, backwards of
    t_b and instant communication: each rank runs its actions in order, an action starts
    when its rank is free and its inputs exist (F(s, i) after F(s - 1, i); B(s, i) after
    F(s, i) and B(s + 1, i))."""
    queues = {r: list(acts) for r, acts in order.items()}
    done: dict[tuple, float] = {}
    free = dict.fromkeys(queues, 0.0)
    busy = dict.fromkeys(queues, 0.0)
    while any(queues.values()):
        progressed = False
        for r, queue in queues.items():
            while queue:
                kind, s, i = queue[0]
                deps = [("F", s - 1, i)] if kind == "F" and s > 0 else []
                if kind == "B":
                    deps = [("F", s, i)] + ([("B", s + 1, i)] if s < num_stages - 1 else [])
                if any(d not in done for d in deps):
                    break
                length = t_f if kind == "F" else t_b
                free[r] = max([free[r]] + [done[d] for d in deps]) + length
                busy[r] += length
                done[(kind, s, i)] = free[r]
                queue.pop(0)
                progressed = True
        if not progressed:
            raise RuntimeError(f"the action order deadlocks: {order}")
    span = max(free.values())
    return sum(1 - b / span for b in busy.values()) / len(busy)


def _work(seconds: float, like) -> None:
    if like.device.type == "meta":  # shape inference on meta tensors (if any): no work
        return
    t0 = time.perf_counter()
    time.sleep(seconds)
    BUSY[0] += time.perf_counter() - t0


def _stage_module(t_f: float, t_b: float):
    import torch

    class SleepWork(torch.autograd.Function):
        """y = x * w; forward sleeps t_f, backward sleeps t_b."""

        @staticmethod
        def forward(ctx, x, w):
            ctx.save_for_backward(x, w)
            _work(t_f, x)
            return x * w

        @staticmethod
        def backward(ctx, grad):
            x, w = ctx.saved_tensors
            _work(t_b, grad)
            return grad * w, (grad * x).sum(0)

    class SleepStage(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.ones(DIM))  # one small parameter so backward runs

        def forward(self, x):
            return SleepWork.apply(x, self.w)

    return SleepStage()


def _build(schedule: str, rank: int, p: int, m: int, v: int, t_f: float):
    """The rank's stages and the schedule; a ValueError when the schedule refuses (p, m)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

    def loss_fn(out, tgt):
        return ((out - tgt) ** 2).mean()

    cpu, group = torch.device("cpu"), dist.group.WORLD
    if schedule == "interleaved_1f1b":
        stages = [PipelineStage(_stage_module(t_f / v, 2 * t_f / v), rank + c * p, v * p, cpu, group=group)
                  for c in range(v)]
        return stages, ScheduleInterleaved1F1B(stages, n_microbatches=m, loss_fn=loss_fn)
    stages = [PipelineStage(_stage_module(t_f, 2 * t_f), rank, p, cpu, group=group)]
    cls = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[schedule]
    return stages, cls(stages[0], n_microbatches=m, loss_fn=loss_fn)


def worker(rank: int, p: int, port: int, configs: list, t_f: float, v: int, steps: int, out: dict) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(p), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=p)
    try:
        for schedule, m in configs:
            try:
                stages, sched = _build(schedule, rank, p, m, v, t_f)
            except ValueError as e:  # every rank refuses the same (p, m)
                out[(schedule, p, m, rank)] = str(e).split("\n")[0]
                continue
            if rank == 0:
                n = len(stages)  # the order's idle fraction depends on t_b / t_f only
                out[(schedule, p, m, "sim")] = simulate(orders(schedule, sched, p, m), n * p, 1 / n, 2 / n)
            torch.manual_seed(0)
            x, tgt = torch.randn(m * MB_ROWS, DIM), torch.randn(m * MB_ROWS, DIM)
            first, last = any(s.is_first for s in stages), any(s.is_last for s in stages)

            def step():
                args = (x,) if first else ()
                kwargs = {"target": tgt} if last else {}
                sched.step(*args, **kwargs)

            step()  # warmup: shape inference, buffers
            rows = []
            for _ in range(steps):
                for s in stages:
                    s.submod.zero_grad(set_to_none=True)
                dist.barrier()
                BUSY[0] = 0.0
                t0 = time.perf_counter()
                step()
                t1 = time.perf_counter()
                rows.append((t0, t1, BUSY[0]))
            dist.barrier()
            out[(schedule, p, m, rank)] = rows
            del stages, sched
    finally:
        dist.destroy_process_group()


def summarize(rows_by_rank: list[list[tuple]]) -> tuple[float, float, float, float, float]:
    """(mean idle, max-rank idle, own-wall mean idle, busy per rank, makespan) over ranks,
    each the median over steps."""
    mean, worst, own, busy, spans = [], [], [], [], []
    for step_rows in zip(*rows_by_rank):
        span = max(r[1] for r in step_rows) - min(r[0] for r in step_rows)
        idle = [1 - r[2] / span for r in step_rows]
        mean.append(statistics.fmean(idle))
        worst.append(max(idle))
        own.append(statistics.fmean(1 - r[2] / (r[1] - r[0]) for r in step_rows))
        busy.append(statistics.fmean(r[2] for r in step_rows))
        spans.append(span)
    return tuple(statistics.median(x) for x in (mean, worst, own, busy, spans))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", default="2,4", help="pipeline ranks p, comma-separated")
    parser.add_argument("--microbatches", default="4,8", help="microbatches m, comma-separated")
    parser.add_argument("--tf-ms", type=float, default=200.0, help="forward time per microbatch per rank; t_b = 2 t_f")
    parser.add_argument("--steps", type=int, default=2, help="timed steps per configuration (after one warmup)")
    parser.add_argument("--schedules", default=",".join(SCHEDULES))
    parser.add_argument("--chunks", type=int, default=2, help="v: stages per rank of interleaved_1f1b")
    args = parser.parse_args()
    ranks = [int(r) for r in args.ranks.split(",")]
    mbs = [int(m) for m in args.microbatches.split(",")]
    schedules = args.schedules.split(",")
    unknown = set(schedules) - set(SCHEDULES)
    if unknown:
        parser.error(f"unknown schedules {sorted(unknown)}; choose from {', '.join(SCHEDULES)}")
    import torch.multiprocessing as mp

    from launcher.local import free_port

    t_f, v = args.tf_ms / 1e3, args.chunks
    configs = [(s, m) for s in schedules for m in mbs]
    manager = mp.Manager()
    out = manager.dict()
    for p in ranks:
        mp.spawn(worker, args=(p, free_port(), configs, t_f, v, args.steps, out), nprocs=p)
    res = dict(out)

    print(f"t_f = {args.tf_ms:g} ms, t_b = {2 * args.tf_ms:g} ms per microbatch per rank (split over v chunks), "
          f"median of {args.steps} steps; idle = 1 - busy / step makespan, mean over ranks")
    head = (f"{'schedule':<17} {'p':>2} {'m':>3} {'v':>2} {'busy/ideal':>10} {'span ms':>8} {'excess':>7} "
            f"{'idle':>7} {'max rank':>8} {'own wall':>8} {'order':>6} {'formula':>8} {'ratio':>6}  goal 0.9..1.1")
    print(head)
    print("-" * len(head))
    misses = 0
    for p in ranks:
        for s, m in configs:
            vv = v if s == "interleaved_1f1b" else 1
            rows = [res.get((s, p, m, r)) for r in range(p)]
            if isinstance(rows[0], str):
                print(f"{s:<17} {p:>2} {m:>3} {vv:>2}  skipped: {rows[0]}")
                continue
            idle, worst, own, busy, span = summarize(rows)
            order, f = res[(s, p, m, "sim")], formula(s, p, m, v)
            excess = span - busy / (1 - order)  # makespan beyond the order's, given the measured work
            ratio = idle / f
            ok = 0.9 <= ratio <= 1.1
            misses += not ok
            print(f"{s:<17} {p:>2} {m:>3} {vv:>2} {busy / (m * 3 * t_f):>10.3f} {span * 1e3:>8.1f} "
                  f"{excess * 1e3:>7.1f} {idle:>7.3f} {worst:>8.3f} {own:>8.3f} {order:>6.3f} {f:>8.3f} "
                  f"{ratio:>6.2f}  {'ok' if ok else 'MISS'}")
    print(f"{misses} configuration(s) outside 10 % of the formula")


if __name__ == "__main__":
    main()
