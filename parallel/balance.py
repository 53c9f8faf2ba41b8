"""Contiguous balancing algorithms: the exact min-max dynamic program the partitioner uses, and
the baselines the benchmark compares with (DeepSpeed's 'uniform' and 'parameters', torchgpipe's
balance_by_time).

A partition of n units into k stages is given by its bounds ``[0 = b_0 < b_1 < ... < b_k = n]``;
stage s covers units ``[b_s, b_{s+1})``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import numpy as np

from .cost import StageCosts


class InfeasiblePartition(ValueError):
    """No contiguous partition satisfies the memory cap / co-location constraints."""


def minmax_partition(
    costs: StageCosts,
    k: int,
    cap: float | None = None,
    forbidden: Iterable[int] = (),
    tolerance: float = 0.0,
) -> tuple[list[int], float]:
    """Exact contiguous partition minimising the largest stage cost, then - among partitions whose
    largest stage cost is within ``(1 + tolerance)`` of that optimum - the total bytes crossing
    the cuts. Stage costs may depend on the stage index (schedules hold different numbers of
    microbatches per rank). ``forbidden`` are cut positions j (cut before unit j) not allowed.

    Two dynamic programs over (stage, end unit), each O(k n^2) vectorised over the start unit:
    ``D[s][j] = min_i max(D[s-1][i], cost(s-1, i, j))`` (the classic linear-partition recurrence),
    then ``C[s][j] = min_i C[s-1][i] + cut[j]`` over starts with ``cost(s-1, i, j) <= bound``.
    """
    n = len(costs.units)
    mods = sum(u.kind == "module" for u in costs.units)
    if mods < k:
        raise InfeasiblePartition(
            f"{mods} module units ({n} units in all) cannot give each of {k} stages a module"
        )
    bad = np.zeros(n + 1, dtype=bool)
    for j in forbidden:
        if 0 < j < n:
            bad[j] = True
    D = np.full((k + 1, n + 1), np.inf)
    D[0, 0] = 0.0
    for s in range(1, k + 1):
        for j in range(s, n - (k - s) + 1):
            if bad[j]:
                continue
            c = costs.cost_all_i(s - 1, j, cap)  # (j,)
            D[s, j] = np.maximum(D[s - 1, :j], c).min()
    best = float(D[k, n])
    if not math.isfinite(best):
        raise InfeasiblePartition("no contiguous partition fits the memory cap and constraints")
    bound = best * (1.0 + tolerance) + 1e-12
    C = np.full((k + 1, n + 1), np.inf)
    C[0, 0] = 0.0
    arg = np.zeros((k + 1, n + 1), dtype=np.int64)
    cut = costs.cut
    for s in range(1, k + 1):
        for j in range(s, n - (k - s) + 1):
            if bad[j]:
                continue
            c = costs.cost_all_i(s - 1, j, cap)
            tot = np.where(c <= bound, C[s - 1, :j], np.inf)
            i = int(np.argmin(tot))
            if math.isfinite(tot[i]):
                C[s, j] = tot[i] + cut[j]
                arg[s, j] = i
    bounds = [n]
    for s in range(k, 0, -1):
        bounds.append(int(arg[s, bounds[-1]]))
    bounds.reverse()
    return bounds, max(costs.cost(s, bounds[s], bounds[s + 1], cap) for s in range(k))


def bottleneck(costs: StageCosts, bounds: Sequence[int], cap: float | None = None) -> float:
    return max(costs.cost(s, bounds[s], bounds[s + 1], cap) for s in range(len(bounds) - 1))


# ----------------------------------------------------------------------------- baselines


def uniform_bounds(n: int, k: int) -> list[int]:
    """DeepSpeed ``partition_method='uniform'``: the same number of layers per stage (the first
    ``n % k`` stages take one more). Stages may be empty when n < k."""
    q, r = divmod(n, k)
    bounds = [0]
    for s in range(k):
        bounds.append(bounds[-1] + q + (1 if s < r else 0))
    return bounds


def balanced_bounds(weights: Sequence[float], k: int) -> list[int]:
    """Contiguous split minimising the largest stage weight: bisection on the bottleneck with a
    greedy probe, as DeepSpeed's ``partition_balanced`` (``_lprobe``) and torchgpipe's
    ``balance_cost`` do. Used with parameter counts ('parameters') and measured times
    (``balance_by_time``). Stages may be empty when there are fewer layers than stages."""
    w = [max(float(x), 0.0) for x in weights]
    n = len(w)
    if n == 0:
        return [0] * (k + 1)

    def probe(limit: float) -> list[int] | None:
        bounds, acc = [0], 0.0
        for i, x in enumerate(w):
            if x > limit:
                return None
            if acc + x > limit:
                bounds.append(i)
                acc = 0.0
                if len(bounds) > k:
                    return None
            acc += x
        while len(bounds) < k:  # pad with empty stages at the end
            bounds.append(n)
        bounds.append(n)
        return bounds

    lo, hi = max(w), sum(w)
    best = probe(hi)
    for _ in range(100):
        mid = (lo + hi) / 2
        b = probe(mid)
        if b is None:
            lo = mid
        else:
            hi, best = mid, b
        if hi - lo <= 1e-9 * max(hi, 1e-30):
            break
    # spread trailing empty stages: give them the tail units when possible
    return _fill_empty(best, n)


def _fill_empty(bounds: list[int], n: int) -> list[int]:
    """Move boundaries so no stage is empty while there are units to spare (a baseline that
    leaves a GPU idle would be a straw man)."""
    k = len(bounds) - 1
    b = list(bounds)
    for s in range(k - 1, 0, -1):  # push cuts left from the end where a stage is empty
        if b[s] >= b[s + 1] and b[s + 1] - 1 > b[s - 1]:
            b[s] = b[s + 1] - 1
    for s in range(1, k):
        if b[s] <= b[s - 1] and b[s - 1] + 1 < n:
            b[s] = min(b[s - 1] + 1, n)
    return sorted(b)
