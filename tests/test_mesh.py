"""Tier 2: meshes of 64 to 1024 ranks built in one process with the ``fake`` backend.

The fake process group answers every collective locally, so one process can play any
rank of a large job: the mesh it builds is the one that rank would build.
"""
from __future__ import annotations

import pytest
import torch.distributed as dist

from helpers import compose_run
from spec.layout import AXES, build_layout
from train.mesh import build_mesh, data_parallel_mesh, dp_mesh
from train.torch_compat import fake_process_group

# (nodes, gpus_per_node, strategy overrides): 64 .. 1024 ranks.
CASES = [
    (8, 8, ["+strategy=fsdp"]),
    (8, 8, ["+strategy=hsdp", "strategy.tensor_parallel=2"]),
    (16, 8, ["+strategy=fsdp", "strategy.tensor_parallel=8", "strategy.pipeline_parallel=2"]),
    (32, 8, ["+strategy=zero3"]),
    (64, 8, ["+strategy=hsdp", "strategy.tensor_parallel=4", "strategy.pipeline_parallel=4",
             "strategy.dp_replicate=16"]),
    (128, 8, ["+strategy=fsdp", "strategy.tensor_parallel=8", "strategy.pipeline_parallel=8",
              "strategy.dp_replicate=4"]),
    (256, 4, ["+strategy=hsdp", "strategy.tensor_parallel=2", "strategy.pipeline_parallel=2",
              "strategy.dp_replicate=128"]),
]


def _layout(nodes, gpn, overrides):
    # llama3_8b: 32 heads, 8 kv heads, 32 layers, so TP 8 and PP 8 are legal.
    return build_layout(compose_run(["+model=llama3_8b", f"cluster.nodes={nodes}", f"cluster.gpus_per_node={gpn}",
                                     *overrides]))


@pytest.fixture
def fake_world():
    """init(rank, world) joins a fake process group; torn down after the test."""
    yield fake_process_group
    if dist.is_initialized():
        dist.destroy_process_group()


@pytest.mark.parametrize("nodes,gpn,overrides", CASES, ids=[f"{n * g}ranks-{o[0][10:]}" for n, g, o in CASES])
def test_mesh_axes_and_placement(fake_world, nodes, gpn, overrides):
    layout = _layout(nodes, gpn, overrides)
    world = layout.world_size
    assert 64 <= world <= 1024
    for rank in (0, world // 2 + 1, world - 1):
        fake_world(rank, world)
        mesh = build_mesh(layout, "cpu")
        assert mesh.mesh_dim_names == AXES and tuple(mesh.shape) == layout.shape
        assert dict(zip(AXES, mesh.get_coordinate())) == layout.coords(rank)
        # Every TP group (rows of the innermost dim) lies inside one node.
        for group in mesh.mesh.reshape(-1, layout.tp).tolist():
            assert len({r // gpn for r in group}) == 1, group
        # This rank's own groups: the ranks that differ from it only along that axis.
        node = rank // gpn
        tp_group = mesh["tp"].mesh.tolist()
        assert rank in tp_group and {r // gpn for r in tp_group} == {node}
        if gpn % (layout.dp_shard * layout.tp) == 0:  # hsdp: the shard group is inside the node too
            assert {r // gpn for r in mesh["dp_shard"].mesh.tolist()} == {node}
        assert data_parallel_mesh(mesh).size() == layout.dp
        assert dp_mesh(mesh, layout).size() == layout.dp
        assert mesh["pp"].size() == layout.pp


def test_hsdp_shards_inside_a_node_and_replicates_across(fake_world):
    layout = _layout(16, 8, ["+strategy=hsdp", "strategy.tensor_parallel=2"])
    assert (layout.dp_replicate, layout.dp_shard, layout.tp) == (16, 4, 2)
    fake_world(37, layout.world_size)
    mesh = build_mesh(layout, "cpu")
    shard = mesh["dp_shard"].mesh.tolist()
    replicate = mesh["dp_replicate"].mesh.tolist()
    assert {r // 8 for r in shard} == {37 // 8}  # one node
    assert len({r // 8 for r in replicate}) == 16  # one rank per node
    assert dp_mesh(mesh, layout).mesh_dim_names == ("dp_replicate", "dp_shard")


def test_pipeline_stages_go_across_nodes(fake_world):
    layout = _layout(16, 8, ["+strategy=fsdp", "strategy.tensor_parallel=8", "strategy.pipeline_parallel=4"])
    fake_world(0, layout.world_size)
    stages = build_mesh(layout, "cpu")["pp"].mesh.tolist()
    assert len(stages) == 4 and len({r // 8 for r in stages}) == 4


def test_world_size_mismatch_is_refused(fake_world):
    layout = _layout(8, 8, ["+strategy=fsdp"])
    fake_world(0, 32)
    with pytest.raises(RuntimeError, match="process group has 32 ranks but the layout needs 64"):
        build_mesh(layout, "cpu")
