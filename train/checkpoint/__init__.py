"""Checkpoints: atomic, verified, resumable.

- :mod:`.manager`: when to save, keep, commit, restore (:class:`Checkpointer`);
- :mod:`.backend`: what DCP and DeepSpeed do differently, one object each (:func:`.backend.backend_for`);
- :mod:`.manifest`: the commit marker, CRCs, verification, the committed steps;
- :mod:`.state`: the Stateful pieces (model + optimizer, data position, RNG, step);
- :mod:`.async_save`: the checkpoint thread and its host buffers;
- :mod:`.dcp_writer` / :mod:`.dcp_reader`: DCP's file writer and reader, summing as they go;
- :mod:`.deepspeed_io`: DeepSpeed's own files, through the engine protocol (its backend).

Faults are injected into saves through the task's one seam, :class:`train.harness.faults.Faults`.
"""
from train.checkpoint.manager import Checkpointer
from train.checkpoint.manifest import LATEST, MANIFEST, CorruptCheckpoint, committed_steps, find_latest, verify

__all__ = ["Checkpointer", "CorruptCheckpoint", "LATEST", "MANIFEST", "committed_steps", "find_latest", "verify"]
