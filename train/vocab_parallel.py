"""Cross-entropy over logits sharded on the vocabulary (tensor parallel's head output).

Each TP rank holds the logits of its slice of the vocabulary for every token. The loss
needs, per token, the maximum and the sum of exponentials over the whole vocabulary and
the target's logit, which lives on one rank: three all-reduces of one number per token
(MAX, SUM, SUM), never the logits themselves (Megatron-LM's vocab-parallel
cross-entropy; torchtitan gets the same from torch's ``loss_parallel``).

Memory: torch's ``loss_parallel`` builds its log-softmax out of place from several
temporaries of the local logits' size (measured: 4 of them live at once). Here the
local logits are turned into the softmax in place (they are the head's output, which
its backward does not need), saved as they are, and turned into their own gradient in
place in the backward: one logits-sized buffer per rank, plus an fp32 copy when the
logits are bf16 (``python bench/memory.py tp-loss``).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

IGNORE = -100  # torch's ignore_index


def is_vocab_sharded(logits: torch.Tensor) -> bool:
    """A DTensor sharded on its last (vocabulary) dimension over a 1-D mesh."""
    if not isinstance(logits, DTensor) or logits.device_mesh.ndim != 1:
        return False
    (p,) = logits.placements
    return p.is_shard() and p.dim in (-1, logits.ndim - 1)


def vocab_parallel_cross_entropy(logits: DTensor, targets: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    """Cross-entropy of ``logits`` (a DTensor [..., vocab] sharded on the vocabulary)
    against ``targets`` [...]: a plain tensor, the same on every rank of the mesh. Targets
    of -100 (torch's ignore_index) carry no loss; ``reduction`` "sum" or "mean" (over
    the others), as ``F.cross_entropy``."""
    mesh = logits.device_mesh
    vocab, k = logits.shape[-1], mesh.size()
    size = -(-vocab // k)  # DTensor's even sharding (torch.chunk's sizes)
    start = min(mesh.get_local_rank() * size, vocab)
    local = logits.to_local()
    targets = targets.reshape(-1).to(local.device)
    total = _VocabParallelCE.apply(local.reshape(-1, local.shape[-1]), targets, mesh.get_group(), start)
    return total if reduction == "sum" else total / (targets != IGNORE).sum()


class _VocabParallelCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, local: torch.Tensor, targets: torch.Tensor, group, start: int) -> torch.Tensor:
        # fp32 in place when the logits are fp32 already (the head's output, unused by its
        # backward); detached: they are a view DTensor's to_local made, which autograd
        # forbids modifying in place (the version counter stays shared: anything that had
        # saved them would still fail loudly)
        x = local.detach() if local.dtype == torch.float32 else local.float()
        width = x.shape[1]
        peak = x.max(dim=-1, keepdim=True).values
        dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=group)
        x.sub_(peak)
        outside = (targets < start) | (targets >= start + width)
        index = (targets - start).clamp_(0, max(width - 1, 0))
        target_logit = x.gather(1, index.unsqueeze(1)).squeeze(1).masked_fill_(outside, 0.0)
        x.exp_()
        sum_exp = x.sum(dim=-1)
        both = torch.stack([target_logit, sum_exp])
        dist.all_reduce(both, op=dist.ReduceOp.SUM, group=group)
        target_logit, sum_exp = both[0], both[1]
        kept = targets != IGNORE
        loss = ((sum_exp.log() - target_logit) * kept).sum()
        x.div_(sum_exp.unsqueeze(1))  # the softmax, kept for the backward
        ctx.save_for_backward(x, index, outside, kept)
        ctx.dtype = local.dtype
        return loss

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        softmax, index, outside, kept = ctx.saved_tensors
        grad = softmax  # d loss / d logits = softmax - one_hot(target), 0 where ignored, in place
        grad.scatter_add_(1, index.unsqueeze(1), (outside.to(grad.dtype) - 1.0).unsqueeze(1))
        grad.mul_(kept.unsqueeze(1).to(grad.dtype) * grad_loss)
        return grad.to(ctx.dtype), None, None, None
