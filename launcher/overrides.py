"""Check command-line overrides before Hydra sees them, for one-line errors.

Hydra's own messages for these mistakes span several lines and exit 1; users get
instead one line naming the field, the value and the fix, and exit status 2:
unknown group option, a group given without ``+``, an unknown field, a sweep
without ``-m``.
"""
from __future__ import annotations

import dataclasses
import typing
from pathlib import Path
from typing import Any, List

from spec.config import GROUPS, ConfigError, RunConfig

CONF_DIR = Path(__file__).resolve().parent.parent / "conf"


def group_options(group: str) -> List[str]:
    return sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml"))


def _field_names(cls: Any) -> List[str]:
    return [f.name for f in dataclasses.fields(cls)]


def check_key(key: str) -> None:
    """Raise ConfigError unless ``key`` (dotted) is a field of the schema."""
    parts = key.split(".")
    cls: Any = RunConfig
    for depth, part in enumerate(parts):
        if not dataclasses.is_dataclass(cls):
            origin = typing.get_origin(cls)
            if origin in (dict, typing.Dict):
                return  # free-form mapping such as cluster.env.NCCL_DEBUG
            raise ConfigError(f"unknown field {key!r}: {'.'.join(parts[:depth])} has no sub-fields")
        hints = typing.get_type_hints(cls)
        if part not in hints:
            where = ".".join(parts[:depth]) or "the config"
            raise ConfigError(f"unknown field {key!r}: {where} has no field {part!r}; known: "
                              f"{', '.join(_field_names(cls))}")
        cls = hints[part]
        if typing.get_origin(cls) is typing.Union:  # Optional[X]
            cls = next(a for a in typing.get_args(cls) if a is not type(None))


def check_overrides(args: List[str], multirun: bool) -> None:
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    candidates = [a for a in args if not a.startswith("-")]
    try:
        parsed = OverridesParser.create().parse_overrides(overrides=candidates)
    except HydraException as exc:
        raise ConfigError(f"cannot parse overrides {' '.join(candidates)!r}: {str(exc).splitlines()[0]}") from None
    for o in parsed:
        key = o.key_or_group
        if key.startswith("hydra"):
            continue
        text = o.input_line or key
        if o.is_sweep_override() and not multirun:
            raise ConfigError(f"{text} is a sweep; add -m (--multirun) to submit one job per value")
        if key in GROUPS:
            if not (o.is_add() or o.is_force_add()):
                raise ConfigError(f"{text}: group {key!r} is not in the defaults list; append it with +{text}")
            values = list(o.sweep_string_iterator()) if o.is_sweep_override() else [o.get_value_element_as_str()]
            options = group_options(key)
            for value in values:
                if value not in options:
                    raise ConfigError(f"+{key}={value}: unknown {key} {value!r}; choose one of "
                                      f"{', '.join(options)} (files in conf/{key}/)")
            continue
        if "/" in key:
            raise ConfigError(f"{text}: unknown config group {key!r}; groups are {', '.join(GROUPS)}")
        check_key(key)
