"""Chat data for training: one conversation per sample (``data.source=chat``).

:class:`ChatLoader` is :class:`~train.data.loader.ShardedLoader` with conversations in
place of windows: the same seeded per-epoch permutations, global sample stream, rank
slices, :class:`~train.data.loader.LoaderState` and resume. A sample is its conversation's
tokens padded to ``seq_len + 1`` with the pad id (the manifest's ``pad_id``: the
tokenizer's pad token, else EOS); the targets are the tokens shifted by one, with -100
(torch's ignore_index) where the token carries no loss (the mask's 0s) and on padding.
``step_targets`` is the count of targets not -100 in the step's whole global batch,
read from the data (every rank computes the same number, no collective).

:class:`PackedChatLoader` (``data.packing=true``, the training split): a sample is a
sequence of ``seq_len`` positions packed with whole conversations (spec/packing.py says
which), each taking the positions it has unpacked (its tokens but the last as inputs,
but the first as targets), padding after the last; a third column gives each position
its place in its conversation (0 where one begins; the padding counts as one more), from
which the model takes RoPE's positions and keeps attention inside each conversation
(train/packed_attention.py). No target crosses conversations: a conversation's last
input predicts its own last token. The packed sequences are an epoch's samples, shuffled
and resumed as conversations are unpacked: the same loss per conversation, fewer pads.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import numpy as np
import torch

from spec.config import RunConfig
from spec.data import MANIFEST, chat_files
from spec.packing import costs, pack
from train.data.loader import ShardedLoader, file_dtype, token_file, val_file

IGNORE = -100  # torch.nn.functional.cross_entropy's default ignore_index


def masked_targets(labels: torch.Tensor, carries: torch.Tensor) -> torch.Tensor:
    """The labels where they carry loss, -100 elsewhere (the loss ignores those)."""
    return torch.where(carries, labels, torch.full_like(labels, IGNORE))


class ChatLoader(ShardedLoader):
    unit = "conversations"

    def __init__(self, directory: Path, split: str, seq_len: int, micro_batch: int, grad_accum: int, dp_rank: int,
                 dp_size: int, seed: int, cp_rank: int = 0, cp_size: int = 1) -> None:
        info = json.loads((Path(directory) / MANIFEST).read_text())
        tokens, mask, offsets = (Path(directory) / name for name in chat_files(split))
        self.offsets = np.fromfile(offsets, dtype=np.int64)
        self.mask = np.memmap(mask, dtype=np.uint8, mode="r") if self.offsets[-1] else np.zeros(0, np.uint8)
        self.pad_id = int(info["pad_id"])
        super().__init__(tokens, 0, seq_len, micro_batch, grad_accum, dp_rank, dp_size, seed,
                         dtype=np.dtype(info["dtype"]), cp_rank=cp_rank, cp_size=cp_size)
        # Targets carrying loss per conversation (its mask past the first token, within seq_len + 1).
        ends = np.minimum(self.offsets[1:], self.offsets[:-1] + seq_len + 1)
        cum = np.concatenate([[0], np.cumsum(self.mask, dtype=np.int64)])
        self.targets_of = cum[ends] - cum[np.minimum(self.offsets[:-1] + 1, ends)]

    def _num_samples(self) -> int:
        return len(self.offsets) - 1

    def _rows(self, ids: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        width = self.seq_len + 1
        tokens = np.full((len(ids), width), self.pad_id, dtype=np.int64)
        carries = np.zeros((len(ids), width), dtype=bool)
        for row, i in enumerate(ids):
            start = int(self.offsets[i])
            n = min(int(self.offsets[i + 1]) - start, width)
            tokens[row, :n] = self.tokens[start:start + n]
            carries[row, :n] = self.mask[start:start + n] != 0
        data = torch.from_numpy(tokens)
        return data[:, :-1], masked_targets(data[:, 1:], torch.from_numpy(carries[:, 1:]))

    def _count_targets(self, start: int) -> int:
        return int(self.targets_of[self.stream(start, self.global_batch)].sum())


class PackedChatLoader(ChatLoader):
    unit = "packed sequences"

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.targets_of = np.add.reduceat(self.targets_of[self.order], self.starts[:-1])

    def sample_kind(self) -> str:
        return f"{self.unit} of {self.seq_len} tokens"  # the packing follows train.seq_len

    def _num_samples(self) -> int:
        sizes = costs(self.offsets.tolist(), self.seq_len)
        order, starts = pack(sizes, self.seq_len)
        self.order, self.starts = np.asarray(order, dtype=np.int64), np.asarray(starts, dtype=np.int64)
        self.sizes = np.asarray(sizes, dtype=np.int64)
        return len(self.starts) - 1

    def _rows(self, ids: np.ndarray) -> tuple[torch.Tensor, ...]:
        width = self.seq_len
        inputs = np.full((len(ids), width), self.pad_id, dtype=np.int64)
        targets = np.full((len(ids), width), IGNORE, dtype=np.int64)
        positions = np.zeros((len(ids), width), dtype=np.int64)
        for row, p in enumerate(ids):
            at = 0
            for i in self.order[self.starts[p]:self.starts[p + 1]]:
                n, start = int(self.sizes[i]), int(self.offsets[i])
                tokens = self.tokens[start:start + n + 1].astype(np.int64)
                inputs[row, at:at + n] = tokens[:-1]
                targets[row, at:at + n] = np.where(self.mask[start + 1:start + n + 1] != 0, tokens[1:], IGNORE)
                positions[row, at:at + n] = np.arange(n)
                at += n
            positions[row, at:] = np.arange(width - at)
        return torch.from_numpy(inputs), torch.from_numpy(targets), torch.from_numpy(positions)


def build_loader(cfg: RunConfig, dp_rank: int, dp_size: int, split: str = "train",
                 cp_rank: int = 0) -> ShardedLoader:
    """The loader of ``split`` (train | val) for data-parallel rank ``dp_rank``, keeping cp
    rank ``cp_rank``'s slice of each sequence (``strategy.cp``)."""
    t, d, vocab = cfg.train, cfg.data, cfg.model.vocab_size
    cp = {"cp_rank": cp_rank, "cp_size": cfg.strategy.cp}
    if d.source == "chat":  # packed: the training split (the validation loss is the same unpacked)
        kind = PackedChatLoader if d.packing and split == "train" else ChatLoader
        return kind(Path(d.path), split, t.seq_len, t.micro_batch_size, t.grad_accum, dp_rank, dp_size, d.seed, **cp)
    path: Optional[Path] = token_file(d, vocab) if split == "train" else val_file(d, vocab)
    if path is None:
        raise ValueError(f"data.source={d.source} has no {split} split")
    return ShardedLoader(path, vocab, t.seq_len, t.micro_batch_size, t.grad_accum, dp_rank, dp_size, seed=d.seed,
                         dtype=file_dtype(d, vocab), **cp)
