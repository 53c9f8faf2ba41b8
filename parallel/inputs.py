"""Batches as ``parallelize`` and ``ParallelModel`` see them: any structure of tensors (a tensor, a
tuple of positional arguments, a dict of keyword arguments), split into microbatches along dim 0.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch


def split_microbatches(inputs: Any, m: int) -> list[Any]:
    """Split dim 0 of every tensor in a tuple / list / dict (nested) into m chunks; everything
    else is repeated."""

    def split(x: Any) -> list[Any]:
        if isinstance(x, torch.Tensor) and x.dim() > 0:
            parts = list(torch.tensor_split(x, m, dim=0))
            return parts
        if isinstance(x, Mapping):
            cols = {k: split(v) for k, v in x.items()}
            return [
                type(x)({k: cols[k][i] for k in x})
                if type(x) is not dict
                else {k: cols[k][i] for k in x}
                for i in range(m)
            ]
        if isinstance(x, list | tuple):
            cols = [split(v) for v in x]
            return [
                type(x)(c[i] for c in cols) if isinstance(x, list | tuple) else None
                for i in range(m)
            ]
        return [x] * m

    if inputs is None:
        return [None] * m
    return split(inputs)


def _as_call(inputs: Any) -> tuple[tuple, dict]:
    if isinstance(inputs, Mapping):
        return (), dict(inputs)
    if isinstance(inputs, list | tuple):
        return tuple(inputs), {}
    return (inputs,), {}


def _default_loss(out: Any, target: Any) -> torch.Tensor:
    if isinstance(out, torch.Tensor) and out.dim() == 0:
        return out
    loss = getattr(out, "loss", None) if not isinstance(out, Mapping) else out.get("loss")
    if isinstance(loss, torch.Tensor):
        return loss
    raise ValueError(
        "train_step needs loss_fn(model_output, target) unless the model returns a loss"
    )


# ----------------------------------------------------------------------------- partition


def _microbatch_of(example: Any, m: int) -> Any:
    """The first microbatch of an example batch (the whole example when it has fewer than m rows):
    plans are made on what one stage call will see."""
    return split_microbatches(example, m)[0] if _batch(example) >= m else example


def _batch(inputs: Any) -> int:
    args, kwargs = _as_call(inputs)
    for x in list(args) + list(kwargs.values()):
        if isinstance(x, torch.Tensor) and x.dim() > 0:
            return int(x.shape[0])
    return 0
