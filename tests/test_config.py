"""Tier 1: every group combination composes and converts to the dataclass schema."""
from __future__ import annotations

import dataclasses
import itertools

import pytest
from conftest import REPO
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


@pytest.fixture(scope="module")
def composed_models():
    """Each model option composed once: a model file interpolates nothing of the other
    groups (test_model_files_stand_alone), so its section is the same in every combination."""
    return {m: _compose([f"+model={m}"]).model for m in MODELS}


def test_model_files_stand_alone():
    assert not [p.name for p in (REPO / "conf" / "model").glob("*.yaml") if "${" in p.read_text()]


@pytest.mark.parametrize("cluster,strategy", list(itertools.product(CLUSTERS, STRATEGIES)))
def test_every_combination_composes(cluster, strategy, composed_models):
    """Every cluster x strategy through Hydra (a strategy may interpolate the cluster:
    hsdp's dp_replicate is ${cluster.nodes}), with every model: the layout is built, or
    refused naming the sizes where the strategy's fixed degrees exceed the world."""
    base = _compose([f"+cluster={cluster}", f"+strategy={strategy}"])
    assert isinstance(base, RunConfig) and isinstance(base.cluster, ClusterConfig)
    assert isinstance(base.strategy, StrategyConfig)
    assert (base.cluster.name, base.strategy.name) == (cluster, strategy)
    s = base.strategy
    fixed = max(1, s.pipeline_parallel) * max(1, s.dp_replicate) * max(1, s.dp_shard) * max(1, s.tensor_parallel)
    world = base.cluster.nodes * base.cluster.gpus_per_node
    for name, model in composed_models.items():
        cfg = dataclasses.replace(base, model=model)
        assert isinstance(cfg.model, ModelConfig) and cfg.model.name == name
        if fixed > world:  # e.g. pp_fsdp_tp (pp 2 x tp 2) on the 2 ranks of `local`: refused, naming the sizes
            with pytest.raises(ConfigError, match=f"world {world}"):
                build_layout(cfg)
            continue
        build_layout(cfg)  # every other shipped combination is a valid layout


def test_one_whole_combination_composes_as_its_parts():
    """The three groups given together compose to what the parts above assume."""
    whole = _compose(["+cluster=a100x8", "+model=llama3_8b", "+strategy=hsdp"])
    parts = dataclasses.replace(_compose(["+cluster=a100x8", "+strategy=hsdp"]),
                                model=_compose(["+model=llama3_8b"]).model)
    assert whole == parts


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
    # Qwen's totals as their safetensors hold them (q/k/v biases; q/k norms and 128-wide heads)
    assert count_params(_compose(["+model=qwen2_5_0_5b"]).model) == 494_032_768
    assert count_params(_compose(["+model=qwen3_0_6b"]).model) == 596_049_920


@pytest.mark.parametrize("name,per_task", [("a100x8", 15), ("h100x8", 13), ("h200x8", 13)])
def test_gpu_profiles_fit_their_nodes(name, per_task):
    """The node's schedulable CPUs shared by its 8 tasks (cpus_per_task 0), all of each
    node's memory (mem_gb 0) with the node's memory known to the planner."""
    from spec.validate import validate

    c = _compose([f"+cluster={name}"]).cluster
    validate(_compose([f"+cluster={name}"]))
    assert c.cpus_per_task == 0 and c.task_cpus() == per_task and per_task * c.gpus_per_node <= c.cpus_per_node
    assert c.mem_gb == 0 and c.node_mem_gb and c.gpu_binding == "node"


@pytest.mark.parametrize("overrides,expect", [
    (["+cluster=h100x8", "cluster.cpus_per_task=16"],
     "cluster.cpus_per_task=16 x cluster.gpus_per_node=8 = 128 CPUs per node exceeds cluster.cpus_per_node=104, "
     "which Slurm would refuse or hold pending; use cluster.cpus_per_task<=13, or cluster.cpus_per_task=0"),
    (["+cluster=h100x8", "cluster.cpus_per_node=null"], "cluster.cpus_per_task=0 derives each task's CPUs from "
     "cluster.cpus_per_node, which is null; set cluster.cpus_per_node"),
    (["+cluster=h100x8", "cluster.cpus_per_node=4"], "cluster.cpus_per_node=4 leaves no whole CPU to each of the "
     "cluster.gpus_per_node=8 tasks"),
    (["+cluster=h100x8", "cluster.cpus_per_node=-1"], "cluster.cpus_per_node=-1 must be > 0 or null"),
    (["+cluster=h100x8", "cluster.cpus_per_task=-2"], "cluster.cpus_per_task=-2 must be >= 0"),
    (["+cluster=h100x8", "cluster.node_mem_gb=0"], "cluster.node_mem_gb=0 must be > 0 or null"),
    (["+cluster=h100x8", "cluster.mem_gb=4000"], "cluster.mem_gb=4000 exceeds cluster.node_mem_gb=2000, the memory "
     "of one node; use cluster.mem_gb<=2000, or cluster.mem_gb=0"),
    (["+cluster=h100x8", "cluster.gpu_binding=socket"], "cluster.gpu_binding='socket' is not one of node, task"),
    (["+cluster=h100x8", "+cluster.sbatch_extra.mem-per-cpu=8G"], "cluster.sbatch_extra.mem-per-cpu with "
     "cluster.mem_gb=0: sbatch takes one of --mem and --mem-per-cpu"),
    (["+cluster=h100x8", "+cluster.sbatch_extra.gpus-per-task=1"], "the toolkit sets --gpus-per-task itself; use "
     "cluster.gpu_binding=task"),
    (["+cluster=h100x8", "cluster.srun_args=['--gpu-bind=closest']"], "the toolkit sets --gpu-bind itself; use "
     "cluster.gpu_binding"),
])
def test_cpus_memory_and_binding_refused_in_one_line(overrides, expect):
    from spec.validate import validate

    with pytest.raises(ConfigError) as info:
        validate(_compose(overrides))
    assert expect in str(info.value) and "\n" not in str(info.value)


def test_site_default_memory_with_mem_per_cpu_is_accepted():
    from spec.validate import validate

    validate(_compose(["+cluster=h100x8", "cluster.mem_gb=null", "+cluster.sbatch_extra.mem-per-cpu=8G"]))
    assert _compose(["+cluster=localslurm"]).cluster.task_cpus() == 1  # given: not derived
