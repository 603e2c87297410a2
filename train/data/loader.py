"""Token data and a resumable, rank-sharded loader.

The data is a flat array of token ids on disk (numpy memmap). The ``markov`` source
generates one deterministically (a seeded first-order Markov chain in which every token
has a few likely successors, so a model can learn it and the loss falls towards
ln(branching)), and a held-out walk of the same chain for validation; ``file`` reads a
user's pre-tokenised file; ``tokens`` reads the train/val split that
``python -m train.data.prepare`` wrote (its manifest gives the dtype). Nothing is
downloaded.

The loader is a pure function of (seed, position in global samples): the global stream
is epoch after epoch of seeded permutations of all windows (epoch ``e``: samples
``e*W .. e*W+W-1``, W = windows in the file), and an optimizer step takes the next G
samples of it (G = global batch in samples = micro x accum x dp; a batch may straddle
two epochs), data-parallel rank ``r`` its contiguous slice. The position it keeps
(:class:`LoaderState`) is the step and the global sample index ``k``, so a resume at
any data-parallel degree continues at sample ``k``: nothing skipped, nothing repeated.
With the same global batch every world size sees the same batches; resumed with another
global batch, step ``s`` takes samples ``k .. k+G'-1`` (the step count goes on, the
samples do not restart). A 2-rank run and a 1-rank run with the same global batch see
identical data.

Context parallel (``strategy.cp``, train/context_parallel.py): the cp ranks of one
data-parallel rank read the same samples and each keeps its contiguous slice of every
sequence's inputs and targets (``cp_rank``); packed data's positions stay whole, for
RoPE and the document mask over the whole sequence after the all-to-all.
"""
from __future__ import annotations

import fcntl
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Optional

import numpy as np
import torch

from spec.config import DataConfig
from spec.data import MANIFEST, TRAIN_BIN, VAL_BIN
from train.context_parallel import sequence_slice


def _dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16 if vocab_size <= 65536 else np.uint32)


def _cache_dir(cfg: DataConfig) -> Path:
    if cfg.cache_dir:
        return Path(cfg.cache_dir)
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "slurm-torch-orchestrator"


def generate_markov(num_tokens: int, vocab_size: int, branching: int, seed: int,
                    walk_seed: Optional[int] = None) -> np.ndarray:
    """A walk of the seed's chain; ``walk_seed`` draws another walk of the same chain
    (the validation split), else the training stream."""
    rng = np.random.default_rng(seed)
    successors = rng.integers(0, vocab_size, size=(vocab_size, branching))
    # Skewed successor probabilities make the stream more learnable than uniform.
    probs = rng.dirichlet(np.ones(branching) * 2.0, size=vocab_size)
    cum = probs.cumsum(axis=1)
    if walk_seed is not None:
        rng = np.random.default_rng([seed, walk_seed])
    out = np.empty(num_tokens, dtype=_dtype(vocab_size))
    u = rng.random(num_tokens)
    tok = int(rng.integers(0, vocab_size))
    for i in range(num_tokens):
        out[i] = tok
        tok = int(successors[tok, min(int(np.searchsorted(cum[tok], u[i])), branching - 1)])
    return out


def manifest(cfg: DataConfig) -> Dict[str, Any]:
    """The manifest of a prepared directory (``data.source=tokens``)."""
    return json.loads((Path(cfg.path) / MANIFEST).read_text())


def file_dtype(cfg: DataConfig, vocab_size: int) -> np.dtype:
    if cfg.source == "tokens":
        return np.dtype(manifest(cfg)["dtype"])
    return _dtype(vocab_size)


def token_file(cfg: DataConfig, vocab_size: int) -> Path:
    """Path of the training tokens, generating the markov data once (file-locked across ranks)."""
    if cfg.source == "file":
        if not cfg.path or not Path(cfg.path).is_file():
            raise FileNotFoundError(f"data.path={cfg.path!r} does not exist; point it at a token file")
        return Path(cfg.path)
    if cfg.source == "tokens":
        return Path(cfg.path) / TRAIN_BIN
    return _markov(cfg, vocab_size, cfg.num_tokens, None)


def val_file(cfg: DataConfig, vocab_size: int) -> Optional[Path]:
    """Path of the held-out tokens; None for a plain token file (no split)."""
    if cfg.source == "tokens":
        return Path(cfg.path) / VAL_BIN
    if cfg.source == "markov":
        return _markov(cfg, vocab_size, max(cfg.num_tokens // 20, 20_000), walk_seed=1)
    return None


def _markov(cfg: DataConfig, vocab_size: int, num_tokens: int, walk_seed: Optional[int]) -> Path:
    cache = _cache_dir(cfg)
    cache.mkdir(parents=True, exist_ok=True)
    split = "" if walk_seed is None else f"-val{walk_seed}"
    path = cache / f"markov-v{vocab_size}-b{cfg.branching}-n{num_tokens}-s{cfg.seed}{split}.bin"
    if path.exists():
        return path
    with open(cache / (path.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not path.exists():
            tokens = generate_markov(num_tokens, vocab_size, cfg.branching, cfg.seed, walk_seed)
            tmp = path.with_suffix(f".tmp{os.getpid()}")
            tokens.tofile(tmp)
            os.replace(tmp, path)
    return path


@dataclass
class LoaderState:
    """Everything needed to resume the data stream: the next optimizer step and the index
    of the next sample of the global stream (``samples``, whatever the data-parallel degree)."""

    step: int = 0
    samples: int = 0


class ShardedLoader:
    """Yields (inputs, targets) micro-batches for one data-parallel rank.

    ``trace``: a file to which each step's window ids (this rank's share) are appended as
    ``step id id ...`` lines (fault.trace_samples: tests count the samples of a run)."""

    def __init__(self, path: Path, vocab_size: int, seq_len: int, micro_batch: int, grad_accum: int,
                 dp_rank: int, dp_size: int, seed: int, dtype: Optional[np.dtype] = None,
                 cp_rank: int = 0, cp_size: int = 1) -> None:
        self.tokens = np.memmap(path, dtype=dtype or _dtype(vocab_size), mode="r")
        self.seq_len = seq_len
        self.micro_batch = micro_batch
        self.grad_accum = grad_accum
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.seed = seed
        self.cp_rank, self.cp_size = cp_rank, cp_size
        self.num_windows = self._num_samples()
        self.global_batch = micro_batch * grad_accum * dp_size
        if self.num_windows < self.global_batch:
            raise ValueError(f"data has {self.num_windows} {self.unit} of {seq_len} tokens, fewer than one global "
                             f"batch of {self.global_batch}; give more data (data.num_tokens, data.path) or a "
                             "smaller global batch")
        self.state = LoaderState()
        # Target positions that carry loss in the whole global batch of the step next_step
        # last returned (every micro-batch, every data-parallel rank): the loss is their sum
        # divided by this. Token data: every position; chat data: the unmasked ones.
        self.step_targets = self.global_batch * seq_len
        self.trace: Optional[Path] = None
        self._perms: Dict[int, np.ndarray] = {}
        # Page-locked micro-batches (the loop sets it on CUDA): their non_blocking copies to
        # the device are asynchronous DMA, where copies from pageable memory hold the host.
        self.pin = False
        self._ahead: Optional[tuple] = None  # prefetch(): (samples it was read at, ids, micro-batches)

    #: What one sample is, for messages.
    unit = "windows"

    @property
    def loss_share(self) -> float:
        """What each micro-batch's loss sum is divided by (train/loss.py): the step's
        counted targets over the ranks whose gradients are averaged, dp x cp."""
        return self.step_targets / (self.dp_size * self.cp_size)

    def _num_samples(self) -> int:
        """Samples in an epoch: windows of seq_len tokens plus the next."""
        return (len(self.tokens) - 1) // self.seq_len

    def _rows(self, ids: np.ndarray) -> tuple[torch.Tensor, ...]:
        """(inputs, targets) of samples ``ids``: [n, seq_len] each."""
        rows = np.stack([self.tokens[i * self.seq_len:i * self.seq_len + self.seq_len + 1] for i in ids])
        data = torch.from_numpy(rows.astype(np.int64))
        return data[:, :-1], data[:, 1:]

    def _count_targets(self, start: int) -> int:
        """Target positions carrying loss in global samples ``start .. start+G-1``."""
        return self.global_batch * self.seq_len

    def _perm(self, epoch: int) -> np.ndarray:
        if epoch not in self._perms:
            if len(self._perms) > 1:  # a batch spans two epochs at most
                self._perms.pop(min(self._perms))
            self._perms[epoch] = np.random.default_rng([self.seed, epoch]).permutation(self.num_windows)
        return self._perms[epoch]

    def stream(self, start: int, count: int) -> np.ndarray:
        """Window ids of global samples ``start .. start+count-1``."""
        out, k = [], start
        while k < start + count:
            epoch, within = divmod(k, self.num_windows)
            take = min(start + count - k, self.num_windows - within)
            out.append(self._perm(epoch)[within:within + take])
            k += take
        return np.concatenate(out)

    def _window_ids(self) -> np.ndarray:
        per_rank = self.micro_batch * self.grad_accum
        return self.stream(self.state.samples + self.dp_rank * per_rank, per_rank)

    def prefetch(self) -> None:
        """Read the next step's micro-batches now, without moving the data position: the
        training loop calls it once a step's work is queued, so on a GPU the host reads (and
        pins) the next batches while the device still runs the step, not between the step's
        end and the next one's start. :meth:`next_step` hands them out; until then the state
        (and a checkpoint of it) is the last step's."""
        if self._ahead is None or self._ahead[0] != self.state.samples:
            ids = self._window_ids()
            self._ahead = (self.state.samples, ids, self._micro(ids))

    def _micro(self, ids: np.ndarray) -> list[tuple[torch.Tensor, ...]]:
        columns = self._rows(ids)  # (inputs, targets), packed chat data: and positions
        if self.cp_size > 1:  # this cp rank's slice of inputs and targets; positions whole
            part = sequence_slice(self.seq_len, self.cp_rank, self.cp_size)
            columns = tuple(c[:, part] if i < 2 else c for i, c in enumerate(columns))
        micro = []
        for k in range(self.grad_accum):
            part = slice(k * self.micro_batch, (k + 1) * self.micro_batch)
            micro.append(tuple(c[part].contiguous().pin_memory() if self.pin else c[part].contiguous() for c in columns))
        return micro

    def next_step(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The grad_accum micro-batches of the next optimizer step (:meth:`prefetch`'s when it
        read them at this position); advances the state."""
        ahead, self._ahead = self._ahead, None
        if ahead is not None and ahead[0] == self.state.samples:
            _, ids, micro = ahead
        else:
            ids = self._window_ids()
            micro = self._micro(ids)
        if self.trace is not None:
            with open(self.trace, "a") as f:
                f.write(f"{self.state.step + 1} {' '.join(map(str, ids.tolist()))}\n")
        self.step_targets = self._count_targets(self.state.samples)
        self.state.step += 1
        self.state.samples += self.global_batch
        return micro

    def sample_kind(self) -> str:
        """What a global sample index counts: a position saved by a loader that counts
        something else (chat data packed or not; packed at another train.seq_len) means
        other samples here."""
        return self.unit

    def state_dict(self) -> dict:
        return {"step": self.state.step, "samples": self.state.samples, "global_batch": self.global_batch,
                "samples_are": self.sample_kind()}

    def load_state_dict(self, state: dict) -> None:
        """Resume at ``state``'s step and global sample (a state without ``samples``,
        from before the loader kept it: the step x this loader's global batch). A state
        whose samples are another kind than this loader's is refused (ValueError)."""
        kind = state.get("samples_are")
        if kind is not None and kind != self.sample_kind():
            raise ValueError(f"the checkpoint's data position counts {kind}, this run's data {self.sample_kind()}: "
                             "resume with the data.packing and train.seq_len it was saved with")
        self._ahead = None
        self.state.step = int(state["step"])
        samples = state.get("samples")
        self.state.samples = int(samples) if samples is not None else self.state.step * self.global_batch
