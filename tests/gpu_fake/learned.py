"""A learned-retriever ``RagModel`` (and its ``SpreadRag``) on fake CUDA with its memory on the
device, for the audits of ``tests/gpu_fake/`` and ``scripts/bench/host_syncs.py``."""

from __future__ import annotations

import torch

from rag_mm.data.documents import DocumentStore
from rag_mm.distributed.spread import SpreadRag
from rag_mm.model.rag import RagModel
from retriever.encoders import DualEncoder
from retriever.memory import RetrievalMemory

CUDA = torch.device("cuda")


def learned_rag(cfg, mode, reader, ids) -> RagModel:
    """The RagModel of ``cfg`` with a learned retriever on fake CUDA, its memory of documents
    ``ids`` (a real tensor) refreshed once, centred on six queries when ``retriever.centre`` (the
    refresh is not the step: real tensors are let in)."""
    r, m, N = cfg.retriever, cfg.model, len(ids)
    mode.allow_non_fake_inputs = True
    try:
        with torch.device(CUDA):
            enc = DualEncoder(r, m.image_size).train()
            store = DocumentStore(
                ids.to(CUDA),
                torch.randn(N, 3, m.image_size, m.image_size),
                torch.randint(0, 100, (N, m.max_doc_text)),
                torch.full((N,), 5),
                [""] * N,
                {},
            )
            calib = (
                torch.randn(6, 3, m.image_size, m.image_size),
                torch.randint(0, 100, (6, 4)),
                torch.full((6,), 4),
            )
        memory = RetrievalMemory(
            enc,
            store.images,
            store.text_ids,
            store.text_len,
            ids,
            device=CUDA,
            queries=calib if r.centre else None,
            on_device=True,
        )
        memory.refresh()
    finally:
        mode.allow_non_fake_inputs = False
    return RagModel(reader, store, r, enc, memory)


def learned_spread(cfg, mode, reader, ids) -> SpreadRag:
    """``learned_rag`` as the trainer trains it."""
    return SpreadRag(learned_rag(cfg, mode, reader, ids), cfg, CUDA)
