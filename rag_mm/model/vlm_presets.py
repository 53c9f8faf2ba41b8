"""Vision-language model configs for ``model.family=hf_vlm`` (``model.vlm_config``), written out by
hand as transformers config fields: nothing is downloaded.

- ``SMALL``: a family built at the reader's size fields (``model.dim``, ``layers``, ``heads``,
  ``mlp_ratio``, ``vision_width``, ``vision_layers``, ``vision_head_width``, ``patch_size``,
  ``image_size``), random-initialised, for tests and the CPU demo. The text vocabulary is the
  tokenizer's plus one row for the image placeholder token (only the VLM's own forward reads it:
  the reader puts picture features in directly).
- ``PRESETS``: public checkpoints' configs (their config.json's hyper-parameters), for planning
  and delayed init on the meta device; ``PUBLIC_PARAMETERS`` holds the published parameter counts
  they are checked against.
"""

from __future__ import annotations

from typing import Any

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)  # OpenAI CLIP's (transformers' OPENAI_CLIP_MEAN)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


def _llava(m: Any, vocab: int) -> dict:
    """LLaVA-1.5's layout: CLIP vision tower, two-layer GELU projector, Llama; features from the
    tower's last layer without the CLS token. LLaVA-1.5 reads CLIP's penultimate layer, whose last
    one was trained for the contrastive pooled output; a random tower has no such layer to skip,
    and from the penultimate its last layer would never be read nor trained."""
    return dict(
        model_type="llava",
        text_config=dict(
            model_type="llama",
            hidden_size=m.dim,
            intermediate_size=int(m.mlp_ratio * m.dim),
            num_hidden_layers=m.layers,
            num_attention_heads=m.heads,
            num_key_value_heads=m.heads,
            vocab_size=vocab + 1,
            max_position_embeddings=m.max_segment_len,
            tie_word_embeddings=m.tie_embeddings,
            rms_norm_eps=1e-5,
        ),
        vision_config=dict(
            model_type="clip_vision_model",
            hidden_size=m.vision_width,
            intermediate_size=4 * m.vision_width,
            num_hidden_layers=m.vision_layers,
            num_attention_heads=m.vision_width // m.vision_head_width,
            image_size=m.image_size,
            patch_size=m.patch_size,
        ),
        image_token_index=vocab,
        vision_feature_layer=-1,
        vision_feature_select_strategy="default",
        projector_hidden_act="gelu",
        tie_word_embeddings=m.tie_embeddings,
    )


def _paligemma(m: Any, vocab: int) -> dict:
    """PaliGemma's layout: SigLIP vision tower (no pooling head), one linear projector, Gemma
    (which scales its input embeddings by sqrt(width); the projector's output is pre-divided)."""
    return dict(
        model_type="paligemma",
        text_config=dict(
            model_type="gemma",
            hidden_size=m.dim,
            intermediate_size=int(m.mlp_ratio * m.dim),
            num_hidden_layers=m.layers,
            num_attention_heads=m.heads,
            num_key_value_heads=m.heads,
            head_dim=m.dim // m.heads,
            vocab_size=vocab + 1,
            max_position_embeddings=m.max_segment_len,
        ),
        vision_config=dict(
            model_type="siglip_vision_model",
            hidden_size=m.vision_width,
            intermediate_size=4 * m.vision_width,
            num_hidden_layers=m.vision_layers,
            num_attention_heads=m.vision_width // m.vision_head_width,
            image_size=m.image_size,
            patch_size=m.patch_size,
            vision_use_head=False,
        ),
        image_token_index=vocab,
        projection_dim=m.dim,
        hidden_size=m.dim,
    )


SMALL = {"llava": _llava, "paligemma": _paligemma}

# llava-hf/llava-1.5-7b-hf's config.json: Vicuna-7B (Llama-2-7B shapes, 32064 tokens with the
# image and padding tokens), CLIP ViT-L/14 at 336 px, features of its penultimate layer.
LLAVA_1_5_7B = dict(
    model_type="llava",
    text_config=dict(
        model_type="llama",
        hidden_size=4096,
        intermediate_size=11008,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=32,
        vocab_size=32064,
        max_position_embeddings=4096,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=False,
    ),
    vision_config=dict(
        model_type="clip_vision_model",
        hidden_size=1024,
        intermediate_size=4096,
        num_hidden_layers=24,
        num_attention_heads=16,
        image_size=336,
        patch_size=14,
        projection_dim=768,
    ),
    image_token_index=32000,
    vision_feature_layer=-2,
    vision_feature_select_strategy="default",
    projector_hidden_act="gelu",
    tie_word_embeddings=False,
)

# google/paligemma-3b-pt-224's config.json: Gemma-2B (18 layers, multi-query attention, 257216
# tokens with the location and segmentation tokens), SigLIP So400m/14 at 224 px without its head.
PALIGEMMA_3B_224 = dict(
    model_type="paligemma",
    text_config=dict(
        model_type="gemma",
        hidden_size=2048,
        intermediate_size=16384,
        num_hidden_layers=18,
        num_attention_heads=8,
        num_key_value_heads=1,
        head_dim=256,
        vocab_size=257216,
        max_position_embeddings=8192,
        hidden_activation="gelu_pytorch_tanh",
    ),
    vision_config=dict(
        model_type="siglip_vision_model",
        hidden_size=1152,
        intermediate_size=4304,
        num_hidden_layers=27,
        num_attention_heads=16,
        image_size=224,
        patch_size=14,
        vision_use_head=False,
    ),
    image_token_index=257152,
    projection_dim=2048,
    hidden_size=2048,
)

PRESETS = {"llava-1.5-7b": LLAVA_1_5_7B, "paligemma-3b-pt-224": PALIGEMMA_3B_224}

# Published parameter counts (the whole model: tower, projector, language model, tied embeddings
# once), as the Hugging Face model pages give them from the safetensors weights ("Model size"):
# https://huggingface.co/llava-hf/llava-1.5-7b-hf "7.06B params";
# https://huggingface.co/google/paligemma-3b-pt-224 "2.92B params". The exact sums of the public
# shapes are 7,063,427,072 and 2,923,466,480; the presets are checked within 1% of the published
# figures.
PUBLIC_PARAMETERS = {"llava-1.5-7b": 7.06e9, "paligemma-3b-pt-224": 2.92e9}


def names() -> list[str]:
    """Every name ``model.vlm_config`` takes besides a path."""
    return sorted(SMALL) + sorted(PRESETS)
