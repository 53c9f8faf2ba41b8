"""A learned-retriever ``SpreadRag`` on fake CUDA with its memory on the device, for the step
audits of ``tests/gpu_fake/test_learned_step.py`` and ``scripts/bench/host_syncs.py``."""

from __future__ import annotations

import torch

from rag_mm.data.documents import DocumentStore
from rag_mm.distributed.spread import SpreadRag
from rag_mm.model.rag import RagModel
from retriever.encoders import DualEncoder
from retriever.memory import RetrievalMemory

CUDA = torch.device("cuda")


def learned_spread(cfg, mode, reader, ids) -> SpreadRag:
    """The demo's RagModel with a learned retriever on fake CUDA, its memory of documents ``ids``
    (a real tensor) refreshed once (the refresh is not the step: real tensors are let in)."""
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
    return SpreadRag(RagModel(reader, store, r, enc, memory), cfg, CUDA)
