"""Reading order: training queries whose retrieved documents the reader reads shuffled and unranked.

A reader trained on what a good retriever returns learns that the first document is the right one:
the rank offsets (``rank_emb``) and the retrieval prior on the copy attention say so, and on the
training queries they are nearly always right. Such a reader is then exactly as good as the
retriever's recall@1, although it reads k documents and the right one is often among them (recall@k
well above recall@1 on entities the retriever has never seen a query of). In a share of the
training queries (``retriever.reader_shuffle``) the k documents are read in a random order with a
uniform prior, so that the answer depends on the reader telling the right document apart itself
(its query picture against each document's picture and passage), as a cross-encoder reranker
does; the other queries keep the retriever's order and prior, which evaluation always uses.

The draw hashes the retrieved ids alone, with tensor ops on their device (no read back to the
host), so every rank of a replica (pipeline stages, tensor-parallel ranks) draws the same order for
the same batch, and a resumed run draws it again.
"""

from __future__ import annotations

import math

import torch

from rag_mm.model.anonymize import P, mix


def shuffled_reads(top: torch.Tensor, share: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``top`` (B, k) retrieved ids (nearest first; -1 for an unfilled slot) -> (order (B, k):
    the column of ``top`` each reading position takes, blind (B,) bool: the rows read shuffled with
    a uniform prior), on ``top``'s device. About ``share`` of the rows are shuffled; the others
    keep 0..k-1. Tensor ops alone: no value is read back to the host."""
    B, k = top.shape
    cols = torch.arange(k, dtype=torch.long, device=top.device)  # (k,)
    key = mix(((top.long() % P) * mix(cols + 1) % P).sum(1) % P)  # (B,) a hash of the retrieved ids
    blind = (mix(key) % 10_000) < share * 10_000  # (B,)
    # a permutation per row: its positions sorted by a hash of (row key, position) each
    noise = _scramble(key[:, None] ^ _scramble(cols + 1))  # (B, k)
    noise = _scramble(noise ^ (noise >> 11))
    order = torch.where(blind[:, None], noise.argsort(dim=1, stable=True), cols)
    return order, blind


def _scramble(v: torch.Tensor) -> torch.Tensor:
    """int64 values in [0, 2**31) -> residues mod P, non-linear (a square between two ``mix``
    rounds; the callers add xor and shift): ``mix`` alone is affine, and sorting an affine map of
    k consecutive positions gives only k orders of the k! there are."""
    v = mix(v)
    return mix((v * v + 1_540_483_477) % P)


def unranked_prior(prior: torch.Tensor, blind: torch.Tensor) -> torch.Tensor:
    """log p(d | q) (B, k) with the ``blind`` (B,) rows made uniform (-log k): the copy head then
    weighs their documents by its own scores alone."""
    k = prior.shape[1]
    return torch.where(blind.to(prior.device)[:, None], prior.new_full((), -math.log(k)), prior)
