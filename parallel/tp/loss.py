"""Cross-entropy over vocabulary-sharded logits (Megatron's vocab-parallel cross-entropy): the
full (N, V) logits are never gathered. Each rank holds (N, V/tp); three all-reduces of (N,)
vectors (max, sum of exponentials, target logit) give the exact loss."""

from __future__ import annotations

import torch
import torch.distributed._functional_collectives as funcol
from torch.distributed.tensor import DTensor

from parallel.tp.comm import _wait


def _ar(x, op, group):
    return _wait(funcol.all_reduce(x.contiguous(), op, group))


class _VocabParallelCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, start, ignore_index, group):
        x = logits.float()  # (N, Vl)
        m = _ar(x.max(-1).values, "max", group)  # (N,)
        z = x - m[:, None]
        e = z.exp()
        s = _ar(e.sum(-1), "sum", group)  # (N,)
        t = target - start
        inside = (t >= 0) & (t < x.shape[-1]) & (target != ignore_index)
        tl = t.clamp(0, x.shape[-1] - 1)
        picked = torch.where(inside, z.gather(-1, tl[:, None])[:, 0], torch.zeros_like(m))
        picked = _ar(picked, "sum", group)
        valid = target != ignore_index
        loss = torch.where(valid, s.log() - picked, torch.zeros_like(m))  # (N,)
        ctx.save_for_backward(e, s, tl, inside, valid)
        ctx.dtype = logits.dtype
        return loss

    @staticmethod
    def backward(ctx, g):
        e, s, tl, inside, valid = ctx.saved_tensors
        grad = e / s[:, None]  # softmax on this rank's slice
        grad.scatter_add_(-1, tl[:, None], -inside.to(grad.dtype)[:, None])
        grad = grad * (g * valid)[:, None]
        return grad.to(ctx.dtype), None, None, None, None


def vocab_parallel_cross_entropy(
    logits,
    target: torch.Tensor,
    *,
    ignore_index: int = -100,
    reduction: str = "mean",
    group=None,
    vocab_start: int | None = None,
) -> torch.Tensor:
    """``F.cross_entropy(full_logits, target)`` from vocabulary shards. ``logits``: a DTensor
    sharded on its last dim (an LM head under ``loss_parallel``), or this rank's local
    ``(..., V/tp)`` slice with ``group`` and ``vocab_start``. ``target``: (...) full ids."""
    if isinstance(logits, DTensor):
        mesh = logits.device_mesh
        group = mesh.get_group()
        vocab_start = mesh.get_local_rank() * (logits.shape[-1] // mesh.size())
        logits = logits.to_local()
    if group is None or vocab_start is None:
        raise ValueError("vocab_parallel_cross_entropy: local logits need group= and vocab_start=")
    loss = _VocabParallelCE.apply(
        logits.reshape(-1, logits.shape[-1]), target.reshape(-1), vocab_start, ignore_index, group
    )
    if reduction == "none":
        return loss.view(target.shape)
    if reduction == "sum":
        return loss.sum()
    return loss.sum() / (target != ignore_index).sum().clamp_min(1)
