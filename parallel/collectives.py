"""One collective over many tensors: flatten them into one buffer, run the collective on it once,
split it back (one message instead of one per tensor, as DDP's buckets and Megatron's grad
buffers do). Used for every flat all-reduce and broadcast of the runtime and of the app."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist


@torch.no_grad()
def flat_collective(
    tensors: Sequence[torch.Tensor],
    collective: Callable[[torch.Tensor], Any],
    *,
    write_back: bool = True,
) -> list[torch.Tensor]:
    """Run ``collective`` (in place on a 1-D tensor: an all-reduce, a broadcast, a reducer) once
    on the concatenation of ``tensors``, flattened in order (``torch.cat``: one dtype, promoted as
    ``cat`` does). Returns views of the result, one per tensor and shaped like it; with
    ``write_back`` each is also copied into its tensor. No tensors: no collective (every rank must
    pass the same list, as with any collective)."""
    if not tensors:
        return []
    buf = torch.cat([t.reshape(-1) for t in tensors])
    collective(buf)
    views = [
        v.view_as(t) for v, t in zip(buf.split([t.numel() for t in tensors]), tensors, strict=True)
    ]
    if write_back:
        for t, v in zip(tensors, views, strict=True):
            t.copy_(v)
    return views


def all_reduce_mean_(buf: torch.Tensor, group=None) -> torch.Tensor:
    """The mean of ``buf`` over ``group`` (default: every rank), in place: a sum, then a division
    by the group's size."""
    dist.all_reduce(buf, group=group)
    return buf.div_(dist.get_world_size(group))
