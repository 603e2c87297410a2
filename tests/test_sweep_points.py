"""Tier 1: the sweep's fast paths give what the slow, general ones give."""
from __future__ import annotations

import itertools

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra

from helpers import strategy_options
from launcher import app
from launcher.overrides import CONF_DIR, group_options
from train.config import to_run_config

# Every option of every group at least once (cycling the shorter lists).
_N = max(len(group_options(g)) for g in ("cluster", "model", "strategy"))
COMBOS = [[f"+cluster={c}", f"+model={m}", f"+strategy={s}"] for c, m, s in itertools.islice(zip(
    itertools.cycle(group_options("cluster")), itertools.cycle(group_options("model")),
    itertools.cycle(strategy_options())), _N)]


@pytest.mark.parametrize("overrides", [[], ["cluster.nodes=3", "train.seed=7", "+cluster.env.X=1"], *COMBOS])
def test_typed_conversion_equals_the_schema_merge(overrides):
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        dcfg = compose("config", overrides=overrides)
    assert app.run_config(dcfg) == to_run_config(dcfg)
