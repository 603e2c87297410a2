"""Layout -> named ``DeviceMesh`` with dims ``("pp", "dp_replicate", "dp_shard", "tp")``.

The mesh is row-major over the layout's axes and ranks are numbered node-major, so
the innermost dim (tp) takes consecutive ranks of one node and the outer dims (pp,
dp_replicate) step across nodes (see :mod:`spec.layout`). Every dim is kept, size 1
included, so a strategy slices ``mesh["dp_shard"]`` without asking whether it exists.

The flattened ``dp`` dim (dp_replicate x dp_shard: the ranks that see different data)
comes from :func:`data_parallel_mesh`. torch 2.13 warns that slicing a flattened dim
from the root mesh is going away, so it is not looked up by name: ``_flatten`` (private,
as torchtitan uses it; fenced in :mod:`train.torch_compat`) is cached per name, and
calling it again returns the same mesh.
"""
from __future__ import annotations

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from spec.layout import AXES, Layout
from train.torch_compat import flatten_mesh  # DeviceMesh._flatten: private, checked there


def build_mesh(layout: Layout, device_type: str) -> DeviceMesh:
    """The job's mesh; every rank of the default process group must call it (collective)."""
    import torch.distributed as dist

    if dist.get_world_size() != layout.world_size:
        raise RuntimeError(f"process group has {dist.get_world_size()} ranks but the layout needs "
                           f"{layout.world_size} ({layout.describe()})")
    return init_device_mesh(device_type, layout.shape, mesh_dim_names=AXES)


def data_parallel_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """1D mesh over dp_replicate x dp_shard (same for every caller; collective on first use)."""
    return flatten_mesh(mesh["dp_replicate", "dp_shard"], "dp")


def dp_mesh(mesh: DeviceMesh, layout: Layout) -> DeviceMesh:
    """The mesh FSDP shards over: 2D (replicate, shard) for HSDP, else the 1D shard dim."""
    if layout.dp_replicate_enabled:
        return mesh["dp_replicate", "dp_shard"]
    return mesh["dp_shard"]
