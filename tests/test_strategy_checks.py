"""Tier 1: combinations a strategy cannot run are refused before submission, in one line."""
from __future__ import annotations

import re

import pytest
from helpers import compose_run
from train.config import ConfigError
from train.layout import build_layout
from train.strategies import check_supported


@pytest.mark.parametrize("overrides,message", [
    (["+strategy=ddp", "strategy.tensor_parallel=2"],
     "strategy 'ddp' (torch ddp) with tensor_parallel=2: tensor parallel composes with FSDP only"),
    (["+strategy=zero2", "cluster.gpus_per_node=4", "strategy.tensor_parallel=2"],
     "strategy 'zero2' (deepspeed zero2) with tensor_parallel=2: tensor parallel composes with FSDP only"),
    (["+strategy=tp", "cluster.gpus_per_node=4", "strategy.data_parallel=none"],
     "strategy 'tp': data_parallel=none but the layout has dp=2 data-parallel ranks"),
    (["+strategy=fsdp_tp", "model.tie_embeddings=true"],
     "model.tie_embeddings=true with tensor_parallel=2"),
    (["+strategy=fsdp", "strategy.pipeline_parallel=2"],
     "strategy 'fsdp': pipeline_parallel=2 is not available in this version"),
])
def test_refused(overrides, message):
    cfg = compose_run(overrides)
    with pytest.raises(ConfigError, match=re.escape(message)):
        check_supported(cfg, build_layout(cfg))


@pytest.mark.parametrize("strategy,ranks,shape", [
    ("tp", 2, (1, 1, 1, 2)), ("tp", 8, (1, 4, 1, 2)), ("fsdp_tp", 2, (1, 1, 1, 2)), ("fsdp_tp", 8, (1, 1, 4, 2)),
    ("hsdp", 4, (1, 1, 4, 1)),
])
def test_supported_layouts(strategy, ranks, shape):
    cfg = compose_run([f"+strategy={strategy}", f"cluster.gpus_per_node={ranks}"])
    layout = build_layout(cfg)
    check_supported(cfg, layout)
    assert layout.shape == shape


def test_tp_alone():
    cfg = compose_run(["+strategy=tp", "strategy.data_parallel=none", "strategy.dp_replicate=1"])
    check_supported(cfg, build_layout(cfg))


def test_hsdp_replicates_across_nodes_and_shards_inside():
    cfg = compose_run(["+strategy=hsdp", "cluster.nodes=3", "cluster.gpus_per_node=4"])
    assert build_layout(cfg).shape == (1, 3, 4, 1)
    cfg = compose_run(["+strategy=hsdp", "cluster.nodes=2", "cluster.gpus_per_node=8", "strategy.tensor_parallel=2"])
    assert build_layout(cfg).shape == (1, 2, 4, 2)
