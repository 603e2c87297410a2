"""DCP's file writer, summing each file as it writes it (no read-back for the manifest)."""
from __future__ import annotations

import functools
import json
from contextlib import contextmanager
from pathlib import Path
from typing import Dict, List

from train.checkpoint.manifest import Sums, crc32, fsync_path

SUBDIR = "dcp"  # DCP's files in a step directory


class SummingStream:
    """A file being written, whose CRC32 and size follow the bytes handed to ``write``
    (DCP writes each file front to back: ``torch.save`` into it, then fsync; DeepSpeed's
    files too: train/checkpoint/deepspeed_io.py)."""

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
def summing_writer():
    """The writer class (defined on first use: importing DCP takes seconds)."""
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
                stream = SummingStream(raw)
                yield stream
                self.sums[Path(path)] = [stream.size, stream.crc]

    class SummingWriter(FileSystemWriter):
        """DCP's file writer (one file per rank, fsynced: the commit protocol needs it)
        that also leaves this rank's CRCs, computed as it wrote, in ``side`` (with ``sums``
        of the files it wrote before, which it fsyncs) for rank 0's manifest."""

        def __init__(self, root: Path, side: Path, sums: Sums) -> None:
            super().__init__(str(root / SUBDIR), single_file_per_rank=True, sync_files=True)
            self.fs = SummingFileSystem()
            self.root, self.side, self.prior = root, side, sums

        def write_data(self, plan, planner):
            # torch.save's own CRC32 of every zip record (miniz: a sizeable part of a save,
            # bench/checkpoint.py) is left out: each file's CRC is taken as it is written, in the
            # manifest, checked before any load. torch.load reads such files (documented).
            # The setting is the process's own for the time of the write.
            from train.torch_compat import torch_save_without_crc

            with torch_save_without_crc():
                future = super().write_data(plan, planner)
            future.wait()  # done already (DCP writes in this call); raises what the write raised
            for rel in self.prior:  # written (not fsynced) by this rank before the save
                fsync_path(self.root / rel)
            sums = dict(self.prior)
            sums.update({str(p.relative_to(self.root)): v for p, v in self.fs.sums.items()})
            self.side.write_text(json.dumps(sums))
            return future

    return SummingWriter
