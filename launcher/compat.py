"""The login side's uses of private names of Hydra and omegaconf: one small function each.

Each says why it is used, what the public way is or why there is none, and the releases
it was read on (those of ``.venv``, pinned by constraints-cpu.txt: hydra-core 1.3.8,
omegaconf 2.3.1). An upgrade that moves one fails here, in one place, and in the tests
of its callers (tests/test_sweep_points.py, tests/test_config.py).

The login side's other private third-party names are submitit's, all in its one
adapter, slurm/submitit_adapter.py; the compute side's are torch's, in
train/torch_compat.py. tests/test_structure.py refuses such a name anywhere else.
``hydra_plugins/`` imports this module too (it already imports ``launcher``; ``spec``, which
both sides import, uses no private name). Imports no torch (tests/test_login_side.py).
"""
from __future__ import annotations

from typing import Any


def basic_sweeper() -> Any:
    """Hydra's ``BasicSweeper`` class (``hydra._internal.core_plugins.basic_sweeper``):
    its ``split_arguments`` is the cartesian product of a sweep's overrides in the order
    ``-m`` runs them (launcher/compose.py ``expand``), and our sweeper
    (hydra_plugins/sto_sweep) subclasses it to keep its job numbers and ``multirun.yaml``.
    Hydra's public plugin API (``hydra.plugins.sweeper.Sweeper``) has no product, and the
    basic sweeper itself is public only by its config name (``hydra/sweeper=basic``).
    Read on hydra-core 1.3.8."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper

    return BasicSweeper


def omegaconf_yaml_dumper() -> Any:
    """omegaconf's YAML dumper class (``omegaconf._utils.get_omega_conf_dumper()``): the one
    ``OmegaConf.to_yaml`` dumps with (a string YAML would read as a bool or number is quoted), for plain
    dicts that never become a DictConfig (launcher/launch.py ``config_yaml``: ~10x faster,
    the same text, tested). The public ``OmegaConf.to_yaml`` takes a config, which costs
    the building of one. Read on omegaconf 2.3.1."""
    from omegaconf._utils import get_omega_conf_dumper

    return get_omega_conf_dumper()
