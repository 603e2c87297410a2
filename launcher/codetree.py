"""The files of a source tree, their hash and a read-only copy (:mod:`launcher.snapshot` uses them).

A git checkout's files are git's tracked and untracked-not-ignored ones as the working
tree holds them (a deleted tracked file is not copied; a submodule's files are listed as
its own); a plain directory's are every file below it but dot-directories and
``__pycache__``. A tree over :data:`MAX_BYTES` or :data:`MAX_FILES` is refused with one
line. The hash is the sha256 of the sorted file list and contents (names, kinds: file,
executable, symlink, and bytes); a copy is written aside and renamed into
``CACHE/<hash>``, so a directory named by a hash is complete.
"""
from __future__ import annotations

import functools
import hashlib
import os
import shutil
import site
import stat
import subprocess
import sysconfig
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, List, Optional, Sequence, Tuple

from spec.config import ConfigError

MAX_BYTES = 200 * 1000 ** 2
MAX_FILES = 20_000
KEY_CHARS = 16  # hex digits of the sha256 in a copy's directory name


@dataclass(frozen=True)
class Tree:
    """The files of one source tree to freeze, as listed at submission."""

    root: Path
    how: str  # "git" (tracked + untracked-not-ignored) | "directory" (every file below root)
    files: Tuple[Tuple[str, int], ...]  # (path relative to root, bytes), sorted

    @property
    def size(self) -> int:
        return sum(n for _, n in self.files)

    @functools.cached_property
    def key(self) -> str:
        """:func:`digest`, read once per listing (a sweep's dry run names the copy for every
        point); :func:`copy_tree` reads the files again."""
        return digest(self)


def mb(n: int) -> str:
    return f"{n / 1e6:.1f} MB"


def within(path: Path, root: Path) -> bool:
    return path == root or root in path.parents


def _git(root: Path, *args: str) -> Optional[str]:
    try:
        proc = subprocess.run(["git", *args], cwd=root, capture_output=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return os.fsdecode(proc.stdout) if proc.returncode == 0 else None


def git_top(path: Path) -> Optional[Path]:
    out = _git(path, "rev-parse", "--show-toplevel")
    return Path(out.strip()).resolve() if out and out.strip() else None


def _git_files(root: Path, prefix: str = "") -> Iterator[Tuple[str, int]]:
    """(path, bytes) of git's tracked and untracked-not-ignored files that exist in the
    working tree (a deleted tracked file is not copied); a submodule's files as its own."""
    out = _git(root, "ls-files", "-z", "--cached", "--others", "--exclude-standard")
    if out is None:
        raise ConfigError(f"launcher.snapshot=true: git cannot list the files of {root}; install git, or set "
                          "launcher.snapshot=false to run the checkout as it is")
    for rel in sorted(set(filter(None, out.split("\0")))):
        st = _lstat(root / rel)
        if st is None:
            continue
        if stat.S_ISDIR(st.st_mode):  # a submodule (a gitlink entry)
            yield from _git_files(root / rel, f"{prefix}{rel}/")
        elif stat.S_ISREG(st.st_mode) or stat.S_ISLNK(st.st_mode):
            yield f"{prefix}{rel}", st.st_size


def _dir_files(root: Path) -> Iterator[Tuple[str, int]]:
    for here, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if not d.startswith(".") and d != "__pycache__")
        for name in files:
            st = _lstat(Path(here, name))
            if st is not None and (stat.S_ISREG(st.st_mode) or stat.S_ISLNK(st.st_mode)):
                yield Path(here, name).relative_to(root).as_posix(), st.st_size


def _lstat(path: Path) -> Optional[os.stat_result]:
    try:
        return os.lstat(path)
    except OSError:
        return None


def list_tree(root: Path, how: str, excluded: Sequence[Path] = ()) -> Tree:
    """The files of ``root`` to freeze; a ConfigError when they are too many or too large
    (a directory is walked no further than the limits)."""
    files: List[Tuple[str, int]] = []
    size = 0
    prefixes = [p.relative_to(root).as_posix() for p in excluded if within(p, root) and p != root]
    for rel, n in (_git_files(root) if how == "git" else _dir_files(root)):
        if any(rel == p or rel.startswith(p + "/") for p in prefixes):
            continue
        files.append((rel, n))
        size += n
        if how == "directory" and (size > MAX_BYTES or len(files) > MAX_FILES):
            break  # a home directory is not walked to its end
    tree = Tree(root, how, tuple(sorted(files)))
    if tree.size > MAX_BYTES or len(tree.files) > MAX_FILES:
        rel, n = max(tree.files, key=lambda f: f[1])
        fix = ("git-ignore or move the large files" if how == "git" else f"move the large files out of {root}")
        raise ConfigError(f"launcher.snapshot=true: the code to freeze, {root} ({how}), holds "
                          f"{'at least ' if how != 'git' else ''}{len(tree.files)} files, {mb(tree.size)} (largest "
                          f"{rel}, {mb(n)}), over the limit of {MAX_FILES} files and {mb(MAX_BYTES)}; {fix}, or set "
                          "launcher.snapshot=false to run the code as it is")
    return tree


def _entries(tree: Tree) -> Iterator[Tuple[str, str, bytes]]:
    """(path, kind, data) of each file: kind "l" a symlink (data: its target), "x" an
    executable file, "f" another; files gone since the listing are skipped."""
    for rel, _ in tree.files:
        path = tree.root / rel
        try:
            if path.is_symlink():
                yield rel, "l", os.fsencode(os.readlink(path))
            else:
                yield rel, "x" if path.stat().st_mode & 0o100 else "f", path.read_bytes()
        except (FileNotFoundError, IsADirectoryError):
            continue


def _feed(h: "hashlib._Hash", rel: str, kind: str, data: bytes) -> None:
    name = rel.encode()
    h.update(b"%s %d:%s %d:" % (kind.encode(), len(name), name, len(data)))
    h.update(data)


def digest(tree: Tree) -> str:
    """sha256 of the tree's file list and contents (names, kinds, bytes)."""
    h = hashlib.sha256()
    for rel, kind, data in _entries(tree):
        _feed(h, rel, kind, data)
    return h.hexdigest()


def copy_tree(tree: Tree, cache: Path) -> Tuple[Path, str]:
    """The copy of ``tree`` in ``cache`` (made now unless one with its hash is there) and
    its sha256. The copy is written aside and renamed into place, so a directory named
    by a hash is complete; its name is the hash of what was copied, even when a file
    changed since the listing."""
    key = digest(tree)
    if (cache / key[:KEY_CHARS]).is_dir():
        os.utime(cache / key[:KEY_CHARS])  # in use again: not stale for prune_copies
        return cache / key[:KEY_CHARS], key
    cache.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".partial-", dir=cache))
    tmp.chmod(0o755)  # mkdtemp's 0o700 would hide the copy from a job running as another user
    h = hashlib.sha256()
    for rel, kind, data in _entries(tree):
        _feed(h, rel, kind, data)
        dest = tmp / rel
        dest.parent.mkdir(parents=True, exist_ok=True)
        if kind == "l":
            os.symlink(os.fsdecode(data), dest)
        else:
            dest.write_bytes(data)
            dest.chmod(0o555 if kind == "x" else 0o444)  # read-only: tracebacks point here, edits go to the source
    key = h.hexdigest()
    final = cache / key[:KEY_CHARS]
    try:
        os.rename(tmp, final)
    except OSError:  # another launch made it meanwhile
        shutil.rmtree(tmp, ignore_errors=True)
        if not final.is_dir():
            raise
    return final, key


#: A copy no run directory names is removed once it has not been made or reused for this long
#: (a launch writes its run.json after freezing: the age covers one in flight beside this one).
STALE_S = 3600.0


def prune_copies(cache: Path, keep: Sequence[Path], referenced: Callable[[], Sequence[Path]],
                 stale_s: float = STALE_S) -> List[Path]:
    """Remove the copies in ``cache`` that nobody made or reused for ``stale_s`` seconds and
    that neither ``keep`` (this launch's) nor ``referenced()`` names (their runs were
    deleted, or resumed with fresh code); partial copies left by a killed launch too.
    ``referenced`` is asked only when a stale copy is there (it reads every run.json
    beside the cache). The removed paths."""
    now = time.time()
    stale = []
    for copy in sorted(cache.iterdir()) if cache.is_dir() else []:
        try:
            old = now - copy.stat().st_mtime >= stale_s
        except FileNotFoundError:
            continue
        if old and copy.is_dir() and not copy.is_symlink():
            stale.append(copy)
    names = {Path(p).name for p in keep}
    if any(c.name not in names for c in stale):
        names |= {Path(p).name for p in referenced()}
    gone = []
    for copy in (c for c in stale if c.name not in names):
        for sub, _, _ in os.walk(copy):  # read-only files sit in writable directories; make sure
            try:
                os.chmod(sub, 0o755)
            except OSError:  # another user's copy: rmtree leaves what it cannot remove
                pass
        shutil.rmtree(copy, ignore_errors=True)
        if not copy.exists():
            gone.append(copy)
    return gone


def installed(path: Path) -> bool:
    """``path`` lies in the interpreter's site-packages or standard library."""
    dirs = [*site.getsitepackages(), site.getusersitepackages(),
            *(sysconfig.get_paths()[k] for k in ("purelib", "platlib", "stdlib"))]
    return any(within(path, Path(d).resolve()) for d in dirs if d)
