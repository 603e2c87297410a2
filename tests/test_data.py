"""The resumable, rank-sharded loader."""
from __future__ import annotations

import numpy as np
import torch

from spec.config import DataConfig
from train.data import ShardedLoader, token_file


def _loader(tmp_path, dp_rank=0, dp_size=1, micro=4, accum=1):
    cfg = DataConfig(num_tokens=20_000, cache_dir=str(tmp_path))
    return ShardedLoader(token_file(cfg, 256), 256, 16, micro, accum, dp_rank, dp_size, seed=7)


def test_generated_data_is_deterministic_and_cached(tmp_path):
    cfg = DataConfig(num_tokens=5_000, cache_dir=str(tmp_path))
    path = token_file(cfg, 256)
    first = np.fromfile(path, dtype=np.uint16)
    path.unlink()
    assert np.array_equal(first, np.fromfile(token_file(cfg, 256), dtype=np.uint16))
    assert first.max() < 256


def test_ranks_partition_the_global_batch(tmp_path):
    single = _loader(tmp_path, micro=8).next_step()[0][0]
    halves = [_loader(tmp_path, r, 2, micro=4).next_step()[0][0] for r in range(2)]
    assert torch.equal(torch.cat(halves), single)


def test_resume_continues_the_stream(tmp_path):
    a = _loader(tmp_path)
    for _ in range(3):
        a.next_step()
    expected = a.next_step()[0][0]
    b = _loader(tmp_path)
    b.load_state_dict({"step": 3})
    assert torch.equal(b.next_step()[0][0], expected)


def test_targets_are_inputs_shifted(tmp_path):
    (inputs, targets), = _loader(tmp_path).next_step()
    assert torch.equal(inputs[:, 1:], targets[:, :-1])


def test_epochs_wrap_with_a_new_order(tmp_path):
    loader = _loader(tmp_path)
    per_epoch = loader.num_windows // loader.global_batch
    first = loader.next_step()[0][0]
    loader.load_state_dict({"step": per_epoch})
    assert not torch.equal(loader.next_step()[0][0], first)


def _take(loader, steps):
    return [[tuple(t.tolist() for t in micro) for micro in loader.next_step()] for _ in range(steps)]


def test_batches_read_ahead_are_the_batches_of_the_next_step_and_leave_the_position(tmp_path):
    plain = _take(_loader(tmp_path, accum=2), 3)
    ahead = _loader(tmp_path, accum=2)
    got = []
    for _ in range(3):
        before = ahead.state_dict()
        ahead.prefetch()
        ahead.prefetch()  # a second call reads nothing new
        assert ahead.state_dict() == before  # a checkpoint taken now is the last step's
        got += _take(ahead, 1)
    assert got == plain
    # A checkpoint of a loader that read ahead resumes at the step after the last one taken.
    ahead.prefetch()
    again = _loader(tmp_path, accum=2)
    again.load_state_dict(ahead.state_dict())
    assert _take(again, 1) == _take(ahead, 1)


def test_batches_read_ahead_are_dropped_when_the_position_changes(tmp_path):
    first = _loader(tmp_path)
    expected = _take(_loader(tmp_path), 1)
    first.next_step()
    first.prefetch()  # read at step 1
    first.load_state_dict({"step": 0, "samples": 0})  # a restore moves the position back
    assert _take(first, 1) == expected


def test_pinned_batches_when_asked(tmp_path, monkeypatch):
    pinned = []

    def pin_memory(self):  # this CPU build cannot pin; the loader asks for it
        pinned.append(tuple(self.shape))
        return self.clone()

    monkeypatch.setattr(torch.Tensor, "pin_memory", pin_memory)
    loader = _loader(tmp_path, micro=2, accum=2)
    loader.next_step()
    assert pinned == []
    loader.pin = True
    loader.prefetch()
    assert pinned == [(2, 16)] * 4  # inputs and targets of both micro-batches
    assert len(loader.next_step()) == 2 and len(pinned) == 4  # handed out, not read twice
