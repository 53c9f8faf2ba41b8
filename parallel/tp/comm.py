"""Differentiable collectives over the tensor-parallel group (Megatron's f / g operators and
their sequence-parallel counterparts), built on functional collectives so that
``torch.distributed.tensor.debug.CommDebugMode`` sees and counts them.

======================  =========================  ==========================
operator                forward                    backward
======================  =========================  ==========================
copy_to_tp              identity                   all-reduce
reduce_from_tp          all-reduce                 identity
gather_seq              all-gather (seq dim)       reduce-scatter (seq dim)
reduce_scatter_seq      reduce-scatter (seq dim)   all-gather (seq dim)
split_seq               keep own chunk             all-gather
gather_from_seq         all-gather                 keep own chunk
gather_last             all-gather (last dim)      keep own chunk
grad_all_reduce         identity                   all-reduce
======================  =========================  ==========================
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol


def _wait(t: torch.Tensor) -> torch.Tensor:
    return t.wait() if isinstance(t, funcol.AsyncCollectiveTensor) else t


def _all_reduce(x: torch.Tensor, group) -> torch.Tensor:
    return _wait(funcol.all_reduce(x.contiguous(), "sum", group))


def _all_gather(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    return _wait(funcol.all_gather_tensor(x.contiguous(), dim % x.dim(), group))


def _reduce_scatter(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    dim = dim % x.dim()
    n = dist.get_world_size(group)
    if x.shape[dim] % n:
        raise ValueError(
            f"sequence parallel: dimension {dim} of size {x.shape[dim]} is not divisible by tp={n}"
        )
    return _wait(funcol.reduce_scatter_tensor(x.contiguous(), "sum", dim, group))


def _chunk(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    n, r = dist.get_world_size(group), dist.get_rank(group)
    if x.shape[dim] % n:
        raise ValueError(
            f"sequence parallel: dimension {dim % x.dim()} of size {x.shape[dim]} is not "
            f"divisible by tp={n} (pad the sequence to a multiple of tp, or turn "
            "sequence_parallel off)"
        )
    return x.chunk(n, dim)[r].contiguous()


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return _all_reduce(g, ctx.group), None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx, g):
        return g, None


class _GatherSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        return _all_gather(x, dim, group)

    @staticmethod
    def backward(ctx, g):
        return _reduce_scatter(g, ctx.dim, ctx.group), None, None


class _ReduceScatterSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        return _reduce_scatter(x, dim, group)

    @staticmethod
    def backward(ctx, g):
        return _all_gather(g, ctx.dim, ctx.group), None, None


class _Split(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        return _chunk(x, dim, group)

    @staticmethod
    def backward(ctx, g):
        return _all_gather(g, ctx.dim, ctx.group), None, None


class _Gather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        return _all_gather(x, dim, group)

    @staticmethod
    def backward(ctx, g):
        return _chunk(g, ctx.dim, ctx.group), None, None


def copy_to_tp(x, group):
    return _CopyToTP.apply(x, group)


def reduce_from_tp(x, group):
    return _ReduceFromTP.apply(x, group)


def gather_seq(x, dim, group):
    return _GatherSeq.apply(x, dim, group)


def reduce_scatter_seq(x, dim, group):
    return _ReduceScatterSeq.apply(x, dim, group)


def split_seq(x, dim, group):
    return _Split.apply(x, dim, group)


def gather_from_seq(x, dim, group):
    return _Gather.apply(x, dim, group)


def gather_last(x, group):
    return _Gather.apply(x, -1, group)


class _GradAllReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return _all_reduce(g, ctx.group), None


def grad_all_reduce(x, group):
    """Identity whose gradient is summed over the group: for a replicated parameter that each rank
    uses on a different part of the data (norms under sequence parallel, slices of a fused bias)."""
    return _GradAllReduce.apply(x, group)
