"""NCCL communication defaults and the flight-recorder dump (both inert on CPU/gloo)."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from helpers import compose_run
from train.harness.dist import nccl_env_defaults
from train.harness.watchdog import dump_nccl_trace


def test_defaults_are_set_when_unset(tmp_path):
    env: dict = {}
    applied = nccl_env_defaults(tmp_path / "logs", env)
    assert applied == env
    assert env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1" and env["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1"
    assert env["TORCH_NCCL_TRACE_BUFFER_SIZE"] == env["TORCH_FR_BUFFER_SIZE"] == "2000"
    prefix = str(tmp_path / "logs" / "nccl_trace_rank")
    assert env["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"] == env["TORCH_FR_DUMP_TEMP_FILE"] == prefix
    assert (tmp_path / "logs").is_dir()  # torch writes PREFIX<rank> there on a collective timeout


def test_values_already_set_win_under_either_spelling(tmp_path):
    env = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "3", "TORCH_FR_BUFFER_SIZE": "50", "TORCH_FR_DUMP_TEMP_FILE": "/x/t"}
    applied = nccl_env_defaults(tmp_path, env)
    assert applied == {"TORCH_NCCL_DUMP_ON_TIMEOUT": "1"}
    assert env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "3" and env["TORCH_FR_BUFFER_SIZE"] == "50"
    assert "TORCH_NCCL_TRACE_BUFFER_SIZE" not in env and "TORCH_NCCL_DEBUG_INFO_TEMP_FILE" not in env
    assert "TORCH_NCCL_DEBUG_INFO_TEMP_FILE" not in nccl_env_defaults(None, {})  # no run directory: torch's own


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU path")
def test_dump_is_none_without_cuda_with_or_without_a_gloo_group(tmp_path):
    path = tmp_path / "nccl_trace_rank0.pkl"
    assert dump_nccl_trace(path) is None
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        assert dump_nccl_trace(path) is None
    finally:
        dist.destroy_process_group()
    assert not path.exists()


@pytest.mark.parametrize("cluster", ["local", "localslurm", "a100x8", "h100x8", "h200x8"])
def test_watchdog_fires_before_the_collective_timeout(cluster):
    cfg = compose_run([f"+cluster={cluster}"])
    assert 0 < cfg.cluster.hang_timeout_s < cfg.train.dist_timeout_s
