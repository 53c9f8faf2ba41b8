"""Small random-initialised models the partitioner is tested on. Adding a model is one line in
``MODELS``: a name and a factory returning ``(model, example_inputs)`` (a tuple of positional
arguments or a dict of keyword arguments). Nothing is downloaded: configs only, random init."""

from __future__ import annotations

import torch


def _ids(vocab: int, b: int = 2, s: int = 16) -> torch.Tensor:
    return torch.randint(0, vocab, (b, s))


def gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(
        n_layer=4,
        n_embd=64,
        n_head=4,
        vocab_size=512,
        n_positions=64,
        bos_token_id=0,
        eos_token_id=0,
    )
    return GPT2LMHeadModel(cfg), (_ids(512),)


def bert():
    from transformers import BertConfig, BertForMaskedLM

    cfg = BertConfig(
        num_hidden_layers=4,
        hidden_size=64,
        num_attention_heads=4,
        intermediate_size=128,
        vocab_size=512,
        max_position_embeddings=64,
    )
    x = _ids(512)
    return BertForMaskedLM(cfg), {"input_ids": x, "attention_mask": torch.ones_like(x)}


def llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        num_hidden_layers=4,
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        vocab_size=512,
        max_position_embeddings=64,
    )
    return LlamaForCausalLM(cfg), {"input_ids": _ids(512)}


def t5():
    from transformers import T5Config, T5ForConditionalGeneration

    cfg = T5Config(
        num_layers=3,
        num_decoder_layers=3,
        d_model=64,
        d_kv=16,
        num_heads=4,
        d_ff=128,
        vocab_size=512,
        decoder_start_token_id=0,
    )
    return T5ForConditionalGeneration(cfg), {
        "input_ids": _ids(512),
        "decoder_input_ids": _ids(512, s=8),
    }


def hf_clip():
    from transformers import CLIPConfig, CLIPModel

    cfg = CLIPConfig(
        text_config=dict(
            hidden_size=64,
            num_hidden_layers=3,
            num_attention_heads=4,
            intermediate_size=128,
            vocab_size=512,
            max_position_embeddings=32,
        ),
        vision_config=dict(
            hidden_size=64,
            num_hidden_layers=3,
            num_attention_heads=4,
            intermediate_size=128,
            image_size=32,
            patch_size=8,
        ),
        projection_dim=32,
    )
    return CLIPModel(cfg), {"input_ids": _ids(512), "pixel_values": torch.randn(2, 3, 32, 32)}


def hf_vit():
    from transformers import ViTConfig, ViTForImageClassification

    cfg = ViTConfig(
        hidden_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        intermediate_size=128,
        image_size=32,
        patch_size=8,
        num_labels=10,
    )
    return ViTForImageClassification(cfg), {"pixel_values": torch.randn(2, 3, 32, 32)}


def open_clip_small():
    import open_clip

    vision = dict(layers=3, width=64, head_width=16, patch_size=8, image_size=32)
    text = dict(context_length=16, vocab_size=512, width=64, heads=4, layers=3)
    model = open_clip.CLIP(embed_dim=32, vision_cfg=vision, text_cfg=text)
    return model, (torch.randn(2, 3, 32, 32), _ids(512))


def timm_resnet():
    import timm

    return timm.create_model("resnet18", pretrained=False, num_classes=10), (
        torch.randn(2, 3, 64, 64),
    )


def rag_mm_reader():
    from rag_mm.config import ModelConfig
    from rag_mm.model import Reader

    cfg = ModelConfig(
        dim=64, layers=6, heads=4, vision_width=64, vision_layers=2, vision_head_width=32
    )
    B, k = 2, 2
    inputs = {
        "image": torch.randn(B, 3, 32, 32),
        "q_ids": torch.randint(1, 1000, (B, 8)),
        "q_len": torch.tensor([8, 5]),
        "a_ids": torch.tensor([[5, 49407], [7, 49407]]),
        "a_len": torch.tensor([2, 2]),
        "doc_image": torch.randn(B, k, 3, 32, 32),
        "doc_ids": torch.randint(1, 1000, (B, k, 20)),
        "doc_len": torch.tensor([[20, 12], [16, 20]]),
    }
    return Reader(cfg, vocab_size=49408), inputs


MODELS = {
    "rag_mm_reader": rag_mm_reader,
    "gpt2": gpt2,
    "bert": bert,
    "llama": llama,
    "t5": t5,
    "hf_clip": hf_clip,
    "hf_vit": hf_vit,
    "open_clip": open_clip_small,
    "timm_resnet18": timm_resnet,
}
