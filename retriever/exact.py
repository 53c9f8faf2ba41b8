"""Exact search on the training device: one matmul and one top-k, no host round trip.

faiss searches on the host, so a reader training on a GPU sends its query embeddings to the CPU
and waits for the ids to come back: a device-to-host sync in every step. Below the flat limit
(``retriever.index_choice.FLAT_MAX_DOCS``) exact search is a (B, E) x (E, N) matmul and a top-k,
which torch runs on whatever device the embeddings are on; the index is a tensor there and the
ids it returns stay there, for the document store's device-side fetch
(``rag_mm.data.documents.DocumentStore.to``). The same code runs on the CPU, where the tests hold
it to faiss's ``Flat`` index row for row. Past the flat limit faiss's approximate indexes are the
choice (on a GPU through ``FaissIndex.to_gpu`` when a faiss GPU build is installed).

``search_on_device`` is the gate ``retriever.search`` goes through; it says why in the log.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import torch

from retriever.config import SEARCH_SETTINGS
from retriever.index_choice import FLAT_MAX_DOCS, default_factory

log = logging.getLogger(__name__)

# the most of a GPU's memory the document store may take when ``auto`` moves it there: the
# reader, its optimizer state and activations need the rest
STORE_SHARE = 0.25


class TorchFlatIndex:
    """Exact inner-product search over ``x`` (N, E) with document ids (N,), on ``x``'s device.

    Results follow ``retriever.index``'s convention: scores descending, ties broken by ascending
    document id, missing results (k > N) scored -inf with id -1, so a search returns the documents
    faiss's ``Flat`` index returns, with scores equal to float rounding (torch's matmul and faiss's
    sum in different orders).
    """

    def __init__(self, x: torch.Tensor, ids: Any = None, device: Any = None) -> None:
        ids = torch.arange(len(x)) if ids is None else torch.as_tensor(np.asarray(ids))
        if ids.shape != (len(x),):
            raise ValueError(f"{len(x)} embeddings but {tuple(ids.shape)} ids")
        order = ids.argsort(stable=True)  # rows in ascending id order: row order breaks ties
        dev = torch.device(device) if device is not None else x.device
        self.x = x.detach()[order].to(dev, torch.float32)  # (N, E)
        self.ids = ids[order].to(dev, torch.long)  # (N,) ascending

    @property
    def ntotal(self) -> int:
        return len(self.ids)

    @property
    def dim(self) -> int:
        return self.x.shape[1]

    @property
    def device(self) -> torch.device:
        return self.x.device

    def __repr__(self) -> str:
        return f"TorchFlatIndex(dim={self.dim}, ntotal={self.ntotal}, {self.device})"

    def search(self, queries: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Top-``k`` (scores (B, k), ids (B, k)) for queries (B, E), on the index's device."""
        if k <= 0:
            raise ValueError(f"k must be positive, got {k}")
        q = queries.detach().to(self.device, torch.float32)
        if q.ndim != 2 or q.shape[1] != self.dim:
            raise ValueError(f"queries of shape {tuple(q.shape)} for an index of dim {self.dim}")
        # fp32 scores under a caller's autocast too: a bf16 matmul would rank by rounded scores
        # and the bit trick below reads the scores as int32
        with torch.autocast(self.device.type, enabled=False):
            scores = q @ self.x.T + 0.0  # (B, N); + 0.0 turns -0.0 into +0.0, which faiss ties
        kk = min(k, self.ntotal)
        # one int64 key per score: the score's bits made to sort as the float does, then the row
        # reversed, so the largest keys are the highest scores, lowest row (lowest id) first among
        # equals. torch.topk keeps an arbitrary one of tied values; the key has none.
        bits = scores.view(torch.int32)
        ordered = (bits ^ ((bits >> 31) & 0x7FFFFFFF)).long()  # monotone in the float
        rev = (self.ntotal - 1) - torch.arange(self.ntotal, device=self.device)  # (N,)
        rows = torch.topk((ordered << 32) | rev, kk, dim=1).indices  # (B, kk), sorted
        top, ids = scores.gather(1, rows), self.ids[rows]
        if kk < k:  # fewer documents than asked for: faiss's padding
            pad = (len(q), k - kk)
            top = torch.cat([top, top.new_full(pad, float("-inf"))], 1)
            ids = torch.cat([ids, ids.new_full(pad, -1)], 1)
        return top, ids


def search_on_device(setting: str, factory: str, num_docs: int, dim: int, device) -> bool:
    """Whether the memory is searched by ``TorchFlatIndex`` on ``device`` (else by faiss on the
    host), for ``retriever.search=setting``; logs the decision and why. ``device``: the one the
    retriever trains on. ``auto`` and ``device``: whenever the index is exact (``Flat``, or
    ``auto`` for a memory under the flat limit), on any device, the CPU included (where torch's
    matmul keeps up with faiss Flat: ``scripts/bench/search.py``); ``device`` refuses an approximate
    index, ``auto`` hands it to faiss. ``faiss``: faiss on the host always."""
    if setting not in SEARCH_SETTINGS:
        raise ValueError(f"retriever.search must be one of {SEARCH_SETTINGS} (got {setting!r})")
    resolved = default_factory(num_docs, dim) if factory == "auto" else factory
    exact = resolved == "Flat"
    dev = torch.device(device)
    if setting == "faiss":
        why, yes = "retriever.search=faiss", False
    elif not exact:
        if setting == "device":
            raise ValueError(
                f"retriever.search=device is exact search; retriever.index_factory={factory!r} "
                f"builds {resolved!r} for {num_docs} documents (the flat limit is "
                f"{FLAT_MAX_DOCS}): set retriever.index_factory=Flat or retriever.search=faiss"
            )
        why, yes = f"the index is approximate ({resolved})", False
    else:
        why, yes = f"retriever.search={setting}, an exact index", True
    log.info(
        "memory search: %s (%s)", f"matmul + top-k on {dev}" if yes else "faiss on the host", why
    )
    return yes


def store_fits(nbytes: int, device) -> bool:
    """Whether a document store of ``nbytes`` goes to ``device`` with the device search: always
    on the CPU, on a GPU when it takes at most ``STORE_SHARE`` of the device's memory."""
    dev = torch.device(device)
    if dev.type != "cuda":
        return True
    total = torch.cuda.get_device_properties(dev).total_memory
    fits = nbytes <= STORE_SHARE * total
    log.info(
        "document store: %.2f GiB %s (%.0f%% of the device's memory at most)",
        nbytes / 2**30,
        "on the device" if fits else "stays on the host: each fetch copies the ids back",
        100 * STORE_SHARE,
    )
    return fits
