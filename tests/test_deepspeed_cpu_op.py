"""DeepSpeed on CPU joins the process group without building its shared-memory op: the
build is a C++ compile per fresh environment and, killed midway, leaves a lock on which
every later DeepSpeed start waits forever (train/strategies/deepspeed.py)."""
from __future__ import annotations

import pytest

pytest.importorskip("deepspeed")


def test_the_cpu_shm_op_is_neither_built_nor_loaded(monkeypatch):
    import importlib

    ds_torch = importlib.import_module("deepspeed.comm.torch")  # deepspeed.comm.torch is also torch
    from deepspeed.ops.op_builder.cpu import ShareMemCommBuilder

    def no_build(self, *args, **kwargs):
        raise AssertionError("deepspeed_shm_comm was built")

    monkeypatch.setattr(ShareMemCommBuilder, "load", no_build)
    monkeypatch.setattr(ShareMemCommBuilder, "jit_load", no_build)
    import deepspeed.ops

    table = deepspeed.ops.__compatible_ops__
    monkeypatch.setitem(table, "deepspeed_shm_comm", table.get("deepspeed_shm_comm", True))
    from deepspeed.accelerator import get_accelerator

    if get_accelerator().device_name() != "cpu":
        pytest.skip("DeepSpeed's accelerator here is not its CPU one")
    monkeypatch.setitem(table, "deepspeed_shm_comm", True)
    with pytest.raises(AssertionError, match="was built"):  # without the mark DeepSpeed builds it
        ds_torch.build_shm_op()
    from train.strategies.deepspeed import without_cpu_shm_op

    without_cpu_shm_op()
    assert ds_torch.build_shm_op() is None
