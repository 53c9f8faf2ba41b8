"""A randomly initialised HF reader embeds only its tokenizer's ids (``model.trim_vocab``): the
Llama-3.2-1B preset's 128,256 rows become the bundled tokenizer's 49,408 (161 M parameters less,
head still tied); ``model.trim_vocab=false`` keeps the preset's rows."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts" / "bench"))

import stepbench as sb  # noqa: E402

from rag_mm.model.factory import build_reader, count_parameters  # noqa: E402

ONE_B = ["model=llama3_2_1b", "retriever.top_k=2"]


def test_preset_vocabulary_cut_to_the_tokenizer():
    cfg, m, vocab = sb.compose_run(ONE_B)
    cut = build_reader(m, vocab, meta=True)
    emb = cut.lm.get_input_embeddings().weight
    assert vocab == 49408 and emb.shape == (vocab, 2048)
    assert cut.lm.get_output_embeddings().weight is emb
    cfg, m_keep, _ = sb.compose_run([*ONE_B, "model.trim_vocab=false"])
    kept = build_reader(m_keep, vocab, meta=True)
    assert kept.lm.get_input_embeddings().weight.shape == (128256, 2048)
    assert count_parameters(kept) - count_parameters(cut) == (128256 - 49408) * 2048


def test_cut_reader_trains():
    cfg, m, vocab = sb.compose_run(
        ["model=hf_tiny", "retriever.top_k=2", "model.lm.vocab_size=60000"]
    )
    model = sb.build_model(m, vocab, "cpu").train()
    assert model.lm.get_input_embeddings().weight.shape[0] == vocab
    loss = model(**sb.synthetic_batch(cfg, 2, vocab, "cpu")).loss
    loss.backward()
    assert torch.isfinite(loss)
