"""The data-parallel replicas that one contrastive loss spans.

In-batch contrastive learning is not linear in the batch: its negatives are the other queries'
documents. When data-parallel replicas each score only their own share of the batch, every query
sees 1/R of the negatives one process gives it, and averaging the replicas' gradients does not
give one process's gradient. CLIP and open_clip gather the embeddings of every replica before the
loss; this does the same. Every replica computes the loss over the gathered rows, and the gather
is differentiable (a functional all-gather: its backward reduce-scatters, summing each slice's
gradients back to the replica that embedded it). Averaged over the replicas, as data parallel
averages gradients, that is exactly the gradient of the one-process loss on the whole batch.

Random draws that join the loss (pseudo-queries) are split the same way: each replica embeds its
share of one draw of the configured count, so the gathered loss has as many as one process has.

Batch statistics are the other thing that is not linear in the batch: a BatchNorm (the ResNet
tower's) normalises by the mean and variance of the rows of one forward. ``ReplicaBatchNorm`` takes
them over every replica's rows while ``Replicas.spanning`` is in force, so the replicas' passes
normalise as one process's pass over the whole batch does, and their running statistics move alike.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn as nn
from torch.nn.modules.batchnorm import _BatchNorm

# the differentiable all-gather: all_gather_single_autograd from torch 2.14,
# all_gather_tensor_autograd before
_gather_autograd = (
    getattr(funcol, "all_gather_single_autograd", None) or funcol.all_gather_tensor_autograd
)


@contextlib.contextmanager
def attribute_set(objs: list, name: str, value: Any) -> Iterator[None]:
    """Within: ``name`` of every one of ``objs`` is ``value``; each one's own is put back on exit
    (so these nest)."""
    before = [getattr(o, name) for o in objs]
    for o in objs:
        setattr(o, name, value)
    try:
        yield
    finally:
        for o, b in zip(objs, before, strict=True):
            setattr(o, name, b)


def _sum_autograd(x: torch.Tensor, group) -> torch.Tensor:
    """Sum of ``x`` over ``group``, differentiable (the backward sums the gradients over the group).
    The functional all-reduce has that backward registered from torch 2.14; before, the older
    ``torch.distributed.nn`` autograd function gives it."""
    if hasattr(funcol, "all_reduce_backward"):
        return funcol.wait_tensor(funcol.all_reduce(x.contiguous(), "sum", group))
    import torch.distributed.nn.functional as dist_nn

    return dist_nn.all_reduce(x.contiguous(), group=group)


@dataclass(frozen=True)
class Replicas:
    # process group with one rank of every replica (None: one replica, nothing to gather)
    group: Any = None
    rank: int = 0  # this replica's index in ``group``: its rows come at that place in a gather
    size: int = 1  # replicas in ``group``

    def share(self, n: int) -> slice:
        """This replica's rows of ``n`` rows drawn alike on every replica: contiguous, in rank
        order, the first ``n % size`` replicas taking one more."""
        base, extra = divmod(n, self.size)
        start = self.rank * base + min(self.rank, extra)
        return slice(start, start + base + (self.rank < extra))

    @classmethod
    def world(cls) -> Replicas:
        """Every rank of the default group as one replica each (one replica without a group)."""
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return cls()
        return cls(dist.group.WORLD, dist.get_rank(), dist.get_world_size())

    @contextlib.contextmanager
    def spanning(self, module: nn.Module | None) -> Iterator[None]:
        """Within: every ``ReplicaBatchNorm`` of ``module`` takes its training-mode statistics over
        these replicas. Each replica must then make the same sequence of training-mode passes (each
        pass all-reduces its statistics), as the replicas of one training step do. Nests: the
        previous span is restored on exit."""
        norms = (
            [m for m in module.modules() if isinstance(m, ReplicaBatchNorm)]
            if module is not None
            else []
        )
        with attribute_set(norms, "span", self):
            yield

    def gather(self, *xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Every replica's rows of each of ``xs`` (all n rows long here) concatenated in rank
        order: (size * n, ...), the same on every replica, differentiable back into this
        replica's rows. Every replica must hold the same n: callers pad a share shorter than the
        longest and mask the padding (``RagModel._contrastive_rows``), since exchanging the
        counts would read them back from an accelerator, a host sync per step. Rows on the CPU
        (gloo) cost nothing to count, and there a mismatch is refused with the counts named."""
        if self.group is None or self.size == 1:
            return xs
        if xs[0].device.type == "cpu":
            self._check_counts(xs[0].shape[0])
        # (size * n, ...); backward sums into each owner
        return tuple(_gather_autograd(x.contiguous(), 0, self.group) for x in xs)

    def _check_counts(self, n: int) -> None:
        counts = [None] * self.size
        dist.all_gather_object(counts, n, group=self.group)
        if len(set(counts)) > 1:
            raise ValueError(
                f"Replicas.gather needs the same row count on every replica, got {counts} "
                "(pad the shorter shares and mask them)"
            )


class ReplicaBatchNorm(_BatchNorm):
    """BatchNorm over any input (N, C, *) whose training-mode batch statistics span the replicas of
    ``span`` while ``Replicas.spanning`` sets it, and which is a plain BatchNorm otherwise.

    torch's SyncBatchNorm does this on accelerators only (its statistics kernels have no CPU path);
    here it is written with plain ops, which also run on gloo. Two all-reduces per pass, both
    differentiable: (sum over rows, row count) gives the mean, then the centred sum of squares the
    variance (two passes rather than sum and sum of squares at once: no cancellation). Their
    backward all-reduces the gradients of the sums, so each replica's rows receive the gradient
    that flows through the statistics from every replica, as in one process."""

    # the replicas the statistics span now (None: this replica's rows alone)
    span: Replicas | None = None

    def _check_input_dim(self, x: torch.Tensor) -> None:
        if x.dim() < 2:
            raise ValueError(f"ReplicaBatchNorm expects (N, C, ...) input, got {x.dim()}-D")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rep = self.span
        if not self.training or rep is None or rep.group is None or rep.size == 1:
            return super().forward(x)
        self._check_input_dim(x)
        dims = [0, *range(2, x.dim())]  # every axis but the channels
        shape = (1, -1) + (1,) * (x.dim() - 2)  # (C,) -> broadcast over (N, C, *)
        xf = x.float()  # statistics in fp32 whatever the activations' dtype
        # values per channel on this replica
        rows = xf.new_tensor([xf.numel() // max(xf.shape[1], 1)])
        total = _sum_autograd(torch.cat([xf.sum(dims), rows]), rep.group)  # (C + 1,)
        n = total[-1].detach()
        mean = total[:-1] / n  # (C,)
        centred = xf - mean.view(shape)
        # (C,) biased, as BatchNorm normalises
        var = _sum_autograd((centred * centred).sum(dims), rep.group) / n
        y = centred * torch.rsqrt(var + self.eps).view(shape)
        if self.affine:
            y = y * self.weight.view(shape) + self.bias.view(shape)
        if self.track_running_stats:
            with torch.no_grad():
                self.num_batches_tracked.add_(1)
                f = (
                    1.0 / float(self.num_batches_tracked)
                    if self.momentum is None
                    else self.momentum
                )
                self.running_mean.lerp_(mean.detach().to(self.running_mean.dtype), f)
                unbiased = var.detach() * (n / (n - 1).clamp_min(1))  # what BatchNorm keeps
                self.running_var.lerp_(unbiased.to(self.running_var.dtype), f)
        return y.to(x.dtype)


def replica_batch_norms(module: nn.Module) -> nn.Module:
    """``module`` with each BatchNorm (1d, 2d, 3d) under it replaced by a ``ReplicaBatchNorm``
    holding the same parameters and buffers (an optimizer or checkpoint sees no change)."""
    for name, child in module.named_children():
        if isinstance(child, _BatchNorm) and not isinstance(
            child, (ReplicaBatchNorm, nn.SyncBatchNorm)
        ):
            new = ReplicaBatchNorm(
                child.num_features,
                child.eps,
                child.momentum,
                child.affine,
                child.track_running_stats,
            )
            new._parameters, new._buffers = child._parameters, child._buffers  # the same tensors
            new.train(child.training)
            setattr(module, name, new)
        else:
            replica_batch_norms(child)
    return module
