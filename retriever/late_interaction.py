"""Late interaction between picture grids: ColBERT's MaxSim on a vision tower's feature map.

A dual encoder scores a query against a document with one dot product of two pooled vectors. Late
interaction keeps each picture as a grid of token vectors instead (here a stage of the tower, e.g.
a ModifiedResNet's ``layer2``: a 6 x 6 grid at 48 px) and scores a pair by how well every token of
one finds a match among the other's (Khattab & Zaharia, ColBERT, SIGIR 2020), both ways:

    maxsim(q, d) = 1/2 (mean_i max_j <q_i, d_j> + mean_j max_i <q_i, d_j>)

A part drawn in another style, turned or moved, still finds its counterpart wherever it sits,
where a pooled vector mixes it with everything else in the picture. The score costs T x U dot
products a pair (36 x 36 on a 6 x 6 grid), so it reranks a pooled index's over-retrieved top-k
rather than searching a large memory itself.

The trainer does not use it: on the knowledge-VQA emoji set it ranks below the pooled vector of the
same tower, alone or as a reranker (``scripts/bench/retriever_unseen.py --maxsim``, measured in
benchmarks/kvqa_emoji_cpu_2026-11-26.md, section 24).

Written by hand: ColBERT's scorer is for text tokens behind its own index; what is needed here is
its score on a tower's grid, which no library in use exposes.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


def maxsim(q: torch.Tensor, d: torch.Tensor, chunk: int = 64) -> torch.Tensor:
    """Unit token vectors q (Q, T, E) and d (R, U, E) -> (Q, R) symmetric MaxSim scores in
    [-1, 1]. ``chunk`` queries at a time bound the (chunk, R, T, U) similarity tensor."""
    R, U, E = d.shape
    keys = d.reshape(R * U, E)
    out = []
    for i in range(0, len(q), chunk):
        c, T = q[i : i + chunk].shape[:2]
        # one GEMM: (c * T, E) @ (E, R * U) -> (c, T, R, U)
        s = (q[i : i + chunk].reshape(c * T, E) @ keys.T).view(c, T, R, U)
        out.append(0.5 * (s.amax(3).mean(1) + s.amax(1).mean(2)))
    return torch.cat(out) if out else q.new_zeros(0, R)


def maxsim_pairs(q: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """Paired unit token vectors q (P, T, E) and d (P, U, E) -> (P,) MaxSim of each pair (a
    query's over-retrieved candidates, row by row)."""
    s = torch.einsum("pte,pue->ptu", q, d)  # (P, T, U)
    return 0.5 * (s.amax(2).mean(1) + s.amax(1).mean(1))


class GridTokens(nn.Module):
    """Catches the feature map (N, C, H, W) a stage of a tower returns (a forward hook) and turns
    it into unit token vectors (N, H * W, dim) through a linear map of its own. The tower runs as
    always; ``take()`` returns the grid of its last call."""

    def __init__(self, stage: nn.Module, channels: int, dim: int = 64) -> None:
        super().__init__()
        self.proj = nn.Linear(channels, dim)
        # MaxSim's temperature for a softmax over documents, CLIP's start (1 / 0.07)
        self.log_scale = nn.Parameter(torch.tensor(2.6593))
        self._grid: torch.Tensor | None = None
        self._hook = stage.register_forward_hook(self._catch)

    def _catch(self, module: nn.Module, inputs, out: torch.Tensor) -> None:
        self._grid = out

    def take(self) -> torch.Tensor:
        """The grid of the tower's last call -> (N, H * W, dim) unit vectors."""
        if self._grid is None:
            raise RuntimeError("GridTokens.take() before the tower ran")
        g, self._grid = self._grid, None
        return F.normalize(self.proj(g.flatten(2).transpose(1, 2)), dim=-1)

    def scale(self) -> torch.Tensor:
        return self.log_scale.exp().clamp(max=100.0)
