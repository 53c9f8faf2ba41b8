"""Under autocast the HF reader hands rag_mm's attention q, k and v in one dtype (RoPE computes
q and k in fp32 while v comes from a bf16 matmul), and grouped K/V heads uncopied."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts" / "bench"))

import stepbench as sb  # noqa: E402

from rag_mm.model import hf_attention  # noqa: E402


def test_qkv_share_one_dtype_under_autocast(monkeypatch):
    seen = []
    real = hf_attention.attention

    def spy(q, k, v, **kw):
        seen.append((q.dtype, k.dtype, v.dtype, q.shape[1], k.shape[1]))
        return real(q, k, v, **kw)

    monkeypatch.setattr(hf_attention, "attention", spy)
    cfg, m, vocab = sb.compose_run(
        ["model=hf_tiny", "retriever.top_k=2", "model.attention_backend=sdpa"]
    )
    model = sb.build_model(m, vocab, "cpu").train()
    batch = sb.synthetic_batch(cfg, 2, vocab, "cpu")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model(**batch).loss.backward()
    assert len(seen) == m.lm["num_hidden_layers"]
    # hf_tiny: 4 query heads over 2 K/V heads
    assert all(d == (torch.bfloat16,) * 3 + (4, 2) for d in seen), seen
