"""The training loop's own per-step, per-save and per-failure work at W = 8, 512 and 4,096
ranks, in one process (../shared/DESIGN.md: scale is designed, then simulated).

This process plays rank 0 and then the last rank of a W-rank job on torch's fake process
group (:func:`train.torch_compat.fake_process_group`: every collective answered locally).
For each W and each of the two ranks it measures:

- a step's host bookkeeping: the agreement (train/loop.py ``_agree`` with the loop's
  ``StepTable``, its task and engine stand-ins as tests/test_agreement_scale.py has them,
  the real ``Watchdog``'s ``phase``/``progress``), the straggler scores
  (``Stragglers.update``, every rank a peer: data parallel), one heartbeat written
  (``Watchdog._beat``: in a run the watchdog's thread writes one every interval, >= 1 s,
  so one a step is the worst case) and, on rank 0, one metrics row (``MetricsRow`` with
  the step-time breakdown, ``spec.rundir.append_metrics``): the median over ``--steps``
  steps after a warm-up, and the file calls a step. Not counted: the step's all-gather,
  timed apart (``collective``), the fake backend's host copy of W rows (NCCL's is on the
  device);
- the async save's coordination group (``coordination_group``; before it, the gloo group
  ``AsyncSaver.prepare`` made, which the fake backend cannot make: n/a);

and for the whole job (every rank simulated, as tests/test_file_work_scale.py does:
rank 0's broadcast object handed to the others), the file calls and seconds of

- a restore of one committed checkpoint of 2W+1 small files (listing, survey, each rank's
  checksums, readahead, manifest shape, its extra state; DCP's own reads not simulated);
- a failure's classification on every rank from W heartbeats (a node's 8 ranks dead).

A counter on ``os.stat``/``lstat``/``open``/``scandir``/``listdir``/``replace``/``rename``
and ``open``/``io.open`` counts the calls on paths under the bench's temporary directory.

The code before the scale changes verified every file on every rank and read every
heartbeat on every rank (W^2 calls a job): those two are run only up to
``--quadratic-max`` ranks there, and the table says "skipped (W^2)" above it.

    python bench/scale.py --worlds 8,512,4096 --steps 50
"""
from __future__ import annotations

import argparse
import builtins
import functools
import inspect
import io
import json
import os
import statistics
import sys
import tempfile
import time
import zlib
from collections import Counter
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace
from unittest import mock
from typing import Dict, List, Optional, Tuple, Union

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from spec.rundir import MetricsRow, append_metrics  # noqa: E402
from train import loop  # noqa: E402
from train.checkpoint import async_save, manifest  # noqa: E402
from train.checkpoint.backend import DCPBackend  # noqa: E402
from train.checkpoint.dcp_reader import readahead  # noqa: E402
from train.harness.faults import Faults  # noqa: E402
from train.harness.watchdog import Watchdog, classify_failure  # noqa: E402
from train.steptimes import FIELDS, StepClock, Stragglers, breakdown  # noqa: E402
from train.torch_compat import fake_process_group  # noqa: E402

CALLS = [(os, "stat"), (os, "lstat"), (os, "open"), (builtins, "open"), (io, "open"), (os, "scandir"),
         (os, "listdir"), (os, "replace"), (os, "rename")]
RANKS_PER_NODE = 8
DEAD_NODE = 1  # its ranks stopped beating: a node failure
WARMUP = 5
SURVEYED = hasattr(manifest, "shared_survey")  # rank 0 surveys, broadcasts (after the scale changes)
PARTS = ("agree", "stragglers", "row", "beat")  # the step's host work, without the collective
COLLECTIVES = ("all_gather_single", "all_gather_into_tensor", "all_gather")  # the agreement's, now and before


@contextmanager
def counting(root: Path):
    """A Counter of the file calls on paths under ``root`` while in the block."""
    calls: Counter = Counter()
    prefix = str(root)

    def wrap(name, fn):
        def counted(path, *args, **kwargs):
            if isinstance(path, (str, os.PathLike)) and os.fspath(path).startswith(prefix):
                calls[name] += 1
            return fn(path, *args, **kwargs)
        return counted

    saved = [(mod, name, getattr(mod, name)) for mod, name in CALLS]
    for mod, name, fn in saved:
        setattr(mod, name, wrap(f"{mod.__name__}.{name}", fn))
    try:
        yield calls
    finally:
        for mod, name, fn in saved:
            setattr(mod, name, fn)


@contextmanager
def timed_collectives(spent: List[Tuple[float, float]]):
    """This thread's CPU seconds and the wall seconds of each call of the agreement's
    all-gather into ``spent``, apart from the loop's own work: the loop calls it through
    ``torch.distributed``, wrapped here (torch's inner calls go through ``distributed_c10d``)."""
    def timed(fn, *args, **kwargs):
        t0, w0 = time.thread_time(), time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            spent.append((time.thread_time() - t0, time.perf_counter() - w0))

    with mock.patch.multiple(dist, **{name: functools.partial(timed, getattr(dist, name))
                                      for name in COLLECTIVES if hasattr(dist, name)}):
        yield


@contextmanager
def no_sleep():
    """The classification's wait for fresh heartbeats (3 intervals) and its bounded waits."""
    real, time.sleep = time.sleep, lambda s: None
    try:
        yield
    finally:
        time.sleep = real


# ---- a step ---------------------------------------------------------------------------------

def _task(world: int, watchdog: Watchdog):
    return SimpleNamespace(ctx=SimpleNamespace(world_size=world), flag=SimpleNamespace(code=0, agreed_requeue=False),
                           faults=Faults(), watchdog=watchdog)


def _engine():
    return SimpleNamespace(peak_reserved_bytes=lambda: None, peak_memory_bytes=lambda: 1 << 30)


def _table(world: int) -> Optional["loop.StepTable"]:
    """The loop's kept gather target, filled with plausible values (the fake backend's
    all-gather writes nothing): losses, peaks, busy times 0.1 s +- 1 %. None before it."""
    if not hasattr(loop, "StepTable"):
        return None
    table = loop.StepTable(world)
    buf = torch.zeros(world, 7 + len(FIELDS), dtype=torch.float64)
    buf[:, 0], buf[:, 1], buf[:, 2] = 2.0, 1.0, float(1 << 30)
    buf[:, 5] = -1.0
    busy = 0.1 + 0.001 * torch.rand(world, dtype=torch.float64)
    buf[:, 7:] = torch.stack([busy * 0.05, busy * 0.8, busy * 0.1, busy], dim=1)
    table.buffer = buf
    return table


def _agree(task, engine, step: int, clock: StepClock, table) -> Union[torch.Tensor, List[List[float]]]:
    """One agreement; its times table (synthetic where the old list gather left garbage
    that reads as a non-finite loss)."""
    args = (task, engine, step, torch.tensor(2.0), torch.tensor(1.0), False, clock)
    try:
        agreed = loop._agree(*args, gathered=table) if table is not None else loop._agree(*args)
    except FloatingPointError:
        return [[0.005, 0.08, 0.01, 0.1]] * task.ctx.world_size
    return agreed.times


def _one_step(step: int, rank: int, world: int, state: dict, run_dir: Path) -> Dict[str, float]:
    """A step's bookkeeping, timed by part: this thread's CPU seconds (what the host did,
    whatever else the machine runs), and the wall seconds of the whole; the agreement's
    all-gather apart (``collective``), counted in neither."""
    clock, spent = state["clock"], state["collective"]
    clock.begin()
    clock.data_ready()
    clock.computed()
    spent.clear()
    w0, t0 = time.perf_counter(), time.thread_time()
    times = _agree(state["task"], state["engine"], step, clock, state["table"])
    t1 = time.thread_time()
    gather, w_gather = sum(c for c, _ in spent), sum(w for _, w in spent)
    state["stragglers"].update(times, step + 1)
    t2 = time.thread_time()
    if rank == 0:
        append_metrics(run_dir, MetricsRow(step=step + 1, loss=2.0, lr=1e-3, grad_norm=1.0, step_time_s=0.1,
                                           world_size=world, segment=0, time=time.time(), **breakdown(times)))
    t3 = time.thread_time()
    state["watchdog"]._beat()
    t4 = time.thread_time()
    return {"agree": t1 - t0 - gather, "stragglers": t2 - t1, "row": t3 - t2, "beat": t4 - t3,
            "total": t4 - t0 - gather, "collective": gather, "wall": time.perf_counter() - w0 - w_gather}


def step_work(rank: int, world: int, steps: int, root: Path) -> Dict[str, float]:
    """Median host ms a step (in total and by part) and file calls a step, as ``rank``."""
    run_dir = root / f"steps-{world}-{rank}"
    (run_dir / "heartbeat").mkdir(parents=True)
    fake_process_group(rank, world)
    try:
        watchdog = Watchdog(run_dir, rank, rank // RANKS_PER_NODE, f"n{rank // RANKS_PER_NODE}", world,
                            timeout_s=0, interval_s=1.0)  # not started: the bench writes its beats
        state = {"task": _task(world, watchdog), "engine": _engine(), "clock": StepClock(torch.device("cpu")),
                 "table": _table(world), "stragglers": Stragglers(groups=[list(range(world))]),
                 "watchdog": watchdog, "collective": []}
        with timed_collectives(state["collective"]):
            for step in range(WARMUP):
                _one_step(step, rank, world, state, run_dir)
            with counting(run_dir) as calls:
                parts = [_one_step(WARMUP + s, rank, world, state, run_dir) for s in range(steps)]
    finally:
        dist.destroy_process_group()
    out = {k: 1000 * statistics.median(p[k] for p in parts) for k in PARTS + ("total", "collective", "wall")}
    out["calls"] = sum(calls.values()) / steps
    return out


def coordination(rank: int, world: int) -> Optional[float]:
    """Seconds to make the async save's group as ``rank``; None where the fake backend
    cannot make it (before: a gloo group)."""
    fake_process_group(rank, world)
    try:
        t0 = time.perf_counter()
        if hasattr(async_save, "coordination_group"):
            async_save.coordination_group()
        else:
            async_save.AsyncSaver().prepare()
        return time.perf_counter() - t0
    except RuntimeError:
        return None
    finally:
        dist.destroy_process_group()


# ---- a restore and a classification, the whole job ------------------------------------------

def fake_checkpoint(root: Path, world: int) -> Path:
    """A committed step of 2W+1 small files (DCP's layout) with its manifest."""
    ckpt = root / "checkpoints" / "step_00000004"
    (ckpt / "dcp").mkdir(parents=True)
    files = {}
    for rel, data in [(f"dcp/__{r}_0.distcp", b"d" * (8 + r % 5)) for r in range(world)] + \
            [(f"extra_rank{r}.pt", b"x%d" % r) for r in range(world)] + [("dcp/.metadata", b"meta" * 9)]:
        (ckpt / rel).write_bytes(data)
        files[rel] = [len(data), zlib.crc32(data)]
    (ckpt / manifest.MANIFEST).write_text(json.dumps({"step": 4, "files": dict(sorted(files.items())),
                                                      "shape": {"world_size": world}}))
    return ckpt


def _restore_rank(ckpt: Path, rank: int, world: int, found, loading) -> None:
    """One rank's file work of a restore (Checkpointer._load_latest, DCPBackend.load before
    dcp.load, Checkpointer._extra); ``found``/``loading``: rank 0's surveys, broadcast
    (None before them: each rank looked itself)."""
    backend = DCPBackend(rank)
    if rank == 0:  # stale saves, the committed steps
        list(ckpt.parent.glob(".tmp-step_*"))
        manifest.committed_steps(ckpt.parent)
    if found is not None:
        assert manifest.verify(ckpt, rank, world, backend.summed_on_load, found) is None
        owned = backend.owned(loading)
    else:
        assert manifest.verify(ckpt, rank, world, backend.summed_on_load) is None
        files = manifest.manifest_files(ckpt)
        mine = manifest.share([ckpt / rel for rel in files], rank, world)
        owned = {p.name: files[rel] for p in mine if backend.summed_on_load(rel := str(p.relative_to(ckpt)))}
    thread = readahead([ckpt / "dcp" / name for name in owned])
    if thread is not None:
        thread.join()
    # Checkpointer._extra: saved_shape opens the manifest (its parse, W times, is CPU, not
    # calls: left out, as the test does), then state.load_extra opens this rank's file
    for name in (manifest.MANIFEST, f"extra_rank{rank}.pt"):
        with open(ckpt / name, "rb"):
            pass


def restore_job(root: Path, world: int) -> Tuple[int, float]:
    """File calls and seconds of a restore, over every rank of the job."""
    ckpt = fake_checkpoint(root / f"restore-{world}", world)
    t0 = time.perf_counter()
    with counting(ckpt.parent.parent) as calls:
        found = loading = None
        if SURVEYED:
            fake_process_group(0, world)
            try:
                found = manifest.shared_survey(ckpt, 0, world)  # rank 0's look, through the broadcast
            finally:
                dist.destroy_process_group()
            loading = manifest.survey(ckpt, world, sizes=False)  # DCPBackend.load's, on rank 0
        for rank in range(world):
            _restore_rank(ckpt, rank, world, found, loading)
    return sum(calls.values()), time.perf_counter() - t0


def heartbeats(run_dir: Path, world: int, now: float) -> None:
    folder = run_dir / "heartbeat"
    folder.mkdir(parents=True, exist_ok=True)
    for r in range(world):
        dead = r // RANKS_PER_NODE == DEAD_NODE
        (folder / f"rank{r}.json").write_text(json.dumps(
            {"rank": r, "host": f"n{r // RANKS_PER_NODE}", "step": 7, "phase": "collective",
             "time": now - 60 if dead else now + 3600}))  # live: fresh however long it takes


def classify_job(root: Path, world: int) -> Tuple[int, float]:
    """File calls and seconds of a failure's classification on every rank."""
    run_dir = root / f"classify-{world}"
    heartbeats(run_dir, world, time.time())
    segment = {"segment": 3} if "segment" in inspect.signature(classify_failure).parameters else {}
    t0 = time.perf_counter()
    with no_sleep(), counting(run_dir) as calls:
        verdicts = [classify_failure(run_dir, world, 1.0, **segment) for _ in range(world)]
    seconds = time.perf_counter() - t0
    want = "node_failure" if world > DEAD_NODE * RANKS_PER_NODE else "communication"  # W=8: no node 1
    assert verdicts[0]["failure"] == want and all(v == verdicts[0] for v in verdicts), verdicts[0]
    return sum(calls.values()), seconds


# ---- the table ------------------------------------------------------------------------------

def stepped(world: int, steps: int, root: Path) -> dict:
    """Both ranks' steps and coordination."""
    return {"world": world, "steps": {r: step_work(r, world, steps, root) for r in (0, world - 1)},
            "coordination": {r: coordination(r, world) for r in (0, world - 1)}}


def measure(world: int, steps: int, root: Path, quadratic_max: int = 512, row: Optional[dict] = None) -> dict:
    """One row: ``row`` (:func:`stepped`; None: measured now), the job's restore and
    classification (None: skipped, W^2 calls before the scale changes)."""
    row = row or stepped(world, steps, root)
    linear = SURVEYED or world <= quadratic_max
    row["restore"] = restore_job(root, world) if linear else None
    linear = "segment" in inspect.signature(classify_failure).parameters or world <= quadratic_max
    row["classify"] = classify_job(root, world) if linear else None
    return row


def _pair(a, b, fmt: str) -> str:
    return " / ".join("n/a" if v is None else format(v, fmt) for v in (a, b))


def _job(found: Optional[Tuple[int, float]], world: int) -> Tuple[str, str]:
    if found is None:
        return "skipped (W^2)", "skipped (W^2)"
    calls, seconds = found
    return f"{calls:,} ({calls / world:.2f} W)", f"{seconds:.2f}"


def render(rows: List[dict]) -> str:
    """The markdown table, the step's parts on rank 0, and the goals beside them."""
    out = ["| W | step host CPU ms (rank 0 / last) | file calls a step (rank 0 / last) | async coordination ms "
           "(rank 0 / last) | restore file calls a job (per rank) | restore s | classification file calls a "
           "job (per rank) | classification s |", "|---:|---|---|---|---|---:|---|---:|"]
    for row in rows:
        w, s, c = row["world"], row["steps"], row["coordination"]
        r0, last = s[0], s[w - 1]
        coord = [None if c[r] is None else 1000 * c[r] for r in (0, w - 1)]
        restore, classify = _job(row["restore"], w), _job(row["classify"], w)
        out.append(f"| {w:,} | {_pair(r0['total'], last['total'], '.3f')} | {_pair(r0['calls'], last['calls'], 'g')} "
                   f"| {_pair(*coord, '.2f')} | {restore[0]} | {restore[1]} | {classify[0]} | {classify[1]} |")
    out += ["", "Step host CPU ms: the loop's own work, without the step's all-gather (the fake backend's host "
            "copy of W rows; NCCL's is on the device), timed apart: collective. Rank 0's step by part, median CPU "
            "ms (and its wall ms): " + "; ".join(f"W={row['world']:,}: " + ", ".join(
                f"{k} {row['steps'][0][k]:.3f}" for k in PARTS) + f" (wall {row['steps'][0]['wall']:.3f}); not "
                f"counted: collective {row['steps'][0]['collective']:.3f}" for row in rows)]
    big = max(rows, key=lambda r: r["world"])
    worst = max(big["steps"][r]["total"] for r in big["steps"])
    out.append(f"Goal: step host work < 1 ms at 4,096 ranks: {worst:.3f} ms at W={big['world']:,} (worst rank): "
               + ("met" if worst < 1 else "NOT met") + (" (W=4,096 not run)" if big["world"] < 4096 else ""))
    ratios = [f"W={row['world']:,}: restore {_ratio(row['restore'], row['world'])}, classification "
              f"{_ratio(row['classify'], row['world'])}" for row in rows]
    out.append("Goal: file calls a job linear in W (calls/W flat): " + "; ".join(ratios))
    return "\n".join(out)


def _ratio(found: Optional[Tuple[int, float]], world: int) -> str:
    return "skipped" if found is None else f"{found[0] / world:.2f}"


def main(argv: Optional[List[str]] = None) -> str:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--worlds", default="8,512,4096", help="ranks of the simulated jobs, comma-separated")
    ap.add_argument("--steps", type=int, default=50, help="steps measured a rank (after a warm-up of 5)")
    ap.add_argument("--quadratic-max", type=int, default=512,
                    help="before the scale changes: the largest W whose restore and classification run (W^2 calls)")
    args = ap.parse_args(argv)
    worlds = [int(w) for w in args.worlds.split(",")]
    with tempfile.TemporaryDirectory(prefix="bench-scale-") as tmp:
        # Steps first: after a restore's thousands of new files, a heartbeat's write took ~1 ms, not 0.15
        rows = [stepped(w, args.steps, Path(tmp)) for w in worlds]
        rows = [measure(w, args.steps, Path(tmp), args.quadratic_max, row) for w, row in zip(worlds, rows)]
    text = render(rows)
    print(f"torch {torch.__version__}, {os.cpu_count()} CPUs, {args.steps} steps a rank\n")
    print(text)
    return text


if __name__ == "__main__":
    main()
