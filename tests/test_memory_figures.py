"""Memory figures users can act on: each metrics row's memory is its own
step's, allocated and reserved; the CUDA allocator gets expandable segments unless the
user chose its settings. CUDA is stood in for where the figures come from (torch.cuda's
counters), so this runs on CPU."""
from __future__ import annotations

import json

import torch

from helpers import trained_in_process
from train import metrics


def test_expandable_segments_unless_the_allocator_was_configured():
    env = {}
    assert metrics.allocator_env_defaults(env) == {"PYTORCH_ALLOC_CONF": "expandable_segments:True"}
    assert env == {"PYTORCH_ALLOC_CONF": "expandable_segments:True"}
    for name in ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF"):  # the user's, under either name
        env = {name: "backend:cudaMallocAsync"}
        assert metrics.allocator_env_defaults(env) == {} and env == {name: "backend:cudaMallocAsync"}


def test_cuda_peaks_are_read_and_reset_from_the_allocator(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda d: 7 * 2**30)
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda d: 9 * 2**30)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda d: calls.append(d))
    cuda = torch.device("cuda", 0)
    assert metrics.peak_memory_bytes(cuda) == 7 * 2**30 and metrics.peak_reserved_bytes(cuda) == 9 * 2**30
    metrics.reset_peaks(cuda)
    assert calls == [cuda]
    cpu = torch.device("cpu")
    metrics.reset_peaks(cpu)
    assert calls == [cuda] and metrics.peak_reserved_bytes(cpu) is None and metrics.peak_memory_bytes(cpu) > 0


def train_counting_resets(rank: int, run_dir: str, out: str) -> None:
    """The trainer in this process, with the device's peaks as CUDA would give them: a
    counter that only a reset lowers."""
    import train.loop
    from train.main import run
    from train.strategies import base

    seen = {"resets": 0, "peak": 0}

    def reset(device):
        seen["resets"] += 1
        seen["peak"] = 0

    def reserved(self):
        seen["peak"] += 1000  # grows within a step, as a step's allocations would
        return seen["peak"]

    train.loop.reset_peaks = reset
    base.DeviceMemory.peak_reserved_bytes = reserved
    code = run(run_dir)
    with open(out, "w") as f:
        json.dump({"code": code, "resets": seen["resets"]}, f)


def test_each_row_has_its_own_steps_peaks(tmp_path):
    out, rows, _ = trained_in_process(tmp_path, train_counting_resets, ["train.steps=3"])
    assert out == {"code": 0, "resets": 3}
    assert [r["peak_reserved_bytes"] for r in rows] == [1000, 1000, 1000]  # reset as each step began
    assert all(r["peak_mem_bytes"] > 0 for r in rows)


def test_cpu_rows_carry_no_reserved_figure():
    from spec.rundir import MetricsRow

    row = MetricsRow(step=1, peak_mem_bytes=1, peak_reserved_bytes=metrics.peak_reserved_bytes(torch.device("cpu")))
    assert "peak_reserved_bytes" not in row.as_dict() and row.as_dict()["peak_mem_bytes"] == 1
