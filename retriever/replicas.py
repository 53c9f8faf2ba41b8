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
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

# the differentiable all-gather: all_gather_single_autograd from torch 2.14, all_gather_tensor_autograd before
_gather_autograd = getattr(funcol, "all_gather_single_autograd", None) or funcol.all_gather_tensor_autograd


@dataclass(frozen=True)
class Replicas:
    group: Any = None  # process group with one rank of every replica (None: one replica, nothing to gather)
    rank: int = 0  # this replica's index in ``group``: its rows come at that place in a gather
    size: int = 1  # replicas in ``group``

    def share(self, n: int) -> slice:
        """This replica's rows of ``n`` rows drawn alike on every replica: contiguous, in rank order,
        the first ``n % size`` replicas taking one more."""
        base, extra = divmod(n, self.size)
        start = self.rank * base + min(self.rank, extra)
        return slice(start, start + base + (self.rank < extra))

    def gather(self, *xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Every replica's rows of each of ``xs`` (all n_r rows long here) concatenated in rank
        order: (sum n_r, ...), the same on every replica, differentiable back into this replica's
        rows. Replicas may hold different row counts (a share of an uneven draw): the counts are
        exchanged once for all of ``xs``, rows padded to the longest for the collective and the
        padding dropped."""
        if self.group is None or self.size == 1:
            return xs
        n = torch.tensor([xs[0].shape[0]], device=xs[0].device)
        counts = [torch.zeros_like(n) for _ in range(self.size)]
        dist.all_gather(counts, n, group=self.group)
        counts = [int(c) for c in counts]
        longest = max(counts)
        out = []
        for x in xs:
            if x.shape[0] < longest:
                x = torch.cat([x, x.new_zeros(longest - x.shape[0], *x.shape[1:])])
            rows = _gather_autograd(x.contiguous(), 0, self.group)  # (size * longest, ...); backward sums into each owner
            out.append(torch.cat([rows[r * longest:r * longest + c] for r, c in enumerate(counts)]))
        return tuple(out)
