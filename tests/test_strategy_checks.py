"""Tier 1: combinations a strategy cannot run are refused before submission, in one line."""
from __future__ import annotations

import re

import pytest
from helpers import compose_run
from spec.config import ConfigError
from spec.layout import build_layout
from spec.support import check_supported


@pytest.mark.parametrize("overrides,message", [
    (["+strategy=ddp", "strategy.tensor_parallel=2"],
     "strategy 'ddp' (torch ddp) with tensor_parallel=2: tensor parallel composes with FSDP only"),
    (["+strategy=zero2", "cluster.gpus_per_node=4", "strategy.tensor_parallel=2"],
     "strategy 'zero2' (deepspeed zero2) with tensor_parallel=2: tensor parallel composes with FSDP only"),
    (["+strategy=tp", "cluster.gpus_per_node=4", "strategy.data_parallel=none"],
     "strategy 'tp': data_parallel=none but the layout has dp=2 data-parallel ranks"),
    (["+strategy=fsdp_tp", "model.tie_embeddings=true"],
     "model.tie_embeddings=true with tensor_parallel=2"),
    (["+strategy=zero1", "strategy.pipeline_parallel=2"],
     "strategy 'zero1': pipeline_parallel=2 with engine=deepspeed: pipeline parallel runs on the torch engine"),
    (["+strategy=pp", "cluster.gpus_per_node=4", "strategy.data_parallel=none"],
     "strategy 'pp': data_parallel=none but pipeline_parallel=2 leaves dp=2 data-parallel ranks"),
    (["+strategy=pp", "strategy.pp_schedule=interleaved_1f1b"],
     "strategy.pipeline_parallel=2 x 2 stage(s) per rank (interleaved_1f1b) = 4 stages > model.n_layers=2"),
    (["+strategy=pp", "model.tie_embeddings=true"],
     "model.tie_embeddings=true with pipeline_parallel=2: the embedding and the head live on different stages"),
    (["+strategy=pp", "train.micro_batch_size=6"],
     "strategy.pp_microbatches=4 must divide the sequences per rank and step, "
     "train.micro_batch_size x train.grad_accum = 6"),
    (["+strategy=pp", "strategy.pp_microbatches=1"],
     "strategy.pp_microbatches=1 < pipeline_parallel=2: 1F1B needs at least one micro-batch per stage"),
    (["+strategy=pp", "cluster.gpus_per_node=4", "strategy.pipeline_parallel=4", "strategy.data_parallel=none",
      "model.n_layers=8", "strategy.pp_schedule=interleaved_1f1b", "strategy.pp_microbatches=9",
      "train.micro_batch_size=9"],
     "strategy.pp_microbatches=9 with interleaved_1f1b and pipeline_parallel=4 must be a multiple of the rounds"),
    (["+strategy=zero3", "strategy.compile=true"],
     "strategy 'zero3': strategy.compile=true with DeepSpeed ZeRO-3 (zero_stage=3): its parameter gathers hook "
     "every submodule and fail on compiled blocks; set strategy.compile=false, or use +strategy=fsdp"),
    (["+strategy=zero3_offload", "strategy.compile=true"],
     "strategy 'zero3_offload': strategy.compile=true with DeepSpeed ZeRO-3"),
])
def test_refused(overrides, message):
    cfg = compose_run(overrides)
    with pytest.raises(ConfigError, match=re.escape(message)):
        check_supported(cfg, build_layout(cfg))


# shape: (pp, dp_replicate, dp_shard, cp, tp), the mesh's axes outermost first
@pytest.mark.parametrize("strategy,ranks,shape", [
    ("tp", 2, (1, 1, 1, 1, 2)), ("tp", 8, (1, 4, 1, 1, 2)), ("fsdp_tp", 2, (1, 1, 1, 1, 2)),
    ("fsdp_tp", 8, (1, 1, 4, 1, 2)), ("hsdp", 4, (1, 1, 4, 1, 1)), ("pp", 2, (2, 1, 1, 1, 1)),
    ("pp", 8, (2, 4, 1, 1, 1)), ("pp_fsdp_tp", 4, (2, 1, 1, 1, 2)), ("pp_fsdp_tp", 8, (2, 1, 2, 1, 2)),
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
    assert build_layout(cfg).shape == (1, 3, 4, 1, 1)
    cfg = compose_run(["+strategy=hsdp", "cluster.nodes=2", "cluster.gpus_per_node=8", "strategy.tensor_parallel=2"])
    assert build_layout(cfg).shape == (1, 2, 4, 1, 2)


@pytest.mark.parametrize("gpus,domain", [(1, 1), (2, 2), (4, 4), (8, 8)])
def test_fewer_gpus_per_node_than_the_nvlink_domain_are_one_domain(gpus, domain):
    """A sweep over cluster.gpus_per_node=1,2,4,8 on an 8-GPU NVLink profile runs every point."""
    cfg = compose_run(["+cluster=h100x8", f"cluster.gpus_per_node={gpus}", "+strategy=fsdp_tp",
                       f"strategy.tensor_parallel={min(gpus, 2)}"])
    assert cfg.cluster.nvlink_domain == 8
    layout = build_layout(cfg)
    assert layout.nvlink_domain == domain and layout.tp == min(gpus, 2)


def test_gpus_per_node_across_nvlink_islands_is_refused_with_a_fix():
    cfg = compose_run(["+cluster=h100x8", "cluster.gpus_per_node=6", "cluster.nvlink_domain=4"])
    with pytest.raises(ConfigError, match=re.escape("cluster.nvlink_domain=4 must divide cluster.gpus_per_node=6 "
                                                    "(GPUs of a node in NVLink islands of 4); use cluster.gpus_per_node "
                                                    "as a multiple of 4, or cluster.nvlink_domain=3")):
        build_layout(cfg)
