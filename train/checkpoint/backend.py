"""Checkpoint backends: what torch.distributed.checkpoint (DCP) and DeepSpeed do differently.

The :class:`~train.checkpoint.manager.Checkpointer` does everything else the same way for
both (temporary directory, extra state, checksums, manifest, commit, verification,
pruning) and holds one backend, chosen once by the run's engine (:func:`backend_for`:
the ``engine`` of the run's shape, :func:`spec.rundir.run_shape`). That is the one way a
backend is chosen: the checkpointer exists, and DeepSpeed's backend plans the load
(``plan_load``), before the engine is built, and each manifest records the shape that
saved it. Each backend saves engines of one capability of the engine protocol
(:mod:`train.strategies.base`), named by its ``format``, which is the engine's
``checkpoint_format`` and the checkpoint's subdirectory: :class:`DCPBackend` "dcp"
(:class:`~train.strategies.base.DCPEngine`), :class:`.deepspeed_io.DeepSpeedBackend`
"deepspeed" (:class:`~train.strategies.base.NativeEngine`). A backend answers:

- ``save``: this rank's files of the engine's state (collective), or, given the
  checkpoint thread (:class:`.async_save.AsyncSaver`), the future of their write;
- ``saves_async``: whether a save may be written by the checkpoint thread;
- ``summed_on_load``: which files are checksummed as the load reads them, not before;
- ``plan_load``: before the engine is built, whether it must be built to load another
  format than its own (DeepSpeed's universal one);
- ``load``: the checkpoint into the engine, or the reason it was rejected, given rank 0's
  survey of it (:class:`.manifest.Survey`: no other rank reads its manifest);
- ``loads_in_place``: whether a rejected load may have left part of it in the engine.
"""
from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Mapping, Optional, Protocol

from train.checkpoint.async_save import AsyncSaver
from train.checkpoint.dcp_reader import readahead, verifying_reader
from train.checkpoint.dcp_writer import SUBDIR, summing_writer
from train.checkpoint.deepspeed_io import DeepSpeedBackend
from train.checkpoint.manifest import DCP_FILE, CorruptCheckpoint, Sums, Survey
from train.checkpoint.state import AppState

if TYPE_CHECKING:
    from train.strategies.base import DCPEngine


class Backend(Protocol):
    format: str  # the checkpoint_format of the engines it saves, the checkpoint's subdirectory
    saves_async: bool
    loads_in_place: bool

    def save(self, engine, tmp: Path, side: Path, sums: Sums, saver: Optional[AsyncSaver] = None
             ) -> Optional[Future]:
        """This rank's files of ``engine``'s state under ``tmp``, the CRCs of those it summed
        as it wrote them (``sums`` included) in ``side``. Collective; with ``saver`` (only
        where ``saves_async``) it returns at once with the future of the write."""

    def summed_on_load(self, rel: str) -> bool:
        """Whether the file ``rel`` of a checkpoint is checksummed as :meth:`load` reads it
        (else before, by :func:`.manifest.verify`)."""

    def plan_load(self, saved: Optional[Mapping[str, Any]]) -> bool:
        """Before the engine is built: whether it must be built to load another format than
        its own, the newest checkpoint's shape being ``saved``."""

    def load(self, engine, ckpt: Path, found: Survey) -> Optional[str]:
        """``ckpt`` (verified, but for the files summed on load) into ``engine``; the reason
        it was rejected, or None. ``found``: rank 0's survey of it, broadcast (each rank's
        share of the files, the saving run's shape). Collective."""


@dataclass
class DCPBackend:
    """Torch engines: model + optimizer state through DCP (``dcp/``); each rank's data files
    are summed as they are written and as they are read (:mod:`.dcp_writer`,
    :mod:`.dcp_reader`), so the disk is read once on either side."""

    rank: int
    format: ClassVar[str] = SUBDIR  # "dcp": train.strategies.base.DCPEngine
    saves_async: ClassVar[bool] = True
    loads_in_place: ClassVar[bool] = True  # DCP reads into the engine's tensors as it verifies

    def save(self, engine: DCPEngine, tmp: Path, side: Path, sums: Sums, saver: Optional[AsyncSaver] = None
             ) -> Optional[Future]:
        writer = summing_writer()(tmp, side, sums)  # into tmp/dcp
        if saver is not None:
            return saver.start(engine, writer)
        import torch.distributed.checkpoint as dcp

        dcp.save({"app": AppState(engine)}, storage_writer=writer)
        return None

    def summed_on_load(self, rel: str) -> bool:
        """DCP's data files: summed by the reader as it loads them."""
        return bool(DCP_FILE.search(rel))

    def plan_load(self, saved: Optional[Mapping[str, Any]]) -> bool:
        return False  # DCP reshards by itself

    def load(self, engine: DCPEngine, ckpt: Path, found: Survey) -> Optional[str]:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.api import CheckpointException

        owned = self.owned(found)
        readahead([ckpt / SUBDIR / name for name in owned])  # the disk works while DCP plans the load
        try:
            dcp.load({"app": AppState(engine, loading=True)},
                     storage_reader=verifying_reader()(ckpt / SUBDIR, owned))
        except CheckpointException as exc:
            corrupt = [e for e, _ in exc.failures.values() if isinstance(e, CorruptCheckpoint)]
            if not corrupt:
                raise
            return str(corrupt[0])
        return None

    def owned(self, found: Survey) -> Sums:
        """This rank's DCP data files, by name, with their manifest entries: its share
        (:func:`.manifest.owners`) that the reader sums as it loads them. From rank 0's
        survey: no other rank reads the manifest or looks at a file it does not load."""
        return {rel.rpartition("/")[2]: [size, crc] for rel, size, crc in found.shares[self.rank]
                if self.summed_on_load(rel)}


def backend_for(shape: Mapping[str, Any], rank: int) -> Backend:
    """The backend of a run of ``shape`` (:func:`spec.rundir.run_shape`): DeepSpeed's own files
    for ``engine: deepspeed``, else DCP (also when the shape is not given). Its ``format``
    is the ``checkpoint_format`` of the engine the run builds."""
    if shape.get("engine") == "deepspeed":
        return DeepSpeedBackend(rank, shape)
    return DCPBackend(rank)
