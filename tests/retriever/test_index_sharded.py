"""Sharded search on 2 gloo ranks equals one Flat index over all documents, exactly; sharded
embedding assembles every row once, in order."""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
import torch

from retriever.index import FaissIndex, build_index
from retriever.sharded import ShardedIndex, embed_sharded, shard_bounds
from tests.distributed import run_ranks

DIM, K = 24, 10


def _data(n_docs: int, n_queries: int, seed: int):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n_docs, DIM)).astype(np.float32)
    q = rng.standard_normal((n_queries, DIM)).astype(np.float32)
    ids = rng.permutation(5 * n_docs)[:n_docs].astype(np.int64)  # sparse, shuffled global ids
    return x, q, ids


def _sharded_search(rank, world, doc_split, query_split, metric, seed):
    """Rank ``rank`` holds docs [doc_split[rank]) and asks queries [query_split[rank])."""
    x, q, ids = _data(doc_split[-1], query_split[-1], seed)
    d0, d1 = doc_split[rank], doc_split[rank + 1]
    q0, q1 = query_split[rank], query_split[rank + 1]
    shard = FaissIndex(DIM, "Flat", metric).add(x[d0:d1], ids[d0:d1])
    sharded = ShardedIndex(shard)
    assert sharded.num_docs() == len(x)
    mine = q[q0:q1]
    # Rank 0 asks with torch, rank 1 with numpy: both forms come back in kind.
    s, i = sharded.search(torch.from_numpy(mine) if rank == 0 else mine, K)
    assert isinstance(s, torch.Tensor) == (rank == 0)
    return np.asarray(s), np.asarray(i)


@pytest.mark.multirank
@pytest.mark.parametrize(
    "doc_split, query_split, metric",
    [
        ((0, 700, 1001), (0, 7, 30), "ip"),  # uneven shards, uneven query batches (7 vs 23)
        ((0, 4, 1001), (0, 30, 30), "l2"),  # a shard smaller than k; rank 1 asks nothing
    ],
)
def test_two_rank_sharded_search_equals_one_flat_index(doc_split, query_split, metric):
    out = run_ranks(_sharded_search, 2, doc_split, query_split, metric, 0)
    x, q, ids = _data(doc_split[-1], query_split[-1], 0)
    # one index, all queries
    ref_s, ref_i = FaissIndex(DIM, "Flat", metric).add(x, ids).search(q, K)
    got_s = np.concatenate([s for s, _ in out])
    got_i = np.concatenate([i for _, i in out])
    assert got_i.shape == (query_split[-1], K)
    np.testing.assert_array_equal(got_i, ref_i)
    np.testing.assert_array_equal(got_s, ref_s)


def _sharded_ties(rank, world):
    # Every vector is stored twice, once on each rank (ids v and v + 100): every score ties
    # across shards, and the merge must order the pair by id, like the single index does.
    x = np.random.default_rng(1).standard_normal((100, DIM)).astype(np.float32)
    start, stop = shard_bounds(200, rank, world)
    assert (start, stop) == ((0, 100), (100, 200))[rank]
    shard = FaissIndex(DIM, "Flat", "ip").add(x, np.arange(start, stop))
    return ShardedIndex(shard).search(x[:5] if rank == 0 else x[5:12], 7)


@pytest.mark.multirank
def test_sharded_ties_are_broken_by_id():
    out = run_ranks(_sharded_ties, 2)
    x = np.random.default_rng(1).standard_normal((100, DIM)).astype(np.float32)
    ref_s, ref_i = build_index(np.concatenate([x, x]), factory="Flat").search(x[:12], 7)
    got_s = np.concatenate([s for s, _ in out])
    got_i = np.concatenate([i for _, i in out])
    np.testing.assert_array_equal(got_i, ref_i)
    np.testing.assert_array_equal(got_s, ref_s)
    assert (got_i[:, 1] - got_i[:, 0] == 100).all()  # the pair, lower id first
    assert got_i[0, 0] == 0


def test_shard_bounds_cover_every_document_once():
    for n in (0, 1, 7, 1000, 1001):
        for world in (1, 2, 3, 8):
            spans = [shard_bounds(n, r, world) for r in range(world)]
            assert spans[0][0] == 0 and spans[-1][1] == n
            assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))
            sizes = [b - a for a, b in spans]
            assert max(sizes) - min(sizes) <= 1


def _embed_rows(rank, world, n, chunk=None):
    asked = []
    joint = []  # whether each call ran under ``jointly``

    @contextlib.contextmanager
    def jointly():
        joint.append(True)
        yield

    def embed(rows):  # row r -> (r, 10 r, 100 r): the whole shows where each row came from
        asked.append((rows.start, rows.stop, bool(joint) and joint.pop()))
        r = torch.arange(rows.start, rows.stop, dtype=torch.float32)
        return torch.stack([r, 10 * r, 100 * r], 1)

    return embed_sharded(embed, n, 3, chunk=chunk, jointly=jointly), asked


@pytest.mark.multirank
def test_embed_sharded_splits_rows_and_gathers_them_in_order():
    cases = (
        (5, None, [[(0, 3, True)], [(3, 5, True)]]),  # one pass, split
        (1, None, [[(0, 1, False)], [(0, 1, False)]]),  # fewer rows than ranks: both embed it whole
        # passes of 3 rows as one process makes them, each split; the last (1 row) whole on both
        (
            7,
            3,
            [
                [(0, 2, True), (3, 5, True), (6, 7, False)],
                [(2, 3, True), (5, 6, True), (6, 7, False)],
            ],
        ),
    )
    for n, chunk, calls in cases:
        out = run_ranks(_embed_rows, 2, n, chunk)
        r = torch.arange(n, dtype=torch.float32)
        for emb, _ in out:  # every rank gets the whole
            assert torch.equal(emb, torch.stack([r, 10 * r, 100 * r], 1))
        assert [asked for _, asked in out] == calls
    emb, asked = _embed_rows(0, 1, 4)  # no process group: one call over all rows
    assert emb.shape == (4, 3) and asked == [(0, 4, False)]
