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
