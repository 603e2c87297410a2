"""Checkpoint cost on 2 gloo ranks (CPU) against the disk, measured in one run.

For a Llama-style model with a few hundred MB of state (``--strategy ddp``: every rank
holds model + AdamW state, DCP writes one copy and every rank reads all of it back;
``fsdp``: each rank writes and reads its own half): sync save time, async save stall
(time the loop is blocked: the call plus the first optimizer step's wait for the
background snapshot, while the loop trains on), the background write's cost to the
steps beside it, restore time from a cold checkpoint (evicted from the page cache, as
after a requeue on another node), and the disk's sequential write bandwidth (dd with
fsync) and cold read bandwidth. Prints stall/sync (goal <= 0.03) and save / restore
throughput over the disk's bandwidth (goal >= 0.7).

Page cache state: on a virtual machine whose host takes back freed guest memory (free
page reporting; this one does) every page the kernel allocates after a few idle seconds
faults in through the hypervisor, and a write into the page cache runs at ~400 MB/s a
writer instead of GB/s; pages freed a moment ago are still backed and fast. The save and
dd are therefore measured side by side in both states: "warm" (a scratch file of the
same size written and deleted just before, as on a host whose memory is in use) and
"cold" (5 s idle before). The cold restore and cold dd read both follow an eviction
(posix_fadvise DONTNEED) of the file they read, so they meet the same state.

Preemption recovery on the local Slurm cluster (``make cluster-up``): a 2-node x 2-task
job of the tiny model (DDP, gloo) gets ``scancel --signal=USR2 JOB`` mid-run (as
tests/test_preemption.py sends it), checkpoints, requeues itself and resumes. The time
from the signal to the first resumed step is split, on one clock (the local cluster runs
on this machine), into:

- save: signal (time.time() just before scancel) -> rank 0's "checkpoint step N
  committed in X s" log line; of which X is writing + committing the checkpoint and the
  rest is waiting for the step boundary at which the ranks agree to stop.
- requeue: commit -> the job RUNNING again, as seen by polling squeue every 0.2 s (Slurm's
  own 1 s resolution Eligible/Start of the attempts, ``sacct -D``, printed beside it);
  includes ``scontrol requeue`` (its log line), the end of the old attempt and the
  requeued job's hold of cred_expire.
- restore+init: RUNNING -> the first metrics row of segment 1 (its ``time``); of which
  srun + Python/torch start + rendezvous (up to run.json's ``started_at``), model build
  (the "rank 0 coords" line), restore (the "resumed from step" line) and the first step.

Committed steps lost = the last step completed before the interruption (the highest
metrics step of segment 0) minus the step resumed from (goal 0): completed work that is
trained again. ``--reference`` also runs the same config uninterrupted and compares the
per-step losses (bitwise equal expected: fp32 DDP on CPU).

    .venv/bin/python bench/checkpoint.py [--dim 768 --layers 8 --repeats 3 --strategy ddp|fsdp|zero2]
        [--preemption | --skip-preemption] [--steps 60 --step-delay 0.2 --signal-after 15 --reference]

Both parts run by default; --preemption runs only the cluster part, --skip-preemption only
the checkpoint cost.

``--strategy zero2`` (DeepSpeed ZeRO-2, 2 ranks; no async save, its restore is DeepSpeed's):
the blocking save's time, the slowest rank's, of DeepSpeed's files summed by the ranks
as they write them (:mod:`train.checkpoint.deepspeed_io`) against the earlier way, in the
same run on the same engine: DeepSpeed's own ``torch.save`` (none summed), then the commit
reading every file back, shared out among the ranks, to sum and fsync it. Saves alternate
between the two (the order swapped each repeat), each in warm pages (as above), once with
the files left in the page cache before the commit and once evicted first (fsynced, then
dropped: the read-back then reads the disk, as a rank reads another node's files on a
shared filesystem; the summed save reads nothing).
"""
from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from spec.rundir import read_metrics, read_run_json  # noqa: E402  (standard library only)


def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def evict(path: Path) -> None:
    """Drop ``path``'s files from the page cache (they are fsynced), so the next read is cold."""
    for p in [path] if path.is_file() else [q for q in path.rglob("*") if q.is_file()]:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


COLD_S = 5.0  # idle seconds after which freed pages are cold (see the module doc)


def warm_pages(work: Path, nbytes: int) -> None:
    """Write and delete a scratch file of ``nbytes``: the next ``nbytes`` of page cache the
    kernel hands out are pages it just got back (backed by the host: "warm")."""
    scratch = work / "scratch.bin"
    subprocess.run(["dd", "if=/dev/zero", f"of={scratch}", "bs=8M", f"count={max(1, nbytes >> 23)}"],
                   capture_output=True, check=True)
    scratch.unlink()


def dd_write(work: Path, size_mb: int, warm: bool) -> tuple[float, Path]:
    """MB/s of one sequential file written with dd (fsync), in the given page state."""
    target = work / "dd.bin"
    if warm:
        warm_pages(work, size_mb << 20)
    else:
        time.sleep(COLD_S)
    out = subprocess.run(["dd", "if=/dev/zero", f"of={target}", "bs=8M", f"count={max(1, size_mb // 8)}",
                          "conv=fsync"], capture_output=True, text=True).stderr
    match = re.search(r"copied, ([0-9.]+) s", out)
    return target.stat().st_size / float(match.group(1)) / 1e6 if match else float("nan"), target


def disk_bandwidth(work: Path, size_mb: int) -> tuple[float, float, float]:
    """(warm write, cold write, cold read) MB/s of one sequential file: dd with fsync in
    both page states, then reading it back cold (evicted), as the restore reads."""
    warm, target = dd_write(work, size_mb, warm=True)
    target.unlink()
    cold, target = dd_write(work, size_mb, warm=False)
    evict(target)
    t0 = time.perf_counter()
    with open(target, "rb") as f:
        while f.read(8 << 20):
            pass
    read_s = time.perf_counter() - t0
    nbytes = target.stat().st_size
    target.unlink()
    return warm, cold, nbytes / read_s / 1e6


def build_engine(cfg_dim: int, layers: int, strategy: str, world: int):
    """The bench's model (Llama-style, vocabulary 32000) wrapped for ``strategy``, and a batch."""
    import torch

    from spec.config import RunConfig
    from spec.layout import build_layout
    from train.harness.dist import init_distributed
    from train.model import build_model
    from train.parallelize import parallelize

    torch.set_num_threads(1)
    cfg = RunConfig()
    cfg.cluster.gpus_per_node = world
    cfg.model.dim, cfg.model.n_layers, cfg.model.n_heads, cfg.model.vocab_size = cfg_dim, layers, 12, 32000
    if strategy == "fsdp":  # as conf/strategy/fsdp.yaml
        cfg.strategy.name, cfg.strategy.data_parallel, cfg.strategy.dp_shard, cfg.strategy.dp_replicate = \
            "fsdp", "fsdp", -1, 1
    if strategy == "zero2":  # as conf/strategy/zero2.yaml
        cfg.strategy.name, cfg.strategy.engine, cfg.strategy.zero_stage = "zero2", "deepspeed", 2
    ctx = init_distributed(600)
    engine = parallelize(build_model(cfg.model, "meta"), cfg, build_layout(cfg), ctx)
    tokens = torch.randint(0, 32000, (1, 33))
    return engine, [(tokens[:, :-1], tokens[:, 1:])]


def timed_steps(engine, batch, n: int) -> list:
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        engine.train_step(batch, 1e-4)
        times.append(time.perf_counter() - t0)
    return times


def sync_saves(ckpt, engine, work: Path, rank: int, step: int, nbytes: int, res: dict) -> tuple[int, int]:
    """One blocking save in warm pages, one in cold (see the module doc); (step, checkpoint bytes)."""
    import torch.distributed as dist

    root = ckpt.root
    for warm, key in ((True, "sync"), (False, "sync_cold")):
        dist.barrier()
        if rank == 0:
            if warm:  # one more checkpoint's worth: the old one stays until the new commits
                warm_pages(work, 2 * nbytes or 2 << 30)
            else:
                time.sleep(COLD_S)
        dist.barrier()
        step += 1
        ckpt.save(engine, step, {"loader": {"step": 0}})
        res[key].append(ckpt.last_save_s)
        ckpt.wait()  # pruning the previous one (in the background) is not part of the save
        nbytes = dir_bytes(root / (root / "latest").read_text().strip()) if rank == 0 else 0
    return step, nbytes


def async_save(ckpt, engine, batch, world: int, step: int, base_step: float, res: dict) -> None:
    """Async: the loop goes on training; it is blocked for the call and for the first
    optimizer step's wait for the snapshot. The background write shares the CPU."""
    import torch.distributed as dist

    ckpt.staging_wait_s = 0.0
    dist.barrier()  # the ranks reach a save together (the loop's per-step all-gather)
    t0 = time.perf_counter()
    ckpt.save(engine, step, {"loader": {"step": 0}}, blocking=False)
    steps = timed_steps(engine, batch, 3)
    ckpt.wait()
    res["write"].append(time.perf_counter() - t0)
    # The loop waits for the slowest rank: its stall counts.
    ranks = [None] * world
    dist.all_gather_object(ranks, (ckpt.last_save_s + ckpt.staging_wait_s, ckpt.last_save_s, ckpt.staging_wait_s))
    worst = max(ranks)
    res["stall"].append(worst[0])
    res["call"].append(worst[1])
    res["staging"].append(worst[2])
    res["slow"].append(statistics.mean(steps) - ckpt.staging_wait_s / len(steps) - base_step)


def cold_restore(ckpt, engine, rank: int, res: dict) -> None:
    """Restore the newest checkpoint, evicted from the page cache (as after a requeue)."""
    import torch.distributed as dist

    dist.barrier()
    if rank == 0:
        evict(ckpt.root)
    dist.barrier()
    t0 = time.perf_counter()
    if ckpt.load_latest(engine, print) is None:
        raise SystemExit("bench: no checkpoint could be restored")
    dist.barrier()
    res["restore"].append(time.perf_counter() - t0)


def worker(rank: int, world: int, port: int, work: str, dim: int, layers: int, repeats: int, strategy: str,
           out: dict) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import torch.distributed as dist

    from train.checkpoint import Checkpointer
    from train.harness.dist import shutdown

    engine, batch = build_engine(dim, layers, strategy, world)
    timed_steps(engine, batch, 1)  # creates the AdamW state
    base_step = statistics.median(timed_steps(engine, batch, 3))
    root = Path(work) / "ckpt"
    ckpt = Checkpointer(root, rank, keep=1)
    ckpt.prepare_async()  # as the loop does at start-up (the gloo group, the thread)
    ckpt.reserve_async(engine).result()  # as the loop does after its first step (waited for here:
    # the background copy would otherwise share the cores with the first sync save)
    res = {key: [] for key in ("sync", "sync_cold", "call", "staging", "stall", "slow", "write", "restore")}
    disk, nbytes, step = [], 0, 10
    for _ in range(repeats):
        step, nbytes = sync_saves(ckpt, engine, Path(work), rank, step, nbytes, res)
        step += 1
        async_save(ckpt, engine, batch, world, step, base_step, res)
        cold_restore(ckpt, engine, rank, res)
        if rank == 0:  # the disk, side by side with this repeat's saves and restore
            disk.append(disk_bandwidth(Path(work), max(256, nbytes >> 20)))
        dist.barrier()
    ckpt.close()
    if rank == 0:
        latest = root / (root / "latest").read_text().strip()
        med = statistics.median
        out.update({key: med(values) for key, values in res.items()}, first_stall=res["stall"][0],
                   base_step=base_step, nbytes=dir_bytes(latest),
                   # each repeat's throughput over the disk bandwidth measured beside it
                   disk=[med(d[i] for d in disk) for i in range(3)],
                   ratios=[med(nbytes / 1e6 / t / d[i] for t, d in zip(res[key], disk))
                           for i, key in enumerate(("sync", "sync_cold", "restore"))],
                   params=sum(p.numel() for p in engine.module.parameters()))
    shutdown()


class ReadBackEngine:
    """A DeepSpeed engine as the checkpointer met it before its files were summed as written:
    DeepSpeed's own ``torch.save`` (and its ``latest`` file), nothing summed (``save_native``
    answers None), so the commit reads every file back to sum and fsync it."""

    def __init__(self, engine) -> None:
        self.engine = engine

    def save_native(self, path: Path) -> None:
        self.engine.ds.save_checkpoint(str(path), tag="state")


def evict_before_commit(root: Path):
    """The checkpointer's fault seam with, once every rank's files are written (before the
    commit), the temporary directory's files fsynced and dropped from the page cache by
    rank 0, then a barrier: what the commit reads, it reads from the disk."""
    import torch.distributed as dist

    from train.harness.faults import Faults

    class Evicting(Faults):
        def save_written(self, step: int) -> None:
            if dist.get_rank() == 0:
                for tmp in root.glob(".tmp-step_*"):
                    for p in (q for q in tmp.rglob("*") if q.is_file()):
                        fd = os.open(p, os.O_RDONLY)
                        try:
                            os.fsync(fd)
                            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                        finally:
                            os.close(fd)
            dist.barrier()
    return Evicting()


def deepspeed_worker(rank: int, world: int, port: int, work: str, dim: int, layers: int, repeats: int,
                     out: dict) -> None:
    """ZeRO-2: blocking saves summed as written against read back, alternating (module doc)."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import torch.distributed as dist

    from train.checkpoint import Checkpointer
    from train.harness.dist import shutdown
    from train.harness.faults import Faults

    engine, batch = build_engine(dim, layers, "zero2", world)
    timed_steps(engine, batch, 1)  # creates the AdamW state
    root = Path(work) / "ckpt"
    shape = {"engine": "deepspeed", "zero_stage": 2, "dp": world, "world_size": world}
    ckpt = Checkpointer(root, rank, keep=1, shape=shape)
    ways = {"summed as written": engine, "read back": ReadBackEngine(engine)}
    pages = {"in the page cache": Faults(), "evicted before the commit": evict_before_commit(root)}
    res = {(way, page): [] for way in ways for page in pages}
    nbytes, step = 0, 10
    for i in range(repeats):
        for page, faults in pages.items():
            for way in (list(ways) if i % 2 == 0 else list(ways)[::-1]):
                dist.barrier()
                if rank == 0:  # one more checkpoint's worth: the old one stays until the new commits
                    warm_pages(Path(work), 2 * nbytes or 2 << 30)
                dist.barrier()
                step += 1
                ckpt.faults = faults
                ckpt.save(ways[way], step, {"loader": {"step": 0}})
                ranks = [None] * world
                dist.all_gather_object(ranks, ckpt.last_save_s)
                res[(way, page)].append(max(ranks))  # the loop waits for the slowest rank
                ckpt.wait()  # pruning the previous one (in the background) is not part of the save
                if rank == 0:
                    nbytes = dir_bytes(root / (root / "latest").read_text().strip())
    ckpt.close()
    if rank == 0:
        out.update(times={f"{way}|{page}": values for (way, page), values in res.items()}, nbytes=nbytes,
                   params=sum(p.numel() for p in engine.module.parameters()))
    shutdown()


def deepspeed_save_cost(args) -> None:
    import torch.multiprocessing as mp

    from launcher.local import free_port

    with tempfile.TemporaryDirectory(prefix="bench-ckpt-ds-", dir=os.environ.get("BENCH_DIR")) as tmp:
        manager = mp.Manager()
        out = manager.dict()
        mp.spawn(deepspeed_worker, args=(2, free_port(), tmp, args.dim, args.layers, args.repeats, out), nprocs=2)
        res = dict(out)
    times = {tuple(key.split("|")): values for key, values in res["times"].items()}
    med = statistics.median
    print(f"model {res['params'] / 1e6:.1f} M params, checkpoint {res['nbytes'] / 1e6:.0f} MB (DeepSpeed ZeRO-2, "
          f"model + AdamW), 2 ranks, blocking save of the slowest rank, median of {args.repeats} (warm pages)")
    for page in ("in the page cache", "evicted before the commit"):
        new, old = med(times[("summed as written", page)]), med(times[("read back", page)])
        print(f"  files {page}:")
        print(f"    read back at the commit   {old:.3f} s   "
              f"({', '.join(f'{t:.2f}' for t in times[('read back', page)])})")
        print(f"    summed as written         {new:.3f} s   "
              f"({', '.join(f'{t:.2f}' for t in times[('summed as written', page)])})   new/old = {new / old:.2f}")


# --- preemption recovery on the local Slurm cluster -------------------------------------

CONF = Path(os.environ.get("LOCALSLURM_DIR", "/tmp/localslurm")) / "etc" / "slurm.conf"
LOG_LINE = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) rank0 (.*)$")
ENDED = ("completed", "stopped", "failed", "interrupted")


def log_events(run_dir: Path) -> list[tuple[float, str]]:
    """(time.time() of the line, message) of every line of rank 0's log."""
    events = []
    for line in (run_dir / "logs" / "rank0.log").read_text().splitlines():
        match = LOG_LINE.match(line)
        if match:
            events.append((datetime.strptime(match.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp(), match.group(2)))
    return events


def first_event(events: list[tuple[float, str]], pattern: str, after: float) -> tuple[float, re.Match]:
    for t, message in events:
        match = re.search(pattern, message)
        if t >= after and match:
            return t, match
    raise RuntimeError(f"no log line matching {pattern!r} after the signal in rank0.log")


def job_state(job: str, env: dict) -> str:
    return subprocess.run(["squeue", "-h", "-j", job, "-o", "%T"], env=env, capture_output=True,
                          text=True).stdout.strip()


def attempts(job: str, env: dict) -> list[dict]:
    """Every attempt of the job (sacct -D keeps the requeued ones), oldest first."""
    out = subprocess.run(["sacct", "-D", "-X", "-n", "-P", "-j", job, "-o", "State,Eligible,Start,End"],
                         env=env, capture_output=True, text=True).stdout
    rows = []
    for line in out.splitlines():
        state, *times = line.split("|")
        parsed = []
        for value in times:
            try:
                parsed.append(datetime.strptime(value, "%Y-%m-%dT%H:%M:%S").timestamp())
            except ValueError:  # Unknown / None
                parsed.append(None)
        rows.append(dict(zip(("state", "eligible", "start", "end"), [state.split()[0] if state else "", *parsed])))
    return rows


def submit(work: Path, name: str, steps: int, delay: float, env: dict, wait: bool = False,
           extra: tuple = ()) -> tuple[str, Path]:
    """The 2-node x 2-task run (``extra``: more overrides); its job id and run directory."""
    run_dir = work / name
    proc = subprocess.run([sys.executable, "-m", "launcher", "+cluster=localslurm", "cluster.nodes=2",
                           "cluster.gpus_per_node=2", f"train.steps={steps}", "train.seq_len=32",
                           "data.num_tokens=50000", f"fault.step_delay_s={delay}", f"launcher.root={work}",
                           f"launcher.run_dir={run_dir}", f"launcher.wait={str(wait).lower()}", *extra],
                          cwd=REPO, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(proc.stdout + proc.stderr)
    job = next(line.split()[2] for line in proc.stdout.splitlines() if line.startswith("submitted job"))
    return job, run_dir


def preemption_recovery(args) -> dict:
    """One USR2 mid-run, watched to the end; every timing point on time.time()'s clock."""
    env = dict(os.environ, SLURM_CONF=str(CONF), PYTHONPATH=str(REPO))
    with tempfile.TemporaryDirectory(prefix="bench-preempt-", dir=os.environ.get("BENCH_DIR")) as tmp:
        job, run_dir = submit(Path(tmp), "interrupted", args.steps, args.step_delay, env)
        deadline = time.time() + args.timeout
        while len(read_metrics(run_dir)) < args.signal_after:
            if time.time() > deadline or read_run_json(run_dir).get("status") in ENDED:
                raise RuntimeError(f"job {job} never reached step {args.signal_after}: {read_run_json(run_dir)}")
            time.sleep(0.1)
        step_at_signal = len(read_metrics(run_dir))
        t_signal = time.time()
        subprocess.run(["scancel", "--signal=USR2", job], env=env, check=True)
        left = back = None  # squeue: first seen not RUNNING, then RUNNING again
        while read_run_json(run_dir).get("status") not in ENDED or job_state(job, env):
            if time.time() > deadline:
                raise RuntimeError(f"job {job} did not finish in {args.timeout} s: {read_run_json(run_dir)}")
            state, now = job_state(job, env), time.time()
            if left is None and state != "RUNNING":
                left = now
            elif left is not None and back is None and state == "RUNNING":
                back = now
            time.sleep(0.2 if back is None else 0.5)
        tries = attempts(job, env)
        for _ in range(20):  # accounting records the end a little after the job leaves the queue
            if len(tries) >= 2 and tries[-1]["end"]:
                break
            time.sleep(0.5)
            tries = attempts(job, env)
        info, rows, events = read_run_json(run_dir), read_metrics(run_dir), log_events(run_dir)
        t_commit, commit = first_event(events, r"checkpoint step (\d+) committed in ([0-9.]+) s", t_signal)
        t_requeue, _ = first_event(events, r"checkpoint committed; requeue of job", t_commit)
        t_built, _ = first_event(events, r"^rank 0 coords", t_requeue)
        t_resumed, resumed = first_event(events, r"resumed from step (\d+) \(segment (\d+)\)", t_requeue)
        if back is None:  # never caught PENDING -> RUNNING: fall back on Slurm's 1 s Start
            back = tries[-1]["start"]
        first = min((r for r in rows if r["segment"] == 1), key=lambda r: r["step"])
        last_done = max(r["step"] for r in rows if r["segment"] == 0)
        res = dict(job=job, step_at_signal=step_at_signal, status=info.get("status"),
                   segments=info.get("segments"), preemptions=info.get("preemptions"),
                   ckpt_step=int(commit.group(1)), write_s=float(commit.group(2)), save=t_commit - t_signal,
                   requeue_call=t_requeue - t_commit, left=(left or back) - t_commit, requeue=back - t_commit,
                   sacct_eligible=tries[-1]["eligible"], sacct_start=tries[-1]["start"],
                   sacct_end_first=tries[0]["end"] if len(tries) > 1 else None, t_commit=t_commit,
                   init=info["started_at"] - back, build=t_built - info["started_at"], restore=t_resumed - t_built,
                   first_step=first["time"] - t_resumed, restore_init=first["time"] - back,
                   total=first["time"] - t_signal, first_step_no=first["step"], last_done=last_done,
                   resume_step=int(resumed.group(1)), attempts=len(tries))
        res["lost"] = max(0, last_done - res["resume_step"])
        res["gap"] = first["step"] - res["resume_step"] - 1  # steps skipped (never trained): must be 0
        if args.reference:
            losses = {r["step"]: r["loss"] for r in rows}
            _, ref_dir = submit(Path(tmp), "reference", args.steps, 0.0, env, wait=True)
            ref = {r["step"]: r["loss"] for r in read_metrics(ref_dir)}
            res["equal"] = sum(losses.get(k) == v for k, v in ref.items())
            res["ref_steps"] = len(ref)
    return res


def print_preemption(res: dict, args) -> None:
    def since(t):
        return "?" if t is None else f"{t - res['t_commit']:+.0f} s"

    print(f"preemption recovery: job {res['job']}, 2 nodes x 2 tasks, tiny model, DDP (gloo), "
          f"scancel --signal=USR2 after step {res['step_at_signal']} of {args.steps} "
          f"(fault.step_delay_s={args.step_delay})")
    print(f"  save            {res['save']:6.2f} s   signal -> checkpoint step {res['ckpt_step']} committed "
          f"(write + commit {res['write_s']:.2f} s, wait for the step boundary {res['save'] - res['write_s']:.2f} s)")
    print(f"  requeue delay   {res['requeue']:6.2f} s   committed -> job RUNNING again (squeue): scontrol requeue "
          f"done +{res['requeue_call']:.2f} s, left RUNNING +{res['left']:.2f} s; sacct (1 s): first attempt end "
          f"{since(res['sacct_end_first'])}, eligible {since(res['sacct_eligible'])}, "
          f"start {since(res['sacct_start'])}")
    print(f"  restore+init    {res['restore_init']:6.2f} s   RUNNING -> first resumed step {res['first_step_no']}: "
          f"srun + Python/torch + rendezvous {res['init']:.2f} s, model build {res['build']:.2f} s, "
          f"restore {res['restore']:.2f} s, first step {res['first_step']:.2f} s")
    print(f"  total           {res['total']:6.2f} s   signal -> first resumed step")
    print(f"  committed steps lost {res['lost']} (goal 0): last step completed before the interruption "
          f"{res['last_done']}, resumed from step {res['resume_step']}, first step after resume "
          f"{res['first_step_no']} (steps skipped {res['gap']})")
    print(f"  run: status {res['status']}, segments {res['segments']}, preemptions {res['preemptions']}, "
          f"sacct attempts {res['attempts']}")
    if "equal" in res:
        print(f"  losses vs an uninterrupted run: {res['equal']}/{res['ref_steps']} steps bitwise equal")


def checkpoint_cost(args) -> None:
    import torch.multiprocessing as mp

    from launcher.local import free_port

    with tempfile.TemporaryDirectory(prefix="bench-ckpt-", dir=os.environ.get("BENCH_DIR")) as tmp:
        manager = mp.Manager()
        out = manager.dict()
        mp.spawn(worker, args=(2, free_port(), tmp, args.dim, args.layers, args.repeats, args.strategy, out),
                 nprocs=2)
        res = dict(out)
    write_bw, write_cold_bw, read_bw = res["disk"]
    save_ratio, save_cold_ratio, restore_ratio = res["ratios"]
    mb = res["nbytes"] / 1e6
    save_bw, save_cold_bw, restore_bw = mb / res["sync"], mb / res["sync_cold"], mb / res["restore"]
    print(f"model {res['params'] / 1e6:.1f} M params, checkpoint {mb:.0f} MB (model + AdamW), 2 ranks, "
          f"{args.strategy}, median of {args.repeats}")
    print(f"  sync save        {res['sync']:.3f} s   {save_bw:7.0f} MB/s   (warm pages)")
    print(f"  sync save        {res['sync_cold']:.3f} s   {save_cold_bw:7.0f} MB/s   (cold pages)")
    print(f"  async stall      {res['stall']:.3f} s   stall/sync = {res['stall'] / res['sync']:.3f} (goal <= 0.03; "
          f"slowest rank): call {res['call']:.3f} s + first optimizer step waiting for the snapshot "
          f"{res['staging']:.3f} s")
    print(f"                   first async save of the process {res['first_stall']:.3f} s (host buffers reserved "
          f"beforehand, as the loop has them reserved after its first step)")
    print(f"  async write      {res['write']:.3f} s   save -> committed, while 3 steps trained; each step "
          f"{res['slow'] * 1000:+.0f} ms vs {res['base_step'] * 1000:.0f} ms alone (the writer shares the 2 cores)")
    print(f"  restore (cold)   {res['restore']:.3f} s   {restore_bw:7.0f} MB/s (verify checksums + DCP load)")
    print(f"  disk write (dd, fsync)  {write_bw:7.0f} MB/s   save/disk    = {save_ratio:.2f} (goal >= 0.7; "
          f"warm pages)")
    print(f"  disk write (dd, fsync)  {write_cold_bw:7.0f} MB/s   save/disk    = {save_cold_ratio:.2f} "
          f"(goal >= 0.7; cold pages)")
    print(f"  disk read (cold)        {read_bw:7.0f} MB/s   restore/disk = {restore_ratio:.2f} (goal >= 0.7)")
    print(f"  (dd: median of {args.repeats}, each measured in its repeat, after its restore; the ratios are "
          f"the median of each repeat's)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dim", type=int, default=768)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--strategy", choices=("ddp", "fsdp", "zero2"), default="ddp",
                        help="ddp: each rank reads the whole checkpoint back; fsdp: its own half; zero2: "
                             "DeepSpeed's files summed as written against read back at the commit")
    part = parser.add_mutually_exclusive_group()
    part.add_argument("--preemption", action="store_true", help="only the preemption recovery on the local cluster")
    part.add_argument("--skip-preemption", action="store_true", help="only the checkpoint cost (no Slurm)")
    parser.add_argument("--steps", type=int, default=60, help="train.steps of the preempted job")
    parser.add_argument("--step-delay", type=float, default=0.2, help="fault.step_delay_s of the preempted job")
    parser.add_argument("--signal-after", type=int, default=15, help="send USR2 once this many steps are logged")
    parser.add_argument("--reference", action="store_true", help="also run it uninterrupted and compare losses")
    parser.add_argument("--timeout", type=float, default=600, help="seconds to wait for the preempted job")
    args = parser.parse_args()
    if not args.skip_preemption and not CONF.is_file():
        sys.exit(f"no local Slurm cluster ({CONF} missing): run `make cluster-up` first, or --skip-preemption")
    if not args.preemption:
        deepspeed_save_cost(args) if args.strategy == "zero2" else checkpoint_cost(args)
    if not args.skip_preemption:
        print_preemption(preemption_recovery(args), args)


if __name__ == "__main__":
    main()
