"""The reader on Hugging Face vision-language models (``model.family=hf_vlm``): the VLM's own
forward with no documents, the retrieval layout with documents, a ``save_pretrained`` directory
with its image processor, the public presets on the meta device, and inputs that are no VLM."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from rag_mm.config import ModelConfig
from tests.rag_mm.hf_cases import reader_inputs

VOCAB = 512  # the tokenizer's; the small configs add one row for the image placeholder


def vlm_model_config(family: str = "llava", **kw) -> ModelConfig:
    """A tiny VLM reader: 2 text layers of width 64 over a 1-layer tower on 32 px pictures (16
    patches)."""
    base = dict(
        family="hf_vlm",
        vlm_config=family,
        dim=64,
        layers=2,
        heads=4,
        mlp_ratio=2.0,
        vision_width=32,
        vision_layers=2,
        vision_head_width=16,
        patch_size=8,
        image_size=32,
        copy_head=False,
        attention_backend="reference",
    )
    return ModelConfig(**(base | kw))


def tiny_vlm_reader(family: str = "llava", seed: int = 0, **kw):
    from rag_mm.model.factory import build_reader

    torch.manual_seed(seed)
    return build_reader(vlm_model_config(family, **kw), VOCAB).eval()


def _eager(vlm):
    """A copy of ``vlm`` whose language model runs transformers' eager attention (its own causal
    mask)."""
    ref = copy.deepcopy(vlm)
    ref.set_attn_implementation({"text_config": "eager"})
    assert ref.get_decoder().config._attn_implementation == "eager"
    return ref


def _own_logits(reader, x: dict) -> torch.Tensor:
    """The VLM's own forward, one example at a time: input_ids = [<image> x P, question, answer
    but its last token], pixel_values from the VLM's processor; the log-probabilities at the
    positions that predict the answer, in the reader's order."""
    vlm = _eager(reader.vlm)
    image_token = vlm.config.image_token_id
    rows = []
    with torch.no_grad():
        pixels = reader.pixel_values(x["image"])
        P = reader.encode_images(x["image"][:1]).shape[1]
        for b in range(x["image"].shape[0]):
            q, a = x["q_ids"][b, : x["q_len"][b]], x["a_ids"][b, : x["a_len"][b] - 1]
            ids = torch.cat([torch.full((P,), image_token), q, a])[None]
            logits = vlm(input_ids=ids, pixel_values=pixels[b : b + 1]).logits[0]  # (L, V)
            first = P + len(q) - 1  # the last question token predicts the first answer token
            rows.append(logits[first : first + int(x["a_len"][b])])
    return torch.log_softmax(torch.cat(rows).float(), -1)


# Gemma 3 from a config.json (model.vlm_config=PATH): SigLIP, pooling to 4 tokens per picture,
# Gemma 3 text (q/k norms, sliding-window layers whose window exceeds the sequence)
GEMMA3 = dict(
    model_type="gemma3",
    image_token_index=VOCAB,
    mm_tokens_per_image=4,
    text_config=dict(
        model_type="gemma3_text",
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=VOCAB + 1,
        sliding_window=512,
    ),
    vision_config=dict(
        model_type="siglip_vision_model",
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        image_size=32,
        patch_size=8,
    ),
)


@pytest.mark.parametrize("family", ["llava", "paligemma", "gemma3"])
def test_no_documents_equals_the_vlms_own_forward(family, tmp_path):
    """Closed book, the reader's answer log-probabilities are the VLM's own forward on the same
    picture, question and answer (its processor, tower, projector, placeholders and eager
    attention)."""
    if family == "gemma3":
        (tmp_path / "config.json").write_text(json.dumps(GEMMA3))
        family = str(tmp_path)
    reader = tiny_vlm_reader(family)
    x = reader_inputs(k=0, vocab=VOCAB)
    with torch.no_grad():
        out = reader(**x)
    ref = _own_logits(reader, x)
    assert out.logits.shape == ref.shape and out.logits.shape[1] == VOCAB + 1
    torch.testing.assert_close(out.logits, ref, atol=1e-5, rtol=0)


def _layout_bias(a) -> torch.Tensor:
    """The retrieval layout as the additive 4D mask transformers' eager attention takes."""
    from parallel.kernels.attention import layout_mask

    allowed = layout_mask(a.seg_offsets, a.x.shape[1])  # (B, 1, S, S)
    return torch.zeros(allowed.shape).masked_fill(~allowed, torch.finfo(torch.float32).min)


def test_documents_follow_the_retrieval_layout():
    """With documents the language model equals its eager attention under the layout's mask
    (documents within themselves, the query over every document and causally over itself), the
    documents change the answer logits, and a document's states do not depend on the query."""
    reader = tiny_vlm_reader("llava")
    x = reader_inputs(k=2, vocab=VOCAB)
    with torch.no_grad():
        a = reader.assemble(**x)
        h = reader.decoder(
            inputs_embeds=a.x, position_ids=a.pos, seg_offsets=a.seg_offsets
        ).last_hidden_state
        ref = (
            _eager(reader.vlm)
            .get_decoder()(inputs_embeds=a.x, position_ids=a.pos, attention_mask=_layout_bias(a))
            .last_hidden_state
        )
        valid = torch.arange(a.x.shape[1])[None] < a.seg_offsets[:, -1:]  # (B, S)
        torch.testing.assert_close(h[valid], ref[valid], atol=1e-5, rtol=0)

        closed = reader(**{k: v for k, v in x.items() if not k.startswith("doc_")}).logits
        with_docs = reader(**x).logits
        assert closed.shape == with_docs.shape
        assert (closed - with_docs).abs().max() > 1e-3  # the query reads the documents

        other = dict(x, q_ids=(x["q_ids"] + 7) % VOCAB)  # another question, the same documents
        a2 = reader.assemble(**other)
        h2 = reader.decoder(
            inputs_embeds=a2.x, position_ids=a2.pos, seg_offsets=a2.seg_offsets
        ).last_hidden_state
    docs_end = a.seg_offsets[:, -2]  # (B,) where the query segment starts
    for b in range(h.shape[0]):
        n = int(docs_end[b])
        # documents do not see the query
        torch.testing.assert_close(h2[b, :n], h[b, :n], atol=1e-6, rtol=0)
        assert (
            h2[b, n : int(a.seg_offsets[b, -1])] - h[b, n : int(a.seg_offsets[b, -1])]
        ).abs().max() > 1e-4


def test_builds_from_a_save_pretrained_directory(tmp_path):
    """``model.pretrained=DIR``: the saved weights and the saved image processor (SigLIP's mean
    and std here, not CLIP's) are the reader's; it reads as the reader it was saved from."""
    from transformers import SiglipImageProcessor

    from rag_mm.model.factory import build_reader

    src = tiny_vlm_reader("llava", seed=3)
    src.vlm.save_pretrained(tmp_path)
    proc = SiglipImageProcessor(size={"height": 32, "width": 32})
    proc.save_pretrained(tmp_path)
    torch.manual_seed(0)
    reader = build_reader(
        ModelConfig(
            family="hf_vlm",
            pretrained=str(tmp_path),
            image_size=32,
            copy_head=False,
            attention_backend="reference",
        ),
        VOCAB,
    ).eval()
    assert type(reader.processor).__name__ == "SiglipImageProcessor"
    for name, p in src.vlm.state_dict().items():
        torch.testing.assert_close(reader.vlm.state_dict()[name], p, atol=0, rtol=0)
    x = reader_inputs(k=1, vocab=VOCAB)
    from rag_mm.data.pipeline import MEAN, STD

    raw = x["image"] * STD + MEAN  # 0..1
    torch.testing.assert_close(
        reader.pixel_values(x["image"]), (raw - 0.5) / 0.5, atol=1e-5, rtol=0
    )
    src.processor = reader.processor
    with torch.no_grad():
        torch.testing.assert_close(reader(**x).logits, src(**x).logits, atol=1e-5, rtol=0)


@pytest.mark.parametrize("family", ["llava", "paligemma"])
def test_picture_tower_is_what_the_projector_reads_and_trains_every_tower_layer(family):
    """``picture_tower`` (what the vision warm-up and ``optim.vision_lr_scale`` act on): its
    tokens are the projector's input, so the VLM's picture features are the projector of them;
    its parameters are the tower's alone; and the
    reader's picture features reach every layer of the tower (a small LLaVA reads its last)."""
    reader = tiny_vlm_reader(family)
    inner = reader.vlm.model
    tower = reader.picture_tower
    assert {id(p) for p in tower.parameters()} == {id(p) for p in inner.vision_tower.parameters()}
    pics = torch.randn(3, 3, 32, 32)
    with torch.no_grad():
        pooled, toks = tower(pics)
        feats = reader.encode_images(pics)
        projected = inner.multi_modal_projector(toks)
    assert toks.shape == (3, 16, 32) and pooled.shape == (3, 32)
    torch.testing.assert_close(projected, feats)
    torch.testing.assert_close(pooled, toks.mean(1))
    reader.encode_images(pics).square().sum().backward()
    last = f"layers.{reader.vlm.config.vision_config.num_hidden_layers - 1}."
    in_last = [(n, p) for n, p in inner.vision_tower.named_parameters() if last in n]
    assert in_last and all(p.grad is not None and p.grad.abs().sum() > 0 for _, p in in_last)


@pytest.mark.parametrize("preset", ["llava1_5_7b", "paligemma_3b"])
def test_presets_on_meta_have_the_public_parameter_counts(preset):
    from rag_mm import plan as rplan
    from rag_mm.config import compose
    from rag_mm.model.factory import build_reader, count_parameters
    from rag_mm.model.vlm_presets import PUBLIC_PARAMETERS

    cfg = compose([f"model={preset}", "run_dir=/tmp/unused"])
    reader = build_reader(cfg.model, 49408, meta=True)
    assert all(p.is_meta for p in reader.parameters())
    public = PUBLIC_PARAMETERS[cfg.model.vlm_config]
    n = count_parameters(reader.vlm)
    assert abs(n - public) <= 0.01 * public, (preset, n, public)
    assert (
        reader.encode_images(
            torch.empty(1, 3, cfg.model.image_size, cfg.model.image_size, device="meta")
        ).shape[1]
        == {"llava1_5_7b": 576, "paligemma_3b": 256}[preset]
    )
    # tp divides the VLM's own query heads: Vicuna's 32 and CLIP-L's 16; Gemma-2B's 8 and SigLIP's
    # 16 (Gemma-2B's one key/value head is replicated over the tp ranks)
    assert rplan.tp_divisor(cfg) == {"llava1_5_7b": 16, "paligemma_3b": 8}[preset]


@pytest.mark.parametrize("preset", ["llava1_5_7b", "paligemma_3b"])
def test_the_planner_lays_the_presets_out_on_16_nodes_of_8_gpus(preset):
    """``python -m rag_mm.plan model=<preset> cluster=h100 cluster.nodes=16``: a fitting layout
    rag_mm accepts (the trace on the meta device and ~2700 layouts: seconds)."""
    from parallel.cluster import Cluster
    from rag_mm import plan as rplan
    from rag_mm.config import compose

    cfg = compose([f"model={preset}", "retriever.top_k=1", "run_dir=/tmp/unused"])
    cluster = Cluster.preset("h100", nodes=16)
    p = rplan.plan(cfg, cluster, rplan.default_global_batch(cfg, cluster.world))
    assert rplan.runnable(cfg, p, cluster.world, 1), p.table(5)


def test_what_is_no_vlm_is_refused_by_name(tmp_path):
    """A directory holding a causal LM, a config of a family with multimodal rotary positions,
    an unknown vlm_config: a message that names the key and why (``build_rag`` turns it into the
    ``ConfigError`` the entry points print without a traceback)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from rag_mm.config import ConfigError, compose, validate
    from rag_mm.model.factory import build_reader

    LlamaForCausalLM(
        LlamaConfig(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
            vocab_size=VOCAB,
        )
    ).save_pretrained(tmp_path / "lm")
    cfg = ModelConfig(
        family="hf_vlm", pretrained=str(tmp_path / "lm"), attention_backend="reference"
    )
    with pytest.raises(
        ValueError, match=r"holds a LlamaForCausalLM model, not a vision-language model"
    ):
        build_reader(cfg, VOCAB)
    (tmp_path / "qwen").mkdir()
    (tmp_path / "qwen" / "config.json").write_text(
        '{"model_type": "qwen2_vl", "text_config": {"rope_scaling": {"type": "mrope", '
        '"mrope_section": [2, 3, 3]}}}'
    )
    with pytest.raises(ValueError, match="multimodal rotary positions"):
        build_reader(vlm_model_config(str(tmp_path / "qwen")), VOCAB)
    for bad, why in [
        ([f"model.pretrained={tmp_path}"], "is not a directory holding config.json"),
        (["model.vlm_config=nosuch"], "model.vlm_config='nosuch' is none of"),
    ]:
        with pytest.raises(ConfigError, match=why):
            validate(compose(["model=hf_vlm", "run_dir=/tmp/unused", *bad]))
    from rag_mm.build import build_rag

    cfg = compose(["model=hf_vlm", "run_dir=/tmp/unused", f"model.pretrained={tmp_path / 'lm'}"])
    validate(cfg)  # a config.json is there: only building the model tells
    with pytest.raises(ConfigError, match="not a vision-language model"):
        build_rag(cfg, torch.device("cpu"))


def _closed_book_reader(which, **model):
    """A tiny ``hf`` or ``hf_vlm`` reader with the ``model`` overrides, and a closed-book batch."""
    from tests.rag_mm.hf_cases import reader_inputs, tiny_hf_reader

    if which == "hf":
        return tiny_hf_reader(**model), reader_inputs(k=0)
    return tiny_vlm_reader("llava", **model), reader_inputs(k=0, vocab=VOCAB)


@pytest.mark.parametrize("which", ["hf", "hf_vlm"])
def test_question_first_reaches_the_hugging_face_readers(which):
    """``model.question_first`` orders the query segment of both Hugging Face readers (the layout
    itself is tested on the native reader, tests/rag_mm/test_reader.py)."""
    from rag_mm.model.layout import QUERY_IMAGE, QUESTION

    for first in (False, True):
        reader, x = _closed_book_reader(which, question_first=first)
        typ = reader.assemble(**x).typ[0].tolist()
        assert (typ.index(QUESTION) < typ.index(QUERY_IMAGE)) == first


@pytest.mark.parametrize("which", ["hf", "hf_vlm"])
def test_query_prefix_reaches_the_hugging_face_readers(which):
    """``model.query_prefix`` lays both Hugging Face readers' query out as a prefix segment and an
    answer segment, and their attention reads it: the same weights give another loss than the
    causal query (the layout itself is tested on the native reader, tests/rag_mm/test_reader.py)."""
    losses = []
    for prefix in (False, True):
        reader, x = _closed_book_reader(which, query_prefix=prefix)
        assert reader.assemble(**x).seg_offsets.shape[1] == (3 if prefix else 2)
        losses.append(reader(**x).loss)
        assert torch.isfinite(losses[-1])
    assert not torch.allclose(losses[0], losses[1])
