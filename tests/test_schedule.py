"""train.epochs and optim.warmup_ratio (spec/schedule.py): the samples of an epoch as the
loader counts them, for every data source; the steps and the warmup they derive; the
refusals; a resume mid-epoch (at another data-parallel size, or another global batch)
that sees the samples of an uninterrupted run, epoch after seeded epoch.
(The launch's and the dry run's lines, and the metrics rows' ``epoch``: tests/test_tracking.py.)
"""
from __future__ import annotations

import json
import math

import numpy as np
import pytest

from spec.config import ConfigError, RunConfig
from spec.data import MANIFEST, TRAIN_BIN
from spec.layout import build_layout
from spec.schedule import samples_per_epoch, schedule, schedule_line
from spec.validate import validate


def run_config(gpus: int = 2, micro: int = 8, accum: int = 1, seq_len: int = 16, **data) -> RunConfig:
    cfg = RunConfig()
    cfg.cluster.gpus_per_node = gpus
    cfg.train.micro_batch_size, cfg.train.grad_accum, cfg.train.seq_len = micro, accum, seq_len
    for key, value in data.items():
        setattr(cfg.data, key, value)
    return cfg


def loader_windows(cfg: RunConfig) -> int:
    from train.data import ShardedLoader, file_dtype, token_file

    d, t = cfg.data, cfg.train
    return ShardedLoader(token_file(d, cfg.model.vocab_size), cfg.model.vocab_size, t.seq_len, 1, 1, 0, 1, seed=0,
                         dtype=file_dtype(d, cfg.model.vocab_size)).num_windows


def test_samples_per_epoch_is_the_loaders_for_every_source(tmp_path):
    markov = run_config(num_tokens=3001, cache_dir=str(tmp_path))
    assert samples_per_epoch(markov) == loader_windows(markov) == 3000 // 16
    big = run_config(source="file", path=str(tmp_path / "ids.bin"))  # > 65536 ids: uint32 on disk
    big.model.vocab_size = 70_000
    np.arange(1000, dtype=np.uint32).tofile(tmp_path / "ids.bin")
    assert samples_per_epoch(big) == loader_windows(big) == 999 // 16
    prepared = tmp_path / "prepared"
    prepared.mkdir()
    np.arange(777, dtype=np.uint16).tofile(prepared / TRAIN_BIN)
    (prepared / MANIFEST).write_text(json.dumps({"dtype": "uint16", "vocab_size": 300,
                                                 "splits": {"train": {"documents": 5, "tokens": 777}}}))
    tokens = run_config(source="tokens", path=str(prepared))
    assert samples_per_epoch(tokens) == loader_windows(tokens) == 776 // 16
    chat = run_config(source="chat", path=str(prepared))  # one conversation a sample
    assert samples_per_epoch(chat) == 5


@pytest.mark.parametrize("epochs,steps", [(1.0, 3), (0.5, 2), (2.0, 6), (0.1, 1), (3.0, 8)])
def test_epochs_derive_the_steps(tmp_path, epochs, steps):
    cfg = run_config(num_tokens=41 * 16 + 1, cache_dir=str(tmp_path))  # 41 windows, global batch 16
    cfg.train.epochs = epochs
    s = schedule(cfg, build_layout(cfg))
    assert (s.samples_per_epoch, s.global_batch, s.total_steps) == (41, 16, steps)
    assert s.total_steps == math.ceil(epochs * 41 / 16)  # (3.0: 123 samples = 7.7 batches -> 8)
    applied = s.apply(cfg)
    assert applied.train.steps == steps and cfg.train.steps == 50  # the run's own config is not touched


def test_fractional_epochs_are_exact():
    """1.1 x 100 samples is 110 (one batch of 110), not 110.00000000000001 (two)."""
    cfg = run_config(gpus=1, micro=110, num_tokens=100 * 16 + 1)
    cfg.train.epochs = 1.1
    assert schedule(cfg, build_layout(cfg)).total_steps == 1


def test_warmup_ratio_is_a_share_of_the_steps():
    cfg = run_config(num_tokens=1000 * 16 + 1)
    cfg.optim.warmup_ratio = 0.03
    assert schedule(cfg, build_layout(cfg)).warmup_steps == 2  # ceil(0.03 x 50) = ceil(1.5)
    cfg.train.steps, cfg.optim.warmup_ratio = 100, 0.1
    assert schedule(cfg, build_layout(cfg)).warmup_steps == 10
    cfg.train.steps, cfg.train.epochs = 50, 2.0  # 2000 samples / 16 -> 125 steps
    s = schedule(cfg, build_layout(cfg))
    assert (s.total_steps, s.warmup_steps) == (125, 13) and s.apply(cfg).optim.warmup_steps == 13
    cfg.optim.warmup_ratio = None
    assert schedule(cfg, build_layout(cfg)).warmup_steps == 2  # optim.warmup_steps
    line = schedule_line(cfg, s)
    assert line.startswith("schedule: samples per epoch 1,000 = 62.5 steps of 16; 125 steps (train.epochs=2)")


@pytest.mark.parametrize("fields,expect", [
    ({"train.epochs": 2.0, "train.steps": 100}, "train.epochs=2 and train.steps=100 both set the run's length"),
    ({"optim.warmup_ratio": 0.1, "optim.warmup_steps": 5}, "optim.warmup_ratio=0.1 and optim.warmup_steps=5 both"),
    ({"optim.warmup_ratio": 1.0}, "optim.warmup_ratio=1.0 must be in [0, 1)"),
    ({"optim.warmup_ratio": float("nan")}, "optim.warmup_ratio=nan must be in [0, 1)"),
    ({"train.epochs": -1.0}, "train.epochs=-1.0 must be >= 0"),
])
def test_refusals_name_both_fields(fields, expect):
    cfg = RunConfig()
    for dotted, value in fields.items():
        section, key = dotted.split(".")
        setattr(getattr(cfg, section), key, value)
    with pytest.raises(ConfigError) as err:
        validate(cfg)
    assert expect in str(err.value) and "\n" not in str(err.value)


def test_epochs_need_data_that_can_be_counted(tmp_path):
    cfg = run_config(source="file", path=str(tmp_path / "missing.bin"))
    assert schedule(cfg, build_layout(cfg)).samples_per_epoch is None  # steps need no count
    assert "samples per epoch unknown" in schedule_line(cfg, schedule(cfg, build_layout(cfg)))
    cfg.train.epochs = 1.0
    with pytest.raises(ConfigError, match="missing.bin does not exist"):
        schedule(cfg, build_layout(cfg))
    short = run_config(num_tokens=10)  # not one window of 16 tokens
    short.train.epochs = 1.0
    with pytest.raises(ConfigError, match="holds no sample of train.seq_len=16"):
        schedule(short, build_layout(short))


def _trace_run(tmp_path, name, path, dp, micro, accum, steps, state=None):
    """Global sample ids per step of ``dp`` loaders (their trace files, ranks in order),
    and the state after the last step."""
    from train.data import ShardedLoader

    loaders = [ShardedLoader(path, 256, 16, micro, accum, r, dp, seed=5) for r in range(dp)]
    for r, loader in enumerate(loaders):
        if state is not None:
            loader.load_state_dict(state)
        loader.trace = tmp_path / f"{name}_rank{r}.txt"
    for _ in range(steps):
        for loader in loaders:
            loader.next_step()
    rows = [[line.split() for line in loader.trace.read_text().splitlines()] for loader in loaders]
    per_step = {int(parts[0][0]): [int(i) for part in parts for i in part[1:]] for parts in zip(*rows)}
    return per_step, loaders[0].state_dict()


@pytest.mark.parametrize("after", [(4, 2, 1), (1, 2, 4), (2, 4, 2)])  # (dp, micro, accum) after the resume
def test_a_resume_mid_epoch_sees_the_uninterrupted_samples(tmp_path, after):
    """Global batch 8 over 25 samples an epoch, 2.6 epochs: saved at step 2 (mid epoch 0),
    resumed at another data-parallel size (or a global batch of 16) up to the end the
    schedule gives; every epoch is the seeded permutation of its samples, and the
    ``epoch`` of each step is samples seen / 25."""
    from train.data import token_file

    cfg = run_config(gpus=2, micro=2, accum=2, num_tokens=25 * 16 + 1, cache_dir=str(tmp_path))
    cfg.train.epochs = 2.6  # 65 samples
    path = token_file(cfg.data, 256)
    assert schedule(cfg, build_layout(cfg)).total_steps == 9  # ceil(65 / 8)
    whole, _ = _trace_run(tmp_path, "whole", path, 2, 2, 2, steps=12)
    first, state = _trace_run(tmp_path, "first", path, 2, 2, 2, steps=2)
    dp, micro, accum = after
    resumed = run_config(gpus=dp, micro=micro, accum=accum, num_tokens=25 * 16 + 1, cache_dir=str(tmp_path))
    resumed.train.epochs = 2.6
    s = schedule(resumed, build_layout(resumed), state["step"], state["samples"])
    rest, end = _trace_run(tmp_path, "rest", path, dp, micro, accum, steps=s.total_steps - 2, state=state)
    stream = [i for step in sorted(whole) for i in whole[step]]
    again = [i for part in (first, rest) for step in sorted(part) for i in part[step]]
    assert again == stream[:len(again)] and 65 <= len(again) < 65 + s.global_batch  # ends after 2.6 epochs
    for e in range(2):
        expected = np.random.default_rng([5, e]).permutation(25).tolist()
        assert stream[25 * e:25 * e + 25] == expected and again[25 * e:25 * e + 25] == expected
    assert s.epoch(end["samples"]) == len(again) / 25 and s.epoch(state["samples"]) == 16 / 25
