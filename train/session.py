"""The toolkit's API for your own training code: ``from train import session``.

A script or function run with ``entrypoint=...`` (README: "Run your own training
script") needs none of this: it gets the torchrun environment, is requeued on
preemption or time limit and restarts from its own checkpoints (``SLURM_RESTART_COUNT``
counts the restarts), and its exit status decides completed / failed. Code that wants
more uses this module; it imports no torch at module level, and outside a toolkit run
it does nothing harmful (``run_dir`` is None, :func:`should_stop` is False, :func:`log`
writes nowhere):

- :data:`run_dir`: the run directory (``$STO_RUN_DIR``); keep your checkpoints there.
- :func:`should_stop`: the preemption / time-limit flag, agreed across ranks at the call
  (an all-reduce when ``torch.distributed`` is initialised: call it on every rank at the
  same point, e.g. every step). Once your code has asked, a warning signal only sets the
  flag: save, then return (or call :func:`requeue`), and the harness requeues the job.
  Until it asks, the harness requeues at once on the signal and the task exits.
- :func:`log`: one ``metrics.jsonl`` row in the project's format (rank 0 writes), so
  ``launcher.status``, the run summary, ``launcher.report`` and the scaling study read
  your run as they read the built-in trainer's: ``tokens_per_s`` (global), ``loss``,
  ``peak_mem_bytes``, ``step_time_s`` and any other number.
- :func:`requeue`: "I saved, requeue me": when your code returns, the harness requeues
  the job (counted as a preemption or a timeout, up to ``cluster.max_requeues``).
- :func:`profiled_step`: ``with session.profiled_step(): ...`` around each step gives your
  loop the built-in trainer's profiler (``profile.*``, ``RUN_DIR/PROFILE_NOW``:
  train/profiling.py), its steps counted by your calls.
"""
from __future__ import annotations

import contextlib
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Optional

from spec.user_env import RUN_DIR_ENV


@dataclass
class _State:
    """Set by the harness (train.harness.user) for the task it runs."""

    run_dir: Path
    rank: int
    world_size: int
    segment: int
    flag: Any  # train.harness.preempt.PreemptionFlag (its hook: train.harness.user)
    watchdog: Any = None
    asked: bool = False  # should_stop() was called: the code handles signals itself
    stop: bool = False  # should_stop() returned True
    requeue: bool = False  # requeue() was called
    started: float = field(default_factory=time.time)
    first_row: Any = None  # called with this segment's first metrics row (rank 0), then dropped
    profiler: Any = None  # train.profiling.StepProfiler, made by the first profiled_step()
    profile_asked: bool = False  # rank 0 saw RUN_DIR/PROFILE_NOW since the ranks last agreed
    profiled_steps: int = 0


_state: Optional[_State] = None


def _bind(state: Optional[_State]) -> None:
    global _state
    _state = state


def __getattr__(name: str) -> Any:
    if name == "run_dir":
        if _state is not None:
            return _state.run_dir
        value = os.environ.get(RUN_DIR_ENV)
        return Path(value) if value else None
    raise AttributeError(f"module 'train.session' has no attribute {name!r}")


def rank() -> int:
    return _state.rank if _state is not None else int(os.environ.get("RANK", 0))


def restart_count() -> int:
    """How many times Slurm restarted this job (requeues): 0 on the first run."""
    return int(os.environ.get("SLURM_RESTART_COUNT", 0) or 0)


def should_stop() -> bool:
    """True when any rank got the preemption / time-limit signal (USR2) or SIGTERM."""
    if _state is None:
        return False
    _state.asked = True
    code = _state.flag.code
    import sys

    dist = sys.modules.get("torch.distributed")  # only when the code uses torch.distributed
    if dist is not None and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        import torch

        device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else "cpu"
        agreed = torch.tensor([code], dtype=torch.float32, device=device)
        dist.all_reduce(agreed, op=dist.ReduceOp.MAX)
        code = float(agreed.item())
    if code >= 2:
        _state.flag.agreed_requeue = True
    if code > 0:
        _state.stop = True
    return _state.stop


def requeue() -> None:
    """Your code saved its state: requeue the job when it returns."""
    if _state is not None:
        _state.requeue = True
        _state.flag.agreed_requeue = True


def log(step: int, **metrics: Any) -> None:
    """Append one metrics.jsonl row for ``step`` (rank 0 writes; other ranks' calls only
    count as progress). Numbers only; ``tokens_per_s`` is the job's total."""
    if _state is None:
        return
    if _state.watchdog is not None:
        _state.watchdog.progress(step)
    if _state.rank != 0:
        return
    from spec.rundir import append_metrics

    row = {k: (v.item() if hasattr(v, "item") else v) for k, v in metrics.items()}
    row.update(step=int(step), world_size=_state.world_size, segment=_state.segment, time=time.time())
    row.setdefault("mfu", None)
    append_metrics(_state.run_dir, row)
    hook, _state.first_row = _state.first_row, None
    if hook is not None:
        hook(row)


# Ranks of a process group agree on RUN_DIR/PROFILE_NOW at every this many profiled_step()
# calls (one small all-reduce): each step's would stall a GPU loop for nothing.
PROFILE_AGREE_EVERY = 10


@contextlib.contextmanager
def profiled_step(step: Optional[int] = None) -> Iterator[None]:
    """One step of your loop, as the built-in trainer's steps are profiled: ``profile.steps``,
    ``profile.every`` / ``active``, ``profile.ranks``, ``RUN_DIR/PROFILE_NOW`` (traces in
    ``RUN_DIR/profile/``; train/profiling.py). ``step``: its number (1-based); by default
    the count of calls (pass it when your code resumes from a checkpoint). Call it on every
    rank the same number of times: with ``torch.distributed`` initialised the ranks agree on
    PROFILE_NOW every :data:`PROFILE_AGREE_EVERY` steps (an all-reduce); without it only
    rank 0 sees the file. A ``torch.OutOfMemoryError`` inside it writes the memory dump of
    ``profile.memory=true``. Outside a toolkit run it does nothing."""
    prof = _profiler()
    if prof is None:
        yield
        return
    n = prof.step + 1 if step is None else int(step)
    prof.before(n)
    try:
        yield
    except BaseException as exc:
        torch = sys.modules.get("torch")
        if torch is not None and isinstance(exc, torch.OutOfMemoryError):
            prof.oom(exc)
        prof.close()  # a window cut short is written with the steps it has
        raise
    prof.after(n, _profile_now(prof))


def _profiler() -> Any:
    if _state is None:
        return None
    if _state.profiler is None:
        import logging

        from spec.config import to_run_config
        from spec.rundir import CONFIG
        from spec.user_env import DEVICE_ENV
        from train.profiling import StepProfiler

        cfg = to_run_config(_state.run_dir / CONFIG)
        _state.profiler = StepProfiler(cfg.profile, _state.run_dir, _state.rank, _state.world_size,
                                       cfg.cluster.gpus_per_node, os.environ.get(DEVICE_ENV, "cpu"),
                                       log=logging.getLogger(f"train.rank{_state.rank}").info)
    return _state.profiler


def _profile_now(prof: Any) -> bool:
    """Whether the ranks agree that rank 0 saw RUN_DIR/PROFILE_NOW (see profiled_step)."""
    _state.profile_asked = _state.profile_asked or prof.asked()
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        _state.profiled_steps += 1
        if _state.profiled_steps % PROFILE_AGREE_EVERY:
            return False
        import torch

        device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else "cpu"
        flag = torch.tensor([float(_state.profile_asked)], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        _state.profile_asked = bool(flag.item())
    asked, _state.profile_asked = _state.profile_asked, False
    return asked
