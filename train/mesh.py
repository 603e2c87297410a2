"""Layout -> named ``DeviceMesh`` with dims ``("pp", "dp_replicate", "dp_shard", "cp", "tp")``.

The mesh is row-major over the layout's axes and ranks are numbered node-major, so
the innermost dim (tp) takes consecutive ranks of one node and the outer dims (pp,
dp_replicate) step across nodes (see :mod:`spec.layout`). Every dim is kept, size 1
included, so a strategy slices ``mesh["dp_shard"]`` without asking whether it exists.

The flattened ``dp`` dim (dp_replicate x dp_shard: the ranks that see different data)
comes from :func:`data_parallel_mesh`. torch 2.13 warns that slicing a flattened dim
from the root mesh is going away, so it is not looked up by name: ``_flatten`` (private,
as torchtitan uses it; fenced in :mod:`train.torch_compat`) is cached per name, and
calling it again returns the same mesh.

Context parallel (``cp``, train/context_parallel.py): the cp ranks hold the same batch and
different slices of its sequences, so their gradients are parts of one sum: they are
reduced over the data-parallel ranks and the cp ranks together, as torchtitan does. DDP
reduces over the flattened ``dp_cp`` (:func:`data_parallel_mesh`), FSDP shards over
``dp_shard_cp`` = dp_shard x cp (:func:`dp_mesh`; HSDP: (dp_replicate, dp_shard_cp)). The
loss is divided by the step's targets over dp x cp (``ShardedLoader.loss_share``) for
the gradient averages over both to be the global batch's mean. With cp = 1 the meshes
are the plain ones.
"""
from __future__ import annotations

import warnings

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
    """1D mesh over the ranks that average gradients, dp_replicate x dp_shard (x cp where
    cp > 1); the same for every caller, collective on first use."""
    if mesh["cp"].size() > 1:
        return flatten_mesh(mesh["dp_replicate", "dp_shard", "cp"], "dp_cp")
    return flatten_mesh(mesh["dp_replicate", "dp_shard"], "dp")


def dp_mesh(mesh: DeviceMesh, layout: Layout) -> DeviceMesh:
    """The mesh FSDP shards over: 2D (replicate, shard) for HSDP, else the 1D shard dim;
    the shard dim is dp_shard x cp where cp > 1."""
    if not layout.cp_enabled:
        return mesh["dp_replicate", "dp_shard"] if layout.dp_replicate_enabled else mesh["dp_shard"]
    shard = flatten_mesh(mesh["dp_shard", "cp"], "dp_shard_cp")
    if not layout.dp_replicate_enabled:
        return shard
    with warnings.catch_warnings():
        # torch 2.13 warns that slicing a flattened dim from the root mesh is going away; it has
        # no other way to pair it with dp_replicate yet (torchtitan slices it the same way).
        warnings.filterwarnings("ignore", message="Slicing a flattened dim")
        return mesh["dp_replicate", "dp_shard_cp"]
