"""Tier 1: the sweep's fast paths give what the slow, general ones give."""
from __future__ import annotations

import itertools

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra

from helpers import strategy_options
from launcher.compose import run_config
from launcher.launch import config_yaml
from launcher.overrides import CONF_DIR, group_options
from spec.config import to_run_config, to_yaml

# Every option of every group at least once (cycling the shorter lists).
_N = max(len(group_options(g)) for g in ("cluster", "model", "strategy"))
COMBOS = [[f"+cluster={c}", f"+model={m}", f"+strategy={s}"] for c, m, s in itertools.islice(zip(
    itertools.cycle(group_options("cluster")), itertools.cycle(group_options("model")),
    itertools.cycle(strategy_options())), _N)]


# Strings YAML would read as other types must come back as the same strings.
TRICKY = ["launcher.job_name='a b;$(x) \"q\"'", "+cluster.env.Y='null'", "+cluster.env.Z='1e3'", "data.path='yes'",
          "cluster.setup=['module load x', '0x10', '~']"]


@pytest.mark.parametrize("overrides", [[], ["cluster.nodes=3", "train.seed=7", "+cluster.env.X=1"], TRICKY, *COMBOS])
def test_typed_conversion_equals_the_schema_merge(overrides):
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        dcfg = compose("config", overrides=overrides)
    cfg = run_config(dcfg)
    assert cfg == to_run_config(dcfg)
    assert config_yaml(cfg, {}) == to_yaml(cfg)


SWEEP = [["+cluster=localslurm", "cluster.nodes=2", "train.seed=3"],
         ["+cluster=a100x8", "+strategy=fsdp", "cluster.nodes=1", "+cluster.env.NCCL_DEBUG=INFO"],
         ["+cluster=localslurm", "~fault", "train.steps=5"],
         ["+model=tiny", "optim.lr=0.5", "cluster.setup=[a,b]"],
         ["+cluster=localslurm", "launcher.root=elsewhere", "train.seed=4"]]  # composed in full


@pytest.fixture()
def hydra_loader():
    from hydra.core.global_hydra import GlobalHydra

    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        yield GlobalHydra.instance().config_loader()


def _master(loader):
    from hydra.types import RunMode

    return loader.load_configuration("config", overrides=["train.seed=1,2"], run_mode=RunMode.MULTIRUN)


def test_points_compose_as_hydra_composes_each(hydra_loader):
    import os
    from pathlib import Path

    from omegaconf import OmegaConf, open_dict

    from launcher.compose import PointComposer

    master = _master(hydra_loader)
    composer = PointComposer(master, hydra_loader)
    for num, overrides in enumerate(SWEEP):
        point = composer.point(num, overrides)
        full = hydra_loader.load_sweep_config(master, overrides)  # what Hydra's basic launcher does
        with open_dict(full.hydra.job):
            full.hydra.job.num = num
        assert point.error is None, point.error
        assert point.run_dir == Path(os.path.join(str(full.hydra.sweep.dir), str(full.hydra.sweep.subdir))).resolve()
        expected = OmegaConf.to_container(full, resolve=True)
        del expected["hydra"]
        assert point.cfg == to_run_config(expected)
    assert "elsewhere" in str(composer.point(9, SWEEP[-1]).run_dir)
    assert len(composer.bases) == 3  # one composition per combination of groups
    # Points are applied to the shared base in place: it must come back as composed,
    # also after an override that failed half-way (nodes set, then a bad seed).
    assert composer.point(10, ["+cluster=localslurm", "cluster.nodes=3", "train.seed=x"]).error
    for groups, (base, *_rest) in composer.bases.items():
        fresh = OmegaConf.to_container(hydra_loader.load_sweep_config(master, list(groups)), resolve=False)
        del fresh["hydra"]
        assert OmegaConf.to_container(base, resolve=False) == fresh


def test_a_point_that_does_not_compose_is_an_error_not_an_exception(hydra_loader):
    from launcher.compose import PointComposer

    composer = PointComposer(_master(hydra_loader), hydra_loader)
    bad = [composer.point(0, ["cluster.nodes=many"]), composer.point(1, ["+strategy=nope"]),
           composer.point(2, ["train.nope=1"])]
    assert all(p.cfg is None and p.error for p in bad), [p.error for p in bad]
    assert "nodes" in bad[0].error and bad[0].run_dir.name == "0"
    assert composer.point(3, ["cluster.nodes=2"]).error is None


def test_array_elements_are_named_arrayid_taskid_and_keep_distinct_ports():
    from slurm.env import rendezvous_port, slurm_job_id, task_identity

    env = {"SLURM_JOB_ID": "231", "SLURM_ARRAY_JOB_ID": "231", "SLURM_ARRAY_TASK_ID": "2", "SLURM_STEP_ID": "0",
           "SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_LOCALID": "0", "SLURM_NODEID": "0",
           "SLURM_STEP_NODELIST": "node1"}
    task = task_identity(env)
    assert task.job_id == slurm_job_id(env) == "231_2"  # raw 231 would name the whole array
    assert task.master_port == rendezvous_port("231")
    other = task_identity(dict(env, SLURM_JOB_ID="232", SLURM_ARRAY_TASK_ID="0"))
    assert other.job_id == "231_0" and other.master_port != task.master_port
    assert slurm_job_id({"SLURM_JOB_ID": "7"}) == "7" and slurm_job_id({}) is None
