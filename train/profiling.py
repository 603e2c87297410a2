"""The profiler: ``torch.profiler`` over chosen steps on chosen ranks (with the step times and
stragglers of train/steptimes.py and the stacks on demand, one of the ways to see inside a run).

A :class:`StepProfiler` is told where each step starts and ends (:meth:`~StepProfiler.before`,
:meth:`~StepProfiler.after`; the built-in trainer's loop, or :func:`train.session.profiled_step`
in users' code) and runs ``torch.profiler.profile`` (CPU activity, and CUDA on CUDA) over

- ``profile.steps=[START,END]``: those optimizer steps (1-based, inclusive);
- ``profile.every=N``: ``profile.active`` steps from every N-th step (N .. N+active-1, 2N ...);
- ``touch RUN_DIR/PROFILE_NOW``: the next ``profile.active`` steps. Rank 0 looks for the
  file at a step boundary (a ``stat`` at most every :data:`POLL_S`); the built-in trainer's
  step all-gather carries what it saw (train/loop.py ``_agree``), so every rank opens the
  window at the same step, and rank 0 removes the file when it opens. A request while a
  window runs is answered after it;

on ``profile.ranks`` only (default: local rank 0 of each node). ``prof.step()`` marks each
step, numbered as the run counts them, so a window's trace holds ``ProfilerStep#START`` ..
``ProfilerStep#END``. At the window's end each profiled rank writes its Chrome trace to
``RUN_DIR/profile/step_<START>/rank<R>.json.gz`` (torch's ``export_chrome_trace`` gzips a
``.gz`` path itself). A window cut short (the run ends, is preempted or fails inside it)
is written with the steps it has.

``profile.memory=true`` adds the allocations to the trace (``profile_memory``) and, on
CUDA, records the caching allocator's history (torch's private ``_record_memory_history``,
fenced in train/torch_compat.py; Python stacks, the last :data:`MEMORY_ENTRIES` events) on
every rank for the whole run: a snapshot ``rank<R>_memory.pickle`` beside each trace
(https://pytorch.org/memory_viz), and
a rank that raises ``torch.OutOfMemoryError`` writes ``RUN_DIR/profile/oom_rank<R>.pickle``
before it exits. Recording costs every allocation a stack walk (a few microseconds): the
history is on for the whole run only when asked. Each such rank also writes
``oom_rank<R>.json`` (step, error, the snapshot's name); on CPU there is no history, and
that file says so.

Nothing asked: no profiler object exists; a step costs an integer compare in each call
and, on rank 0, a clock read.
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Optional, Tuple

from spec.config import ProfileConfig
from spec.rundir import PROFILE, PROFILE_NOW

POLL_S = 0.5  # rank 0 looks at RUN_DIR/PROFILE_NOW at most this often
MEMORY_ENTRIES = 100_000  # allocator events the CUDA history keeps (the newest)
_NEVER = -1  # a step number no step has

Window = Tuple[int, int]  # (first, last) step, 1-based, inclusive


def profiled_ranks(cfg: ProfileConfig, world_size: int, gpus_per_node: int) -> Tuple[int, ...]:
    """``profile.ranks``, or local rank 0 of each node: 0, gpus_per_node, 2 x gpus_per_node ..."""
    if cfg.ranks is not None:
        return tuple(sorted(set(cfg.ranks)))
    return tuple(range(0, world_size, max(1, gpus_per_node)))


def next_window(cfg: ProfileConfig, step: int) -> Optional[Window]:
    """The first configured window (``profile.steps``, ``profile.every``) that has steps from
    ``step`` on, starting no earlier than ``step`` (a resumed run, or after a window on
    request); None when there is none."""
    found: list = []
    if cfg.steps is not None and cfg.steps[1] >= step:
        found.append((max(cfg.steps[0], step), cfg.steps[1]))
    if cfg.every > 0:
        k = max(1, (step - cfg.active) // cfg.every + 1)  # the first multiple whose window ends at step or later
        while k * cfg.every + cfg.active - 1 < step:
            k += 1
        found.append((max(k * cfg.every, step), k * cfg.every + cfg.active - 1))
    return min(found) if found else None


class StepProfiler:
    """One rank's profiler. ``before(n)`` as step ``n`` (1-based) begins, ``after(n, asked)``
    once it ended, where ``asked`` is rank 0's :meth:`asked` agreed by every rank;
    ``close()`` when the loop ends; :meth:`oom` on ``torch.OutOfMemoryError``."""

    def __init__(self, cfg: ProfileConfig, run_dir: Path, rank: int, world_size: int, gpus_per_node: int,
                 device: Any = "cpu", first: int = 1, log: Optional[Callable[[str], None]] = None) -> None:
        self.cfg, self.run_dir, self.rank = cfg, Path(run_dir), rank
        self.mine = rank in profiled_ranks(cfg, world_size, gpus_per_node)
        self.is_main = rank == 0
        self.cuda = str(device).startswith("cuda")
        self.log = log or (lambda line: None)
        self.begin_at(first)
        self.on_request = False  # the window was asked for with PROFILE_NOW
        self._next_look = 0.0
        self._prof: Any = None
        self._started_at = _NEVER
        self.history = False  # the CUDA allocator's history is being recorded
        if cfg.memory and self.cuda:
            from train.torch_compat import record_memory_history

            record_memory_history(max_entries=MEMORY_ENTRIES)
            self.history = True

    def begin_at(self, first: int) -> None:
        """The loop's first step is ``first`` (a resumed run's: the step after its checkpoint)."""
        self.window: Optional[Window] = next_window(self.cfg, first)
        self._begin = self.window[0] if self.window else _NEVER
        self.step = first - 1  # the last step begun

    # ---- the step hooks ------------------------------------------------------------
    def before(self, step: int) -> None:
        self.step = step
        if step != self._begin:
            return
        if self.on_request and self.is_main:
            (self.run_dir / PROFILE_NOW).unlink(missing_ok=True)
        if self.mine:
            self._start(step)

    def asked(self) -> bool:
        """Rank 0: whether RUN_DIR/PROFILE_NOW exists (looked at no more than every POLL_S)."""
        if not self.is_main:
            return False
        now = time.monotonic()
        if now < self._next_look:
            return False
        self._next_look = now + POLL_S
        return (self.run_dir / PROFILE_NOW).exists()

    def after(self, step: int, asked: bool = False) -> None:
        window = self.window
        if window is not None and window[0] <= step:
            if step < window[1]:
                if self._prof is not None:
                    self._prof.step()
                return  # a request while a window runs: rank 0 keeps the file, answered after it
            self._stop()
            self._plan(next_window(self.cfg, step + 1), on_request=False)
        if asked:
            self._plan((step + 1, step + self.cfg.active), on_request=True)
            if self.is_main:
                self.log(f"profile: {PROFILE_NOW} seen at step {step}: profiling steps {step + 1}-"
                         f"{step + self.cfg.active}")

    def close(self) -> None:
        """The loop ends (done, preempted or failed): a window cut short is written as it is
        (the configured windows after it stay planned, for code that goes on)."""
        self._stop()
        self._plan(next_window(self.cfg, self.step + 1), on_request=False)

    def oom(self, exc: BaseException, when: str = "") -> None:
        """This rank ran out of memory (at a step, or ``when`` says where: building the model):
        with ``profile.memory``, write what it knows (the CUDA allocator's snapshot when its
        history was on) before the error ends the task. Never raises."""
        if not self.cfg.memory:
            return
        try:
            folder = self.run_dir / PROFILE
            folder.mkdir(parents=True, exist_ok=True)
            where = when or f"at step {self.step}"
            info = {"rank": self.rank, "step": self.step, "where": where, "time": time.time(), "cuda": self.cuda,
                    "error": f"{type(exc).__name__}: {str(exc)[:500]}", "snapshot": None}
            if self.history:
                from train.torch_compat import dump_memory_snapshot

                dump_memory_snapshot(str(folder / f"oom_rank{self.rank}.pickle"))
                info["snapshot"] = f"oom_rank{self.rank}.pickle"
            else:
                info["why"] = "no CUDA on this rank: the allocator's history (the .pickle snapshot) is CUDA's alone"
            _write_json(folder / f"oom_rank{self.rank}.json", info)
            self.log(f"profile: out of memory {where}: {PROFILE}/oom_rank{self.rank}"
                     f"{'.pickle' if self.history else '.json'} written")
        except Exception as err:  # noqa: BLE001 - the OOM is the error to report, not this
            self.log(f"profile: no out-of-memory dump: {type(err).__name__}: {err}")

    # ---- inside ---------------------------------------------------------------------
    def _plan(self, window: Optional[Window], on_request: bool) -> None:
        self.window, self.on_request = window, on_request
        self._begin = window[0] if window else _NEVER

    def _start(self, step: int) -> None:
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.cuda else [])
        # A schedule (always RECORD) makes the profiler mark each step ProfilerStep#<step_num>.
        prof = profile(activities=activities, schedule=_record, record_shapes=self.cfg.shapes,
                       profile_memory=self.cfg.memory, with_stack=self.cfg.with_stack)
        prof.step_num = step  # the run's step number, not the profiler's count from 0
        prof.start()
        self._prof, self._started_at = prof, step

    def _stop(self) -> None:
        prof, self._prof = self._prof, None
        if prof is None:
            return
        first, last = self._started_at, self.step
        t0 = time.perf_counter()
        prof.stop()
        folder = self.run_dir / PROFILE / f"step_{first}"
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"rank{self.rank}.json.gz"
        tmp = folder / f".rank{self.rank}.{os.getpid()}.tmp.json.gz"  # ".gz": torch gzips it
        prof.export_chrome_trace(str(tmp))
        os.replace(tmp, path)  # a reader never sees half a trace
        written = [path.name]
        if self.history:
            from train.torch_compat import dump_memory_snapshot

            dump_memory_snapshot(str(folder / f"rank{self.rank}_memory.pickle"))
            written.append(f"rank{self.rank}_memory.pickle")
        self.log(f"profile: steps {first}-{last} on rank {self.rank}: {PROFILE}/step_{first}/"
                 f"{' and '.join(written)} ({time.perf_counter() - t0:.2f} s to write)")


def _record(step: int) -> Any:
    from torch.profiler import ProfilerAction

    return ProfilerAction.RECORD


def _write_json(path: Path, obj: Any) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(obj, indent=1))
    os.replace(tmp, path)


def step_numbers(trace: dict) -> Iterable[int]:
    """The N of every ``ProfilerStep#N`` event of a Chrome trace (as json.load reads it)."""
    for event in trace.get("traceEvents", []):
        name = event.get("name", "")
        if isinstance(name, str) and name.startswith("ProfilerStep#"):
            yield int(name.split("#", 1)[1])
