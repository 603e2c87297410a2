"""Atomic, verified checkpoints: torch.distributed.checkpoint (DCP) or DeepSpeed's own.

Layout under ``RUN_DIR/checkpoints``::

    step_00000040/            a committed checkpoint
        COMMITTED             manifest: step, every file's size and CRC32 (written last)
        dcp/ or deepspeed/    the sharded model + optimizer state
        extra_rank{R}.pt      per rank: step, data-loader position, RNG states
    latest                    name of the newest committed step (replaced atomically)
    .tmp-step_00000050/       a save in progress: never loaded, removed on the next save

Commit protocol: every rank writes into the temporary directory; barrier; rank 0
fsyncs and checksums every file, writes ``COMMITTED``, renames the directory to its
final name, fsyncs the parent, then replaces ``latest``. A kill at any point leaves
either the previous checkpoint as newest or the new one complete. Loading picks the
newest directory whose manifest verifies (sizes and CRCs); a corrupt or truncated one
is reported and skipped.
"""
from __future__ import annotations

import json
import os
import random
import shutil
import signal
import threading
import time
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

import numpy as np
import torch
import torch.distributed as dist

MANIFEST = "COMMITTED"
LATEST = "latest"


def step_name(step: int) -> str:
    return f"step_{step:08d}"


def _crc32(path: Path) -> int:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(8 << 20):
            crc = zlib.crc32(chunk, crc)
        os.fsync(f.fileno())  # flush what the ranks wrote before we publish it
    return crc


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _files(root: Path) -> List[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file() and p.name != MANIFEST)


def verify(ckpt: Path) -> Optional[str]:
    """None when ``ckpt`` is a complete committed checkpoint, else the reason it is not."""
    manifest = ckpt / MANIFEST
    if not manifest.is_file():
        return "no commit marker"
    try:
        info = json.loads(manifest.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        return f"unreadable manifest ({exc})"
    for rel, (size, crc) in info["files"].items():
        path = ckpt / rel
        if not path.is_file():
            return f"missing file {rel}"
        if path.stat().st_size != size:
            return f"truncated file {rel} ({path.stat().st_size} of {size} bytes)"
        if _crc32(path) != crc:
            return f"checksum mismatch in {rel}"
    return None


def committed_steps(root: Path) -> List[Path]:
    """Committed-looking checkpoint directories, newest first (not yet verified)."""
    if not root.is_dir():
        return []
    dirs = [p for p in root.iterdir() if p.is_dir() and p.name.startswith("step_")]
    return sorted(dirs, key=lambda p: p.name, reverse=True)


def find_latest(root: Path, report: Callable[[str], None]) -> Optional[Path]:
    """Newest checkpoint that verifies; each bad one is reported and skipped."""
    for ckpt in committed_steps(root):
        reason = verify(ckpt)
        if reason is None:
            return ckpt
        report(f"checkpoint {ckpt.name} ignored: {reason}")
    return None


def rng_state() -> Dict[str, Any]:
    state = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: Dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


@dataclass
class Checkpointer:
    """Saves and restores one run's engine + loader state; collective (every rank calls).

    ``save(..., blocking=False)`` (torch engines) goes through DCP's ``async_save`` on a
    separate gloo group with a ``DefaultStager`` that copies the state into reused host
    buffers in a background thread (pinned, on a side stream, on GPU). The loop goes on
    at once: forward and backward only read the parameters, and a step pre-hook on every
    optimizer waits for the copy before the first update, so the snapshot is the state
    of the step saved. The loop is blocked only for the call and that wait
    (``last_save_s`` + ``staging_wait_s``). DCP's last phase gathers every rank's write
    results on rank 0, so when rank 0's future is done every shard is on disk: rank 0
    then commits in a background thread (checksums, rename, ``latest``). A later save, a
    preemption save and the end of training wait for a pending one first.
    """

    root: Path
    rank: int
    keep: int = 3

    def __post_init__(self) -> None:
        self._pending: Optional[Tuple[Any, Path, Path, int]] = None  # future, tmp, final, step
        self._committer: Optional[threading.Thread] = None
        self._async_group = None
        self._stager = None
        self._staging = None  # future: the async snapshot is complete
        self._guarded: set = set()  # ids of the optimizers whose step waits for it
        self.last_save_s = 0.0
        self.staging_wait_s = 0.0  # time optimizer steps waited for a snapshot, summed

    def save(self, engine, step: int, extra: Dict[str, Any], kill_before_commit: bool = False,
             blocking: bool = True) -> Path:
        self.wait()
        t0 = time.perf_counter()
        final = self.root / step_name(step)
        tmp = self.root / f".tmp-{step_name(step)}"
        if self.rank == 0:
            self.root.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir()
        dist.barrier()
        torch.save({"step": step, "rng": rng_state(), **extra}, tmp / f"extra_rank{self.rank}.pt")
        if not blocking and not hasattr(engine, "ds"):
            import torch.distributed.checkpoint as dcp

            if self._async_group is None:
                self._async_group = dist.new_group(backend="gloo")
            self._guard_optimizers(engine)
            response = dcp.async_save({"app": _AppState(engine)}, storage_writer=_writer(tmp / "dcp"),
                                      process_group=self._async_group, async_stager=self._async_stager())
            self._staging = response.staging_completion
            self._pending = (response.upload_completion, tmp, final, step)
            self.last_save_s = time.perf_counter() - t0  # the stall, with staging_wait_s
            return final
        _engine_save(engine, tmp)
        dist.barrier()
        if kill_before_commit:  # fault injection (tests): die with the shards written, uncommitted
            os.kill(os.getpid(), signal.SIGKILL)
        if self.rank == 0:
            self._commit(tmp, final, step)
        dist.barrier()
        self.last_save_s = time.perf_counter() - t0
        return final

    def _async_stager(self):
        if self._stager is None:
            from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

            gpu = torch.cuda.is_available()
            self._stager = DefaultStager(StagingOptions(use_pinned_memory=gpu, use_shared_memory=False,
                                                        use_async_staging=True, use_non_blocking_copy=gpu))
        return self._stager

    def _guard_optimizers(self, engine) -> None:
        """Every optimizer step first waits for a pending snapshot (see the class doc)."""
        for opt in getattr(engine, "optimizers", None) or [engine.optimizer]:
            if id(opt) not in self._guarded:
                opt.register_step_pre_hook(lambda *_: self.wait_staged())
                self._guarded.add(id(opt))

    def wait_staged(self) -> None:
        """Block until the pending async snapshot is copied (then the state may change)."""
        if self._staging is not None:
            t0 = time.perf_counter()
            self._staging.result()
            self._staging = None
            self.staging_wait_s += time.perf_counter() - t0

    def close(self) -> None:
        """Wait for a pending save, then free the staging buffers and thread."""
        self.wait()
        if self._stager is not None:
            self._stager.close()
            self._stager = None

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
        if self._pending is not None:
            self.wait_staged()
            self._pending[0].result()
            self.poll()
            dist.barrier()
        if self._committer is not None:
            self._committer.join()
            self._committer = None

    def _commit(self, tmp: Path, final: Path, step: int) -> None:
        files = {str(p.relative_to(tmp)): [p.stat().st_size, _crc32(p)] for p in _files(tmp)}
        manifest = tmp / MANIFEST
        manifest.write_text(json.dumps({"step": step, "time": time.time(), "files": files}, indent=1))
        with open(manifest) as f:
            os.fsync(f.fileno())
        if final.exists():  # a re-save of the same step (e.g. resumed and preempted at once)
            shutil.rmtree(final)
        os.rename(tmp, final)
        _fsync_dir(self.root)
        pointer = self.root / f".{LATEST}.tmp"
        pointer.write_text(final.name + "\n")
        os.replace(pointer, self.root / LATEST)
        _fsync_dir(self.root)
        self._prune()

    def _prune(self) -> None:
        for old in committed_steps(self.root)[self.keep:]:
            shutil.rmtree(old, ignore_errors=True)
        for stale in self.root.glob(".tmp-step_*"):
            shutil.rmtree(stale, ignore_errors=True)

    def load_latest(self, engine, report: Callable[[str], None]) -> Optional[Dict[str, Any]]:
        """Restore the newest good checkpoint (rank 0 chooses, all load it); None if none."""
        choice = [None]
        if self.rank == 0:
            found = find_latest(self.root, report)
            choice = [found.name if found else None]
        dist.broadcast_object_list(choice, src=0)
        if choice[0] is None:
            return None
        ckpt = self.root / choice[0]
        _engine_load(engine, ckpt)
        extra_path = ckpt / f"extra_rank{self.rank}.pt"
        if not extra_path.exists():  # resumed at another world size: rank 0's stream position
            extra_path = ckpt / "extra_rank0.pt"
        extra = torch.load(extra_path, weights_only=False)
        set_rng_state(extra["rng"])
        return extra


def _engine_save(engine, path: Path) -> None:
    if hasattr(engine, "ds"):  # DeepSpeed writes its own sharded files
        engine.ds.save_checkpoint(str(path / "deepspeed"), tag="state")
        return
    import torch.distributed.checkpoint as dcp

    dcp.save({"app": _AppState(engine)}, storage_writer=_writer(path / "dcp"))


def _writer(path: Path):
    """DCP's file writer: one file per rank, fsynced (needed for the commit protocol)."""
    from torch.distributed.checkpoint import FileSystemWriter

    return FileSystemWriter(str(path), single_file_per_rank=True, sync_files=True)


def _engine_load(engine, path: Path) -> None:
    if hasattr(engine, "ds"):
        engine.ds.load_checkpoint(str(path / "deepspeed"), tag="state")
        return
    import torch.distributed.checkpoint as dcp

    dcp.load({"app": _AppState(engine)}, checkpoint_id=str(path / "dcp"))


class _AppState:
    """DCP Stateful: model + optimizer through get/set_state_dict (DDP, FSDP2, TP alike);
    an engine with its own ``state_dict`` (pipeline stages) provides it."""

    def __init__(self, engine) -> None:
        self.engine = engine

    def state_dict(self) -> Dict[str, Any]:
        if hasattr(self.engine, "state_dict"):
            return self.engine.state_dict()
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model, optim = get_state_dict(self.engine.module, self.engine.optimizer)
        return {"model": model, "optim": optim}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        if hasattr(self.engine, "load_state_dict"):
            self.engine.load_state_dict(state)
            return
        from torch.distributed.checkpoint.state_dict import set_state_dict

        set_state_dict(self.engine.module, self.engine.optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optim"])
