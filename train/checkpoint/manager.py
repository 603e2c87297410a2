"""Atomic, verified checkpoints: torch.distributed.checkpoint (DCP) or DeepSpeed's own.

Layout under ``RUN_DIR/checkpoints``::

    step_00000040/            a committed checkpoint
        COMMITTED             manifest: step, every file's size and CRC32 (written last)
        dcp/ or deepspeed/    the sharded model + optimizer state
        extra_rank{R}.pt      per rank: step, data-loader position, RNG states
    universal/step_00000040/  DeepSpeed only: that step in the universal format, made when
                              a run resumes it at another data-parallel size or ZeRO stage
    latest                    name of the newest committed step (replaced atomically)
    .tmp-step_00000050/       a save in progress (or killed): never loaded, removed at start-up

Commit protocol: every rank writes into the temporary directory (fsynced), computing
the CRC32 of its files from the bytes as it writes them, and leaves them beside its
files (``.crc_rank{R}.json``); barrier; rank 0 lists the directory and reads the side
files, once; files no rank summed as it wrote (DCP's ``.metadata``, a DeepSpeed file not
summed) are read back and summed, shared out among the ranks by rank 0; rank 0 writes
``COMMITTED`` with every file's size and CRC, renames the directory to its final name,
fsyncs the parent, then replaces ``latest`` (:mod:`.manifest`). A kill at any point
leaves either the previous checkpoint as newest or the new one complete. Loading picks
the newest directory whose manifest verifies (sizes, and CRCs read back, the files shared
out among the ranks; DCP's data files summed as they are loaded, :mod:`.dcp_reader`); a
corrupt or truncated one is reported and skipped.

What DCP and DeepSpeed do differently (the engine's files, async saves, which files are
summed as they load, a load at another shape) is the checkpointer's backend, chosen by
the run's engine (:mod:`.backend`); faults are injected through the task's one seam
(:class:`train.harness.faults.Faults`).

Each manifest records the shape of the run that saved it (``shape``:
:func:`spec.rundir.run_shape`). Resumed on another shape, DCP reshards by itself (the
state dicts are DTensors or whole tensors, by parameter name, whatever the world size);
DeepSpeed goes through its universal format (:mod:`.deepspeed_io`); the data position is
in global samples (:mod:`train.data.loader`), and the RNG states are rank 0's on every
rank (:func:`.state.load_extra`).
"""
from __future__ import annotations

import shutil
import threading
import time
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, Optional, Tuple

import torch.distributed as dist

from spec.peft import check_same_base
from spec import evals
from train.checkpoint.async_save import AsyncSaver
from train.checkpoint.backend import backend_for
from train.checkpoint.deepspeed_io import universal_dir
from train.checkpoint.manifest import (
    SUMS, agreed_reason, committed_steps, publish, read_back, read_backs, saved_shape, shared_save_plan, shared_survey, step_name,
    verify,
)
from train.checkpoint.policy import SavePolicy
from train.checkpoint.state import load_extra, write_extra
from train.harness.faults import Faults
from train.harness.watchdog import COLLECTIVE, Watchdog


@dataclass
class Checkpointer:
    """Saves and restores one run's engine + loader state; collective (every rank calls).

    ``shape`` (the run's, :func:`spec.rundir.run_shape`; recorded in each manifest) picks
    the backend (:func:`.backend.backend_for`: DCP unless the engine is DeepSpeed);
    ``faults`` is the task's fault seam (none by default).

    ``save(..., blocking=False)`` (DCP's backend) hands the state to the checkpoint
    thread (:mod:`.async_save`) and returns: the loop is blocked only for the call and
    the first optimizer step's wait for the snapshot (``last_save_s`` +
    ``staging_wait_s``). DCP's last phase gathers every rank's write results on rank 0,
    so when rank 0's future is done every shard is on disk: rank 0 then commits in a
    background thread (checksums, rename, ``latest``). A later save, a preemption save
    and the end of training wait for a pending one first.
    """

    root: Path
    rank: int
    keep: int = 3
    shape: Dict[str, Any] = field(default_factory=dict)  # this run's (spec.rundir.run_shape), in each manifest
    faults: Faults = field(default_factory=Faults)
    # The rank's hang watchdog (train.harness.watchdog.Watchdog): a save or restore runs
    # under its own bound (checkpoint.save_timeout_s), the save's barriers as collectives.
    watchdog: Optional[Watchdog] = None
    policy: SavePolicy = field(default_factory=SavePolicy)  # when to save (the loop asks it)
    # Rank 0, once a checkpoint is committed, before pruning: called with its step (the
    # evaluation queue, spec/evals.py; its checkpoints are pinned until an evaluation reads them).
    on_commit: Optional[Callable[[int], None]] = None

    def __post_init__(self) -> None:
        self._pending: Optional[Tuple[Future, Path, Path, int]] = None  # future, tmp, final, step
        # An async save not yet waited for. Unlike _pending (cleared by whichever rank's
        # poll() sees its write done first) it is the same on every rank, so wait() can
        # decide on it whether to enter its barrier.
        self._unwaited = False
        self._committer: Optional[threading.Thread] = None
        self.backend = backend_for(self.shape, self.rank)
        self._async = AsyncSaver(self.faults)
        self.last_save_s = 0.0
        self.engine_dirty = False  # see load_latest

    @property
    def staging_wait_s(self) -> float:
        """Time optimizer steps waited for an async snapshot, summed."""
        return self._async.staging_wait_s

    @staging_wait_s.setter
    def staging_wait_s(self, value: float) -> None:
        self._async.staging_wait_s = value

    @contextmanager
    def _io(self, step: Optional[int], name: str = "checkpoint") -> Iterator[None]:
        """A checkpoint's I/O for the watchdog: its own bound, then progress (``step``
        None: the watchdog's own)."""
        if self.watchdog is None:
            yield
            return
        self.watchdog.saving(self.watchdog.step if step is None else step, name)
        try:
            yield
        finally:
            self.watchdog.saved()

    def _barrier(self, step: Optional[int]) -> None:
        """The save's barrier: a collective for the watchdog (the rank that never gets
        here is the one named), then back to the save."""
        w = self.watchdog
        if w is not None:
            step = w.step if step is None else step
            w.phase(COLLECTIVE, step)
        dist.barrier()
        if w is not None:
            w.phase("checkpoint", step)

    def save(self, engine, step: int, extra: Dict[str, Any], blocking: bool = True) -> Path:
        with self._io(step):
            final = self._save(engine, step, extra, blocking)
        self.policy.saved()
        return final

    def _save(self, engine, step: int, extra: Dict[str, Any], blocking: bool) -> Path:
        self.wait()
        t0 = time.perf_counter()
        final, tmp = self.root / step_name(step), self.root / f".tmp-{step_name(step)}"
        background = not blocking and self.backend.saves_async
        if background:  # no barrier: a stale temporary directory was removed at start-up (load_latest)
            tmp.mkdir(parents=True, exist_ok=True)
        else:
            if self.rank == 0:
                self.root.mkdir(parents=True, exist_ok=True)
                shutil.rmtree(tmp, ignore_errors=True)
                tmp.mkdir()
            self._barrier(step)
        # In the background the writer fsyncs it: an fsync here may wait for the journal.
        sums = write_extra(tmp, self.rank, step, extra, fsync=not background)
        side = tmp / f"{SUMS}{self.rank}.json"
        if background:
            future = self.backend.save(engine, tmp, side, sums, self._async)
            self._pending, self._unwaited = (future, tmp, final, step), True
        else:
            self.backend.save(engine, tmp, side, sums)  # every rank's files under tmp, its CRCs in side
            self.faults.in_save(step)  # fault.slow_save_s, fault.hang_in=save: a slow or stuck writer
            self._barrier(step)
            self.faults.save_written(step)
            self._commit_now(tmp, final, step)
        self.last_save_s = time.perf_counter() - t0  # async: the stall, with staging_wait_s
        if not background and self.rank == 0:  # deleting old checkpoints need not hold up the loop
            self._committer = threading.Thread(target=self._prune, args=(step,), daemon=False)  # wait() joins it
            self._committer.start()
        return final

    def _commit_now(self, tmp: Path, final: Path, step: int) -> None:
        """Rank 0 lists ``tmp`` and reads the ranks' side files, once, and tells each rank
        its share of the files no rank summed as it wrote (:func:`.manifest.save_plan`);
        each reads back its share; rank 0 publishes (collective). No other rank lists the
        directory or reads another's file: a save's file work is linear in the ranks."""
        written, shares = shared_save_plan(tmp, self.rank, dist.get_world_size())
        back = read_back(tmp, self.rank, shares)
        if any(rank != 0 for rank in shares):  # (the same on every rank) another rank's entries, in its file
            self._barrier(step)
        if self.rank == 0:
            publish(tmp, final, step, {**written, **back, **read_backs(tmp, shares)}, shape=self.shape)
        self._barrier(step)

    def prepare_async(self) -> None:
        """The gloo group and the thread of async saves, where the backend saves async
        (collective when it makes the group: the loop calls it at start-up, so that the
        first save does not wait for it)."""
        if self.backend.saves_async:
            self._async.prepare()

    def reserve_async(self, engine) -> Optional[Future]:
        """Have the checkpoint thread allocate (and fault in) the snapshot's host buffers
        now, in the background, so that the first async save finds them: the first copy
        into new buffers (their pages faulted in) costs several times a copy into reused
        ones, and page-locked memory on a GPU host is slower to allocate still. The loop
        calls it after its first step (the optimizer state exists then). The copy it makes
        is thrown away, so reading the state while the training thread updates it does
        no harm. Not collective; None if there is nothing to do."""
        return self._async.reserve(engine)

    def wait_staged(self) -> None:
        """Block until the pending async snapshot is copied (then the state may change)."""
        self._async.wait_staged()

    def close(self) -> None:
        """Wait for a pending save, then free the snapshot buffers and the thread."""
        self.wait()
        self._async.close()

    def poll(self) -> None:
        """Non-blocking: commit a finished async save (rank 0, in the background)."""
        if self._pending is None or not self._pending[0].done():
            return
        future, tmp, final, step = self._pending
        self._pending = None
        future.result()  # re-raise a failed write
        if self.rank == 0:
            self._committer = threading.Thread(target=self._commit, args=(tmp, final, step), daemon=False)
            self._committer.start()

    def wait(self) -> None:
        """Block until a pending async save is written and committed (collective)."""
        if self._unwaited:
            step = self._pending[3] if self._pending is not None else None
            with self._io(step):  # the async write may still be going: the save's bound
                self._async.wait_staged()
                if self._pending is not None:
                    self._pending[0].result()
                    self.poll()
                self._barrier(step)
            self._unwaited = False
        if self._committer is not None:
            self._committer.join()
            self._committer = None

    def _commit(self, tmp: Path, final: Path, step: int) -> None:
        """Rank 0, after an async write: publish, then prune."""
        publish(tmp, final, step, shape=self.shape)
        self._prune(step)

    def _prune(self, step: int) -> None:
        """Committed checkpoints beyond the newest ``keep``, but those an evaluation has yet
        to read (spec.evals.pinned). Not temporary directories: an async save of another
        rank may be writing one already (load_latest removes the stale ones at start-up)."""
        if self.on_commit is not None:
            self.on_commit(step)
        prune(self.root, self.keep)

    def load_latest(self, engine, report: Callable[[str], None]) -> Optional[Dict[str, Any]]:
        """Restore the newest good checkpoint; None if none. Rank 0 checks each
        candidate's manifest and file sizes and tells the others (a survey, broadcast: no
        other rank reads the manifest), every rank checksums its share of the files (newest
        first); the first that all pass is loaded.

        DCP's data files are checksummed as they are read, in the same pass over the disk
        (:mod:`.dcp_reader`): a mismatch fails the load on every rank and the next
        candidate is tried. That load may have put part of the rejected checkpoint into
        the engine's tensors; the next one overwrites all of them, and if none is left
        ``engine_dirty`` tells the caller to build the engine again."""
        with self._io(None, "restore"):
            return self._load_latest(engine, report)

    def _load_latest(self, engine, report: Callable[[str], None]) -> Optional[Dict[str, Any]]:
        world = dist.get_world_size()
        self.engine_dirty = False
        if self.rank == 0:  # saves killed before their commit: never loaded, removed now
            for stale in self.root.glob(".tmp-step_*"):
                shutil.rmtree(stale, ignore_errors=True)
        names = [[p.name for p in committed_steps(self.root)] if self.rank == 0 else None]
        dist.broadcast_object_list(names, src=0)
        for name in names[0]:
            ckpt = self.root / name
            found = shared_survey(ckpt, self.rank, world)  # rank 0's look, broadcast: the manifest parsed once
            reason = agreed_reason(verify(ckpt, self.rank, world, self.backend.summed_on_load, found), self.rank,
                                   world)  # the lowest rank's, as every rank's own check of its files says
            if reason is None:
                check_same_base(found.shape, self.shape, str(ckpt))  # LoRA: the adapters' base is this run's
                reason = self.backend.load(engine, ckpt, found)
                self.engine_dirty |= reason is not None and self.backend.loads_in_place
            if reason is None:
                return self._extra(ckpt, found.shape)
            if self.rank == 0:
                report(f"checkpoint {name} ignored: {reason}")
        return None

    def saved_shape(self, ckpt: Optional[Path] = None) -> Optional[Dict[str, Any]]:
        """The shape of the run that saved ``ckpt`` (default: the newest committed step), from
        its manifest; None if there is none (or it was saved before shapes were recorded)."""
        if ckpt is None:
            steps = committed_steps(self.root)
            if not steps:
                return None
            ckpt = steps[0]
        return saved_shape(ckpt)

    def plan_load(self) -> bool:
        """Before the engine is built (collective: rank 0 reads the newest manifest's shape
        and broadcasts it): whether it must load DeepSpeed's universal format, i.e. the
        newest checkpoint is a ZeRO one saved at another data-parallel size or stage (then
        the engine is built with ``checkpoint.load_universal``). DCP's backend: never."""
        saved = [self.saved_shape() if self.rank == 0 else None]
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.broadcast_object_list(saved, src=0)
        return self.backend.plan_load(saved[0])

    def _extra(self, ckpt: Path, saved: Optional[Dict[str, Any]]) -> Dict[str, Any]:
        """This rank's step, loader position and RNG states; every rank takes rank 0's when
        the checkpoint was saved on another layout (``saved``: its shape, from rank 0's
        survey; ``reshaped_from``)."""
        keys = ("world_size", "dp", "tp", "pp")
        moved = saved is not None and any(saved.get(k) != self.shape.get(k) for k in keys)
        extra = load_extra(ckpt, self.rank, same_layout=not moved)
        if saved is not None and saved != {k: self.shape.get(k) for k in saved}:
            extra["reshaped_from"] = saved
        return extra


def prune(root: Path, keep: int) -> None:
    """Delete the committed checkpoints under ``root`` beyond the newest ``keep``, but those
    an evaluation has yet to read (spec.evals.pinned): rank 0 after each commit, and an
    evaluation job once it has read its own (train/eval_job.py)."""
    for old in committed_steps(root)[keep:]:
        if evals.pinned(root.parent, int(old.name[len("step_"):])):
            continue
        shutil.rmtree(old, ignore_errors=True)
        shutil.rmtree(universal_dir(old), ignore_errors=True)  # DeepSpeed's conversion, if any
