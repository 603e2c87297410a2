"""Hang watchdog: detect a step that never ends, name the ranks that hold it up, exit.

Every rank runs a small thread that, every few seconds (:func:`spec.cluster.heartbeat_interval`),
writes the rank's heartbeat (``RUN_DIR/heartbeat/rank{R}.json``: step, phase, host, last
progress) and checks how long ago the rank last completed a step. The main thread only
sets two attributes per phase, so the cost is nil. When no step has completed for ``cluster.hang_timeout_s``
(until the segment's first step completes: ``startup_timeout_s``, which also covers
model build, restore and the first step's lazy work: communicators, compile, DeepSpeed's
extension build):

1. each rank dumps the Python stack of all its threads to ``logs/stack_rank{R}.txt``
   (faulthandler) and, on NCCL, torch's flight recorder (its last collectives, see
   ``train.harness.dist.nccl_env_defaults``) to ``logs/nccl_trace_rank{R}.pkl``;
2. after a short grace for the others to do the same, the first rank to get there
   writes ``hang.json``: every rank's last heartbeat, and the *stuck* ranks: those not
   waiting in a collective (they never arrived), or, if all are waiting, those at the
   lowest step; it alone reads the heartbeats, the others take its report
   (:func:`train.harness.classify.once`);
3. every rank exits with status 75, so the run is classified as a hang (run.json
   ``status: failed``, ``error: hang ...``) and requeued only per policy.

The watchdog must fire before the collective timeout (``train.dist_timeout_s``), which
would otherwise abort with a less useful error.

A save is progress, not a hang. While a checkpoint is written or read (:meth:`Watchdog.saving`
... :meth:`Watchdog.saved`, nested calls allowed: the trainer's save, the checkpointer's
wait for an async write, a restore) the limit is ``checkpoint.save_timeout_s`` counted from
the save's start, in place of the hang timeout (the launch derives it from the predicted
save time: launcher/plan/checkpoints.py), and the end of a save counts as progress. The
ranks waiting at the save's barriers are in a collective phase, so a writer that never
returns is named the stuck rank, its phase ``checkpoint``.

Stacks on demand, without a hang: ``touch RUN_DIR/STACK_NOW`` (or ``python -m
launcher.stacks RUN_DIR``). The same thread looks at the file's time every
:data:`STACK_POLL_S` (one ``stat`` per rank); for each new touch (after the segment
started) each rank writes every thread's Python stack, by thread name, to
``stacks/rank{R}.txt`` (and, on NCCL, its flight recorder to ``stacks/nccl_trace_rank{R}.pkl``),
and training goes on.
"""
from __future__ import annotations

import faulthandler
import json
import os
import socket
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any, Dict, List, Optional

from spec.rundir import STACK_NOW, STACKS
from train.harness.classify import classify_failure, once, read_beats, wait_timeout  # noqa: F401 - classify_failure: its old home

HANG_EXIT = 75
COLLECTIVE = "collective"
STACK_POLL_S = 0.5  # how often each rank looks at RUN_DIR/STACK_NOW


def request_time(run_dir: Path) -> Optional[int]:
    """The time (ns) RUN_DIR/STACK_NOW was last touched; None when it is absent."""
    try:
        return os.stat(Path(run_dir) / STACK_NOW).st_mtime_ns
    except OSError:
        return None


def write_stacks(path: Path, header: Dict[str, Any]) -> None:
    """Every thread's Python stack, innermost frame last, the main thread first; the first
    line is ``header`` as JSON (rank, host, pid, step, phase, the request it answers)."""
    names = {t.ident: t.name for t in threading.enumerate()}
    main = threading.main_thread().ident
    frames = sorted(sys._current_frames().items(), key=lambda item: item[0] != main)
    lines = [json.dumps(header)]
    for ident, frame in frames:
        lines.append(f"\nThread {names.get(ident, '?')} ({ident}):")
        lines += [line.rstrip("\n") for line in traceback.format_stack(frame)]
    tmp = path.with_suffix(".tmp")
    tmp.write_text("\n".join(lines) + "\n")
    os.replace(tmp, path)  # a reader (launcher.stacks) never sees half a file


def stuck_ranks(beats: List[Dict[str, Any]]) -> List[int]:
    """Ranks holding the others up: not in a collective, else the ones furthest behind."""
    if not beats:
        return []
    absent = [b["rank"] for b in beats if b.get("phase") != COLLECTIVE]
    if absent and len(absent) < len(beats):
        return sorted(absent)
    low = min(b.get("step", 0) for b in beats)
    behind = [b["rank"] for b in beats if b.get("step", 0) == low]
    return sorted(behind) if len(behind) < len(beats) else sorted(absent or behind)


def dump_nccl_trace(path: Path) -> Optional[str]:
    """Write this rank's NCCL flight-recorder trace (pickled) to ``path``; None if there is none.

    Only with CUDA and an NCCL process group: on CPU/gloo, or a torch build without the
    recorder, nothing is written. Never raises: a hang report must not fail on a diagnostic.
    """
    torch = sys.modules.get("torch")  # never import torch here: the job has, or there is no NCCL
    try:
        if torch is None or not torch.cuda.is_available():
            return None
        import torch.distributed as dist

        if not dist.is_initialized() or "nccl" not in str(dist.get_backend()):
            return None
        from train.torch_compat import nccl_trace

        payload = nccl_trace()
        if payload is None:
            return None
        path.write_bytes(payload)
        return str(path)
    except Exception:  # noqa: BLE001 - best effort
        return None


class Watchdog:
    """``interval_s`` 0: no heartbeat (the thread only answers STACK_NOW; the loop's calls
    stay attribute writes); ``timeout_s`` 0: heartbeats without the hang check (users'
    code: its steps are unseen)."""

    def __init__(self, run_dir: Path, rank: int, node: int, host: str, world_size: int, timeout_s: float,
                 interval_s: float = 1.0, on_hang=None, startup_timeout_s: Optional[float] = None,
                 segment: int = 0, save_timeout_s: float = 0.0) -> None:
        self.run_dir, self.rank, self.node, self.host = run_dir, rank, node, host
        self.segment = segment  # which start of the run: one hang.json writer per segment
        self.world_size, self.timeout_s, self.interval_s = world_size, timeout_s, interval_s
        self.startup_timeout_s = max(timeout_s, startup_timeout_s or 0)
        self.warm = False  # a step of this segment has completed: the plain timeout applies
        self.save_timeout_s = save_timeout_s  # the bound while saving; 0: the plain one applies
        self.save_since: Optional[float] = None  # when the outermost save began (None: not saving)
        self._save_depth = 0
        self.on_hang = on_hang
        self.step, self.phase_name = 0, "startup"
        self.last_progress = time.time()
        self.answered = time.time_ns()  # STACK_NOW touched before this segment started is old
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    # Called by the training loop (main thread): plain attribute writes.
    def phase(self, name: str, step: int) -> None:
        self.phase_name, self.step = name, step

    def begin(self, step: int) -> None:
        """The loop starts at ``step``: the clock restarts, still under the startup timeout."""
        self.step, self.phase_name, self.last_progress = step, "compute", time.time()

    def progress(self, step: int) -> None:
        self.step, self.phase_name, self.last_progress = step, "compute", time.time()
        self.warm = True

    def saving(self, step: int, name: str = "checkpoint") -> None:
        """A checkpoint's I/O begins (nested calls count): its own bound applies until
        the matching :meth:`saved`."""
        self.phase_name, self.step = name, step
        if self._save_depth == 0:
            self.save_since = time.time()
        self._save_depth += 1

    def saved(self) -> None:
        """The checkpoint's I/O ended: progress (the hang clock starts again)."""
        self._save_depth = max(0, self._save_depth - 1)
        if self._save_depth == 0:
            self.save_since = None
            self.phase_name, self.last_progress = "compute", time.time()

    def limit_s(self) -> float:
        """The hang timeout, the startup one before the segment's first step; while
        saving, the save's bound if that is longer."""
        plain = self.timeout_s if self.warm else self.startup_timeout_s
        return max(plain, self.save_timeout_s) if self.save_since is not None else plain

    def overdue(self, now: float) -> bool:
        """No progress within :meth:`limit_s`: from the save's start while saving, else
        from the last progress."""
        since = self.last_progress if self.save_since is None else max(self.save_since, self.last_progress)
        return now - since > self.limit_s()

    def start(self) -> "Watchdog":
        # Heartbeats (failure classification reads them), if enabled hang checks, and STACK_NOW.
        self.last_progress = time.time()
        if self.interval_s > 0:
            (self.run_dir / "heartbeat").mkdir(parents=True, exist_ok=True)
        self._thread = threading.Thread(target=self._run, name="hang-watchdog", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def _beat(self, **extra: Any) -> Dict[str, Any]:
        beat = {"rank": self.rank, "node": self.node, "host": self.host, "pid": os.getpid(), "step": self.step,
                "phase": self.phase_name, "last_progress": self.last_progress, "time": time.time(), **extra}
        path = self.run_dir / "heartbeat" / f"rank{self.rank}.json"
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(beat))
        os.replace(tmp, path)
        return beat

    def _run(self) -> None:
        tick = min(self.interval_s, STACK_POLL_S) if self.interval_s > 0 else STACK_POLL_S
        next_beat = time.monotonic() + self.interval_s
        while not self._stop.wait(tick):
            self.answer_stack_request()
            if self.interval_s <= 0 or time.monotonic() < next_beat:
                continue
            next_beat = time.monotonic() + self.interval_s
            self._beat()
            if self.timeout_s > 0 and self.overdue(time.time()):
                self._hang()

    def answer_stack_request(self) -> bool:
        """Write this rank's stacks when RUN_DIR/STACK_NOW was touched since the last answer."""
        asked = request_time(self.run_dir)
        if asked is None or asked <= self.answered:
            return False
        self.answered = asked
        try:
            folder = self.run_dir / STACKS
            folder.mkdir(exist_ok=True)
            trace = dump_nccl_trace(folder / f"nccl_trace_rank{self.rank}.pkl")
            write_stacks(folder / f"rank{self.rank}.txt",
                         {"rank": self.rank, "node": self.node, "host": self.host or socket.gethostname(),
                          "pid": os.getpid(), "step": self.step, "phase": self.phase_name, "request_ns": asked,
                          "time": time.time(), "nccl_trace": trace})
        except OSError as exc:  # a full or gone file system: the job goes on
            print(f"rank {self.rank}: STACK_NOW not answered: {exc}", file=sys.stderr)
        return True

    def _hang(self) -> None:
        logs = self.run_dir / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        with open(logs / f"stack_rank{self.rank}.txt", "w") as f:
            faulthandler.dump_traceback(file=f, all_threads=True)
        trace = dump_nccl_trace(logs / f"nccl_trace_rank{self.rank}.pkl")
        self._beat(hung=True, nccl_trace=trace)
        time.sleep(3 * self.interval_s)  # let every rank dump and publish its heartbeat

        def read() -> Dict[str, Any]:
            beats = read_beats(self.run_dir, self.world_size)
            stuck = stuck_ranks(beats)
            held = set(stuck)
            return {"detected_by": self.rank, "segment": self.segment, "time": time.time(),
                    "timeout_s": self.limit_s(), "stuck_ranks": stuck, "in_save": self.save_since is not None,
                    "stuck_hosts": sorted({b.get("host", "?") for b in beats if b["rank"] in held}),
                    "nccl_trace": trace, "ranks": beats}  # each rank's own trace: ranks[R]["nccl_trace"]

        # The first rank of this segment to get here reads every heartbeat and writes the
        # report, over an earlier hang's; the others take its report (not W reads each).
        report = once(self.run_dir / "heartbeat" / f"hang_segment{self.segment}.lock", self.run_dir / "hang.json",
                      read, lambda found: found.get("segment") == self.segment, wait_timeout(self.world_size))
        # Every rank that saw the hang records it (the same fields), not only the one that
        # wrote hang.json: a rank exiting here ends its peers (the local launcher's ranks
        # die with rank 0), and the writer might be gone before it recorded (a loaded
        # suite run saw run.json without failure=hang).
        if self.on_hang is not None:
            self.on_hang(report)
        os._exit(HANG_EXIT)
