"""Stable run directories and the reproducibility files written into them.

A run's directory is derived from its command-line overrides (sorted, ``+`` dropped,
the launcher's own switches such as ``launcher.wait`` ignored): readable text plus a
hash, ``runs/<slug>``. A sweep's points live in ``runs/multirun/<slug>/<N>`` with N
Hydra's job number. Re-running the same command therefore finds the same directory.
"""
from __future__ import annotations

import hashlib
import os
import platform
import re
import subprocess
import sys
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Tuple

# Overrides that do not change what a run computes: the launcher's own switches, a sweep's
# cap, and the profiler (profiling a run's steps is asked again of the same run directory).
_IGNORED = ("launcher.wait", "launcher.dry_run", "launcher.root", "launcher.run_dir", "launcher.snapshot",
            "launcher.max_parallel", "profile.", "hydra.", "hydra/")


def _normalise(overrides: Iterable[str]) -> List[str]:
    kept = []
    for item in overrides:
        if item.startswith("-"):
            continue
        item = item.lstrip("+~")
        if any(item.startswith(prefix) for prefix in _IGNORED):
            continue
        kept.append(item)
    return sorted(kept)


def slug(overrides: Iterable[str]) -> str:
    items = _normalise(overrides)
    if not items:
        return "default"
    digest = hashlib.sha1("\n".join(items).encode()).hexdigest()[:8]
    text = "_".join(items)
    text = re.sub(r"[^A-Za-z0-9._=,-]+", "-", text)[:80].strip("-_.")
    return f"{text}-{digest}"


def cli_overrides() -> List[str]:
    return [a for a in sys.argv[1:] if "=" in a and not a.startswith("-")]


def resolve_run_dir(root: str, explicit: Optional[str]) -> str:
    return str(explicit) if explicit not in (None, "", "None") else os.path.join(root, slug(cli_overrides()))


def outermost_missing(path: Path) -> Optional[Path]:
    """The first directory ``mkdir -p path`` would make (``path`` or one of its parents),
    or None when ``path`` exists."""
    path = path.absolute()
    if path.exists():
        return None
    while not path.parent.exists():
        path = path.parent
    return path


def remove_made(run_dir: Path, made: Optional[Path]) -> None:
    """Remove ``run_dir`` and its parents up to ``made`` (what Hydra made for this run)
    while they are empty: a refused command leaves nothing behind."""
    if made is None:
        return
    run_dir, made = run_dir.absolute(), made.absolute()
    for d in (run_dir, *run_dir.parents):
        if d != made and made not in d.parents:
            return
        try:
            d.rmdir()
        except OSError:  # not empty (another run's), or gone
            return


def resolve_sweep_dir(root: str, explicit: Optional[str]) -> str:
    if explicit not in (None, "", "None"):
        return str(explicit)
    return os.path.join(root, "multirun", slug(cli_overrides()))


def register_resolvers(made: Optional[Dict[str, Optional[Path]]] = None) -> None:
    """``made``: filled with run directory -> :func:`outermost_missing` of it when first
    resolved, before Hydra makes it (the launcher removes it again on a refusal)."""
    from omegaconf import OmegaConf

    def run_dir(root: str, explicit: Optional[str]) -> str:
        path = resolve_run_dir(root, explicit)
        if made is not None and path not in made:
            made[path] = outermost_missing(Path(path))
        return path

    OmegaConf.register_new_resolver("sto_run_dir", run_dir, replace=True)
    OmegaConf.register_new_resolver("sto_sweep_dir", resolve_sweep_dir, replace=True)


def git(*args: str, cwd: Optional[Path] = None) -> str:
    """``git ARGS`` in ``cwd`` (default: this checkout); its output, or "" when git fails."""
    try:
        proc = subprocess.run(["git", *args], capture_output=True, text=True, timeout=10,
                              cwd=cwd or Path(__file__).resolve().parent.parent)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return proc.stdout if proc.returncode == 0 else ""


CodeState = Tuple[str, str, Tuple[str, ...]]


def code_state() -> CodeState:
    """git commit, diff and package versions. A launch asks once (its session keeps the
    answer): every point of a sweep runs the same checkout (two git calls per point were
    ~26 ms of a sweep's time)."""
    commit = git("rev-parse", "HEAD").strip() or "unknown"
    diff = git("diff", "HEAD")
    versions = []
    try:
        from importlib.metadata import version

        for pkg in ("torch", "deepspeed", "hydra-core", "omegaconf", "submitit"):
            try:
                versions.append(f"{pkg}: {version(pkg)}")
            except Exception:
                versions.append(f"{pkg}: not installed")
    except ImportError:
        pass
    return commit, diff, tuple(versions)


def write_provenance(run_dir: Path, state: CodeState) -> None:
    """git commit (+ diff when dirty) and an environment summary, for reproducibility."""
    commit, diff, versions = state
    (run_dir / "git_commit.txt").write_text(commit + "\n")
    if diff:
        (run_dir / "git_diff.patch").write_text(diff)
    lines = [f"python: {sys.version.split()[0]} ({sys.executable})", f"platform: {platform.platform()}",
             f"host: {platform.node()}", f"argv: {' '.join(sys.argv)}", *versions]
    for key in sorted(os.environ):
        if key.startswith(("SLURM_CONF", "NCCL_", "TORCH_", "CUDA_VISIBLE", "OMP_")):
            lines.append(f"env {key}={os.environ[key]}")
    (run_dir / "environment.txt").write_text("\n".join(lines) + "\n")
