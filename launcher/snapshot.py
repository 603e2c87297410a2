"""Frozen code per run: what a Slurm job's tasks import is copied at submission.

A job runs long after it is submitted, and a requeued or restarted segment starts again
later still: tasks importing the live checkout would run whatever it holds by then.
With ``launcher.snapshot=true`` (the default) the launcher copies, at submission:

- this project's files: git's tracked and its untracked-not-ignored files, as the working
  tree holds them (what the user sees is what runs, uncommitted edits included);
- for ``entrypoint=``: the git repository holding the script or module, or, outside git,
  its directory (every file but dot-directories and ``__pycache__``); nothing for code
  installed in site-packages, which is part of the environment like torch;

each into ``.code/<hash>`` beside the run directory (a sweep's directory for its points),
named by the sha256 of the file list and contents, so the points of a sweep and every run
of unchanged code share one copy. Files are read-only; run directories, the run root and
the cache inside a tree are left out. A tree over 200 MB or 20,000 files is refused
with one line (:mod:`launcher.codetree`).

The job's batch script puts the project's copy first on ``PYTHONPATH`` (ahead of an
editable install's path entry, which ``site`` appends) and starts every task's Python
with ``-P`` (3.11+), so the job's working directory (often the checkout itself) is not
put before it; the task wrapper is the copy's. ``entrypoint.json`` names the entry
point's copy. Local runs import the checkout: they run while the command waits.
``run.json``'s ``code_snapshot`` says where the code came from.
"""
from __future__ import annotations

import json
import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

from launcher import entrypoint
from launcher.codetree import KEY_CHARS, Tree, copy_tree, git_top, installed, list_tree, mb, prune_copies, within
from spec.config import ConfigError, RunConfig
from spec.rundir import ENTRYPOINT, read_run_json

MODES = {"true": "true", "True": "true", "false": "false", "False": "false", "refresh": "refresh"}
CACHE = ".code"  # beside the run directory: RUN_DIR/../.code/<hash>
PROJECT = Path(__file__).resolve().parent.parent  # the directory holding launcher/, train/, spec/, slurm/
_OWN_FILE = "launcher/snapshot.py"  # in the project's git tree when the project is a checkout


def mode(cfg: RunConfig) -> str:
    """``launcher.snapshot`` as one of true, false, refresh; a ConfigError otherwise."""
    value = str(cfg.launcher.snapshot)
    if value not in MODES:
        raise ConfigError(f"launcher.snapshot={value}: give true (freeze the code at submission), false (run the "
                          "checkout as it is) or refresh (launcher.resume: freeze the code anew)")
    return MODES[value]


@dataclass(frozen=True)
class Frozen:
    """Where a job's tasks import from: the copies (source root -> copy) and the project's."""

    copies: Tuple[Tuple[Path, Path], ...]  # (source root, its copy)
    record: Dict[str, Any] = field(compare=False, hash=False)  # run.json's code_snapshot

    def inside(self, path: Path) -> Path:
        """Where ``path`` of a frozen source lies in its copy (itself outside them)."""
        for source, copy in self.copies:
            if within(path, source):
                return copy / path.relative_to(source)
        return path

    @property
    def python_path(self) -> Optional[Path]:
        """The project's package root in its copy; None when the project was not frozen."""
        path = self.inside(PROJECT)
        return None if path == PROJECT else path

    def setup_lines(self) -> List[str]:
        """Batch-script lines (after the site's setup and cluster.env) that put the copy first."""
        if self.python_path is None:
            return []
        return [f"export PYTHONPATH={shlex.quote(str(self.python_path))}${{PYTHONPATH:+:$PYTHONPATH}}"]

    def task_python(self) -> Tuple[Optional[str], Optional[str]]:
        """(python command, task wrapper) for ``slurm.submitit_adapter.task_python``: the
        interpreter with ``-P`` (no working directory on sys.path) and the copy's wrapper."""
        if self.python_path is None:
            return None, None
        flag = " -P" if sys.version_info >= (3, 11) else ""
        return f"{shlex.quote(sys.executable)}{flag}", str(self.python_path / "slurm" / "task_wrapper.sh")

    @classmethod
    def from_record(cls, record: Dict[str, Any]) -> "Frozen":
        return cls(tuple((Path(t["source"]), Path(t["copy"])) for t in record.get("trees", [])), record)


@dataclass(frozen=True)
class Plan:
    """What a Slurm point's tasks will import: the trees to freeze and where their copies go."""

    cache: Path
    trees: Tuple[Tree, ...]  # the project's (a git checkout), then the entry point's (when another)

    def would_be(self) -> Frozen:
        """The copies this plan would make (the dry run: hashes read, nothing written)."""
        keys = [t.key for t in self.trees]
        return _frozen(self, [self.cache / k[:KEY_CHARS] for k in keys], keys)


def _frozen(plan: Plan, copies: List[Path], keys: List[str]) -> Frozen:
    frozen = Frozen(tuple((t.root, c) for t, c in zip(plan.trees, copies)), {})
    trees = [{"source": str(t.root), "copy": str(c), "sha256": k, "how": t.how, "files": len(t.files),
              "bytes": t.size} for t, c, k in zip(plan.trees, copies, keys)]
    python_path = str(frozen.python_path) if frozen.python_path else None
    frozen.record.update(frozen=True, python_path=python_path, trees=trees)
    return frozen


def freeze(plan: Plan, memo: Optional[Dict[Plan, Frozen]] = None) -> Frozen:
    """Copy the plan's trees (once per launch: ``memo``, a session's)."""
    if memo is not None and plan in memo:
        return memo[plan]
    made = [copy_tree(t, plan.cache) for t in plan.trees]
    frozen = _frozen(plan, [c for c, _ in made], [k for _, k in made])
    prune_copies(plan.cache, [c for c, _ in made], lambda: referenced_copies(plan.cache))
    if memo is not None:
        memo[plan] = frozen
    return frozen


def referenced_copies(cache: Path) -> List[Path]:
    """The copies in ``cache`` that the run directories beside it (a runs root's runs, a
    sweep's points) name in run.json's ``code_snapshot``."""
    named = []
    for run_json in cache.parent.glob("*/run.json"):
        trees = (read_run_json(run_json.parent).get("code_snapshot") or {}).get("trees") or []
        named += [Path(t["copy"]) for t in trees if t.get("copy")]
    return named


def _outermost(paths: Sequence[Path]) -> List[Path]:
    return [p for p in paths if not any(q != p and within(p, q) for q in paths)]


def _project_source() -> Optional[Tuple[Path, str]]:
    if installed(PROJECT):  # a plain install: code that edits of a checkout do not reach
        return None
    top = git_top(PROJECT)
    if top is None:
        if (PROJECT / ".git").exists():
            raise ConfigError(f"launcher.snapshot=true: git cannot read the checkout {PROJECT}; install git, or set "
                              "launcher.snapshot=false to run the checkout as it is")
        return None
    return top, "git"


def _entry_source(entry: Optional[Dict[str, Any]]) -> Optional[Tuple[Path, str]]:
    if entry is None:
        return None
    sys_path = Path(entry.get("source_sys_path", entry["sys_path"])).resolve()
    if installed(sys_path):
        return None
    top = Path(entry["git_root"]).resolve() if entry.get("git_root") else None
    return (top, "git") if top is not None and within(sys_path, top) else (sys_path, "directory")


def plan(cfg: RunConfig, run_dir: Path, entry: Optional[Dict[str, Any]],
         trees: Dict[Any, Tree]) -> Optional[Plan]:
    """The code a Slurm point freezes, or None (``launcher.snapshot=false``, a local run,
    installed code). ``trees``: the listings made during this launch (a sweep lists once).
    A ConfigError for a bad mode, a tree too large, or a path PYTHONPATH cannot hold."""
    if mode(cfg) == "false" or cfg.cluster.backend != "slurm":
        return None
    cache = run_dir.parent / CACHE
    if ":" in str(cache):
        raise ConfigError(f"launcher.run_dir={run_dir}: the frozen code would go to {cache}, whose ':' splits "
                          "PYTHONPATH; pick a directory without ':', or set launcher.snapshot=false")
    if sys.version_info < (3, 11) and any((Path.cwd() / p / "__init__.py").is_file() for p in ("train", "slurm")):
        raise ConfigError(f"launcher.snapshot=true: Python {sys.version.split()[0]} puts the job's working "
                          f"directory {Path.cwd()} (a checkout) before the frozen copy on sys.path; submit from "
                          "another directory, use Python >= 3.11, or set launcher.snapshot=false")
    excluded = _outermost([Path(cfg.launcher.root).resolve(), cache, run_dir.resolve()])
    project = _project_source()
    listed: List[Tree] = []
    for source in dict.fromkeys(s for s in (project, _entry_source(entry)) if s):
        inside = tuple(p for p in excluded if within(p, source[0]))
        if (source, inside) not in trees:
            trees[(source, inside)] = list_tree(*source, excluded=inside)
        listed.append(trees[(source, inside)])
    if project is not None and (PROJECT / _OWN_FILE).relative_to(project[0]).as_posix() not in dict(listed[0].files):
        raise ConfigError(f"launcher.snapshot=true: the project's files in {PROJECT} are not tracked by git in "
                          f"{project[0]}; track them, or set launcher.snapshot=false to run them as they are")
    return Plan(cache, tuple(listed)) if listed else None


def resume_code(run_dir: Path, cfg: RunConfig,
                overrides: Sequence[str]) -> Tuple[Optional[Dict[str, Any]], Optional[Plan], Optional[Frozen]]:
    """``launcher.resume``'s code: (the entry point, the code to freeze now, the run's copy
    kept). The copy is kept unless this command says ``launcher.snapshot=refresh`` (or
    false), the run has none, or it runs locally; otherwise the code is planned as at
    submission, a frozen or to-be-frozen entry point resolved again from its source."""
    path = run_dir / ENTRYPOINT
    saved = json.loads(path.read_text()) if path.is_file() else None
    refresh = any(o.lstrip("+").replace(" ", "") == "launcher.snapshot=refresh" for o in overrides)
    record = read_run_json(run_dir).get("code_snapshot") or {}
    if not refresh and mode(cfg) != "false" and cfg.cluster.backend == "slurm" and record.get("frozen"):
        kept = Frozen.from_record(record)
        gone = [str(copy) for _, copy in kept.copies if not copy.is_dir()]
        if gone:
            raise ConfigError(f"launcher.snapshot=true: the run's frozen code {gone[0]} is gone; set "
                              "launcher.snapshot=refresh to freeze the code as it is now, or launcher.snapshot=false "
                              "to run the checkout")
        return saved, None, kept
    entry = saved
    if saved is not None and ("source_path" in saved or (mode(cfg) != "false" and cfg.cluster.backend == "slurm")):
        entry = entrypoint.resolve(cfg, cwd=Path(saved.get("source_sys_path", saved["sys_path"])))
    return entry, plan(cfg, run_dir, entry, {}), None


def entry_for_tasks(entry: Optional[Dict[str, Any]], frozen: Optional[Frozen]) -> Optional[Dict[str, Any]]:
    """entrypoint.json's content: the entry point in its copy, the original beside it."""
    if entry is None:
        return None
    source = {"path": entry.get("source_path", entry["path"]),
              "sys_path": entry.get("source_sys_path", entry["sys_path"])}
    clean = {k: v for k, v in entry.items() if k not in ("source_path", "source_sys_path")}
    if frozen is None or frozen.inside(Path(source["path"])) == Path(source["path"]):
        return {**clean, **source}
    return {**clean, "path": str(frozen.inside(Path(source["path"]))),
            "sys_path": str(frozen.inside(Path(source["sys_path"]))),
            "source_path": source["path"], "source_sys_path": source["sys_path"]}


def _why(cfg: RunConfig) -> str:
    if cfg.cluster.backend != "slurm":
        return "a local run: it runs while the command waits"
    return "launcher.snapshot=false" if mode(cfg) == "false" else "installed code: nothing to freeze"


def record(frozen: Optional[Frozen], cfg: RunConfig) -> Dict[str, Any]:
    """run.json's ``code_snapshot``: the copies, or where the unfrozen code lies and why."""
    if frozen is not None and frozen.copies:
        return frozen.record
    return {"frozen": False, "source": str(PROJECT), "why": _why(cfg)}


def describe(frozen: Optional[Frozen], cfg: RunConfig, verb: str) -> str:
    """The line on the job's code that the dry run and the submission print (``verb``:
    "would freeze", "froze", "keeps")."""
    if frozen is None or not frozen.copies:
        return f"code: the tasks import {PROJECT} as it is when they start ({_why(cfg)})"
    parts = [f"{t['source']} ({t['how']}: {t['files']} files, {mb(t['bytes'])}) -> {t['copy']}"
             for t in frozen.record["trees"]]
    return (f"code: {verb} {'; '.join(parts)}; every segment of the job imports "
            "the copy (launcher.snapshot=false: the checkout)")
