"""A document memory split across ranks: embedding it, and searching it when it outgrows one
process.

``embed_sharded`` has each rank embed 1/W of every forward pass one process would make and
all-gathers the whole (the memory's synchronous refresh and scripts/build_index.py).

``ShardedIndex`` searches a memory too large for one process: each rank holds an index over 1/W
of the documents, added with their global ids (``shard_bounds`` gives the contiguous split).
A search is collective, Atlas-style:

1. all-gather the queries (each rank may bring a different number, zero included);
2. every rank searches its shard for all queries: top-k (scores, global ids) per query;
3. all-to-all sends each query's W candidate lists back to the rank that asked it;
4. the owner merges its W*k candidates to the top-k, ties broken by ascending id.

With exact (Flat) shards the merged result is exactly the top-k of one Flat index over all
documents, ids and scores (``tests/retriever/test_index_sharded.py``). Works on gloo (CPU
tensors) and nccl (CUDA tensors; the faiss search itself runs wherever the shard index lives).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any, Protocol

import numpy as np
import torch
import torch.distributed as dist

from retriever.errors import RefreshInterrupted
from retriever.index import sort_rows


class Searchable(Protocol):
    def search(self, queries: Any, k: int) -> tuple[Any, Any]: ...


def embed_sharded(
    embed: Callable[[range], torch.Tensor],
    num_rows: int,
    dim: int,
    chunk: int | None = None,
    jointly: Callable[[], AbstractContextManager] = contextlib.nullcontext,
    should_stop: Callable[[], bool] | None = None,
) -> torch.Tensor:
    """``embed(rows)`` -> (len(rows), dim) over all ``num_rows`` rows, split across the ranks; the
    (num_rows, dim) whole on every rank.

    The rows go in passes of ``chunk`` (default all of them), as one process embeds them in forward
    passes of that many rows. Each pass is split over the ranks, contiguous shares in rank order
    (``shard_bounds``), each rank embedding its share under ``jointly()`` (a context in which the
    encoder's batch statistics span the ranks, ``Replicas.spanning``: then a training-mode
    BatchNorm normalises every pass as one process does) and an all-gather assembling the pass. A
    pass of fewer rows than ranks is embedded whole by every rank, no share being empty. Without a
    process group, or with one rank, ``embed`` of each pass.

    ``should_stop()``, called on every rank before each pass (it may be a collective: every rank
    makes the same calls), ends the embedding with ``RefreshInterrupted`` when it returns True.
    """
    chunk = max(1, chunk or num_rows)
    passes = [range(s, min(num_rows, s + chunk)) for s in range(0, num_rows, chunk)]

    def check(done: int) -> None:
        if should_stop is not None and should_stop():
            raise RefreshInterrupted(done, len(passes))

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        out = [torch.zeros(0, dim)]
        for i, p in enumerate(passes):
            check(i)
            out.append(embed(p))
        return torch.cat(out)
    W, r = dist.get_world_size(), dist.get_rank()
    out = torch.zeros(num_rows, dim)
    for i, p in enumerate(passes):
        check(i)
        if len(p) < W:
            out[p.start : p.stop] = embed(p)
            continue
        bounds = [shard_bounds(len(p), i, W) for i in range(W)]
        start, stop = bounds[r]
        with jointly():
            mine = embed(range(p.start + start, p.start + stop))  # (stop - start, dim)
        longest = max(b - a for a, b in bounds)
        buf = torch.zeros(longest, dim)  # all_gather needs equal sizes: pad to the longest share
        buf[: len(mine)] = mine
        parts = [torch.zeros_like(buf) for _ in range(W)]
        dist.all_gather(parts, buf)
        out[p.start : p.stop] = torch.cat([part[: b - a] for part, (a, b) in zip(parts, bounds)])
    return out


def shard_bounds(num_docs: int, rank: int, world: int) -> tuple[int, int]:
    """Rows [start, stop) of rank ``rank``'s shard; sizes differ by at most one."""
    base, extra = divmod(num_docs, world)
    start = rank * base + min(rank, extra)
    return start, start + base + (rank < extra)


class ShardedIndex:
    """This rank's shard of a memory, searched collectively with every rank of ``group``.

    ``local`` is anything with ``search(queries, k) -> (scores, ids)`` that follows the
    ``FaissIndex`` conventions (higher score is better, global ids, -1 / -inf for missing): a
    ``FaissIndex`` or a ``retriever.serve.DocumentIndex`` (whose rebuilds then swap this rank's
    shard).
    """

    def __init__(self, local: Searchable, group: dist.ProcessGroup | None = None):
        self.local = local
        self.group = group

    def _comm_device(self) -> torch.device:
        if "nccl" in dist.get_backend(self.group):
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def search(self, queries: Any, k: int) -> tuple[Any, Any]:
        """Global top-``k`` for this rank's ``queries`` (nq, dim); every rank must call it.

        Returns ``(scores, ids)`` (nq, k) in the form of ``queries``: torch on its device, or numpy.
        """
        is_torch = isinstance(queries, torch.Tensor)
        out_device = queries.device if is_torch else None
        dev = self._comm_device()
        q = (queries.detach() if is_torch else torch.tensor(np.asarray(queries))).to(
            dev, torch.float32
        )
        if q.ndim != 2 and q.numel():
            raise ValueError(f"queries must be (nq, dim), got shape {tuple(q.shape)}")
        world = dist.get_world_size(self.group)

        # 1. Gather every rank's queries; sizes may differ, so pad to the largest batch.
        counts_t = [torch.zeros(1, dtype=torch.int64, device=dev) for _ in range(world)]
        dist.all_gather(
            counts_t, torch.tensor([q.shape[0]], dtype=torch.int64, device=dev), group=self.group
        )
        counts = [int(c.item()) for c in counts_t]
        dim, most = self._index().dim, max(counts)
        if q.shape[0] == 0:
            q = q.reshape(0, dim)  # an empty batch may come as (0,) or (0, 0)
        if q.shape[1] != dim:
            raise ValueError(f"shard holds {dim}-d vectors, got {q.shape[1]}-d queries")
        padded = torch.zeros(most, dim, dtype=torch.float32, device=dev)
        padded[: q.shape[0]] = q
        gathered = [torch.empty_like(padded) for _ in range(world)]
        dist.all_gather(gathered, padded, group=self.group)
        all_q = torch.cat([g[:n] for g, n in zip(gathered, counts)])  # (sum(counts), dim)

        # 2. Search this shard for everyone's queries.
        if all_q.shape[0]:
            s, i = self.local.search(all_q.cpu().numpy(), k)  # (sum(counts), k) each
        else:
            s, i = np.zeros((0, k), np.float32), np.zeros((0, k), np.int64)
        scores = torch.from_numpy(np.ascontiguousarray(s, dtype=np.float32)).to(dev)
        ids = torch.from_numpy(np.ascontiguousarray(i, dtype=np.int64)).to(dev)

        # 3. Send each rank the candidate lists of its own queries; rows arrive grouped by shard.
        mine = counts[dist.get_rank(self.group)]
        recv_s = torch.empty(world * mine, k, dtype=torch.float32, device=dev)
        recv_i = torch.empty(world * mine, k, dtype=torch.int64, device=dev)
        dist.all_to_all_single(recv_s, scores, [mine] * world, counts, group=self.group)
        dist.all_to_all_single(recv_i, ids, [mine] * world, counts, group=self.group)

        # 4. Merge (world, nq, k) -> (nq, world * k) -> top-k, score descending then id ascending.
        cand_s = recv_s.view(world, mine, k).permute(1, 0, 2).reshape(mine, world * k).cpu().numpy()
        cand_i = recv_i.view(world, mine, k).permute(1, 0, 2).reshape(mine, world * k).cpu().numpy()
        top_s, top_i = sort_rows(cand_s, cand_i, k)
        if is_torch:
            return torch.from_numpy(top_s).to(out_device), torch.from_numpy(top_i).to(out_device)
        return top_s, top_i

    def _index(self):
        """The FaissIndex behind ``local`` (a DocumentIndex serves its current one)."""
        return self.local.current if hasattr(self.local, "current") else self.local

    def num_docs(self) -> int:
        """Documents over all shards (collective)."""
        n = torch.tensor([self._index().ntotal], dtype=torch.int64, device=self._comm_device())
        dist.all_reduce(n, group=self.group)
        return int(n.item())
