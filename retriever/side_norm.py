"""Batch norms that keep running statistics per side of a shared tower (queries / documents).

One tower embedding both the memory and the queries (``retriever.shared_towers``) sees two kinds
of picture when they differ in style: the memory's clean drawings and the queries' photos of other
drawings. A BatchNorm's running statistics then average the two, and at evaluation each kind is
normalised by a mixture that is neither's. Normalising each kind by its own statistics is AdaBN
(Li et al., 2016) and, with them kept while training, domain-specific batch normalisation (Chang et
al., CVPR 2019): here the affine weights stay shared and only the statistics are per side.

``SideBatchNorm`` is a ``ReplicaBatchNorm`` (its statistics may span the data-parallel replicas)
whose own running statistics are the query side's, with the document side's beside them as
``doc_running_mean``, ``doc_running_var``, ``doc_num_batches_tracked``: the other keys of its state
stay open_clip's. ``on_side(module, side)`` sets the side of every one under ``module`` for a block
of calls (``DualEncoder.embed_docs`` / ``embed_queries`` do). A training-mode pass normalises by
the batch and moves that side's running statistics; an evaluation pass reads that side's.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn as nn
from torch.nn.modules.batchnorm import _BatchNorm

from retriever.replicas import ReplicaBatchNorm, attribute_set

SIDES = ("query", "doc")  # a SideBatchNorm's own buffers are the first side's
_STATS = ("running_mean", "running_var", "num_batches_tracked")


class SideBatchNorm(ReplicaBatchNorm):
    """A batch norm with a second set of running statistics for the document side (module doc)."""

    side = SIDES[0]  # which statistics a pass uses and moves

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        if not self.track_running_stats:
            raise ValueError("SideBatchNorm needs a batch norm that tracks running statistics")
        self._add_doc_stats()

    def _add_doc_stats(self) -> None:
        for name in _STATS:  # the document side starts where the query side is
            self.register_buffer(f"doc_{name}", getattr(self, name).detach().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.side == SIDES[0]:
            return super().forward(x)
        if self.side != SIDES[1]:
            raise ValueError(f"SideBatchNorm.side must be one of {SIDES} (got {self.side!r})")
        # the document side's statistics lent to the norm for this pass (it updates them in place
        # in training mode), its own put back after
        own = {name: self._buffers[name] for name in _STATS}
        self._buffers.update({name: self._buffers[f"doc_{name}"] for name in _STATS})
        try:
            return super().forward(x)
        finally:
            self._buffers.update(own)


def side_batch_norms(module: nn.Module) -> int:
    """Every batch norm under ``module`` made a ``SideBatchNorm`` (in place, holding the same
    parameters and buffers, the document side's added). Returns how many."""
    n = 0
    for name, child in module.named_children():
        if isinstance(child, SideBatchNorm):
            continue
        if isinstance(child, _BatchNorm):
            if not child.track_running_stats:
                raise ValueError(f"batch norm {name} tracks no running statistics to keep per side")
            new = SideBatchNorm(child.num_features, child.eps, child.momentum, child.affine, True)
            new._parameters, new._buffers = child._parameters, child._buffers  # the same tensors
            new._add_doc_stats()
            new.train(child.training)
            setattr(module, name, new)
            n += 1
        else:
            n += side_batch_norms(child)
    return n


def doc_stats_from_queries(module: nn.Module) -> None:
    """Start every ``SideBatchNorm``'s document side at its query side's statistics (a checkpoint
    of a tower without sides loaded into one with them)."""
    for m in module.modules():
        if isinstance(m, SideBatchNorm):
            for name in _STATS:
                m._buffers[f"doc_{name}"].copy_(m._buffers[name])


def split_doc_stats(state: dict) -> tuple[dict, dict]:
    """A tower's state dict -> (its open_clip keys, the document side's statistics)."""
    doc = {k: v for k, v in state.items() if k.rsplit(".", 1)[-1].startswith("doc_")}
    return {k: v for k, v in state.items() if k not in doc}, doc


@contextlib.contextmanager
def on_side(module: nn.Module, side: str) -> Iterator[None]:
    """Within: every ``SideBatchNorm`` under ``module`` normalises as ``side``; the previous sides
    are restored on exit (calls nest)."""
    if side not in SIDES:
        raise ValueError(f"side must be one of {SIDES} (got {side!r})")
    with attribute_set([m for m in module.modules() if isinstance(m, SideBatchNorm)], "side", side):
        yield
