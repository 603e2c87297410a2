"""The commit marker of a checkpoint directory: every file's size and CRC32, written last.

A step directory is published by :func:`publish`: the manifest (``COMMITTED``) is
written and fsynced, the temporary directory renamed to its final name, then the
``latest`` pointer replaced. At a save rank 0 alone lists the temporary directory and
reads the ranks' side files (:func:`save_plan`), and tells each rank its share of the
files to read back. :func:`verify` checks a directory against its manifest; with
several ranks, rank 0 alone reads the manifest and looks at every file's size
(:func:`survey`) and broadcasts each rank's share of the files (:func:`owners`), which
that rank reads back and sums: a job's file work is linear in its ranks.
"""
from __future__ import annotations

import heapq
import json
import os
import re
import shutil
import stat
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple

try:  # ISA-L's CRC32: the same checksum as zlib.crc32 (manifests stay compatible), ~6x faster
    from isal.isal_zlib import crc32
except ImportError:  # a dependency, but zlib computes the same checksum
    from zlib import crc32

MANIFEST = "COMMITTED"
LATEST = "latest"
SUMS = ".crc_rank"  # + "{rank}.json": CRCs of the files a rank wrote, merged into the manifest
BACK = ".back.json"  # SUMS + "{rank}" + BACK: CRCs of the files a rank read back at the commit
DCP_FILE = re.compile(r"__(\d+)_\d+\.distcp$")  # DCP's file of writer rank R: __R_N.distcp

Sums = Dict[str, List[int]]  # path relative to the step directory -> [size, CRC32]
Share = List[Tuple[str, int, int]]  # one rank's files to sum: (relative path, size, CRC32), in order
Shares = Dict[int, List[str]]  # a save's files no rank summed as it wrote: rank -> its to read back


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


def owners(sizes: Mapping[str, int], world: int) -> Dict[str, int]:
    """The rank that checksums each file of ``sizes`` (path -> bytes), in the order they are
    summed (the largest first). DCP's data file written by rank R goes to rank R % world:
    the rank that reads most of it on resume checksums it as it reads it
    (:mod:`.dcp_reader`). The rest: each to the least loaded rank (the lowest such rank;
    a heap, so that rank 0 shares out 2W files among W ranks in W log W)."""
    load = [0] * world
    heap = [(0, r) for r in range(world)]  # (load, rank), stale entries skipped: loads only grow
    owner: Dict[str, int] = {}
    for path in sorted(sizes, key=lambda p: (-sizes[p], p)):
        match = DCP_FILE.search(path.rpartition("/")[2])
        if match:
            rank = int(match.group(1)) % world
        else:
            while heap[0][0] != load[heap[0][1]]:
                heapq.heappop(heap)
            rank = heap[0][1]
        load[rank] += sizes[path]
        heapq.heappush(heap, (load[rank], rank))
        owner[path] = rank
    return owner


def share(paths: List[Path], rank: int, world: int) -> List[Path]:
    """This rank's part of ``paths`` to checksum (:func:`owners` of their sizes, one stat a
    file; every rank that calls it computes the same split from the same listing)."""
    by_name = {str(p): p for p in paths}
    owner = owners({name: p.stat().st_size for name, p in by_name.items()}, world)
    return [by_name[name] for name, r in owner.items() if r == rank]


def checksums(root: Path, paths: List[Path], fsync: bool = False) -> Sums:
    return {str(p.relative_to(root)): [p.stat().st_size, file_crc32(p, fsync)] for p in paths}


def fsync_path(path: Path) -> None:
    """fsync a file or a directory (its entries: a rename in it)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _walk(root: Path) -> List[Path]:
    """Every regular file under ``root``: one ``os.scandir`` a directory, no stat a file
    (its type is the listing's; symbolic links to directories not followed, as ``rglob``)."""
    files: List[Path] = []
    below: List[Path] = []
    with os.scandir(root) as entries:
        for entry in entries:
            if entry.is_dir(follow_symlinks=False):
                below.append(Path(entry.path))
            elif entry.is_file():
                files.append(Path(entry.path))
    for folder in below:
        files.extend(_walk(folder))
    return files


def save_plan(tmp: Path, world: int) -> Tuple[Sums, Shares]:
    """Rank 0's look at a save's temporary directory once every rank wrote into it: the
    entries the ranks computed as they wrote (their side files ``.crc_rank{R}.json``,
    merged), and the files no rank summed shared out among ``world`` ranks to be read back
    (:func:`owners`; by rank, only the ranks given some). One listing of the directory, one
    read a side file, one stat a file to read back: linear in the ranks."""
    sides, rest = [], []
    for path in _walk(tmp):
        if path.name.startswith(SUMS):
            if path.parent == tmp and path.name.endswith(".json"):
                sides.append(path)
        elif path.name != MANIFEST:
            rest.append(str(path.relative_to(tmp)))
    written: Sums = {}
    for side in sorted(sides):
        written.update(json.loads(side.read_text()))
    shares: Shares = {}
    for rel, rank in owners({rel: os.stat(tmp / rel).st_size for rel in rest if rel not in written}, world).items():
        shares.setdefault(rank, []).append(rel)
    return written, shares


def shared_save_plan(tmp: Path, rank: int, world: int) -> Tuple[Sums, Shares]:
    """:func:`save_plan` made by rank 0, its shares broadcast (collective when ``world`` > 1);
    the entries stay on rank 0, which writes the manifest (the others get none)."""
    if world == 1:
        return save_plan(tmp, 1)
    import torch.distributed as dist

    written, shares = save_plan(tmp, world) if rank == 0 else ({}, None)
    box = [shares]
    dist.broadcast_object_list(box, src=0)
    return written, box[0]


def read_back(tmp: Path, rank: int, shares: Shares) -> Sums:
    """This rank's share of the files no rank summed as it wrote: read back, fsynced and
    summed. A rank other than 0 leaves its entries beside them (``.crc_rank{R}.back.json``)
    for rank 0 (:func:`read_backs`)."""
    sums = checksums(tmp, [tmp / rel for rel in shares.get(rank, [])], fsync=True)
    if rank != 0 and rank in shares:
        (tmp / f"{SUMS}{rank}{BACK}").write_text(json.dumps(sums))
    return sums


def read_backs(tmp: Path, shares: Shares) -> Sums:
    """Rank 0, once the others read back their shares: the entries they left (one file
    each rank given a share)."""
    sums: Sums = {}
    for rank in sorted(r for r in shares if r != 0):
        sums.update(json.loads((tmp / f"{SUMS}{rank}{BACK}").read_text()))
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


@dataclass(frozen=True)
class Survey:
    """What rank 0 found in a checkpoint directory, broadcast to the other ranks: why it is
    not a complete committed checkpoint (``reason``: no or an unreadable manifest, a file
    missing or of another size than its entry), else nothing wrong so far and each rank's
    share of the files to read back (``shares[rank]``, :func:`owners`), and the saving run's
    shape. One object, some 30 bytes a file pickled (270 kB at W = 4,096), so that the
    other ranks need not read the manifest nor look at a file they do not read."""

    reason: Optional[str]
    shares: List[Share] = field(default_factory=list)
    shape: Optional[Dict[str, Any]] = None  # the saving run's (:func:`saved_shape`)


def _size_error(ckpt: Path, rel: str, size: int) -> Optional[str]:
    try:
        st = os.stat(ckpt / rel)  # one call: exists, a regular file (as Path.is_file), its size
    except OSError:
        return f"missing file {rel}"
    if not stat.S_ISREG(st.st_mode):
        return f"missing file {rel}"
    if st.st_size != size:
        return f"truncated file {rel} ({st.st_size} of {size} bytes)"
    return None


def survey(ckpt: Path, world: int = 1, sizes: bool = True) -> Survey:
    """Rank 0's look at ``ckpt``: its manifest, every file's size (``sizes``: skipped when
    the caller verified them already), and the files shared out among ``world`` ranks."""
    if not (ckpt / MANIFEST).is_file():
        return Survey("no commit marker")
    try:
        content = json.loads((ckpt / MANIFEST).read_text())
        files: Sums = content["files"]
    except (OSError, json.JSONDecodeError, KeyError) as exc:
        return Survey(f"unreadable manifest ({exc})")
    if sizes:
        for rel, (size, _) in files.items():
            reason = _size_error(ckpt, rel, size)
            if reason is not None:
                return Survey(reason)
    shares: List[Share] = [[] for _ in range(world)]
    for rel, rank in owners({rel: size for rel, (size, _) in files.items()}, world).items():
        shares[rank].append((rel, *files[rel]))
    return Survey(None, shares, content.get("shape"))


def shared_survey(ckpt: Path, rank: int, world: int, sizes: bool = True) -> Survey:
    """:func:`survey` made by rank 0 and broadcast (collective when ``world`` > 1)."""
    if world == 1:
        return survey(ckpt, 1, sizes)
    import torch.distributed as dist

    box = [survey(ckpt, world, sizes) if rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def verify(ckpt: Path, rank: int = 0, world: int = 1, deferred: Callable[[str], bool] = lambda rel: False,
           found: Optional[Survey] = None) -> Optional[str]:
    """None when ``ckpt`` is a complete committed checkpoint, else the reason it is not.

    Rank 0 checks the manifest and every file's size and tells the others
    (:func:`shared_survey`: collective when ``world`` > 1; ``found``: that survey, already
    made); each rank reads back and checksums only its share of the files (see
    :func:`owners`), so the ranks must combine their answers (``Checkpointer.load_latest``
    does). Files for which ``deferred(rel)`` holds are not read here: the caller
    checksums them as it loads them."""
    found = shared_survey(ckpt, rank, world) if found is None else found
    if found.reason is not None:
        return found.reason
    for rel, _, crc in found.shares[rank]:
        if not deferred(rel) and file_crc32(ckpt / rel) != crc:
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
    """Commit ``tmp`` as ``final``: the manifest (``sums``: every file's entry, from
    :func:`save_plan` and the read-back; None: this rank makes the plan and reads back
    every file no rank summed; ``shape``: the run's that saved it), its rename, then the
    ``latest`` pointer."""
    if sums is None:
        written, shares = save_plan(tmp, 1)
        sums = {**written, **read_back(tmp, 0, shares)}
    for side in tmp.glob(SUMS + "*.json"):  # one listing
        side.unlink()
    manifest = tmp / MANIFEST
    content: Dict[str, Any] = {"step": step, "time": time.time(), "files": dict(sorted(sums.items()))}
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


def agreed_reason(mine: Optional[str], rank: int, world: int) -> Optional[str]:
    """The reason of the lowest rank that found one (None: no rank did), on every rank
    (collective when ``world`` > 1): one all-reduce of one number (the lowest failing
    rank, ``world`` for none) and, only when one failed, its reason broadcast from it;
    no list of W objects."""
    if world == 1:
        return mine
    import torch
    import torch.distributed as dist

    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else "cpu"
    first = torch.tensor([rank if mine is not None else world], dtype=torch.int64, device=device)
    dist.all_reduce(first, op=dist.ReduceOp.MIN)
    src = int(first.item())
    if src == world:
        return None
    box = [mine]
    dist.broadcast_object_list(box, src=src)
    return box[0]
