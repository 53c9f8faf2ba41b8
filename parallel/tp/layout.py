"""Fused layouts read off the dataflow: which output features of a column-parallel source each
rank's slice of the row-parallel sink's input reads.

The planner's width rule (one source k times the sink's input width: k fused equal blocks) cannot
tell GPT-2's q|k|v (three contiguous blocks: k = 3) from GPT-NeoX's per-head [q_h k_h v_h] (each
head's q, k and v adjacent: one block, k = 1), and it misreads a grouped-query q|k|v (unequal
blocks). The example answers it: for each of the tp slices of the sink's input (the features one
row-parallel rank will hold) one backward pass marks the source features that slice reads
(nonzero gradient, summed over tokens, for a random cotangent). The layout is the number k of
equal fused blocks for which every feature a slice reads sits in that rank's shard (rank r keeps
the r-th 1/tp of every block, ``TPContext.shard_param``). When no k fits, no DTensor placement
(``Shard`` / ``_StridedShard``) holds the pair and it stays replicated.

A feature no slice reads on the example (a ReLU that never fired) constrains nothing, so a layout
is a fit when each slice reads a subset of its shard; the width rule's guess is tried first.

Grouped-query and multi-query attention with fewer key/value heads than tp ranks: the k and v
sources fit no block count (every rank reads a whole key/value head, several ranks the same one).
Such a source is *replicated* (``replicated_rows``) when the ranks' read sets are equal-sized,
pairwise equal or disjoint, and cover its output: each rank then computes the rows its slice
reads from a weight every rank holds whole (Megatron-Core and vLLM replicate the KV heads the
same way), as long as another source of the pair is sharded.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from parallel.tp.registry import linear_kind


def _rank_of_feature(n: int, blocks: int, tp: int) -> torch.Tensor:
    """(n,) the rank holding each of ``n`` output features when they form ``blocks`` equal
    blocks."""
    idx = torch.arange(n)
    return (idx % (n // blocks)) // (n // (blocks * tp))


def _ranges(mask: torch.Tensor) -> str:
    """'0:32,64:80' for the runs of True in a (n,) bool mask."""
    idx = mask.nonzero().flatten().tolist()
    runs: list[list[int]] = []
    for i in idx:
        if runs and runs[-1][1] == i:
            runs[-1][1] = i + 1
        else:
            runs.append([i, i + 1])
    return ",".join(f"{a}:{b}" for a, b in runs) or "nothing"


def slice_reads(
    outs: list[torch.Tensor | None], sink_in: torch.Tensor, tp: int
) -> list[list[torch.Tensor]]:
    """reads[s][r]: (out_s,) bool, the features of source ``s``'s output (last dim) that rank
    ``r``'s slice of ``sink_in``'s last dim depends on. ``outs`` and ``sink_in`` are tensors of
    one forward under autograd (its graph kept)."""
    width = sink_in.shape[-1]
    live = [o for o in outs if o is not None]
    reads = [
        [torch.zeros(o.shape[-1] if o is not None else 0, dtype=torch.bool) for _ in range(tp)]
        for o in outs
    ]
    gen = torch.Generator().manual_seed(0)  # the cotangent: any fixed values without cancellation
    for r in range(tp):
        part = sink_in[..., r * width // tp : (r + 1) * width // tp]
        cot = torch.randn(part.shape, generator=gen, dtype=torch.float32).to(part)
        grads = torch.autograd.grad((part * cot).sum(), live, retain_graph=True, allow_unused=True)
        it = iter(grads)
        for s, o in enumerate(outs):
            if o is None:
                continue
            g = next(it)
            if g is not None:
                reads[s][r] = g.detach().abs().reshape(-1, g.shape[-1]).sum(0).cpu() > 0
    return reads


def fit_blocks(reads: list[torch.Tensor], tp: int, guesses: list[int]) -> int | None:
    """The number of equal fused blocks (``guesses`` first, then 1, 2, ...) that puts every
    feature each rank's slice reads in that rank's shard; None when none does."""
    n = reads[0].numel()
    if n == 0:
        return guesses[0] if guesses else 1
    tried = list(dict.fromkeys([*guesses, *range(1, n // tp + 1)]))
    for k in tried:
        if k < 1 or n % (k * tp):
            continue
        owner = _rank_of_feature(n, k, tp)
        if all(not bool((reads[r] & (owner != r)).any()) for r in range(tp)):
            return k
    return None


def replicated_rows(reads: list[torch.Tensor], tp: int) -> list[list[int]] | None:
    """rows[r]: the output features rank ``r``'s slice reads, when they form a replicated source:
    every rank reads the same number of features, two ranks read the same set or disjoint sets,
    the sets cover the output and each is read by the same number (>= 2) of ranks (key/value heads
    fewer than tp: ranks 2r and 2r + 1 read head r). None otherwise."""
    n = reads[0].numel()
    sets = [rd.nonzero().flatten() for rd in reads]
    c = sets[0].numel()
    if c == 0 or any(s.numel() != c for s in sets):
        return None
    distinct: list[torch.Tensor] = []
    for s in sets:
        if any(torch.equal(s, d) for d in distinct):
            continue
        if any(bool(reads_of(d, n)[s].any()) for d in distinct):  # overlaps another set partly
            return None
        distinct.append(s)
    if len(distinct) * c != n or tp % len(distinct) or tp // len(distinct) < 2:
        return None
    return [s.tolist() for s in sets]


def reads_of(idx: torch.Tensor, n: int) -> torch.Tensor:
    """(n,) bool mask of the features in ``idx``."""
    m = torch.zeros(n, dtype=torch.bool)
    m[idx] = True
    return m


def read_layout(
    outs: list[torch.Tensor | None], sink_in: torch.Tensor, tp: int, guesses: list[int]
) -> tuple[list[int] | None, dict[int, list[list[int]]], str]:
    """Blocks per source as read off the example (None: no layout fits), the rows each rank
    computes of the sources that are replicated (``replicated_rows``; their blocks are 0), and,
    for the log, what each rank's slice reads."""
    reads = slice_reads(outs, sink_in, tp)
    fits = [fit_blocks(rd, tp, [g]) for rd, g in zip(reads, guesses)]
    rows = {s: replicated_rows(reads[s], tp) for s, f in enumerate(fits) if f is None}
    if rows and all(r is not None for r in rows.values()) and len(rows) < len(fits):
        return [0 if f is None else int(f) for f in fits], rows, ""
    if all(f is not None for f in fits):
        return [int(f) for f in fits], {}, ""
    bad = [s for s, f in enumerate(fits) if f is None]
    desc = "; ".join(
        f"source {s}: " + ", ".join(f"rank {r} reads [{_ranges(reads[s][r])}]" for r in range(tp))
        for s in bad
    )
    return None, {}, desc


def read_pair_blocks(
    keep: dict[str, list[Any]],
    mods: dict[str, nn.Module],
    srcs: list[str],
    sink: str,
    tp: int,
    guess: dict[str, int],
) -> tuple[dict[str, int] | None, dict[str, list[list[int]]] | None, str]:
    """Each source's fused blocks for the pair ``srcs -> sink`` as the example's gradients show
    them (``keep``: ``linear_dataflow``'s [input, output] per linear), and the per-rank rows of
    the replicated ones (blocks 0); the width rule's ``guess`` (and no rows) where the example
    cannot tell (no graph, meta tensors, features not on the last dimension). None, with what
    each rank's slice reads, when no layout fits."""
    outs = [keep.get(s, [None, None])[1] for s in srcs]
    sink_in = keep.get(sink, [None, None])[0]
    if sink_in is None or sink_in.is_meta or any(o is None or o.is_meta for o in outs):
        return guess, None, ""
    widths = [linear_kind(mods[s]).out_features(mods[s]) for s in srcs]
    if sink_in.shape[-1] != linear_kind(mods[sink]).in_features(mods[sink]) or any(
        o.shape[-1] != w for o, w in zip(outs, widths)
    ):
        return guess, None, ""
    read, rows, why = read_layout(outs, sink_in, tp, [guess[s] for s in srcs])
    if read is None:
        return None, None, why
    return dict(zip(srcs, read)), {srcs[i]: r for i, r in rows.items()}, ""
