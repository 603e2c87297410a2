"""Every point of a sweep as Hydra would compose it, composing once per group combination.

Hydra composes a point in two phases: the group overrides (``+cluster=x``,
``+strategy=y``) pick the defaults list and the files merged into the config; then the
value overrides (``cluster.nodes=2``, ``train.seed=5``) are applied to the result. A
full composition costs ~0.1 s; a sweep over values shares its group overrides, so here
each distinct set of group overrides is composed once (``ConfigLoader.load_sweep_config``,
Hydra's public loader interface), and each point's plain ``key=value`` overrides are set
on it as Hydra sets them (``OmegaConf.update(cfg, key, value, merge=True)``), then
converted to a RunConfig (~2 ms a point). Any other override (``+key``, ``++key``,
``~key``, a list or dict value), or a point whose output directory could depend on its
own values (it overrides ``launcher.root`` / ``launcher.run_dir``, or
``hydra.sweep.subdir`` is not the job number), is composed in full, as Hydra's basic
launcher does.

The same composer serves ``-m`` (our Hydra sweep launcher, :mod:`launcher.sweep`) and the
planner (:func:`standalone`, :func:`expand`): both see the points Hydra would.
"""
from __future__ import annotations

import contextlib
import copy
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

from omegaconf import DictConfig, OmegaConf, open_dict, read_write

from spec.config import RunConfig, to_run_config

def run_config(dcfg) -> RunConfig:
    """Hydra's composed config -> RunConfig dataclasses.

    conf/config.yaml is built on the registered ``run_schema``, so Hydra's DictConfig is
    already typed and checked field by field: ``to_object`` builds the dataclasses at once
    (~1.5 ms). ``to_run_config`` merges a fresh structured schema first (~40 ms a point);
    it stays for YAML files and untyped mappings.
    """
    from omegaconf import OmegaConf

    if OmegaConf.is_config(dcfg) and OmegaConf.get_type(dcfg) is RunConfig:
        obj = OmegaConf.to_object(dcfg)
        if isinstance(obj, RunConfig):
            return obj
    return to_run_config(dcfg)


# Value overrides that feed the sweep directory's resolver (conf/config.yaml).
_DIR_KEYS = ("launcher", "launcher.root", "launcher.run_dir")
_JOB_NUM = "${hydra.job.num}"


@dataclass
class Composed:
    num: int
    overrides: List[str]
    run_dir: Path
    label: str
    cfg: Optional[RunConfig] = None  # None when the point did not compose
    error: Optional[str] = None


def _task_config(full: DictConfig) -> DictConfig:
    """The config the task function would get: a copy without the hydra node (as run_job)."""
    task = copy.deepcopy(full)
    with read_write(task), open_dict(task):
        del task["hydra"]
    return task


class _NotPlain(Exception):
    """An override that is not a plain leaf assignment."""


def _apply_in_place(base: DictConfig, values: List[Any]) -> RunConfig:
    """The point's RunConfig: ``values`` applied to the shared ``base``, which is then put back.

    Deep-copying the base for every point cost ~12 ms; a plain ``key=value`` override
    replaces one leaf, so remembering that leaf's raw value (interpolations included) and
    setting it back is enough. Anything else (``+``, ``++``, ``~``, lists, dicts, keys
    that are not leaves) raises, and the caller applies it to a copy instead.
    """
    saved: List[Tuple[DictConfig, str, Any]] = []
    try:
        for o in values:
            if o.is_delete() or o.is_add() or o.is_force_add() or isinstance(o.value(), (dict, list)):
                raise _NotPlain(o.input_line)
            parent_key, _, leaf = o.key_or_group.rpartition(".")
            parent = OmegaConf.select(base, parent_key) if parent_key else base
            if not isinstance(parent, DictConfig) or leaf not in parent:
                raise _NotPlain(o.input_line)
            raw = OmegaConf.to_container(parent, resolve=False)[leaf]
            if isinstance(raw, (dict, list)):
                raise _NotPlain(o.input_line)
            saved.append((parent, leaf, raw))
            OmegaConf.update(base, o.key_or_group, o.value(), merge=True)
        return run_config(base)
    finally:
        for parent, leaf, raw in reversed(saved):
            parent[leaf] = raw


def _error(exc: Exception) -> str:
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return f"{type(exc).__name__}: {' '.join(lines[:2])[:300]}"


class PointComposer:
    """Composes the points of one sweep (master = the sweep's own config)."""

    def __init__(self, master: DictConfig, loader: Any) -> None:
        from hydra.core.override_parser.overrides_parser import OverridesParser

        self.master, self.loader = master, loader
        self.parser = OverridesParser.create()
        self.parsed: Dict[str, Any] = {}   # override text -> Override (the parser is slow)
        self.groups: Dict[str, bool] = {}  # key -> is a config group
        self.bases: Dict[Tuple[str, ...], Tuple[Optional[DictConfig], str, bool, Optional[str]]] = {}

    def _override(self, text: str):
        if text not in self.parsed:
            self.parsed[text] = self.parser.parse_override(text)
        return self.parsed[text]

    def _is_group(self, override) -> bool:
        key = override.key_or_group
        if key not in self.groups:
            repo = getattr(self.loader, "repository", None)
            self.groups[key] = repo is None or repo.group_exists(key)  # no repository: compose in full
        return self.groups[key] or override.package is not None

    def _base(self, groups: Tuple[str, ...]):
        """(task config, sweep dir, whether subdir is the job number, error) of a group combination."""
        if groups not in self.bases:
            try:
                full = self.loader.load_sweep_config(self.master, list(groups))
                subdir = OmegaConf.to_container(full.hydra.sweep, resolve=False).get("subdir")
                self.bases[groups] = (_task_config(full), str(full.hydra.sweep.dir), subdir == _JOB_NUM, None)
            except Exception as exc:  # a composition error skips these points with the reason
                self.bases[groups] = (None, "", False, _error(exc))
        return self.bases[groups]

    def _full(self, num: int, overrides: List[str]) -> Tuple[Optional[RunConfig], Optional[Path], Optional[str]]:
        """Hydra's basic launcher's way: compose the point, set its job number, resolve its directory."""
        try:
            full = self.loader.load_sweep_config(self.master, list(overrides))
            with open_dict(full.hydra.job):
                full.hydra.job.num = num
            run_dir = Path(os.path.join(str(full.hydra.sweep.dir), str(full.hydra.sweep.subdir))).resolve()
            return run_config(_task_config(full)), run_dir, None
        except Exception as exc:
            return None, None, _error(exc)

    def point(self, num: int, overrides: Sequence[str]) -> Composed:
        overrides = list(overrides)
        label = f"#{num} " + (" ".join(overrides) or "defaults")
        try:
            parsed = [self._override(text) for text in overrides]
        except Exception as exc:
            return Composed(num, overrides, self._fallback_dir(num), label, error=_error(exc))
        groups = tuple(o.input_line for o in parsed if self._is_group(o))
        values = [o for o in parsed if not self._is_group(o)]
        base, sweep_dir, plain_subdir, error = self._base(groups)
        if error is None and plain_subdir and not any(o.key_or_group in _DIR_KEYS for o in values):
            run_dir = Path(sweep_dir, str(num)).resolve()
            try:
                return Composed(num, overrides, run_dir, label, cfg=_apply_in_place(base, values))
            except _NotPlain:  # an override the shortcut does not take: composed in full below
                pass
            except Exception as exc:
                return Composed(num, overrides, run_dir, label, error=_error(exc))
        cfg, run_dir, error = self._full(num, overrides)
        return Composed(num, overrides, run_dir or self._fallback_dir(num), label, cfg=cfg, error=error)

    def _fallback_dir(self, num: int) -> Path:
        """Where a point that could not be composed is recorded as skipped."""
        return Path(str(self.master.hydra.sweep.dir), str(num)).resolve()


def compose_points(master: DictConfig, loader: Any, job_overrides: Sequence[Sequence[str]],
                   first_num: int) -> List[Composed]:
    composer = PointComposer(master, loader)
    return [composer.point(first_num + i, overrides) for i, overrides in enumerate(job_overrides)]


def expand(overrides: Sequence[str]) -> List[List[str]]:
    """The points of ``overrides`` (``cluster.nodes=1,2,4``) as Hydra's basic sweeper lists
    them for ``-m``: the cartesian product, in the same order."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    from launcher.compat import basic_sweeper

    parsed = OverridesParser.create().parse_overrides(overrides=list(overrides))
    return [list(point) for batch in basic_sweeper().split_arguments(parsed, None) for point in batch]


@contextlib.contextmanager
def standalone(conf_dir: Path) -> Iterator[PointComposer]:
    """A composer over ``conf_dir`` outside a Hydra run (the planner): Hydra's loader with
    the master config a ``-m`` run starts from."""
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.types import RunMode

    from launcher.provenance import register_resolvers
    from spec.config import register_configs

    register_configs()
    register_resolvers()
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(conf_dir), version_base="1.3"):
        loader = GlobalHydra.instance().config_loader()
        master = loader.load_configuration(config_name="config", overrides=[], run_mode=RunMode.MULTIRUN)
        yield PointComposer(master, loader)
