"""The reader's attention calls, described for ``parallel.kernels.attention.autotune``.

``backend=auto`` times its candidates on first use of a shape key (``parallel.kernels.autotune``).
In one process that happens lazily; under torch.distributed nothing is timed lazily (ranks reach a
key at different moments), so the trainer calls ``tune_reader_attention`` once on every rank before
the first step: rank 0 measures, or reads its cache, and every rank runs its choices.
"""

from __future__ import annotations

import torch

from parallel.kernels.attention import autotune
from parallel.kernels.autotune import TuneSpec, seq_bucket
from rag_mm.config import TrainConfig


def reader_specs(cfg: TrainConfig, device: torch.device) -> list[TuneSpec]:
    """The attention shapes a native reader trains on: its retrieval layout (documents within
    themselves, the query over them) at the longest sequence the config allows and the bucket
    below it (a packed batch is often shorter than the longest). Empty for other readers (their
    head size is the language model's, read at their own first call) and for fixed backends."""
    m = cfg.model
    if m.family != "native" or m.attention_backend != "auto":
        return []
    k = cfg.retriever.top_k if cfg.retriever.mode != "none" else 0
    patches = (m.image_size // m.patch_size) ** 2
    # k documents (patches + passage) and the query (patches + question + answer)
    longest = k * (patches + m.max_doc_text) + patches + m.max_question + m.max_answer
    dtype = torch.bfloat16 if cfg.optim.precision == "bf16" else torch.float32
    top = seq_bucket(longest)
    return [
        TuneSpec(
            layout="retrieval",
            seq_len=s,
            head_dim=m.dim // m.heads,
            dtype=dtype,
            grad=True,
            device=device.type,
        )
        for s in sorted({top, max(top // 2, 1)})
    ]


def tune_reader_attention(cfg: TrainConfig, device: torch.device, group=None) -> dict[str, str]:
    """Choose ``auto``'s kernel for every shape of ``reader_specs``; a collective under
    torch.distributed (every rank calls it at the same point). Key -> choice (each logged once
    by the tuner)."""
    specs = reader_specs(cfg, device)
    return autotune(specs, group) if specs else {}
