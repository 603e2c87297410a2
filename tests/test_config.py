"""Tier 1: every group combination composes and converts to the dataclass schema."""
from __future__ import annotations

import itertools

import pytest
from helpers import compose_run as _compose
from launcher.overrides import group_options
from spec.config import ConfigError, ClusterConfig, ModelConfig, RunConfig, StrategyConfig
from spec.layout import build_layout
from train.model import build_model, count_params


CLUSTERS, MODELS, STRATEGIES = group_options("cluster"), group_options("model"), group_options("strategy")


def test_required_groups_exist():
    assert {"local", "localslurm", "a100x8", "h100x8", "h200x8"} <= set(CLUSTERS)
    assert {"tiny", "gpt2_124m", "llama3_1b", "llama3_8b", "llama3_70b"} <= set(MODELS)
    assert "ddp" in STRATEGIES


@pytest.mark.parametrize("cluster,model,strategy", list(itertools.product(CLUSTERS, MODELS, STRATEGIES)))
def test_every_combination_composes(cluster, model, strategy):
    cfg = _compose([f"+cluster={cluster}", f"+model={model}", f"+strategy={strategy}"])
    assert isinstance(cfg, RunConfig) and isinstance(cfg.cluster, ClusterConfig)
    assert isinstance(cfg.model, ModelConfig) and isinstance(cfg.strategy, StrategyConfig)
    assert (cfg.cluster.name, cfg.model.name, cfg.strategy.name) == (cluster, model, strategy)
    s = cfg.strategy
    fixed = max(1, s.pipeline_parallel) * max(1, s.dp_replicate) * max(1, s.dp_shard) * max(1, s.tensor_parallel)
    world = cfg.cluster.nodes * cfg.cluster.gpus_per_node
    if fixed > world:  # e.g. pp_fsdp_tp (pp 2 x tp 2) on the 2 ranks of `local`: refused, naming the sizes
        with pytest.raises(ConfigError, match=f"world {world}"):
            build_layout(cfg)
        return
    build_layout(cfg)  # every other shipped combination is a valid layout


def test_schema_defaults_are_local_tiny_ddp():
    plain = _compose([])
    explicit = _compose(["+cluster=local", "+model=tiny", "+strategy=ddp"])
    assert plain == explicit
    assert (plain.cluster.backend, plain.cluster.gpus_per_node, plain.model.name) == ("local", 2, "tiny")


def test_overrides_reach_the_dataclasses():
    cfg = _compose(["+cluster=a100x8", "cluster.nodes=4", "train.steps=7", "+cluster.env.NCCL_DEBUG=INFO"])
    assert cfg.cluster.nodes == 4 and cfg.train.steps == 7
    assert cfg.cluster.env["NCCL_DEBUG"] == "INFO" and cfg.cluster.peak_tflops_bf16 == 312.0
    assert build_layout(cfg).world_size == 32


@pytest.mark.parametrize("name", ["a100x8", "h100x8", "h200x8"])
def test_gpu_profiles_have_real_fields(name):
    c = _compose([f"+cluster={name}"]).cluster
    assert c.backend == "slurm" and c.accelerator == "gpu" and c.gpus_per_node == 8
    assert c.partition and c.peak_tflops_bf16 and c.gpu_mem_gb and c.inter_node_gbps


@pytest.mark.parametrize("model", MODELS)
def test_param_count_matches_module(model):
    cfg = _compose([f"+model={model}"]).model
    module = build_model(cfg, "meta")
    assert count_params(cfg) == sum(p.numel() for p in module.parameters())


def test_known_model_sizes():
    sizes = {m: count_params(_compose([f"+model={m}"]).model) for m in ("gpt2_124m", "llama3_1b", "llama3_8b")}
    assert 120e6 < sizes["gpt2_124m"] < 130e6
    assert 1.2e9 < sizes["llama3_1b"] < 1.3e9      # Llama 3.2 1B: 1.24 B
    assert 7.9e9 < sizes["llama3_8b"] < 8.1e9      # Llama 3.1 8B: 8.03 B
