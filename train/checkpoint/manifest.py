"""The commit marker of a checkpoint directory: every file's size and CRC32, written last.

A step directory is published by :func:`publish`: the manifest (``COMMITTED``) is
written and fsynced, the temporary directory renamed to its final name, then the
``latest`` pointer replaced. :func:`verify` checks a directory against its manifest; with
several ranks each reads back and sums its share of the files (:func:`share`).
"""
from __future__ import annotations

import json
import os
import re
import shutil
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

try:  # ISA-L's CRC32: the same checksum as zlib.crc32 (manifests stay compatible), ~6x faster
    from isal.isal_zlib import crc32
except ImportError:  # a dependency, but zlib computes the same checksum
    from zlib import crc32

MANIFEST = "COMMITTED"
LATEST = "latest"
SUMS = ".crc_rank"  # + "{rank}.json": CRCs of the files a rank wrote, merged into the manifest
DCP_FILE = re.compile(r"__(\d+)_\d+\.distcp$")  # DCP's file of writer rank R: __R_N.distcp

Sums = Dict[str, List[int]]  # path relative to the step directory -> [size, CRC32]


class CorruptCheckpoint(Exception):
    """A checkpoint file's bytes do not match its manifest entry."""


def step_name(step: int) -> str:
    return f"step_{step:08d}"


def file_crc32(path: Path, fsync: bool = False) -> int:
    """CRC32 of a file, read front to back in large blocks (fsynced first if asked)."""
    crc, buf = 0, bytearray(8 << 20)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            crc = crc32(view[:n], crc)
        if fsync:  # flush what the ranks wrote before we publish it
            os.fsync(f.fileno())
    return crc


def share(paths: List[Path], rank: int, world: int) -> List[Path]:
    """This rank's part of ``paths`` to checksum (every rank computes the same split from the
    same listing). DCP's data file written by rank R goes to rank R % world: the rank that
    reads most of it on resume checksums it as it reads it (:mod:`.dcp_reader`). The
    rest: the largest first, each to the least loaded rank."""
    load, mine = [0] * world, []
    for path in sorted(paths, key=lambda p: (-p.stat().st_size, str(p))):
        match = DCP_FILE.search(path.name)
        owner = int(match.group(1)) % world if match else load.index(min(load))
        load[owner] += path.stat().st_size
        if owner == rank:
            mine.append(path)
    return mine


def checksums(root: Path, paths: List[Path], fsync: bool = False) -> Sums:
    return {str(p.relative_to(root)): [p.stat().st_size, file_crc32(p, fsync)] for p in paths}


def fsync_path(path: Path) -> None:
    """fsync a file or a directory (its entries: a rename in it)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _files(root: Path) -> List[Path]:
    return sorted(p for p in root.rglob("*")
                  if p.is_file() and p.name != MANIFEST and not p.name.startswith(SUMS))


def unsummed(root: Path, sums: Sums) -> List[Path]:
    """The files under ``root`` that ``sums`` has no entry for (they are read back)."""
    return [p for p in _files(root) if str(p.relative_to(root)) not in sums]


def written_sums(root: Path) -> Sums:
    """The CRCs the ranks computed as they wrote (their ``.crc_rank*.json``), merged."""
    sums: Sums = {}
    for side in sorted(root.glob(SUMS + "*.json")):
        sums.update(json.loads(side.read_text()))
    return sums


def manifest_files(ckpt: Path) -> Sums:
    return json.loads((ckpt / MANIFEST).read_text())["files"]


def saved_shape(ckpt: Path) -> Optional[Dict[str, Any]]:
    """The shape of the run that saved ``ckpt`` (:func:`spec.rundir.run_shape`), from its
    manifest; None if it has none (saved before shapes were recorded) or is unreadable."""
    try:
        return json.loads((ckpt / MANIFEST).read_text()).get("shape")
    except (OSError, ValueError):
        return None


def verify(ckpt: Path, rank: int = 0, world: int = 1, deferred: Callable[[str], bool] = lambda rel: False
           ) -> Optional[str]:
    """None when ``ckpt`` is a complete committed checkpoint, else the reason it is not.

    Every caller checks the manifest and every file's size; with ``world`` > 1 each rank
    reads back and checksums only its share of the files (see :func:`share`), so the ranks
    must combine their answers (``Checkpointer.load_latest`` does). Files for which
    ``deferred(rel)`` holds are not read here: the caller checksums them as it loads them."""
    if not (ckpt / MANIFEST).is_file():
        return "no commit marker"
    try:
        files = manifest_files(ckpt)
    except (OSError, json.JSONDecodeError, KeyError) as exc:
        return f"unreadable manifest ({exc})"
    for rel, (size, _) in files.items():
        path = ckpt / rel
        if not path.is_file():
            return f"missing file {rel}"
        if path.stat().st_size != size:
            return f"truncated file {rel} ({path.stat().st_size} of {size} bytes)"
    for path in share([ckpt / rel for rel in files], rank, world):
        rel = str(path.relative_to(ckpt))
        if not deferred(rel) and file_crc32(path) != files[rel][1]:
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


def publish(tmp: Path, final: Path, step: int, sums: Optional[Sums] = None,
            shape: Optional[Dict[str, Any]] = None) -> None:
    """Commit ``tmp`` as ``final``: the manifest (the CRCs the ranks computed, the files
    they did not read back and fsynced here; ``shape``: the run's that saved it), its
    rename, then the ``latest`` pointer."""
    files = dict(sums) if sums is not None else written_sums(tmp)
    files.update(checksums(tmp, unsummed(tmp, files), fsync=True))
    for side in tmp.glob(SUMS + "*.json"):
        side.unlink()
    manifest = tmp / MANIFEST
    content: Dict[str, Any] = {"step": step, "time": time.time(), "files": dict(sorted(files.items()))}
    if shape:
        content["shape"] = shape
    manifest.write_text(json.dumps(content, indent=1))
    fsync_path(manifest)
    if final.exists():  # a re-save of the same step (e.g. resumed and preempted at once)
        shutil.rmtree(final)
    os.rename(tmp, final)
    root = final.parent
    fsync_path(root)
    pointer = root / f".{LATEST}.tmp"
    pointer.write_text(final.name + "\n")
    os.replace(pointer, root / LATEST)
    fsync_path(root)
