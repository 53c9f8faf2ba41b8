"""Retriever losses: in-batch contrastive (CLIP), and the reader-driven losses named in Atlas
(Izacard et al. 2022, arXiv 2208.03299 §2.2): attention distillation, EMDR², perplexity
distillation.

Shapes: ``scores`` (B, k) retriever scores of each query's k retrieved documents (already scaled
by the temperature); reader signals per (query, document) pair are (B, k) and detached here.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def contrastive(
    q: torch.Tensor,
    d: torch.Tensor,
    q_doc: torch.Tensor,
    scale: torch.Tensor,
    hard: torch.Tensor | None = None,
    hard_doc: torch.Tensor | None = None,
    valid: torch.Tensor | None = None,
) -> torch.Tensor:
    """InfoNCE of queries against the batch's gold documents (both directions, as CLIP), plus
    optional hard negatives for the query side (DPR, Karpukhin et al. 2020).

    q, d: (B, E) unit vectors; q_doc: (B,) gold document id of each query; hard: (N, E) more
    document embeddings (e.g. what the index retrieved) with ids hard_doc (N,). Every candidate
    whose id is a query's gold id counts as a positive of it (multi-positive targets).
    valid: (B,) bool, the rows that take part (None: all). A row left out is neither a query nor
    a candidate: the loss equals the one over the valid rows alone, with fixed shapes (selecting
    them would read their count back from the device); no valid row gives 0.
    """
    logits = scale * q @ d.t()  # (B, B)
    pos = (q_doc[:, None] == q_doc[None, :]).float()  # (B, B)
    if valid is not None:
        both = valid[:, None] & valid[None, :]  # (B, B) pairs of valid rows
        pos = pos * both
        # a left-out row or column weighs nothing in the softmax: a finite fill, not -inf, keeps
        # a fully left-out row's softmax (and its gradient) finite
        logits = logits.masked_fill(~both, torch.finfo(logits.dtype).min)
    # every valid row is its own positive: the clamp only keeps left-out rows and columns at 0 / 1
    d2q = -(pos / pos.sum(0, keepdim=True).clamp_min(1) * F.log_softmax(logits, 0)).sum(0)
    if hard is not None:
        logits = torch.cat([logits, scale * q @ hard.t()], 1)  # (B, B + N)
        hard_pos = (q_doc[:, None] == hard_doc[None, :]).float()  # (B, N)
        pos = torch.cat([pos, hard_pos if valid is None else hard_pos * valid[:, None]], 1)
    q2d = -(pos / pos.sum(1, keepdim=True).clamp_min(1) * F.log_softmax(logits, 1)).sum(1)
    if valid is None:
        return 0.5 * (q2d.mean() + d2q.mean())
    n = valid.sum().clamp_min(1)
    return 0.5 * ((q2d * valid).sum() + (d2q * valid).sum()) / n


def _kl_to(target: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
    """KL(target || softmax(scores)) averaged over queries; target rows sum to 1 and are
    constants."""
    return F.kl_div(F.log_softmax(scores, -1), target.detach(), reduction="batchmean")


def perplexity_distillation(
    scores: torch.Tensor, reader_nll: torch.Tensor, temperature: float
) -> torch.Tensor:
    """PDist: the target is softmax(-NLL_i / tau), the reader's answer NLL with document i alone."""
    return _kl_to(F.softmax(-reader_nll.detach() / temperature, -1), scores)


def attention_distillation(
    scores: torch.Tensor, doc_attention: torch.Tensor, temperature: float = 1.0
) -> torch.Tensor:
    """ADist: the target is the reader's attention mass on each document (from the answer
    positions)."""
    target = doc_attention.detach().clamp_min(1e-9)
    if temperature != 1.0:
        target = F.softmax(target.log() / temperature, -1)
    return _kl_to(target / target.sum(-1, keepdim=True), scores)


def emdr2(scores: torch.Tensor, reader_loglik: torch.Tensor) -> torch.Tensor:
    """EMDR²: -log sum_i p_retr(d_i | q) p_reader(a | q, d_i), reader term constant (Sachan et al.
    2021)."""
    return -torch.logsumexp(F.log_softmax(scores, -1) + reader_loglik.detach(), -1).mean()
