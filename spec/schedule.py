"""How long a run trains: steps from ``train.steps`` or from ``train.epochs``, and the
warmup from ``optim.warmup_steps`` or ``optim.warmup_ratio``. Pure (no torch): the
launcher prints it at launch and in the dry run, and the trainer runs the same numbers.

An epoch is one pass over the training split's samples (:func:`samples_per_epoch`): the
loader's global stream is epoch after epoch of seeded permutations of them, and a step
takes the next global batch of it (a batch may straddle two epochs; nothing is dropped).
``train.epochs=E`` trains ceil(E x samples per epoch / global batch) steps (E may be
fractional: 0.5 is half a pass). Resumed with another global batch, the run still ends
after ceil(E x samples per epoch) samples: the steps already taken plus those the rest of
the samples need (:func:`schedule`'s ``step`` and ``samples``). Hugging Face's Trainer
counts whole micro-batches per epoch and drops a remainder; here no sample is dropped.
"""
from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import Optional

from spec.batch import global_batch
from spec.config import ConfigError, OptimConfig, RunConfig, TrainConfig
from spec.data import TRAIN_BIN, read_manifest
from spec.layout import Layout
from spec.packing import packed_sequences

DEFAULT_STEPS = TrainConfig().steps
DEFAULT_WARMUP = OptimConfig().warmup_steps


@dataclass(frozen=True)
class Schedule:
    """The run's length and warmup, in optimizer steps."""

    global_batch: int  # samples (sequences) per optimizer step
    samples_per_epoch: Optional[int]  # None: the data cannot be read here (train.epochs off)
    total_steps: int
    warmup_steps: int

    @property
    def steps_per_epoch(self) -> Optional[float]:
        return None if not self.samples_per_epoch else self.samples_per_epoch / self.global_batch

    def epoch(self, samples: int) -> Optional[float]:
        """Epochs done after ``samples`` samples of the global stream (metrics.jsonl's ``epoch``)."""
        return None if not self.samples_per_epoch else samples / self.samples_per_epoch

    def apply(self, cfg: RunConfig) -> RunConfig:
        """``cfg`` with ``train.steps`` and ``optim.warmup_steps`` set to these numbers:
        what the training loop and its learning-rate schedule run."""
        return dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, steps=self.total_steps),
                                   optim=dataclasses.replace(cfg.optim, warmup_steps=self.warmup_steps))


def _itemsize(dtype: str) -> int:
    bits = re.fullmatch(r"u?int(8|16|32|64)", dtype)
    if not bits:
        raise ConfigError(f"data.path: the manifest's dtype {dtype!r} is not an integer type; prepare the data again")
    return int(bits.group(1)) // 8


def train_tokens(cfg: RunConfig) -> int:
    """Tokens of the training split, counted as the loader memory-maps them."""
    d = cfg.data
    if d.source == "markov":
        return d.num_tokens
    if d.source == "tokens":
        path, size = Path(d.path) / TRAIN_BIN, _itemsize(read_manifest(Path(d.path))["dtype"])
    else:  # file: uint16 ids when the vocabulary fits, else uint32 (train/data/loader.py)
        path, size = Path(d.path or ""), 2 if cfg.model.vocab_size <= 65536 else 4
    if not path.is_file():
        raise ConfigError(f"data.path={d.path}: {path} does not exist; point data.path at the token data")
    return path.stat().st_size // size


def samples_per_epoch(cfg: RunConfig) -> int:
    """Samples in one pass over the training split: what an epoch of the loader holds.

    The one place that counts them. Token data: windows of ``train.seq_len`` tokens plus
    the next (ShardedLoader.num_windows). Chat data: one conversation per sample (the
    manifest's ``splits.train.documents``); packed (``data.packing``), the sequences of
    ``train.seq_len`` they fill (spec/packing.py, the loader's own packing)."""
    d = cfg.data
    if d.source == "chat" and d.packing:
        return packed_sequences(Path(d.path), cfg.train.seq_len)
    if d.source == "chat":
        return int(read_manifest(Path(d.path))["splits"]["train"]["documents"])
    return max(0, (train_tokens(cfg) - 1) // cfg.train.seq_len)


def _exact(x: float) -> Fraction:
    return Fraction(repr(float(x)))  # 0.1 is 1/10, not the nearest binary float


def schedule(cfg: RunConfig, layout: Layout, step: int = 0, samples: int = 0) -> Schedule:
    """The schedule of ``cfg`` on ``layout``; ``step`` and ``samples``: where a resumed
    run's loader stands (under ``train.epochs`` the run ends after the same samples)."""
    t, o = cfg.train, cfg.optim
    batch = global_batch(cfg, layout)[0]
    try:
        per_epoch: Optional[int] = samples_per_epoch(cfg)
    except (OSError, KeyError, ValueError) as exc:  # ConfigError is a ValueError
        if t.epochs > 0:
            raise exc if isinstance(exc, ConfigError) else ConfigError(
                f"train.epochs={t.epochs:g}: the samples of data.path={cfg.data.path} cannot be counted "
                f"({type(exc).__name__}: {exc}); prepare the data again") from None
        per_epoch = None  # steps do not need it; the epoch is then not reported
    if t.epochs > 0:
        if not per_epoch:
            raise ConfigError(f"train.epochs={t.epochs}: the training data holds no sample of train.seq_len="
                              f"{t.seq_len} tokens; use more data or a shorter train.seq_len")
        target = math.ceil(_exact(t.epochs) * per_epoch)
        total = step + -(-max(0, target - samples) // batch)  # integer ceil
    else:
        total = t.steps
    warmup = o.warmup_steps if o.warmup_ratio is None else math.ceil(_exact(o.warmup_ratio) * total)
    return Schedule(global_batch=batch, samples_per_epoch=per_epoch, total_steps=max(total, 1), warmup_steps=warmup)


def schedule_line(cfg: RunConfig, s: Schedule) -> str:
    """What the launch and the dry run print under the global batch line."""
    t, o = cfg.train, cfg.optim
    steps = f"train.epochs={t.epochs:g}" if t.epochs > 0 else f"train.steps={t.steps}"
    warm = f"optim.warmup_ratio={o.warmup_ratio:g}" if o.warmup_ratio is not None else "optim.warmup_steps"
    if s.samples_per_epoch:
        epochs = s.total_steps * s.global_batch / s.samples_per_epoch
        data = (f"samples per epoch {s.samples_per_epoch:,} = {s.steps_per_epoch:,.1f} steps of {s.global_batch}; "
                f"{s.total_steps} steps ({steps}) = {epochs:.4g} epochs")
    else:
        data = f"samples per epoch unknown (the data is not readable here); {s.total_steps} steps ({steps})"
    return f"schedule: {data}; warmup {s.warmup_steps} steps ({warm})"


def check_length(cfg: RunConfig) -> None:
    """The length and the warmup are each set one way (layout-free: spec.validate calls it)."""
    t, o = cfg.train, cfg.optim
    if t.epochs > 0 and t.steps != DEFAULT_STEPS:
        raise ConfigError(f"train.epochs={t.epochs:g} and train.steps={t.steps} both set the run's length; keep one "
                          f"(train.epochs derives the steps from the data and the global batch: drop train.steps, "
                          f"or set train.epochs=0)")
    if o.warmup_ratio is not None:
        if not (o.warmup_ratio == o.warmup_ratio and 0 <= o.warmup_ratio < 1):
            raise ConfigError(f"optim.warmup_ratio={o.warmup_ratio} must be in [0, 1) (a fraction of the run's "
                              "steps); set e.g. optim.warmup_ratio=0.03, or null to use optim.warmup_steps")
        if o.warmup_steps != DEFAULT_WARMUP:
            raise ConfigError(f"optim.warmup_ratio={o.warmup_ratio:g} and optim.warmup_steps={o.warmup_steps} both set "
                              "the warmup; keep one (drop optim.warmup_steps, or set optim.warmup_ratio=null)")
