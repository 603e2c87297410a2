"""DCP's file reader, checking the CRC32 of the files this rank owns in the same pass.

On resume every rank verifies its share of a checkpoint's files (see
:func:`train.checkpoint.manifest.share`); DCP's data files are summed as the load reads
them (:func:`verifying_reader`), so the disk is read once. It uses DCP's
``FileSystemReader`` and, of its internals (private: fenced and checked against the
running torch in :mod:`train.torch_compat`, with DCP's own reader as the fallback), its
``storage_data`` (where each item lies) and ``transforms``; for each saved tensor
``torch.load(map_location="meta", weights_only=True)`` (its dtype, shape and stride)
with the standard library's ``zipfile`` (where its bytes lie in the ``torch.save``
record: the entry in the zip's central directory, and its local header's fixed size per
the ZIP specification).
"""
from __future__ import annotations

import functools
import io
import os
import struct
import threading
import zipfile
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch.futures import Future

from train.checkpoint.manifest import CorruptCheckpoint, Sums, crc32, file_crc32


def _available_memory() -> int:
    """MemAvailable of /proc/meminfo in bytes (0 where there is none)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) << 10
    except OSError:
        pass
    return 0


def readahead(paths: List[Path]) -> Optional[threading.Thread]:
    """Read ``paths`` front to back into the page cache, in a thread of its own, when they
    fit in half the available memory (else the load's own pass reads them once).

    The checkpoint's backend starts it for this rank's files before DCP plans the load
    (collectives), so the disk streams meanwhile and the load's pass then mostly copies
    from the page cache. Plain reads, not POSIX_FADV_WILLNEED: a WILLNEED'd file read
    back slower than a plain cold read, and restores were slower with it than with this
    thread (bench/checkpoint.py measures restores)."""
    try:
        total = sum(p.stat().st_size for p in paths)
    except OSError:  # missing: the load reports it
        return None
    if not paths or total > _available_memory() // 2:
        return None

    def run() -> None:
        buf = bytearray(8 << 20)
        for path in paths:
            try:
                with open(path, "rb", buffering=0) as f:
                    while f.readinto(buf):
                        pass
            except OSError:
                return

    thread = threading.Thread(target=run, name="ckpt-readahead", daemon=True)
    thread.start()
    return thread


class _Window(io.RawIOBase):
    """The bytes [start, start + length) of an open file, as a file of their own (read
    with ``os.pread``: the file's own position is left alone)."""

    def __init__(self, fd: int, start: int, length: int) -> None:
        super().__init__()
        self.fd, self.start, self.length, self.pos = fd, start, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        self.pos = {io.SEEK_SET: 0, io.SEEK_CUR: self.pos, io.SEEK_END: self.length}[whence] + offset
        return self.pos

    def readinto(self, buf) -> int:
        view = memoryview(buf).cast("B")
        n = max(0, min(len(view), self.length - self.pos))
        got = os.preadv(self.fd, [view[:n]], self.start + self.pos) if n else 0
        self.pos += got
        return got


def _entry_offset(fd: int, start: int, entry: zipfile.ZipInfo) -> Optional[int]:
    """Offset in its record of a zip entry's bytes: after its local header, whose fixed
    part (ZIP specification 4.3.7) ends with the lengths of the name and extra field."""
    header = os.pread(fd, zipfile.sizeFileHeader, start + entry.header_offset)
    if len(header) < zipfile.sizeFileHeader or header[:4] != zipfile.stringFileHeader:
        return None
    name_len, extra_len = struct.unpack_from("<HH", header, 26)
    return entry.header_offset + zipfile.sizeFileHeader + name_len + extra_len


class TensorRecords:
    """Where a saved tensor's bytes lie in its ``torch.save`` record, and its layout.

    ``find`` answers (the tensor on the meta device, offset of its bytes in the record)
    for a record at [start, start + length) of a file that holds one plain tensor whose
    bytes are stored uncompressed, in order, from its storage's start; None for anything
    else (or a record that does not parse). The first record of a kind is parsed: the
    layout from ``torch.load(..., map_location="meta", weights_only=True)``, the offsets
    from the zip's central directory (at the record's end). A later record of the same
    length whose bytes up to its tensor's bytes equal that record's (the pickle, which
    names the storage's dtype and size and the tensor's shape and stride, and every
    local zip header before the data) has the same layout and offset: its head is read
    (where the pass over the file is), its end is not (a seek and a read ahead of it)."""

    def __init__(self) -> None:
        self._known: Dict[int, List[Tuple[bytes, torch.Tensor, int]]] = {}  # length -> (head, meta, offset)

    def find(self, fd: int, start: int, length: int) -> Optional[Tuple[torch.Tensor, int]]:
        known = self._known.setdefault(length, [])
        for head, meta, at in known:
            if os.pread(fd, at, start) == head:
                return meta, at
        found = self._parse(fd, start, length)
        if found is not None and len(known) < 8:
            known.append((os.pread(fd, found[1], start), *found))
        return found

    @staticmethod
    def _parse(fd: int, start: int, length: int) -> Optional[Tuple[torch.Tensor, int]]:
        window = _Window(fd, start, length)
        try:
            with zipfile.ZipFile(window) as archive:
                entries = [e for e in archive.infolist() if e.filename.split("/", 1)[-1].startswith("data/")]
            if len(entries) != 1 or entries[0].compress_type != zipfile.ZIP_STORED:
                return None
            at = _entry_offset(fd, start, entries[0])
            window.seek(0)
            meta = torch.load(window, map_location="meta", weights_only=True)
        except Exception:  # noqa: BLE001  (not a record read in place: DCP's way reports it)
            return None
        if at is None or type(meta) is not torch.Tensor or meta.storage_offset() \
                or entries[0].file_size != meta.untyped_storage().nbytes():
            return None
        return meta, at


class _Pass:
    """One file read front to back; with ``summed``, its CRC32 follows the bytes read."""

    def __init__(self, f, rel: str, summed: bool) -> None:
        self.f, self.rel, self.summed, self.pos, self.crc = f, rel, summed, 0, 0
        self.scratch = memoryview(bytearray(8 << 20)) if summed else None

    def read_into(self, view: memoryview) -> None:
        """Fill ``view`` from the current position (summed)."""
        self.f.seek(self.pos)
        done = 0
        while done < len(view):
            n = self.f.readinto(view[done:])
            if not n:
                raise CorruptCheckpoint(f"truncated file dcp/{self.rel} (ends at {self.pos + done})")
            done += n
        if self.summed:
            self.crc = crc32(view, self.crc)
        self.pos += done

    def skip_to(self, end: int) -> None:
        """Move on to ``end``: the bytes between are read and summed if ``summed``."""
        if not self.summed:
            self.pos = max(self.pos, end)
        while self.pos < end:
            self.read_into(self.scratch[:min(len(self.scratch), end - self.pos)])


def _narrow(tensor: torch.Tensor, offsets, lengths) -> torch.Tensor:
    """The part of a loaded chunk a read item asks for."""
    for dim, (start, length) in enumerate(zip(offsets, lengths)):
        if start or length != tensor.size(dim):
            tensor = tensor.narrow(dim, start, length)
    return tensor


class _OnePass:
    """The reading half of :func:`verifying_reader`'s class, over ``FileSystemReader``'s
    ``path``, ``storage_data`` (where each saved item lies) and ``transforms``; ``owned``
    (file name -> [size, CRC32] from the manifest) and ``records`` come from its
    ``__init__``."""

    path: Any
    storage_data: Dict[Any, Any]
    owned: Sums
    records: TensorRecords
    direct: int

    def read_data(self, plan, planner):
        per_file: Dict[str, list] = {}
        for req in plan.items:
            per_file.setdefault(self.storage_data[req.storage_index].relative_path, []).append(req)
        # its own files first: the other ranks meanwhile bring theirs into the page cache
        order = sorted(per_file, key=lambda rel: (rel not in self.owned, rel))
        for rel in order:
            self._read_file(rel, per_file[rel], planner)
        for rel, (_, crc) in self.owned.items():
            if rel not in per_file and file_crc32(Path(self.path) / rel) != crc:
                raise CorruptCheckpoint(f"checksum mismatch in dcp/{rel}")
        future: Future = Future()
        future.set_result(None)
        return future

    def _read_file(self, rel: str, reqs: list, planner) -> None:
        expected = self.owned.get(rel)
        groups: Dict[Any, list] = {}
        for req in reqs:
            groups.setdefault(req.storage_index, []).append(req)
        order = sorted(groups.items(), key=lambda kv: self.storage_data[kv[0]].offset)
        path = Path(self.path) / rel
        with open(path, "rb", buffering=0) as f:
            src = _Pass(f, rel, summed=expected is not None)
            try:
                for index, group in order:
                    self._read_item(src, self.storage_data[index], group, planner)
                if expected is not None:
                    src.skip_to(expected[0])
            except CorruptCheckpoint:
                raise
            except Exception as exc:  # unreadable: corrupt if its checksum says so
                if expected is not None and file_crc32(path) != expected[1]:
                    raise CorruptCheckpoint(f"checksum mismatch in dcp/{rel}") from exc
                raise
        if expected is not None and src.crc != expected[1]:
            raise CorruptCheckpoint(f"checksum mismatch in dcp/{rel}")

    def _read_item(self, src: _Pass, info, group: list, planner) -> None:
        """The read items of one saved item (``info``: where it lies in the file)."""
        src.skip_to(info.offset)
        direct = self._destination(src.f.fileno(), info, group, planner)
        if direct is not None:
            target, start = direct
            src.skip_to(info.offset + start)
            src.read_into(memoryview(target.reshape(-1).view(torch.uint8).numpy()))
            src.skip_to(info.offset + info.length)
            planner.commit_tensor(group[0], target)
            self.direct += 1
            return
        blob = bytearray(info.length)
        src.read_into(memoryview(blob))
        for req in group:
            self._load_item(req, info, io.BytesIO(blob), planner)

    def _destination(self, fd: int, info, group: list, planner) -> Optional[Tuple[torch.Tensor, int]]:
        """(destination, offset of the tensor's bytes in its record) if the item can be
        read straight into its destination, else None."""
        req = group[0]
        if len(group) > 1 or req.type.name == "BYTE_IO" or info.transform_descriptors:
            return None
        target = planner.resolve_tensor(req).detach()
        if target.device.type != "cpu" or not target.is_contiguous() or any(req.storage_offsets) \
                or tuple(req.lengths) != tuple(target.shape):
            return None
        found = self.records.find(fd, info.offset, info.length)
        if found is None:
            return None
        meta, start = found
        if meta.dtype != target.dtype or meta.shape != target.shape or meta.stride() != target.stride():
            return None
        return target, start

    def _load_item(self, req, info, stream, planner) -> None:
        """One item as DCP's reader reads it (``FileSystemReader.read_data``)."""
        stream = self.transforms.transform_load_stream(req, info.transform_descriptors or (), stream)
        if req.type.name == "BYTE_IO":
            planner.load_bytes(req, io.BytesIO(stream.read(-1)))
            return
        if not stream.seekable():
            stream = io.BytesIO(stream.read(-1))
        tensor = _narrow(torch.load(stream, map_location="cpu", weights_only=True), req.storage_offsets,
                         req.lengths)
        target = planner.resolve_tensor(req).detach()
        if target.size() != tensor.size():
            raise AssertionError(f"req {req.storage_index} mismatch sizes {target.size()} vs {tensor.size()}")
        target.copy_(tensor)
        planner.commit_tensor(req, target)


@functools.lru_cache(maxsize=None)
def verifying_reader():
    """The reader class (defined on first use: importing DCP takes seconds): the one-pass
    reader where DCP's internals it reads are as this code knows them
    (:func:`train.torch_compat.dcp_reader_internals`), else :func:`checking_first_reader`."""
    from torch.distributed.checkpoint import FileSystemReader

    from train.torch_compat import dcp_reader_internals

    if dcp_reader_internals():
        return checking_first_reader()

    class VerifyingReader(_OnePass, FileSystemReader):
        """DCP's file reader in one pass over the files: the ones this rank owns
        (``owned``: file name -> [size, CRC32] from the manifest) are read front to back
        and summed on the way; a mismatch or a short file raises
        :class:`CorruptCheckpoint`. A tensor whose destination is a contiguous CPU
        tensor of its dtype, shape and stride is read straight into it
        (:class:`TensorRecords`); any other item is read as DCP's reader reads it
        (``torch.load(weights_only=True)`` of its record, then copied)."""

        def __init__(self, path: Path, owned: Sums) -> None:
            super().__init__(str(path))
            self.owned = owned
            self.records = TensorRecords()
            self.direct = 0  # tensors read straight into their destination (tests)

    return VerifyingReader


@functools.lru_cache(maxsize=None)
def checking_first_reader():
    """The fallback of :func:`verifying_reader` on a torch whose ``FileSystemReader``
    internals differ: the same constructor and errors, the files this rank owns summed in
    a pass of their own before DCP's own reader loads (the disk read twice)."""
    from torch.distributed.checkpoint import FileSystemReader

    class CheckingFirstReader(FileSystemReader):
        def __init__(self, path: Path, owned: Sums) -> None:
            super().__init__(str(path))
            self.owned = owned
            self.direct = 0  # never reads in place

        def read_data(self, plan, planner):
            for rel, (_, crc) in self.owned.items():
                if file_crc32(Path(self.path) / rel) != crc:
                    raise CorruptCheckpoint(f"checksum mismatch in dcp/{rel}")
            return super().read_data(plan, planner)

    return CheckingFirstReader
