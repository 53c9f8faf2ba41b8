"""Tiny Hugging Face readers and their inputs, shared by the reader, pipeline and tensor-parallel
tests (module-level so spawned ranks can import them)."""

from __future__ import annotations

import torch

from rag_mm.config import ModelConfig

# tiny configs of several decoder families: each exercises another attention / position code path
# (rotary with grouped-query heads, learned absolute positions with a fused Conv1D q|k|v, a fused
# qkv Linear with partial rotary, q/k norms, scaled embeddings with final-logit soft-capping,
# GPT-NeoX's parallel residual)
LM_CONFIGS = {
    "llama": dict(
        model_type="llama",
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
    ),
    "gpt2": dict(model_type="gpt2", n_embd=64, n_layer=2, n_head=4, n_positions=256),
    "qwen2": dict(
        model_type="qwen2",
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
    ),
    "phi3": dict(
        model_type="phi3",
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=256,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    ),
    "qwen3": dict(
        model_type="qwen3",
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=256,
    ),
    "gemma2": dict(
        model_type="gemma2",
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=256,
        attn_logit_softcapping=None,
    ),
    "gpt_neox": dict(
        model_type="gpt_neox",
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=256,
        eos_token_id=2,
        bos_token_id=1,
    ),
}


def model_config(
    family: str = "llama", vocab: int = 512, layers: int | None = None, **kw
) -> ModelConfig:
    lm = dict(LM_CONFIGS[family], vocab_size=vocab)
    if layers is not None:
        lm["n_layer" if family == "gpt2" else "num_hidden_layers"] = layers
    base = dict(
        family="hf",
        lm=lm,
        vision_width=32,
        vision_layers=1,
        vision_head_width=16,
        copy_head=False,
        attention_backend="reference",
    )
    return ModelConfig(**(base | kw))


def tiny_hf_reader(family: str = "llama", vocab: int = 512, seed: int = 0, **kw):
    from rag_mm.model.factory import build_reader

    torch.manual_seed(seed)
    return build_reader(model_config(family, vocab, **kw), vocab)


def reader_inputs(b: int = 4, k: int = 2, vocab: int = 512, seed: int = 1) -> dict:
    """A batch of b queries with k documents each (k = 0: closed book), ragged lengths."""
    g = torch.Generator().manual_seed(seed)
    lt, lq, la = 6, 5, 4
    x = {
        "image": torch.randn(b, 3, 32, 32, generator=g),
        "q_ids": torch.randint(0, vocab, (b, lq), generator=g),
        "q_len": torch.randint(2, lq + 1, (b,), generator=g),
        "a_ids": torch.randint(0, vocab, (b, la), generator=g),
        "a_len": torch.randint(2, la + 1, (b,), generator=g),
    }
    if k:
        x |= {
            "doc_image": torch.randn(b, k, 3, 32, 32, generator=g),
            "doc_ids": torch.randint(0, vocab, (b, k, lt), generator=g),
            "doc_len": torch.randint(1, lt + 1, (b, k), generator=g),
        }
    return x
