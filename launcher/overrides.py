"""Check command-line overrides before Hydra sees them, for one-line errors.

Hydra's own messages for these mistakes span several lines and exit 1; users get
instead one line naming the field, the value and the fix, and exit status 2:
unknown group option, a group given without ``+``, an unknown field, a sweep
without ``-m``.

Groups and options are looked up where Hydra looks them up: ``conf/``, then the user's
own config directories (``--config-dir DIR``, and ``hydra.searchpath=[file://DIR,...]``),
which may add options to our groups (``cluster/ourcluster.yaml``) and groups of their own
(``experiment/bigrun.yaml``, used as ``+experiment=bigrun``).
"""
from __future__ import annotations

import dataclasses
import typing
from pathlib import Path
from typing import Any, List, Optional, Tuple

from spec.config import GROUPS, ConfigError, RunConfig
from spec.validate import field_names

CONF_DIR = Path(__file__).resolve().parent.parent / "conf"


# Hydra's command-line flags that take a value (the value is not an override).
VALUE_FLAGS = ("--config-dir", "-cd", "--config-path", "-cp", "--config-name", "-cn", "--experimental-rerun")


def split_args(args: List[str]) -> Tuple[List[str], List[Path]]:
    """(the overrides, the directories of ``--config-dir``) of a command line."""
    overrides, dirs, skip = [], [], False
    for i, arg in enumerate(args):
        if skip:
            skip = False
            continue
        flag, _, value = arg.partition("=")
        if flag in VALUE_FLAGS:
            if not value:
                value, skip = (args[i + 1] if i + 1 < len(args) else ""), True
            if flag in ("--config-dir", "-cd") and value:
                dirs.append(Path(value).expanduser())
        elif not arg.startswith("-"):
            overrides.append(arg)
    return overrides, dirs


def search_dirs(extra: List[Path], parsed: List[Any]) -> List[Path]:
    """conf/, the ``--config-dir`` directories and the file paths of ``hydra.searchpath``."""
    dirs = [CONF_DIR, *extra]
    for o in parsed:
        if o.key_or_group == "hydra.searchpath":
            value = o.value()
            for item in value if isinstance(value, list) else [value]:
                text = str(item)
                if text.startswith("file://"):
                    dirs.append(Path(text[len("file://"):]))
                elif "://" not in text:
                    dirs.append(Path(text))
    return dirs


def group_options(group: str, dirs: Optional[List[Path]] = None) -> List[str]:
    return sorted({p.stem for d in (dirs or [CONF_DIR]) for p in (d / group).glob("*.yaml")})


# Groups whose options set fields of several sections (``# @package _global_``): a recipe
# (conf/experiment/r1_distill_sft.yaml) composes a model, a strategy and its settings at once.
GLOBAL_GROUPS = ("experiment",)


def _is_group(key: str, dirs: List[Path]) -> bool:
    return key in GROUPS or key in GLOBAL_GROUPS or any((d / key).is_dir() for d in dirs[1:])


def chosen_by_global_group(group: str, parsed: List[Any], dirs: List[Path]) -> bool:
    """Whether an appended global group's option (``+experiment=r1_distill_sft``) lists
    ``group`` in its defaults: then ``group=value`` overrides that choice (Hydra's rule),
    where ``+group=value`` would be a second value for it."""
    import yaml

    for o in parsed:
        if o.key_or_group.lstrip("+") in GLOBAL_GROUPS and (o.is_add() or o.is_force_add()):
            for d in dirs:
                path = d / o.key_or_group.lstrip("+") / f"{o.get_value_element_as_str()}.yaml"
                defaults = (yaml.safe_load(path.read_text()) or {}).get("defaults", []) if path.is_file() else []
                if any(isinstance(e, dict) and f"/{group}" in e for e in defaults):
                    return True
    return False


def group_prefix(group: str, overrides: List[str]) -> str:
    """How to choose ``group`` on top of ``overrides``: ``group=`` where an appended global
    group's option (a recipe) chose it already, else ``+group=``."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    candidates, config_dirs = split_args(overrides)
    parsed = OverridesParser.create().parse_overrides(overrides=candidates)
    return f"{group}=" if chosen_by_global_group(group, parsed, search_dirs(config_dirs, parsed)) else f"+{group}="


def check_key(key: str) -> Optional[Tuple[Any, Any]]:
    """Raise ConfigError unless ``key`` (dotted) is a field of the schema. (the dataclass
    that declares it, its type hint), or None inside a free-form mapping."""
    parts = key.split(".")
    cls: Any = RunConfig
    owner, hint = None, None
    for depth, part in enumerate(parts):
        if not dataclasses.is_dataclass(cls):
            origin = typing.get_origin(cls)
            if origin in (dict, typing.Dict):
                return None  # free-form mapping such as cluster.env.NCCL_DEBUG
            raise ConfigError(f"unknown field {key!r}: {'.'.join(parts[:depth])} has no sub-fields")
        hints = typing.get_type_hints(cls)
        if part not in hints:
            where = ".".join(parts[:depth]) or "the config"
            raise ConfigError(f"unknown field {key!r}: {where} has no field {part!r}; known: "
                              f"{', '.join(field_names(cls))}")
        owner, hint = cls, hints[part]
        cls = _unwrap(hint)[0]
    return owner, hint


def _unwrap(hint: Any) -> Tuple[Any, bool]:
    """(X, True) for Optional[X], else (hint, False)."""
    if typing.get_origin(hint) is typing.Union:
        return next(a for a in typing.get_args(hint) if a is not type(None)), True
    return hint, False


# What a scalar field takes, for the error, and an example when its default is null.
_KINDS = {bool: ("true or false", "true"), int: ("an integer", "2"), float: ("a number", "0.5"),
          str: ("a string", "text")}


def _surely_valid(hint: Any, value: Any) -> bool:
    """A quick yes for the usual values; False: ask OmegaConf (it converts more, e.g. '3')."""
    base, optional = _unwrap(hint)
    if value is None:
        return optional
    if base is bool:
        return isinstance(value, bool)
    if base is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if base is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if base is str:
        return isinstance(value, (str, int, float, bool))
    if typing.get_origin(base) in (list, List):
        return isinstance(value, list) and all(isinstance(v, str) for v in value)
    return True  # mappings, nested sections: Hydra's own merge decides


def check_value(key: str, value: Any, text: str) -> None:
    """Raise ConfigError when ``value`` (parsed by Hydra) does not convert to the type of
    field ``key``: one line instead of Hydra's six (exit 1)."""
    found = check_key(key)
    if found is None or (isinstance(value, str) and "${" in value) or _surely_valid(found[1], value):
        return
    from omegaconf import OmegaConf
    from omegaconf.errors import ValidationError

    owner, hint = found
    name = key.rsplit(".", 1)[-1]
    try:
        OmegaConf.update(OmegaConf.structured(owner), name, value, merge=True)
        return
    except ValidationError:
        pass
    base, optional = _unwrap(hint)
    kind, example = _KINDS.get(base, ("a list such as [a,b]", "[a,b]") if typing.get_origin(base) in (list, List)
                               else (f"a value of type {base}", None))
    default = next(f.default for f in dataclasses.fields(owner) if f.name == name)
    if isinstance(default, (bool, int, float, str)):
        example = str(default).lower() if isinstance(default, bool) else default
    fix = f"; e.g. {key}={example}" if example is not None else ""
    shown = "null" if value is None else repr(value)
    raise ConfigError(f"{key}={text}: {key} takes {kind}{' or null' if optional else ''}, not {shown}{fix}")


def check_overrides(args: List[str], multirun: bool) -> None:
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    candidates, config_dirs = split_args(args)
    for d in config_dirs:
        if not d.is_dir():
            raise ConfigError(f"--config-dir {d}: no such directory; give the directory that holds your "
                              "groups (e.g. ~/myteam/conf with cluster/ourcluster.yaml)")
    try:
        parsed = OverridesParser.create().parse_overrides(overrides=candidates)
    except HydraException as exc:
        raise ConfigError(f"cannot parse overrides {' '.join(candidates)!r}: {str(exc).splitlines()[0]}") from None
    dirs = search_dirs(config_dirs, parsed)
    for o in parsed:
        key = o.key_or_group
        if key.startswith("hydra"):
            continue
        text = o.input_line or key
        if o.is_sweep_override() and not multirun:
            raise ConfigError(f"{text} is a sweep; add -m (--multirun) to submit one job per value")
        if _is_group(key, dirs):
            if not (o.is_add() or o.is_force_add() or chosen_by_global_group(key, parsed, dirs)):
                raise ConfigError(f"{text}: group {key!r} is not in the defaults list; append it with +{text}")
            values = list(o.sweep_string_iterator()) if o.is_sweep_override() else [o.get_value_element_as_str()]
            options = group_options(key, dirs)
            for value in values:
                if value not in options:
                    where = ", ".join(f"{d}/{key}/" for d in dirs if (d / key).is_dir())
                    raise ConfigError(f"+{key}={value}: unknown {key} {value!r}; choose one of "
                                      f"{', '.join(options)} (files in {where})")
            continue
        if "/" in key:
            raise ConfigError(f"{text}: unknown config group {key!r}; groups are {', '.join(GROUPS)} (conf/), "
                              "or a directory of your own config directory (--config-dir DIR)")
        check_key(key)
        # A sweep's value of the wrong type is its point's to skip, with the reason, as every
        # point that does not compose is (the sweep's contract: tests/test_sweep_arrays.py).
        if not o.is_sweep_override() and not o.is_delete():
            check_value(key.lstrip("+~"), o.value(), o.get_value_element_as_str())
