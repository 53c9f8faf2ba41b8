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

The draw hashes the retrieved ids alone (host tensors, no device synchronisation), so every rank
of a replica (pipeline stages, tensor-parallel ranks) draws the same order for the same batch, and
a resumed run draws it again.
"""

from __future__ import annotations

import math

import torch

from rag_mm.model.anonymize import P, mix


def shuffled_reads(top: torch.Tensor, share: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``top`` (B, k) retrieved ids (host, nearest first; -1 for an unfilled slot) -> (order (B, k):
    the column of ``top`` each reading position takes, blind (B,) bool: the rows read shuffled with
    a uniform prior). About ``share`` of the rows are shuffled; the others keep 0..k-1."""
    B, k = top.shape
    w = mix(torch.arange(k, dtype=torch.long) + 1)  # (k,) a weight per rank
    key = mix(((top.long() % P) * w % P).sum(1) % P)  # (B,) a hash of the retrieved ids
    blind = (mix(key) % 10_000) < share * 10_000  # (B,)
    order = torch.arange(k).repeat(B, 1)  # (B, k)
    for b in blind.nonzero().flatten().tolist():  # host tensors: a few small draws a step
        order[b] = torch.randperm(k, generator=torch.Generator().manual_seed(int(key[b])))
    return order, blind


def unranked_prior(prior: torch.Tensor, blind: torch.Tensor) -> torch.Tensor:
    """log p(d | q) (B, k) with the ``blind`` (B,) rows made uniform (-log k): the copy head then
    weighs their documents by its own scores alone."""
    k = prior.shape[1]
    return torch.where(blind.to(prior.device)[:, None], prior.new_full((), -math.log(k)), prior)
