"""The checkpoint half of bench/bigjob_rank.py: one rank's real shard through the toolkit's
async save and its checksummed load, on the fake process group.

- the snapshot: :class:`train.checkpoint.async_save.AsyncSaver` as the loop drives it
  (``prepare`` at start-up, ``reserve`` after the first step, ``start`` at the save, the
  next optimizer step waiting for the copy): page-locked host buffers on a GPU, the stall
  = the ``start`` call + the next step's wait for the copy (the loop's ``last_save_s`` and
  ``staging_wait_s``);
- the write: DCP through the toolkit's summing writer (train/checkpoint/dcp_writer.py: one
  file, its CRC32 taken as it is written, fsynced), and the load: DCP through the
  toolkit's one-pass reader (train/checkpoint/dcp_reader.py: the file's CRC32 checked as
  it is read), into the engine's own tensors in place, after the file is evicted from the
  page cache (fsynced, then ``POSIX_FADV_DONTNEED``).

What differs from a real job, and why: DCP plans a save across the ranks (its gathers to
rank 0, scatters back) and checks that the chunks it is given cover every tensor; the fake
group carries no data and one rank's chunks cover 1/W of each tensor, so this rank's
state goes to DCP as its local shards (plain tensors, the same bytes a rank writes in a
job: :class:`LocalShards`) and DCP runs without the group (``no_dist``). Its metadata then
describes one rank's file, not the job's.
"""
from __future__ import annotations

import os
import time
import warnings
from pathlib import Path
from typing import Any, Dict, Iterator, Optional, Tuple

import torch

from train.checkpoint.async_save import AsyncSaver
from train.checkpoint.manifest import crc32

# DCP's word for a save or load without a process group (expected here: said in the docstring).
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")


class LocalShards:
    """An engine whose state dict is this rank's shards as plain tensors (DTensors' local
    parts: views of the live ones, so a load writes into the engine)."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.optimizers = list(getattr(engine, "optimizers", None) or [engine.optimizer])

    def state_dict(self) -> Dict[str, Any]:
        from torch.distributed.tensor import DTensor

        return {part: {k: v.to_local() if isinstance(v, DTensor) else v for k, v in values.items()}
                for part, values in self.engine.state_dict().items()}


class OneRankSaver(AsyncSaver):
    """The toolkit's async saver whose write runs without the process group (DCP's
    ``no_dist``: see the module's docstring), with the times of its copy and its write."""

    def __init__(self) -> None:
        super().__init__()
        self.taken: Any = None
        self.times: Dict[str, float] = {}

    def _write(self, state: Dict[str, Any], staged, writer) -> None:
        import torch.distributed.checkpoint as dcp

        t0 = time.perf_counter()
        try:
            self.taken = self._snapshot.take(state)
        except BaseException as exc:
            staged.set_exception(exc)
            raise
        staged.set_result(None)
        t1 = time.perf_counter()
        dcp.save({"app": self.taken}, storage_writer=writer, no_dist=True)
        self.times.update(copy_s=t1 - t0, write_s=time.perf_counter() - t1)


def tensors(state: Any, key: Tuple = ()) -> Iterator[Tuple[Tuple, torch.Tensor]]:
    """(key path, tensor) of every tensor in a nested state, in key order."""
    if isinstance(state, dict):
        for k in sorted(state, key=str):
            yield from tensors(state[k], key + (k,))
    elif isinstance(state, torch.Tensor):
        yield key, state


def content_crc(state: Any) -> int:
    """CRC32 of the bytes of the state's tensors, in key order (device tensors copied to
    the host first)."""
    crc = 0
    for _, t in tensors(state):
        host = t.detach().contiguous().cpu().reshape(-1)
        crc = crc32(host.view(torch.uint8).numpy(), crc) if host.numel() else crc
    return crc


def pinned_pool() -> Optional[int]:
    """Bytes the pinned host allocator holds (its blocks rounded up to powers of two); None
    without CUDA or where torch does not say."""
    stats = getattr(torch.cuda, "host_memory_stats", None)
    try:
        return int(stats()["allocated_bytes.current"]) if stats and torch.cuda.is_initialized() else None
    except (KeyError, RuntimeError):
        return None


def snapshot(saver: OneRankSaver, shards: LocalShards, folder: Path, step) -> Dict[str, Any]:
    """The async save at a step boundary, as the loop makes it: ``start``, then ``step()``
    (the next step, whose optimizer waits for the copy), then the write's end. Its
    figures: the stall, the bytes copied (pinned, and those that came from the GPU), the
    copy's and the write's seconds."""
    from train.checkpoint.backend import DCPBackend

    folder.mkdir(parents=True, exist_ok=True)
    on_device = sum(t.numel() * t.element_size() for _, t in tensors(shards.state_dict()) if t.is_cuda)
    t0 = time.perf_counter()
    future = DCPBackend(0).save(shards, folder, folder / "sums0.json", {}, saver)
    start_s = time.perf_counter() - t0
    wait_before = saver.staging_wait_s
    step_s = step()
    future.result()
    held = [t for _, t in tensors(saver.taken)]
    return {"start_s": start_s, "wait_s": saver.staging_wait_s - wait_before, "step_s": step_s, "pool": pinned_pool(),
            "bytes": sum(t.numel() * t.element_size() for t in held),
            "pinned_bytes": sum(t.numel() * t.element_size() for t in held if t.is_pinned()), "device_bytes": on_device,
            "tensors": len(held), **saver.times}


def load_back(shards: LocalShards, folder: Path) -> Dict[str, Any]:
    """Load the file written by :func:`snapshot` into the engine's own tensors through the
    toolkit's verifying reader (the writer's CRC32 checked as it reads), after evicting it;
    then the loaded tensors' content against the snapshot's and a flipped byte refused."""
    import json

    import torch.distributed.checkpoint as dcp

    from bench.checkpoint import evict
    from train.checkpoint.dcp_reader import verifying_reader
    from train.checkpoint.dcp_writer import SUBDIR
    from train.checkpoint.state import AppState

    sums = json.loads((folder / "sums0.json").read_text())
    owned = {rel.rpartition("/")[2]: v for rel, v in sums.items() if rel.endswith(".distcp")}
    files = [folder / SUBDIR / name for name in owned]
    evict(folder / SUBDIR)  # bench/checkpoint.py's: the writer fsynced them
    state = AppState(shards, loading=True).state_dict()
    sync = torch.cuda.synchronize if any(t.is_cuda for _, t in tensors(state)) else (lambda: None)
    t0 = time.perf_counter()
    dcp.load({"app": state}, storage_reader=verifying_reader()(folder / SUBDIR, owned), no_dist=True)
    sync()
    load_s = time.perf_counter() - t0
    return {"load_s": load_s, "file_bytes": sum(p.stat().st_size for p in files), "files": len(files),
            "crc": {name: f"{crc:08x}" for name, (_, crc) in owned.items()}, "state": state, "owned": owned}


def refuses_a_flipped_byte(shards: LocalShards, folder: Path, owned: Dict[str, list]) -> str:
    """A byte in the middle of the written file flipped (after the good load: the file is
    not needed again): the reader refuses it as corrupt ("" when it did; else what
    happened). What it read into the engine's tensors before the end of the file is left
    there (the row's last use of them)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    from train.checkpoint.dcp_reader import verifying_reader
    from train.checkpoint.dcp_writer import SUBDIR
    from train.checkpoint.manifest import CorruptCheckpoint
    from train.checkpoint.state import AppState

    path = folder / SUBDIR / next(iter(owned))
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))
    try:
        dcp.load({"app": AppState(shards, loading=True).state_dict()},
                 storage_reader=verifying_reader()(folder / SUBDIR, owned), no_dist=True)
    except CheckpointException as exc:
        found = [e for e, _ in exc.failures.values() if isinstance(e, CorruptCheckpoint)]
        return "" if found else f"refused, not as corrupt: {exc}"
    except CorruptCheckpoint:
        return ""
    return "a flipped byte was loaded without a word"
