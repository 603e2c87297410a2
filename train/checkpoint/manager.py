"""Atomic, verified checkpoints: torch.distributed.checkpoint (DCP) or DeepSpeed's own.

Layout under ``RUN_DIR/checkpoints``::

    step_00000040/            a committed checkpoint
        COMMITTED             manifest: step, every file's size and CRC32 (written last)
        dcp/ or deepspeed/    the sharded model + optimizer state
        extra_rank{R}.pt      per rank: step, data-loader position, RNG states
    latest                    name of the newest committed step (replaced atomically)
    .tmp-step_00000050/       a save in progress (or killed): never loaded, removed at start-up

Commit protocol: every rank writes into the temporary directory (fsynced), computing
the CRC32 of its files from the bytes as it writes them, and leaves them beside its
files (``.crc_rank{R}.json``); barrier; files no rank summed as it wrote (DeepSpeed's,
DCP's ``.metadata``) are read back and summed, shared out among the ranks; rank 0 writes
``COMMITTED`` with every file's size and CRC, renames the directory to its final name,
fsyncs the parent, then replaces ``latest``. A kill at any point leaves either the
previous checkpoint as newest or the new one complete. Loading picks the newest
directory whose manifest verifies (sizes, and CRCs read back, the files shared out
among the ranks; DCP's data files summed as they are loaded, see ``load_latest``); a
corrupt or truncated one is reported and skipped.
"""
from __future__ import annotations

import collections
import copy
import functools
import io
import json
import os
import pickle
import random
import re
import shutil
import signal
import struct
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

import numpy as np
import torch
import torch.distributed as dist

try:  # ISA-L's CRC32: the same checksum as zlib.crc32 (manifests stay compatible), ~6x faster
    from isal.isal_zlib import crc32
except ImportError:  # a dependency, but zlib computes the same checksum
    from zlib import crc32

MANIFEST = "COMMITTED"
LATEST = "latest"
SUMS = ".crc_rank"  # + "{rank}.json": CRCs of the files a rank wrote, merged into the manifest


def step_name(step: int) -> str:
    return f"step_{step:08d}"


def _crc32(path: Path, fsync: bool = False) -> int:
    crc, buf = 0, bytearray(8 << 20)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            crc = crc32(view[:n], crc)
        if fsync:  # flush what the ranks wrote before we publish it
            os.fsync(f.fileno())
    return crc


_DCP_FILE = re.compile(r"__(\d+)_\d+\.distcp$")  # DCP's file of writer rank R: __R_N.distcp


def _share(paths: List[Path], rank: int, world: int) -> List[Path]:
    """This rank's part of ``paths`` to checksum (every rank computes the same split from the
    same listing). DCP's data file written by rank R goes to rank R % world: the rank that
    reads most of it on resume checksums it as it reads it (``_verifying_reader``). The
    rest: the largest first, each to the least loaded rank."""
    load, mine = [0] * world, []
    for path in sorted(paths, key=lambda p: (-p.stat().st_size, str(p))):
        match = _DCP_FILE.search(path.name)
        owner = int(match.group(1)) % world if match else load.index(min(load))
        load[owner] += path.stat().st_size
        if owner == rank:
            mine.append(path)
    return mine


def _checksums(root: Path, paths: List[Path], fsync: bool = False) -> Dict[str, List[int]]:
    return {str(p.relative_to(root)): [p.stat().st_size, _crc32(p, fsync)] for p in paths}


def _fsync(path: Path) -> None:
    """fsync a file or a directory (its entries: a rename in it)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _files(root: Path) -> List[Path]:
    return sorted(p for p in root.rglob("*")
                  if p.is_file() and p.name != MANIFEST and not p.name.startswith(SUMS))


def _unsummed(root: Path, sums: Dict[str, List[int]]) -> List[Path]:
    """The files under ``root`` that ``sums`` has no entry for (they are read back)."""
    return [p for p in _files(root) if str(p.relative_to(root)) not in sums]


def _written_sums(root: Path) -> Dict[str, List[int]]:
    """The CRCs the ranks computed as they wrote (their ``.crc_rank*.json``), merged."""
    sums: Dict[str, List[int]] = {}
    for side in sorted(root.glob(SUMS + "*.json")):
        sums.update(json.loads(side.read_text()))
    return sums


def verify(ckpt: Path, rank: int = 0, world: int = 1, deferred: Callable[[str], bool] = lambda rel: False
           ) -> Optional[str]:
    """None when ``ckpt`` is a complete committed checkpoint, else the reason it is not.

    Every caller checks the manifest and every file's size; with ``world`` > 1 each rank
    reads back and checksums only its share of the files (see ``_share``), so the ranks
    must combine their answers (``Checkpointer.load_latest`` does). Files for which
    ``deferred(rel)`` holds are not read here: the caller checksums them as it loads them."""
    manifest = ckpt / MANIFEST
    if not manifest.is_file():
        return "no commit marker"
    try:
        info = json.loads(manifest.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        return f"unreadable manifest ({exc})"
    for rel, (size, _) in info["files"].items():
        path = ckpt / rel
        if not path.is_file():
            return f"missing file {rel}"
        if path.stat().st_size != size:
            return f"truncated file {rel} ({path.stat().st_size} of {size} bytes)"
    for path in _share([ckpt / rel for rel in info["files"]], rank, world):
        rel = str(path.relative_to(ckpt))
        if not deferred(rel) and _crc32(path) != info["files"][rel][1]:
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

    ``save(..., blocking=False)`` (torch engines) takes the state dict (references to the
    live tensors) and hands it to one long-lived checkpoint thread, which copies it into
    host buffers kept from save to save (``_Snapshot``: one ``_foreach_copy_``, without
    the GIL; pinned, on a side stream, on GPU), then writes it with ``dcp.save`` on a
    separate gloo group. DCP's own ``async_save`` was not used: it starts a new thread
    per save and its stager walks the state in Python beside the training thread, which
    waits for the GIL: 15-30 ms of a 30-45 ms call on 2 CPU cores, against 9-14 ms for the
    whole call now (105.8M params, DDP, bench/checkpoint.py).
    The loop goes on at once: forward and backward only read the parameters, and a step
    pre-hook on every optimizer waits for the copy before the first update, so the
    snapshot is the state of the step saved. The loop is blocked only for the call and
    that wait (``last_save_s`` + ``staging_wait_s``). DCP's last phase gathers every
    rank's write results on rank 0, so when rank 0's future is done every shard is on
    disk: rank 0 then commits in a background thread (checksums, rename, ``latest``). A
    later save, a preemption save and the end of training wait for a pending one first.
    """

    root: Path
    rank: int
    keep: int = 3
    slow_async_s: float = 0.0  # fault injection: see FaultConfig.slow_async_save_s

    def __post_init__(self) -> None:
        self._pending: Optional[Tuple[Any, Path, Path, int]] = None  # future, tmp, final, step
        # An async save not yet waited for. Unlike _pending (cleared by whichever rank's
        # poll() sees its write done first) it is the same on every rank, so wait() can
        # decide on it whether to enter its barrier.
        self._unwaited = False
        self._committer: Optional[threading.Thread] = None
        self._async_group = None
        self._worker: Optional[ThreadPoolExecutor] = None  # one thread: snapshot, then write
        self._snapshot: Optional[_Snapshot] = None
        self._staging: Optional[Future] = None  # the async snapshot is complete
        self._guarded: set = set()  # ids of the optimizers whose step waits for it
        self.last_save_s = 0.0
        self.staging_wait_s = 0.0  # time optimizer steps waited for a snapshot, summed
        self.engine_dirty = False  # see load_latest

    def save(self, engine, step: int, extra: Dict[str, Any], kill_before_commit: bool = False,
             blocking: bool = True) -> Path:
        self.wait()
        t0 = time.perf_counter()
        final = self.root / step_name(step)
        tmp = self.root / f".tmp-{step_name(step)}"
        background = not blocking and not engine.native_checkpoint
        if background:  # no barrier: a stale temporary directory was removed at start-up (load_latest)
            tmp.mkdir(parents=True, exist_ok=True)
        else:
            if self.rank == 0:
                self.root.mkdir(parents=True, exist_ok=True)
                shutil.rmtree(tmp, ignore_errors=True)
                tmp.mkdir()
            dist.barrier()
        # In the background the writer fsyncs it: an fsync here may wait for the journal.
        sums = _write_summed(tmp, f"extra_rank{self.rank}.pt", {"step": step, "rng": rng_state(), **extra},
                             fsync=not background)
        side = tmp / f"{SUMS}{self.rank}.json"
        if background:
            self.prepare_async(engine)
            self._guard_optimizers(engine)
            state = _AppState(engine).state_dict()  # references to the live tensors
            staged: Future = Future()
            writer = _summing_writer()(tmp, side, sums)
            self._staging = staged
            self._pending = (self._worker.submit(self._write_async, state, staged, writer), tmp, final, step)
            self._unwaited = True
            self.last_save_s = time.perf_counter() - t0  # the stall, with staging_wait_s
            return final
        if engine.native_checkpoint:  # DeepSpeed writes its own sharded files; read back below
            engine.save_native(tmp / "deepspeed")
            side.write_text(json.dumps(sums))
        else:
            import torch.distributed.checkpoint as dcp

            dcp.save({"app": _AppState(engine)}, storage_writer=_summing_writer()(tmp, side, sums))
        dist.barrier()
        if kill_before_commit:  # fault injection (tests): die with the shards written, uncommitted
            os.kill(os.getpid(), signal.SIGKILL)
        # The files no rank summed as it wrote, read back (and fsynced), shared out.
        written = _written_sums(tmp)
        rest = _unsummed(tmp, written)
        parts: List[Dict[str, List[int]]] = [{} for _ in range(dist.get_world_size())]
        dist.all_gather_object(parts, _checksums(tmp, _share(rest, self.rank, dist.get_world_size()), fsync=True))
        if self.rank == 0:
            for part in parts:
                written.update(part)
            self._commit(tmp, final, step, written, prune=False)
        dist.barrier()
        self.last_save_s = time.perf_counter() - t0
        if self.rank == 0:  # deleting old checkpoints need not hold up the loop (wait() joins it)
            self._committer = threading.Thread(target=self._prune, daemon=False)
            self._committer.start()
        return final

    def prepare_async(self, engine) -> None:
        """The gloo group and the thread of async saves (collective when it makes the group:
        the loop calls it at start-up, so that the first save does not wait ~70 ms for it)."""
        if engine.native_checkpoint:
            return
        if self._async_group is None:
            self._async_group = dist.new_group(backend="gloo")
        if self._worker is None:
            self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint")
            self._snapshot = _Snapshot()

    def reserve_async(self, engine) -> Optional[Future]:
        """Have the checkpoint thread allocate (and fault in) the snapshot's host buffers
        now, in the background, so that the first async save finds them: the first copy
        into new buffers took 2.2 s for 1270 MB on this VM, against 0.1-0.3 s into reused
        ones, and page-locked memory on a GPU host is slower to allocate still. The loop
        calls it after its first step (the optimizer state exists then). The copy it makes
        is thrown away, so reading the state while the training thread updates it does
        no harm. Not collective; None if there is nothing to do."""
        if self._worker is None or self._snapshot.reserved:
            return None
        return self._worker.submit(self._snapshot.take, _AppState(engine).state_dict())

    def _write_async(self, state: Dict[str, Any], staged: Future, writer) -> None:
        """The worker thread: snapshot ``state`` (then the optimizers may step), write it."""
        import torch.distributed.checkpoint as dcp

        try:
            time.sleep(self.slow_async_s)
            snapshot = self._snapshot.take(state)
        except BaseException as exc:
            staged.set_exception(exc)
            raise
        staged.set_result(None)
        time.sleep(self.slow_async_s)
        dcp.save({"app": snapshot}, storage_writer=writer, process_group=self._async_group)

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
        """Wait for a pending save, then free the snapshot buffers and the thread."""
        self.wait()
        if self._worker is not None:
            self._worker.shutdown()
            self._worker, self._snapshot = None, None

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
            self.wait_staged()
            if self._pending is not None:
                self._pending[0].result()
                self.poll()
            dist.barrier()
            self._unwaited = False
        if self._committer is not None:
            self._committer.join()
            self._committer = None

    def _commit(self, tmp: Path, final: Path, step: int, sums: Optional[Dict[str, List[int]]] = None,
                prune: bool = True) -> None:
        """Rank 0: the manifest (CRCs the ranks computed, the rest read back), then publish."""
        files = dict(sums) if sums is not None else _written_sums(tmp)
        files.update(_checksums(tmp, _unsummed(tmp, files), fsync=True))
        for side in tmp.glob(SUMS + "*.json"):
            side.unlink()
        manifest = tmp / MANIFEST
        manifest.write_text(json.dumps({"step": step, "time": time.time(), "files": dict(sorted(files.items()))},
                                       indent=1))
        _fsync(manifest)
        if final.exists():  # a re-save of the same step (e.g. resumed and preempted at once)
            shutil.rmtree(final)
        os.rename(tmp, final)
        _fsync(self.root)
        pointer = self.root / f".{LATEST}.tmp"
        pointer.write_text(final.name + "\n")
        os.replace(pointer, self.root / LATEST)
        _fsync(self.root)
        if prune:
            self._prune()

    def _prune(self) -> None:
        """Committed checkpoints beyond the newest ``keep``. Not temporary directories: an
        async save of another rank may be writing one already (load_latest removes the
        stale ones at start-up)."""
        for old in committed_steps(self.root)[self.keep:]:
            shutil.rmtree(old, ignore_errors=True)

    def load_latest(self, engine, report: Callable[[str], None]) -> Optional[Dict[str, Any]]:
        """Restore the newest good checkpoint; None if none. Every rank checks each
        candidate's manifest and file sizes and checksums its share of the files (newest
        first); the first that all pass is loaded.

        DCP's data files are checksummed as they are read, in the same pass over the disk
        (``_verifying_reader``): a mismatch fails the load on every rank and the next
        candidate is tried. That load may have put part of the rejected checkpoint into
        the engine's tensors; the next one overwrites all of them, and if none is left
        ``engine_dirty`` tells the caller to build the engine again."""
        world = dist.get_world_size()
        self.engine_dirty = False
        if self.rank == 0:  # saves killed before their commit: never loaded, removed now
            for stale in self.root.glob(".tmp-step_*"):
                shutil.rmtree(stale, ignore_errors=True)
        names = [[p.name for p in committed_steps(self.root)] if self.rank == 0 else None]
        dist.broadcast_object_list(names, src=0)
        in_load = (lambda rel: False) if engine.native_checkpoint else (lambda rel: bool(_DCP_FILE.search(rel)))
        ckpt = None
        for name in names[0]:
            reasons: List[Optional[str]] = [None] * world
            dist.all_gather_object(reasons, verify(self.root / name, self.rank, world, in_load))
            reason = next((r for r in reasons if r is not None), None)
            if reason is None:
                reason = self._engine_load(engine, self.root / name, in_load)
            if reason is None:
                ckpt = self.root / name
                break
            if self.rank == 0:
                report(f"checkpoint {name} ignored: {reason}")
        if ckpt is None:
            return None
        extra_path = ckpt / f"extra_rank{self.rank}.pt"
        if not extra_path.exists():  # resumed at another world size: rank 0's stream position
            extra_path = ckpt / "extra_rank0.pt"
        extra = torch.load(extra_path, weights_only=False)
        set_rng_state(extra["rng"])
        return extra

    def _engine_load(self, engine, ckpt: Path, in_load: Callable[[str], bool]) -> Optional[str]:
        """Load ``ckpt`` into ``engine`` (collective); the reason if a file it read was corrupt."""
        if engine.native_checkpoint:  # verified beforehand: DeepSpeed reads its files itself
            engine.load_native(ckpt / "deepspeed")
            return None
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.api import CheckpointException

        files = json.loads((ckpt / MANIFEST).read_text())["files"]
        mine = _share([ckpt / rel for rel in files], self.rank, dist.get_world_size())
        owned = {p.name: files[str(p.relative_to(ckpt))] for p in mine if in_load(str(p.relative_to(ckpt)))}
        try:
            dcp.load({"app": _AppState(engine)}, storage_reader=_verifying_reader()(ckpt / "dcp", owned))
        except CheckpointException as exc:
            corrupt = [e for e, _ in exc.failures.values() if isinstance(e, CorruptCheckpoint)]
            if not corrupt:
                raise
            self.engine_dirty = True
            return str(corrupt[0])
        return None


def _rebuild_layout(storage, offset, size, stride, *_):
    return storage, offset, tuple(size), tuple(stride)


# "FloatStorage" -> torch.float32, ...: the storage classes' dtype without touching the
# classes (TypedStorage.dtype warns that TypedStorage is deprecated)
_STORAGE_DTYPES = {name: dtype for dtype, name in torch.storage._dtype_to_storage_type_map().items()}


class _LayoutUnpickler(pickle.Unpickler):
    """Unpickles a ``torch.save``d tensor's data.pkl into its layout only: (storage id,
    offset, shape, stride). Any other object is refused (the caller then loads it
    with ``torch.load``)."""

    def find_class(self, module: str, name: str):
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return _rebuild_layout
        if (module, name) == ("collections", "OrderedDict"):
            return collections.OrderedDict
        if module == "torch" and name in _STORAGE_DTYPES:  # torch.FloatStorage etc.: its dtype
            return _STORAGE_DTYPES[name]
        raise pickle.UnpicklingError(f"not a plain tensor: {module}.{name}")

    def persistent_load(self, pid):
        return pid  # ("storage", storage type, key, location, numel)


_LOCAL, _DESCRIPTOR = b"PK\x03\x04", b"PK\x07\x08"


def tensor_record(head: bytes) -> Optional[Tuple[torch.dtype, tuple, tuple, int, int, int]]:
    """(dtype, shape, stride, storage offset, storage bytes, offset of the storage's bytes)
    of the tensor ``torch.save`` wrote at the start of ``head``, found by walking the zip's
    local headers front to back (torch writes sizes into data descriptors after each
    record, so a record ends where its descriptor with its own size begins; data.pkl ends
    where the pickle stops); None for anything else. ``torch.load(map_location="meta")``
    finds the same offset from the central directory at the end of the record (tested)."""
    pos, layout = 0, None
    while head[pos:pos + 4] == _LOCAL and pos + 30 <= len(head):
        nlen, elen = struct.unpack_from("<HH", head, pos + 26)
        name = head[pos + 30:pos + 30 + nlen].decode("utf-8", "replace").split("/", 1)[-1]
        data = pos + 30 + nlen + elen
        if name == "data.pkl":
            stream = io.BytesIO(memoryview(head)[data:])
            try:
                layout = _LayoutUnpickler(stream).load()
            except Exception:
                return None
            end = data + stream.tell()
        elif layout is not None and name.startswith("data/"):
            if not (isinstance(layout, tuple) and len(layout) == 4 and isinstance(layout[0], tuple)
                    and len(layout[0]) == 5 and layout[0][0] == "storage" and name == f"data/{layout[0][2]}"):
                return None
            try:
                (_, kind, _, _, numel), offset, shape, stride = layout
                dtype, nbytes = kind, int(numel) * kind.itemsize
            except (AttributeError, TypeError, ValueError):
                return None
            return (dtype, shape, stride, offset, nbytes, data) if isinstance(dtype, torch.dtype) else None
        else:  # a small record: its descriptor follows within a few bytes
            end = head.find(_DESCRIPTOR, data, data + 4096)
            if end < 0:
                return None
        if head[end:end + 4] != _DESCRIPTOR or struct.unpack_from("<I", head, end + 8)[0] != end - data:
            return None
        pos = end + 16
    return None


class CorruptCheckpoint(Exception):
    """A checkpoint file's bytes do not match its manifest entry."""


@functools.lru_cache(maxsize=None)
def _verifying_reader():
    """The reader class (defined on first use: importing DCP takes seconds)."""

    from torch.distributed._shard._utils import narrow_tensor_by_index
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.planner import LoadItemType
    from torch.futures import Future

    class VerifyingReader(FileSystemReader):
        """DCP's file reader, in one pass over the files: the ones this rank owns
        (``owned``: file name -> [size, CRC32] from the manifest) are read front to back
        and checksummed on the way, and a tensor whose destination is a contiguous CPU
        tensor of its dtype and shape is read straight into it (DCP's reader
        ``torch.load``s each into a new tensor, then copies it). The saved tensor's
        layout and the offset of its bytes come from the head of its record
        (``tensor_record``). Any other item goes DCP's way."""

        def __init__(self, path: Path, owned: Dict[str, List[int]]) -> None:
            super().__init__(str(path))
            self.owned = owned
            self.direct = 0  # tensors read straight into their destination (tests)

        def read_data(self, plan, planner):
            per_file: Dict[str, list] = {}
            for req in plan.items:
                per_file.setdefault(self.storage_data[req.storage_index].relative_path, []).append(req)
            # its own files first: the other ranks meanwhile bring theirs into the page cache
            order = sorted(per_file, key=lambda rel: (rel not in self.owned, rel))
            for rel in [r for r in order if r in self.owned]:  # the kernel reads ahead the whole file
                fd = os.open(Path(self.path) / rel, os.O_RDONLY)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
                os.close(fd)
            for rel in order:
                self._read_file(rel, per_file[rel], planner)
            for rel, (_, crc) in self.owned.items():
                if rel not in per_file and _crc32(Path(self.path) / rel) != crc:
                    raise CorruptCheckpoint(f"checksum mismatch in dcp/{rel}")
            future: Future = Future()
            future.set_result(None)
            return future

        def _read_file(self, rel: str, reqs: list, planner) -> None:
            expected = self.owned.get(rel)
            blobs: Dict[Any, list] = {}
            for req in reqs:
                blobs.setdefault(req.storage_index, []).append(req)
            order = sorted(blobs.items(), key=lambda kv: self.storage_data[kv[0]].offset)
            crc, pos, scratch = 0, 0, memoryview(bytearray(8 << 20))
            with open(Path(self.path) / rel, "rb", buffering=0) as f:

                def read_into(view: memoryview) -> None:
                    nonlocal crc, pos
                    f.seek(pos)
                    done = 0
                    while done < len(view):
                        n = f.readinto(view[done:])
                        if not n:
                            raise CorruptCheckpoint(f"truncated file dcp/{rel} (ends at {pos + done})")
                        done += n
                    if expected is not None:
                        crc = crc32(view, crc)
                    pos += done

                def advance(end: int) -> None:  # to ``end``: read and summed if owned
                    nonlocal pos
                    if expected is None:
                        pos = max(pos, end)
                    while pos < end:
                        read_into(scratch[:min(len(scratch), end - pos)])

                try:
                    for index, group in order:
                        info = self.storage_data[index]
                        advance(info.offset)
                        direct = self._destination(f, info, group, planner)
                        if direct is not None:
                            target, start = direct
                            advance(info.offset + start)
                            read_into(memoryview(target.reshape(-1).view(torch.uint8).numpy()))
                            advance(info.offset + info.length)
                            planner.commit_tensor(group[0], target)
                            self.direct += 1
                            continue
                        blob = bytearray(info.length)
                        read_into(memoryview(blob))
                        for req in group:
                            self._load_item(req, info, io.BytesIO(blob), planner)
                    if expected is not None:
                        advance(expected[0])
                except CorruptCheckpoint:
                    raise
                except Exception as exc:  # unreadable: corrupt if its checksum says so
                    if expected is not None and _crc32(Path(self.path) / rel) != expected[1]:
                        raise CorruptCheckpoint(f"checksum mismatch in dcp/{rel}") from exc
                    raise
            if expected is not None and crc != expected[1]:
                raise CorruptCheckpoint(f"checksum mismatch in dcp/{rel}")

        def _destination(self, f, info, group: list, planner) -> Optional[Tuple[torch.Tensor, int]]:
            """(destination, offset of the tensor's bytes in its record) if the item can be
            read straight into its destination, else None."""
            req = group[0]
            if len(group) > 1 or req.type == LoadItemType.BYTE_IO or info.transform_descriptors:
                return None
            target = planner.resolve_tensor(req).detach()
            if target.device.type != "cpu" or not target.is_contiguous() or any(req.storage_offsets) \
                    or tuple(req.lengths) != tuple(target.shape):
                return None
            record = tensor_record(os.pread(f.fileno(), min(info.length, 1 << 16), info.offset))
            if record is None:
                return None
            dtype, shape, stride, offset, nbytes, start = record
            if dtype != target.dtype or shape != tuple(target.shape) or stride != target.stride() or offset \
                    or nbytes != target.numel() * target.element_size():
                return None
            return target, start

        def _load_item(self, req, info, stream, planner) -> None:
            """One item DCP's way (filesystem.FileSystemReader.read_data) from its record."""
            stream = self.transforms.transform_load_stream(req, info.transform_descriptors or (), stream)
            if req.type == LoadItemType.BYTE_IO:
                planner.load_bytes(req, io.BytesIO(stream.read(-1)))
                return
            if not stream.seekable():
                stream = io.BytesIO(stream.read(-1))
            tensor = narrow_tensor_by_index(torch.load(stream, map_location="cpu", weights_only=True),
                                            req.storage_offsets, req.lengths)
            target = planner.resolve_tensor(req).detach()
            if target.size() != tensor.size():
                raise AssertionError(f"req {req.storage_index} mismatch sizes {target.size()} vs {tensor.size()}")
            target.copy_(tensor)
            planner.commit_tensor(req, target)

    return VerifyingReader


def _write_summed(root: Path, rel: str, obj: Any, fsync: bool = True) -> Dict[str, List[int]]:
    """torch.save ``obj`` to ``root/rel``; its manifest entry, summed as written."""
    import io

    buf = io.BytesIO()
    torch.save(obj, buf)
    data = buf.getbuffer()
    with open(root / rel, "wb") as f:
        f.write(data)
        if fsync:
            f.flush()
            os.fsync(f.fileno())
    return {rel: [len(data), crc32(data)]}


class _SummingStream:
    """A file being written, whose CRC32 and size follow the bytes handed to ``write``
    (DCP writes each file front to back: ``torch.save`` into it, then fsync)."""

    def __init__(self, raw) -> None:
        self.raw, self.crc, self.size = raw, 0, 0

    def write(self, data) -> int:
        n = self.raw.write(data)
        self.crc = crc32(data, self.crc)
        self.size += n
        return n

    def __getattr__(self, name: str):  # tell, flush, fileno, close
        return getattr(self.raw, name)


@functools.lru_cache(maxsize=None)
def _summing_writer():
    """The writer class (defined on first use: importing DCP takes seconds)."""
    from contextlib import contextmanager

    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint.filesystem import FileSystem

    class SummingFileSystem(FileSystem):
        def __init__(self) -> None:
            self.sums: Dict[Path, List[int]] = {}

        @contextmanager
        def create_stream(self, path, mode):
            with super().create_stream(path, mode) as raw:
                if mode != "wb":
                    yield raw
                    return
                stream = _SummingStream(raw)
                yield stream
                self.sums[Path(path)] = [stream.size, stream.crc]

    class SummingWriter(FileSystemWriter):
        """DCP's file writer (one file per rank, fsynced: the commit protocol needs it)
        that also leaves this rank's CRCs, computed as it wrote, in ``side`` (with ``sums``
        of the files it wrote before, which it fsyncs) for rank 0's manifest."""

        def __init__(self, root: Path, side: Path, sums: Dict[str, List[int]]) -> None:
            super().__init__(str(root / "dcp"), single_file_per_rank=True, sync_files=True)
            self.fs = SummingFileSystem()
            self.root, self.side, self.prior = root, side, sums

        def write_data(self, plan, planner):
            # torch.save's own CRC32 of every zip record (miniz, ~4 GB/s: 15% of a save on
            # this machine) is left out: each file's CRC is taken as it is written, in the
            # manifest, checked before any load. torch.load reads such files (documented).
            # The setting is the process's own for the time of the write.
            from torch.utils.serialization import config

            with config.patch({"save.compute_crc32": False}):
                future = super().write_data(plan, planner)
            future.wait()  # done already (DCP writes in this call); raises what the write raised
            for rel in self.prior:  # written (not fsynced) by this rank before the save
                _fsync(self.root / rel)
            sums = dict(self.prior)
            sums.update({str(p.relative_to(self.root)): v for p, v in self.fs.sums.items()})
            self.side.write_text(json.dumps(sums))
            return future

    return SummingWriter


class _AppState:
    """DCP Stateful over an engine's model + optimizer state (:class:`train.strategies.base.Engine`)."""

    def __init__(self, engine) -> None:
        self.engine = engine

    def state_dict(self) -> Dict[str, Any]:
        return self.engine.state_dict()

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.engine.load_state_dict(state)


class _Snapshot:
    """Copies of a state dict's tensors in host buffers that are kept from one save to
    the next (page-locked on GPU hosts). ``take`` runs on the checkpoint thread: one
    ``_foreach_copy_`` per device, which runs without the GIL, so the training thread
    is not held up by it; the rest of the state (plain values) is copied as it is."""

    def __init__(self) -> None:
        self._buffers: Dict[tuple, torch.Tensor] = {}

    @property
    def reserved(self) -> bool:
        return bool(self._buffers)

    def _buffer(self, key: tuple, src: torch.Tensor) -> torch.Tensor:
        buf = self._buffers.get(key)
        if buf is None or buf.dtype != src.dtype or buf.shape != src.shape:  # the source's strides, if dense
            buf = torch.empty_like(src, device="cpu", pin_memory=src.device.type == "cuda")
            self._buffers[key] = buf
        return buf

    @torch.no_grad()
    def take(self, state: Any) -> Any:
        from torch.distributed.tensor import DTensor

        copies: Dict[torch.device, Tuple[List[torch.Tensor], List[torch.Tensor]]] = {}

        def snap(key: tuple, value: Any) -> Any:
            if isinstance(value, dict):
                return {k: snap(key + (k,), v) for k, v in value.items()}
            if isinstance(value, (list, tuple)):
                items = [snap(key + (i,), v) for i, v in enumerate(value)]
                return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)  # namedtuple
            if isinstance(value, DTensor):
                # The host copy of the shard, with the same sharding spec. Not from_local: it
                # would move the copy back to the mesh's device (a GPU).
                return DTensor(snap(key, value.to_local()), value._spec, requires_grad=False)
            if isinstance(value, torch.Tensor):
                buf = self._buffer(key, value)
                dsts, srcs = copies.setdefault(value.device, ([], []))
                dsts.append(buf)
                srcs.append(value.detach())
                return buf
            if isinstance(value, (int, float, str, bytes, bool, type(None))):
                return value
            return copy.deepcopy(value)  # a copy, not a reference to live state

        out = snap((), state)
        for device, (dsts, srcs) in copies.items():
            if device.type == "cpu":
                torch._foreach_copy_(dsts, srcs)
            else:  # on a side stream, so that it overlaps the training thread's kernels
                stream = torch.cuda.Stream(device)
                stream.wait_stream(torch.cuda.current_stream(device))
                with torch.cuda.stream(stream):
                    torch._foreach_copy_(dsts, srcs, non_blocking=True)
                stream.synchronize()
        return out
