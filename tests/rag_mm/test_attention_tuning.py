"""The reader's attention shapes are tuned before the first step: the specs match what the reader
runs, and tuning them fills the tuner's choices for exactly those keys."""

from __future__ import annotations

import torch

from parallel.kernels import autotune as T
from rag_mm.config import compose
from rag_mm.model.attention_tuning import reader_specs, tune_reader_attention


def test_specs_follow_the_reader_config():
    cfg = compose(["+experiment=demo"])
    m = cfg.model
    specs = reader_specs(cfg, torch.device("cpu"))
    patches = (m.image_size // m.patch_size) ** 2
    longest = (
        cfg.retriever.top_k * (patches + m.max_doc_text) + patches + m.max_question + m.max_answer
    )
    assert [s.seq_len for s in specs] == sorted({T.seq_bucket(longest), T.seq_bucket(longest) // 2})
    assert {(s.layout, s.head_dim, s.dtype, s.grad) for s in specs} == {
        ("retrieval", m.dim // m.heads, torch.float32, True)
    }
    # closed book: only the query segment
    closed = compose(["+experiment=demo", "retriever=none"])
    assert max(s.seq_len for s in reader_specs(closed, torch.device("cpu"))) == T.seq_bucket(
        patches + m.max_question + m.max_answer
    )
    # a fixed backend is not tuned
    assert (
        reader_specs(
            compose(["+experiment=demo", "model.attention_backend=sdpa"]), torch.device("cpu")
        )
        == []
    )


def test_tuning_chooses_for_every_spec(tmp_path, monkeypatch):
    monkeypatch.setenv(T.CACHE_ENV, str(tmp_path / "autotune.json"))
    monkeypatch.delenv(T.ENV, raising=False)
    T.reset()
    try:
        cfg = compose(["+experiment=demo", "retriever=none"])
        specs = reader_specs(cfg, torch.device("cpu"))
        choices = tune_reader_attention(cfg, torch.device("cpu"))
        # one choice per spec (at least SDPA and the reference-checked fused kernel compete on a
        # machine with the extension; without it there is nothing to choose and nothing is tuned)
        from parallel.kernels.attention import fused_available

        if fused_available()[0]:
            assert len(choices) == len(specs)
            assert all(c.startswith(("sdpa", "fused")) for c in choices.values())
        else:
            assert choices == {}
    finally:
        T.reset()
