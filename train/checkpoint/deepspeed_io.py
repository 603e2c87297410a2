"""DeepSpeed's own checkpoint files, through the engine protocol
(:class:`train.strategies.base.Engine`: ``native_checkpoint``, ``save_native``,
``load_native``).

DeepSpeed writes and reads its files itself, so no CRC is taken as they are written or
read: the files are summed after the save (read back, shared out among the ranks, see
:func:`train.checkpoint.manifest.share`) and verified in full before a load.
"""
from __future__ import annotations

import json
from pathlib import Path

from train.checkpoint.manifest import Sums

SUBDIR = "deepspeed"


def is_native(engine) -> bool:
    """Whether ``engine`` writes its own checkpoint files (else: DCP)."""
    return bool(engine.native_checkpoint)


def save(engine, tmp: Path, side: Path, sums: Sums) -> None:
    """The engine's files under ``tmp``; ``sums`` (this rank's files summed as written)
    left in ``side`` for the manifest. Collective."""
    engine.save_native(tmp / SUBDIR)
    side.write_text(json.dumps(sums))


def load(engine, ckpt: Path) -> None:
    """Read the engine's files of a checkpoint verified beforehand. Collective."""
    engine.load_native(ckpt / SUBDIR)


def deferred(rel: str) -> bool:
    """No file of a DeepSpeed checkpoint is summed as it is loaded: all are verified first."""
    return False
