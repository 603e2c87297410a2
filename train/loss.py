"""The training loss: a sum of cross-entropies, divided by the step's count of targets.

Targets carry ``IGNORE`` (-100, torch's ``ignore_index``) where a position has no loss
(chat data's prompt tokens). A micro-batch's loss is the *sum* of cross-entropy over its
counted targets; the engines divide it by the step's share of counted targets per
data-parallel rank (``ShardedLoader.step_targets / dp``), so that after the gradients'
average over the data-parallel ranks the step's loss is the sum over every counted token
of the global batch divided by their count: not a mean of micro-batch means, which
would weigh a token of a short-answer micro-batch more than one of a long answer.
Under context parallel (``strategy.cp``) a rank's micro-batch is a slice of each
sequence, its sum that slice's, and the gradients are averaged over dp x cp ranks: the
divisor is the step's count over dp x cp (``ShardedLoader.loss_share``), so the losses
and gradients are those of the whole sequences.

The head and the loss in chunks (:func:`chunked_head_loss`): at a 152k vocabulary a
sequence of 32k tokens has 10-20 GB of logits. The final norm's output goes through the
head ``chunk`` tokens at a time, each chunk under ``torch.utils.checkpoint``
(non-reentrant), so that the forward keeps only the chunk's input and its loss, and the
backward recomputes one chunk's logits at a time: the whole logits never exist.
"""
from __future__ import annotations

import functools
from typing import Callable, Iterable, Tuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from spec.config_model import loss_chunk_tokens  # noqa: F401  (re-exported: model.loss_chunk_tokens)
from train.vocab_parallel import is_vocab_sharded, vocab_parallel_cross_entropy

IGNORE = -100  # torch's ignore_index: a target position without loss


def cross_entropy_sum(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Sum of cross-entropy over the targets that are not ``IGNORE``, in fp32."""
    return F.cross_entropy(logits.flatten(0, -2).float(), targets.flatten(), ignore_index=IGNORE, reduction="sum")


@functools.lru_cache(maxsize=None)
def compiled_cross_entropy_sum() -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """:func:`cross_entropy_sum` through torch.compile (``strategy.compile``, as torchtitan
    compiles its loss): Inductor fuses the fp32 cast, the log-softmax and the targets' pick
    (and the backward's softmax minus one-hot) into its own kernels, where eager writes an
    fp32 copy of the logits, their log-softmax and in the backward its gradient, each a
    pass over vocabulary x tokens (what it saves on a GPU is for the speed rows to show).
    Static shapes: a chunked head has two (its chunks and the last one), each compiled once."""
    return torch.compile(cross_entropy_sum, dynamic=False)


def loss_sum(logits: torch.Tensor, targets: torch.Tensor, compiled: bool = False) -> torch.Tensor:
    """Sum of cross-entropy over the targets that are not ``IGNORE`` (fp32), ``compiled``
    or eager; logits sharded over the vocabulary (tensor parallel's head) are reduced in
    parallel, never gathered (train/vocab_parallel.py)."""
    if is_vocab_sharded(logits):
        return vocab_parallel_cross_entropy(logits, targets, reduction="sum")
    return (compiled_cross_entropy_sum() if compiled else cross_entropy_sum)(logits, targets)


def _chunk_loss(head: nn.Module, h: torch.Tensor, targets: torch.Tensor, compiled: bool) -> torch.Tensor:
    return loss_sum(head(h), targets, compiled)


def chunked_head_loss(head: nn.Module, h: torch.Tensor, targets: torch.Tensor, chunk: int,
                      compiled: bool = False) -> torch.Tensor:
    """``loss_sum(head(h), targets)`` computed ``chunk`` tokens at a time (h [..., dim],
    targets [...]); ``head`` is called as a module (its hooks run: DDP, FSDP, ZeRO).
    Every chunk but the last is checkpointed (its logits recomputed in the backward); the
    last one's are kept: nothing runs between its forward and its backward, which comes
    first, so keeping them adds nothing to the peak and saves a recompute of the head
    (all of it when the micro-batch is one chunk)."""
    flat, tgt = h.reshape(-1, h.shape[-1]), targets.reshape(-1)
    total = torch.zeros((), device=h.device, dtype=torch.float32)
    starts = range(0, flat.shape[0], chunk)
    for start in starts:
        piece, piece_targets = flat[start:start + chunk], tgt[start:start + chunk]
        if start == starts[-1]:
            total = total + _chunk_loss(head, piece, piece_targets, compiled)
        else:
            total = total + checkpoint(_chunk_loss, head, piece, piece_targets, compiled, use_reentrant=False)
    return total


def counted(batches: Iterable[Tuple[torch.Tensor, ...]]) -> int:
    """Targets carrying loss in these micro-batches (not ``IGNORE``): (inputs, targets[, positions])."""
    return sum(int((batch[1] != IGNORE).sum()) for batch in batches)
