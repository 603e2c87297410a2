"""Async saves: one long-lived checkpoint thread and the host buffers it copies into.

The training thread hands the state dict (references to the live tensors) to the thread,
which copies it into host buffers kept from save to save (:class:`Snapshot`: one
``_foreach_copy_``, without the GIL; pinned, on a side stream, on GPU), then writes it
with ``dcp.save`` on a group of its own (:func:`coordination_group`). DCP's own
``async_save`` was not used: it starts a new thread per save and its stager walks the
state in Python beside the training thread, which waits for the GIL for most of the call
(bench/checkpoint.py measures the stall).

Forward and backward only read the parameters, so the loop goes on at once; a step
pre-hook on every optimizer waits for the copy before the first update, so the snapshot
is the state of the step saved.

The thread works on the rank's GPU: its current CUDA device is set to the training
thread's when it starts (:func:`_use_device`). A new thread's current device is 0, and
CUDA calls there (the side stream's context restoring the current stream, pinned
buffers) would make a CUDA context on GPU 0 for every rank of the node (~0.5 GB each).
"""
from __future__ import annotations

import copy
import os
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from train.checkpoint.state import AppState
from train.harness.faults import Faults
from train.torch_compat import foreach_copy, host_dtensor


class Snapshot:
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
        copies: Dict[torch.device, Tuple[List[torch.Tensor], List[torch.Tensor]]] = {}
        out = self._snap((), state, copies)
        for device, (dsts, srcs) in copies.items():
            if device.type == "cpu":
                foreach_copy(dsts, srcs)
            else:  # on a side stream, so that it overlaps the training thread's kernels
                stream = torch.cuda.Stream(device)
                stream.wait_stream(torch.cuda.current_stream(device))
                with torch.cuda.stream(stream):
                    foreach_copy(dsts, srcs, non_blocking=True)
                stream.synchronize()
        return out

    def _snap(self, key: tuple, value: Any, copies: dict) -> Any:
        """``value`` with each tensor replaced by its buffer (the copy queued in ``copies``)."""
        from torch.distributed.tensor import DTensor

        if isinstance(value, dict):
            return {k: self._snap(key + (k,), v, copies) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            items = [self._snap(key + (i,), v, copies) for i, v in enumerate(value)]
            return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)  # namedtuple
        if isinstance(value, DTensor):
            # The host copy of the shard, with the same sharding spec (kept on the host)
            return host_dtensor(self._snap(key, value.to_local(), copies), value)
        if isinstance(value, torch.Tensor):
            buf = self._buffer(key, value)
            dsts, srcs = copies.setdefault(value.device, ([], []))
            dsts.append(buf)
            srcs.append(value.detach())
            return buf
        if isinstance(value, (int, float, str, bytes, bool, type(None))):
            return value
        return copy.deepcopy(value)  # a copy, not a reference to live state


def _current_cuda_device() -> Optional[int]:
    """The calling thread's CUDA device (the rank's: train.harness.dist.pick_device set it);
    None where CUDA is not in use (a CPU run: nothing is initialised, nothing to set)."""
    return torch.cuda.current_device() if torch.cuda.is_initialized() else None


def _use_device(index: Optional[int]) -> None:
    """A thread's first call: make ``index`` its current CUDA device."""
    if index is not None:
        torch.cuda.set_device(index)


#: torch's switch (documented under "Improving initialization time" in its distributed
#: docs; read when a gloo group is made, in 2.11 and 2.13) that connects a gloo pair at
#: its first message instead of every pair when the group is made.
GLOO_LAZY_INIT = "TORCH_GLOO_LAZY_INIT"


def coordination_group():
    """The checkpoint thread's own group over every rank, for DCP's planning gathers and
    scatters and its commit (the training thread's collectives keep the default group).

    Gloo, whose pairs connect lazily (:data:`GLOO_LAZY_INIT`, unless the environment sets
    it): a gloo group otherwise connects every rank to every other as it is made, W - 1
    sockets a rank (4,095 at 4,096 ranks), where a save's gathers to rank 0, scatters and
    broadcasts from it and its all-gather of sizes touch a few peers a rank (rank 0: all;
    on 12 gloo ranks, two saves connected 3 to 6 of the 11 peers of each other rank).
    Under the fake backend (one rank of a large job in one process, tests and bench), a
    fake group: gloo cannot be made there."""
    if dist.get_backend() == "fake":
        return dist.new_group(backend="fake")
    lazy = os.environ.get(GLOO_LAZY_INIT)
    os.environ[GLOO_LAZY_INIT] = lazy or "1"
    try:
        return dist.new_group(backend="gloo")
    finally:  # only this group: the process's other gloo groups are made as the user asked
        if lazy is None:
            os.environ.pop(GLOO_LAZY_INIT, None)


class AsyncSaver:
    """The checkpoint thread of one run, its group and its snapshot buffers.

    ``faults``: the task's fault seam, asked before the snapshot and before the write
    (:meth:`train.harness.faults.Faults.checkpoint_thread`)."""

    def __init__(self, faults: Optional[Faults] = None) -> None:
        self.faults = faults or Faults()
        self._group = None
        self._worker: Optional[ThreadPoolExecutor] = None  # one thread: snapshot, then write
        self._snapshot: Optional[Snapshot] = None
        self._staging: Optional[Future] = None  # the pending snapshot is complete
        self._guarded: set = set()  # ids of the optimizers whose step waits for it
        self.staging_wait_s = 0.0  # time optimizer steps waited for a snapshot, summed

    def prepare(self) -> None:
        """The group (:func:`coordination_group`, collective when it is made) and the
        thread, on the calling (training) thread's CUDA device."""
        if self._group is None:
            self._group = coordination_group()
        if self._worker is None:
            self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint",
                                              initializer=_use_device, initargs=(_current_cuda_device(),))
            self._snapshot = Snapshot()

    def reserve(self, engine) -> Optional[Future]:
        """Have the thread allocate (and fault in) the snapshot's buffers now; the copy
        it makes is thrown away. None if there is nothing to do."""
        if self._worker is None or self._snapshot.reserved:
            return None
        return self._worker.submit(self._snapshot.take, AppState(engine).state_dict())

    def start(self, engine, writer) -> Future:
        """Snapshot ``engine``'s state and write it with ``writer`` on the thread; the
        future of the write. The optimizers' next step waits for the snapshot."""
        self.prepare()
        self._guard_optimizers(engine)
        state = AppState(engine).state_dict()  # references to the live tensors
        staged: Future = Future()
        self._staging = staged
        return self._worker.submit(self._write, state, staged, writer)

    def _write(self, state: Dict[str, Any], staged: Future, writer) -> None:
        """The checkpoint thread: snapshot ``state`` (then the optimizers may step), write it."""
        import torch.distributed.checkpoint as dcp

        try:
            self.faults.checkpoint_thread()
            snapshot = self._snapshot.take(state)
        except BaseException as exc:
            staged.set_exception(exc)
            raise
        staged.set_result(None)
        self.faults.checkpoint_thread()
        dcp.save({"app": snapshot}, storage_writer=writer, process_group=self._group)

    def _guard_optimizers(self, engine) -> None:
        """Every optimizer step first waits for a pending snapshot."""
        optimizers: List[Any] = getattr(engine, "optimizers", None) or [engine.optimizer]  # pipeline: one a stage
        for opt in optimizers:
            if id(opt) not in self._guarded:
                opt.register_step_pre_hook(self._hook())
                self._guarded.add(id(opt))

    def _hook(self) -> Callable[..., None]:
        return lambda *_: self.wait_staged()

    def wait_staged(self) -> None:
        """Block until the pending snapshot is copied (then the state may change)."""
        if self._staging is not None:
            t0 = time.perf_counter()
            self._staging.result()
            self._staging = None
            self.staging_wait_s += time.perf_counter() - t0

    def close(self) -> None:
        """Free the snapshot buffers and the thread (a pending write is waited for)."""
        if self._worker is not None:
            self._worker.shutdown()
            self._worker, self._snapshot = None, None
