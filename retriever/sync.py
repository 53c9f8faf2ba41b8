"""Keeping the retriever's copies one: it is held whole on every rank (only the reader is spread),
and these are the collectives, over every rank, that keep the copies equal.

- ``average_grads``: the mean gradient over every rank, once per optimizer step. Ranks of one
  replica read the same batch, but need not make the same random draws (pseudo-queries, bank
  negatives): each pipeline stage draws from the global generator for its own blocks (dropout),
  so the streams part once the model uses randomness. Averaged, every copy takes the same step
  and every rank of a pipeline retrieves the same documents, which its stages need
  (``check_copies``). The contrastive term is the global batch's on every replica, and its
  gather's backward sums each replica's share into the rows it embedded, so this mean is one
  process's gradient of it (``retriever/replicas.py``).
- ``broadcast_buffers``: rank 0's buffers to every rank, before each use, as DDP's
  ``broadcast_buffers`` does. BatchNorm's running statistics (the ResNet tower) move in every
  train-mode forward, the index refresh's too, where each rank embeds its own share of the
  memory: left alone, the copies' statistics drift apart and evaluation, which reads them,
  retrieves different documents on the stages.
- ``check_copies``: raise unless every rank holds the same parameters, bit for bit.

Each is a no-op without a process group or with one rank (or without a retriever).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from parallel.collectives import all_reduce_mean_, flat_collective


def _spread(module: nn.Module | None) -> bool:
    return module is not None and dist.is_initialized() and dist.get_world_size() > 1


def average_grads(module: nn.Module | None) -> None:
    """The mean of ``module``'s gradients over every rank, in place (one flat all-reduce). Call it
    once per optimizer step, after the last accumulated backward: the mean is linear, so
    averaging the accumulated sum equals averaging each micro-step."""
    if _spread(module):
        flat_collective(
            [q.grad for q in module.parameters() if q.grad is not None], all_reduce_mean_
        )


@torch.no_grad()
def broadcast_buffers(module: nn.Module | None) -> None:
    """``module``'s floating-point buffers from rank 0 to every rank (one flat broadcast)."""
    bufs = [b for b in module.buffers() if b.is_floating_point()] if module is not None else []
    if bufs and _spread(module):
        flat_collective(bufs, lambda flat: dist.broadcast(flat, src=0))


@torch.no_grad()
def check_copies(module: nn.Module | None) -> None:
    """Raise unless every rank holds the same parameters of ``module``, bit for bit (buffers are
    broadcast before each use). Stages of one pipeline each run their own search; with diverged
    retrievers they would read different documents and the cut tensors would no longer fit the
    receiving stage's own batch (a shape error at best, a silently wrong step at worst). A
    collective; the checksum is an integer sum of the parameters' bits, exact whatever the
    summation order."""
    if not _spread(module):
        return
    bits = [
        q.detach().reshape(-1).contiguous().view(torch.int32).long().sum()
        for q in module.parameters()
        if q.dtype == torch.float32
    ]
    mine = torch.stack(bits).sum().reshape(1)
    every = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine)
    sums = [int(t) for t in every]
    if len(set(sums)) > 1:
        raise RuntimeError(
            f"the retriever copies differ between ranks (parameter checksums {sums}): the ranks of "
            "a pipeline would retrieve different documents"
        )
