"""Accuracy by kind of question (the query json's ``attribute``), seen and held-out apart.

A knowledge-VQA score hides where copying fails: a reader can answer the shared facts (a category,
a version) by picking among training answers and still miss every name of an unseen entity. The
kinds are not known in advance and a rank may see only some of them, so each rank keeps a dict
and the dicts are merged over the ranks (``all_gather_object``) once, at the end.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


class KindSums:
    """Per kind: [seen queries, seen correct, held-out queries, held-out correct]."""

    def __init__(self) -> None:
        self.rows: dict[str, list[float]] = {}

    def add(self, kinds: list[str], correct: torch.Tensor, heldout: torch.Tensor) -> None:
        """One batch: ``kinds`` (B,) names ("" for none), ``correct`` and ``heldout`` (B,) bool."""
        for kind, c, h in zip(kinds, correct.tolist(), heldout.tolist()):
            if kind:
                row = self.rows.setdefault(kind, [0.0, 0.0, 0.0, 0.0])
                row[2 * int(h)] += 1
                row[2 * int(h) + 1] += float(c)

    def results(self, replicas: int = 1) -> dict:
        """{kind: {n_seen, acc_seen, n_heldout, acc_heldout}} over every rank (a rank's share is
        counted ``replicas`` times when that many ranks see each batch: divided back)."""
        rows = self.rows
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            every: list[dict[str, list[float]] | None] = [None] * dist.get_world_size()
            dist.all_gather_object(every, rows)
            rows = {}
            for part in every:
                for kind, r in (part or {}).items():
                    rows[kind] = [a + b for a, b in zip(rows.get(kind, [0.0] * 4), r)]
        out = {}
        for kind in sorted(rows):
            ns, cs, nh, ch = (x / replicas for x in rows[kind])
            out[kind] = {
                "n_seen": int(ns),
                "acc_seen": cs / ns if ns else None,
                "n_heldout": int(nh),
                "acc_heldout": ch / nh if nh else None,
            }
        return out
