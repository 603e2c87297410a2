"""The async save's snapshot (train.checkpoint.async_save.Snapshot): copies, not references, in
host buffers that the next save reuses. DTensor shards and the order against the
optimizer step: tests/test_checkpoint.py and tests/test_resume_strategies.py."""
from __future__ import annotations

import collections

import pytest
import torch

from train.checkpoint.async_save import Snapshot as _Snapshot


Pair = collections.namedtuple("Pair", "tensor count")


def state():
    w = torch.randn(4, 6)
    return {"model": {"w": w, "wt": w.t(), "half": torch.arange(5, dtype=torch.bfloat16)},
            "optim": {"state": {"w": {"step": torch.tensor(3.0), "exp_avg": torch.zeros(4, 6)}},
                      "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.95), "params": ["w"]}]},
            "extra": Pair(torch.ones(2), 7)}


def test_snapshot_is_a_copy_and_reuses_its_buffers():
    live = state()
    snap = _Snapshot()
    first = snap.take(live)
    assert first["optim"]["param_groups"] == live["optim"]["param_groups"]
    assert isinstance(first["optim"]["param_groups"][0]["betas"], tuple)
    assert isinstance(first["extra"], Pair) and first["extra"].count == 7 and torch.equal(first["extra"].tensor,
                                                                                           live["extra"].tensor)
    for key in ("w", "wt", "half"):
        assert torch.equal(first["model"][key], live["model"][key]) and first["model"][key].dtype == live["model"][key].dtype
        assert first["model"][key].data_ptr() != live["model"][key].data_ptr()
    assert first["model"]["wt"].stride() == live["model"]["wt"].stride()  # the source's layout, as DCP saw it
    before = {k: v.clone() for k, v in first["model"].items()}
    live["model"]["w"].add_(1)  # the optimizer steps after the snapshot
    live["optim"]["state"]["w"]["step"].add_(1)
    live["optim"]["param_groups"][0]["params"].append("x")  # a mutable plain value changes
    assert all(torch.equal(first["model"][k], before[k]) for k in before)
    assert first["optim"]["state"]["w"]["step"].item() == 3.0
    assert first["optim"]["param_groups"][0]["params"] == ["w"]
    second = snap.take(live)
    assert second["model"]["w"].data_ptr() == first["model"]["w"].data_ptr()  # reused, not allocated again
    assert torch.equal(second["model"]["w"], live["model"]["w"])
    assert second["optim"]["state"]["w"]["step"].item() == 4.0
    live["model"]["w"] = torch.randn(2, 2)  # a tensor whose shape changed gets a new buffer
    assert snap.take(live)["model"]["w"].shape == (2, 2)


@pytest.fixture
def one_rank():
    """A 1-rank process group (DTensors need one); destroyed afterwards."""
    import torch.distributed as dist

    backend = "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def sharded(device: str):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh(device, (1,))
    return distribute_tensor(torch.randn(8, 4, device=device), mesh, [Shard(0)])


def test_snapshot_of_a_dtensor_keeps_its_sharding(one_rank):
    from torch.distributed.tensor import DTensor

    live = {"w": sharded("cpu")}
    taken = _Snapshot().take(live)["w"]
    assert isinstance(taken, DTensor) and taken.placements == live["w"].placements
    assert taken.device_mesh == live["w"].device_mesh and taken.shape == live["w"].shape
    assert torch.equal(taken.to_local(), live["w"].to_local())
    assert taken.to_local().data_ptr() != live["w"].to_local().data_ptr()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_snapshot_of_gpu_tensors_lands_in_pinned_host_memory(one_rank):
    live = {"w": torch.randn(256, 256, device="cuda"), "b": torch.randn(7), "h": torch.ones(3, device="cuda").half(),
            "d": sharded("cuda")}
    taken = _Snapshot().take(live)
    for key in ("w", "b", "h"):
        assert taken[key].device.type == "cpu" and torch.equal(taken[key], live[key].cpu())
    assert taken["w"].is_pinned() and not taken["b"].is_pinned()
    local = taken["d"].to_local()  # the shard's host copy: not moved back to the GPU
    assert local.device.type == "cpu" and local.is_pinned() and torch.equal(local, live["d"].to_local().cpu())
