"""A user's entry point, checked and recorded on the login side.

``entrypoint=path/to/script.py`` or ``entrypoint=package.module:function`` (see
``spec.config.RunConfig.entrypoint``). Nothing is imported here: a script must be a file;
a module is found on the launch directory and ``sys.path`` as ``python -m`` would find
it, read as source, and its function's signature read with :mod:`ast` (the user's
package may import torch, which the login side never does). What every task runs is
written to ``RUN_DIR/entrypoint.json``: the kind, the file, the directory put first on
``sys.path``, the file's sha256 and the git commit and diff of its repository, so a
requeued job can tell whether it runs the same code (:mod:`train.harness.user`).
"""
from __future__ import annotations

import ast
import hashlib
import json
import os
import re
import sys
from pathlib import Path
from typing import Any, Dict, Optional

from launcher.provenance import git
from spec.config import ConfigError, RunConfig
from spec.rundir import ENTRYPOINT
from spec.user_env import ACCELERATE_DS_CONFIG, accelerate_ds_config

_FUNCTION = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)*):([A-Za-z_][A-Za-z0-9_]*)$")


def _no_trainer_schedule(cfg: RunConfig) -> None:
    """``train.epochs`` and ``optim.warmup_ratio`` set the built-in trainer's schedule
    (spec/schedule.py); a script's own loop never sees them: refused, not ignored. (A
    function entry point gets the config and may read them.)"""
    given = [f"train.epochs={cfg.train.epochs:g}"] if cfg.train.epochs > 0 else []
    given += [f"optim.warmup_ratio={cfg.optim.warmup_ratio:g}"] if cfg.optim.warmup_ratio else []
    if given:
        raise ConfigError(f"{given[0]}: sets the built-in trainer's schedule, which the script entrypoint="
                          f"{cfg.entrypoint} does not run; pass your script its epochs and warm-up in "
                          f"entrypoint_args=[...] and drop {given[0].split('=')[0]}")


def resolve(cfg: RunConfig, cwd: Optional[Path] = None,
            cache: Optional[Dict[str, Dict[str, Any]]] = None) -> Optional[Dict[str, Any]]:
    """The entry point of ``cfg`` as entrypoint.json records it (None: the built-in
    trainer). A script's path becomes absolute in ``cfg``. Raises ConfigError.
    ``cache``: the files' code state already asked during this launch."""
    if not cfg.entrypoint:
        if cfg.entrypoint_args:
            raise ConfigError(f"entrypoint_args={list(cfg.entrypoint_args)} without an entrypoint; set "
                              "entrypoint=path/to/script.py or drop entrypoint_args")
        return None
    cwd = Path.cwd() if cwd is None else cwd
    match = _FUNCTION.match(cfg.entrypoint)
    if match and not cfg.entrypoint.endswith(".py"):
        if cfg.entrypoint_args:
            raise ConfigError(f"entrypoint_args={list(cfg.entrypoint_args)}: a function entry point "
                              f"({cfg.entrypoint}) gets the config, not arguments; put its settings under "
                              "+user.NAME=VALUE")
        return _function(cfg.entrypoint, match.group(1), match.group(2), cwd, cache)
    _no_trainer_schedule(cfg)
    info = _script(cfg.entrypoint, cwd, cache)
    cfg.entrypoint = info["path"]
    return info


def _script(text: str, cwd: Path, cache: Optional[Dict[str, Dict[str, Any]]]) -> Dict[str, Any]:
    path = (cwd / Path(text).expanduser()).resolve()
    if path.is_dir():
        raise ConfigError(f"entrypoint={text} is a directory; give the script in it, e.g. "
                          f"entrypoint={Path(text) / 'train.py'}")
    if not path.is_file():
        hint = " (or package.module:function for a function)" if ":" in text else ""
        raise ConfigError(f"entrypoint={text}: no such file ({path}); give the path of your training "
                          f"script{hint}")
    return {"kind": "script", "path": str(path), "sys_path": str(path.parent), **_code(path, cache)}


def _find_module(module: str, cwd: Path) -> Optional[Path]:
    """The source file ``python -m`` would import for ``module`` (the launch directory
    first), found without importing anything."""
    parts = module.split(".")
    for entry in [str(cwd), *sys.path[1:]]:
        base = Path(entry or ".")
        if not base.is_dir():
            continue
        for candidate in (base.joinpath(*parts).with_suffix(".py"), base.joinpath(*parts, "__init__.py")):
            if candidate.is_file():
                return candidate
    return None


def _function(text: str, module: str, name: str, cwd: Path,
              cache: Optional[Dict[str, Dict[str, Any]]]) -> Dict[str, Any]:
    source = _find_module(module, cwd)
    if source is None:
        raise ConfigError(f"entrypoint={text}: no module {module} in the launch directory ({cwd}) or on "
                          "sys.path; run from the directory that holds your package, or install it")
    tree = ast.parse(source.read_text(), filename=str(source))
    defs = {n.name: n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    assigned = {t.id for n in tree.body if isinstance(n, ast.Assign) for t in n.targets if isinstance(t, ast.Name)}
    imported = {a.asname or a.name for n in tree.body if isinstance(n, ast.ImportFrom) for a in n.names}
    if name not in defs and name not in assigned | imported:
        raise ConfigError(f"entrypoint={text}: {source} has no top-level function {name}; define "
                          f"`def {name}(cfg):` there or name an existing one")
    if name in defs:
        args = defs[name].args
        positional = [*args.posonlyargs, *args.args]
        required = len(positional) - len(args.defaults)
        required_kw = [a.arg for a, d in zip(args.kwonlyargs, args.kw_defaults) if d is None]
        if isinstance(defs[name], ast.AsyncFunctionDef) or required > 1 or required_kw or \
                (not positional and args.vararg is None):
            raise ConfigError(f"entrypoint={text}: {name} must take the config as its one argument "
                              f"(`def {name}(cfg):`), not ({ast.unparse(args)}); change its signature")
    root = source.parents[len(module.split(".")) - (1 if source.name != "__init__.py" else 0)]
    return {"kind": "function", "module": module, "function": name, "path": str(source.resolve()),
            "sys_path": str(root.resolve()), **_code(source, cache)}


def _code(path: Path, cache: Optional[Dict[str, Dict[str, Any]]] = None) -> Dict[str, Any]:
    """sha256 of the file, and the commit and diff of the git repository holding it. A
    launch asks once per file (``cache``: its session's), not once per sweep point."""
    if cache is not None and str(path) in cache:
        return cache[str(path)]
    info: Dict[str, Any] = {"sha256": hashlib.sha256(path.read_bytes()).hexdigest()}
    top = git("rev-parse", "--show-toplevel", cwd=path.parent).strip()
    if top:
        info.update(git_root=top, git_commit=git("rev-parse", "HEAD", cwd=path.parent).strip() or None,
                    git_diff=git("diff", "HEAD", cwd=Path(top)) or None)
    if cache is not None:
        cache[str(path)] = info
    return info


def write(run_dir: Path, info: Optional[Dict[str, Any]], cfg: RunConfig) -> None:
    """RUN_DIR/entrypoint.json (removed for the built-in trainer) and, for a DeepSpeed
    strategy, the DeepSpeed JSON an Accelerate script gets (spec.user_env)."""
    path = run_dir / ENTRYPOINT
    if info is None:
        path.unlink(missing_ok=True)
        return
    _write_json(path, info)
    if cfg.strategy.engine == "deepspeed":
        _write_json(run_dir / ACCELERATE_DS_CONFIG, accelerate_ds_config(cfg))


def _write_json(path: Path, data: Dict[str, Any]) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, path)
