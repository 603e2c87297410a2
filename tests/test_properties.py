"""Property-based checks of the layout rules and of bad input (hypothesis).

Every layout either builds with the invariants the mesh relies on, or is refused with
one ConfigError line naming a field; through the CLI, a refused config submits nothing.
"""
from __future__ import annotations

import subprocess
import uuid

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import launcher
from train.config import ConfigError, RunConfig, validate
from train.layout import build_layout

degree = st.sampled_from([-1, 1, 2, 3, 4, 8, 16, 0, -2])


def make(nodes, gpn, pp, rep, shard, tp, engine, zero):
    cfg = RunConfig()
    cfg.cluster.nodes, cfg.cluster.gpus_per_node = nodes, gpn
    s = cfg.strategy
    s.pipeline_parallel, s.dp_replicate, s.dp_shard, s.tensor_parallel = pp, rep, shard, tp
    s.engine, s.zero_stage = engine, zero
    s.data_parallel = "fsdp" if shard != 1 else "ddp"
    cfg.model.n_layers, cfg.model.n_heads, cfg.model.dim = 16, 16, 256
    return cfg


@settings(max_examples=400, deadline=None)
@given(nodes=st.integers(-1, 8), gpn=st.sampled_from([1, 2, 4, 8]), pp=degree, rep=degree, shard=degree,
       tp=degree, engine=st.sampled_from(["torch", "deepspeed"]), zero=st.integers(0, 3))
def test_every_layout_is_valid_or_refused_with_one_line(nodes, gpn, pp, rep, shard, tp, engine, zero):
    cfg = make(nodes, gpn, pp, rep, shard, tp, engine, zero)
    try:
        layout = build_layout(cfg)
    except ConfigError as exc:
        message = str(exc)
        assert "\n" not in message and "=" in message  # names a field and its value
        return
    assert layout.pp * layout.dp_replicate * layout.dp_shard * layout.tp == nodes * gpn
    assert gpn % layout.tp == 0
    for rank in range(layout.world_size):  # every TP group inside one node
        node, _ = layout.placement(rank)
        group_start = rank - layout.coords(rank)["tp"]
        assert layout.placement(group_start)[0] == node
    assert not (engine == "deepspeed" and layout.pp > 1 and zero > 1)


@settings(max_examples=200, deadline=None)
@given(steps=st.integers(-3, 3), mb=st.integers(-2, 2), seq=st.integers(-1, 600),
       precision=st.sampled_from(["auto", "fp32", "bf16", "fp8", ""]))
def test_field_values_are_valid_or_refused(steps, mb, seq, precision):
    cfg = RunConfig()
    cfg.train.steps, cfg.train.micro_batch_size, cfg.train.seq_len = steps, mb, seq
    cfg.strategy.mixed_precision = precision
    ok = steps >= 1 and mb >= 1 and 1 <= seq <= cfg.model.max_seq_len and precision in ("auto", "fp32", "bf16")
    try:
        validate(cfg)
    except ConfigError as exc:
        assert not ok and "\n" not in str(exc)
        return
    assert ok


@pytest.mark.slurm
@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(bad=st.sampled_from(["cluster.nodes=0", "strategy.tensor_parallel=3", "strategy.dp_replicate=5",
                            "train.seq_len=100000", "strategy.mixed_precision=fp8", "train.steps=-1",
                            "strategy.pipeline_parallel=0", "cluster.gpus_per_node=0"]))
def test_refused_configs_submit_nothing(tmp_path, slurm_cluster, bad):
    name = f"refused-{uuid.uuid4().hex[:12]}"  # other tests may submit meanwhile: look for ours only
    proc = launcher(["+cluster=localslurm", bad, f"launcher.job_name={name}"], cwd=tmp_path, env=slurm_cluster,
                    timeout=60)
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert "submitted job" not in proc.stdout
    queued = subprocess.run(["squeue", "-h", "-n", name, "-o", "%i"], env=slurm_cluster, capture_output=True,
                            text=True).stdout.split()
    accounted = subprocess.run(["sacct", "-X", "-n", "--name", name, "-o", "JobID", "-S", "now-300seconds"],
                               env=slurm_cluster, capture_output=True, text=True).stdout.split()
    assert queued == [] and accounted == []
