"""The reader on Hugging Face causal LMs: rag_mm's attention inside the model's own modules, the
retrieval layout, pretrained directories and tokenizers, presets on the meta device, and the
export -> import round trip."""

from __future__ import annotations

import dataclasses
import logging
import re
import time

import pytest
import torch

from rag_mm.model.layout import IGNORE
from tests.rag_mm.hf_cases import LM_CONFIGS, model_config, reader_inputs, tiny_hf_reader


def _own_forward(reader, a, mask=None):
    """The LM's own forward (transformers' eager attention) on the reader's assembled sequence."""
    lm = reader.lm
    impl = lm.config._attn_implementation
    lm.set_attn_implementation("eager")
    try:
        return lm(inputs_embeds=a.x, position_ids=a.pos, attention_mask=mask)
    finally:
        lm.set_attn_implementation(impl)


def _layout_bias(a) -> torch.Tensor:
    """The retrieval layout as the additive 4D mask transformers' eager attention takes."""
    from parallel.kernels.attention import layout_mask

    allowed = layout_mask(a.seg_offsets, a.x.shape[1])  # (B, 1, S, S)
    return torch.zeros(allowed.shape).masked_fill(~allowed, torch.finfo(torch.float32).min)


@pytest.mark.parametrize("family", sorted(LM_CONFIGS))
def test_no_documents_equals_the_models_own_forward(family):
    reader = tiny_hf_reader(family).eval()
    x = reader_inputs(k=0)
    with torch.no_grad():
        out = reader(**x)
        a = reader.assemble(**x)
        ref = torch.log_softmax(_own_forward(reader, a).logits[a.labels != IGNORE].float(), -1)
    assert out.logits.shape == ref.shape
    torch.testing.assert_close(out.logits, ref, atol=1e-5, rtol=0)


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_documents_follow_the_retrieval_layout(family):
    """With documents, the reader equals the LM's eager attention under the layout's mask, with
    positions restarting per segment: the offsets reach every attention call."""
    reader = tiny_hf_reader(family).eval()
    x = reader_inputs(k=2)
    with torch.no_grad():
        a = reader.assemble(**x)
        h = reader.lm.base_model(
            inputs_embeds=a.x, position_ids=a.pos, seg_offsets=a.seg_offsets
        ).last_hidden_state
        ref = _own_forward(reader, a, _layout_bias(a)).logits
        causal = _own_forward(reader, a).logits
    valid = torch.arange(a.x.shape[1])[None] < a.seg_offsets[:, -1:]  # (B, S)
    torch.testing.assert_close(reader.lm.lm_head(h)[valid], ref[valid], atol=1e-5, rtol=0)
    # the layout is not plain causal
    assert not torch.allclose(ref[valid], causal[valid], atol=1e-3)
    assert int(a.pos.max()) < a.x.shape[1] // 2  # positions restart per segment


def test_models_that_bypass_the_attention_interface_are_refused():
    """A family that looks its attention classes up itself (Falcon), or one layer that computes
    its own attention, would silently read documents as one causal stream: refused at build."""
    from rag_mm.model.hf_attention import check_dispatch

    falcon = model_config(
        "llama",
        lm=dict(
            model_type="falcon",
            hidden_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            vocab_size=512,
        ),
    )
    with pytest.raises(ValueError, match="cannot build this LM with rag_mm's attention"):
        tiny_hf_reader(lm=falcon.lm)
    lm = tiny_hf_reader("llama").lm
    check_dispatch(lm)
    lm.model.layers[1].self_attn.forward = lambda hidden_states, **_: (
        torch.zeros_like(hidden_states),
        None,
    )
    with pytest.raises(ValueError, match="1 of its 2 layers do not call their attention"):
        check_dispatch(lm)


def test_reader_trains_and_generates():
    reader = tiny_hf_reader("llama", copy_head=True)
    x = reader_inputs(k=2)
    out = reader(**x)
    out.loss.backward()
    assert (
        reader.projector.fc1.weight.grad.abs().sum() > 0
        and reader.rank_emb.weight.grad.abs().sum() > 0
    )
    assert out.doc_attention.shape == (4, 2)
    answers = reader.eval().generate(
        x["image"], x["q_ids"], x["q_len"], x["doc_image"], x["doc_ids"], x["doc_len"], eot_id=2
    )
    assert len(answers) == 4 and all(len(a) <= reader.max_answer for a in answers)


PUBLIC = {  # language-model parameters of the public checkpoints (tied embeddings counted once)
    "qwen2_5_0_5b": 494_032_768,
    "llama3_2_1b": 1_235_814_400,
    "llama3_2_3b": 3_212_749_824,
    "llama3_1_8b": 8_030_261_248,
}


@pytest.mark.parametrize("preset", sorted(PUBLIC))
def test_presets_build_on_meta_with_public_shapes(preset):
    from rag_mm.config import compose
    from rag_mm.model.factory import build_reader, count_parameters

    # the public vocabulary kept (random-init presets otherwise embed the tokenizer's ids only)
    cfg = compose([f"model={preset}", "run_dir=/tmp/unused", "model.trim_vocab=false"])
    t = time.perf_counter()
    reader = build_reader(cfg.model, 49408, meta=True)
    assert time.perf_counter() - t < 30
    assert all(p.is_meta for p in reader.parameters())
    n = count_parameters(reader.lm)
    assert abs(n - PUBLIC[preset]) <= 0.01 * PUBLIC[preset], (preset, n)
    assert cfg.model.vision_width in (768, 1024) and cfg.model.image_size == 224


def test_meta_reader_materializes_like_a_fresh_one():
    from rag_mm.model.factory import build_reader, materialize

    cfg = model_config("llama")
    meta = materialize(build_reader(cfg, 512, meta=True)).eval()
    assert not any(p.is_meta for p in meta.parameters()) and not any(
        b.is_meta for b in meta.buffers()
    )
    fresh = build_reader(cfg, 512).eval()
    x = reader_inputs(k=1)
    for name, b in fresh.named_buffers():  # rotary frequencies are computed, not initialised
        torch.testing.assert_close(dict(meta.named_buffers())[name], b)
    fresh_params = dict(fresh.named_parameters())
    for name, p in meta.named_parameters():  # every tensor drawn as a fresh build draws it
        want, got = fresh_params[name].detach(), p.detach()
        assert got.abs().max() <= 10 * want.abs().max() + 1e-6, name
        if want.numel() > 16 and want.std() > 0:
            assert 0.7 < float(got.std() / want.std()) < 1.4, (
                name,
                float(got.std()),
                float(want.std()),
            )
    with torch.no_grad():
        out = meta(**x)
    assert (
        torch.isfinite(out.logits).all()
        and abs(float(out.loss) - float(torch.log(torch.tensor(512.0)))) < 1.5
    )


def save_word_tokenizer(path, words) -> int:
    """A word-level Hugging Face tokenizer over ``words``, saved with save_pretrained; its size."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(["<pad>", "</s>", "[UNK]", *sorted(set(words))])}
    core = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core, eos_token="</s>", unk_token="[UNK]", pad_token="<pad>"
    )
    tok.save_pretrained(path)
    return len(vocab)


def test_pretrained_directory_and_its_tokenizer(tmp_path, caplog):
    """A model and tokenizer saved locally: the reader loads both offline, its weights are the
    saved ones (logits equal the model's own forward), and it reads with that tokenizer."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from rag_mm.config import reader_tokenizer
    from rag_mm.data.tokenizer import HFTokenizer, get_tokenizer
    from rag_mm.model.factory import build_reader

    # the tokenizer in its own directory: transformers picks a tokenizer class by the model_type
    # of a config.json beside it, and this word-level one is no Qwen2 tokenizer
    n = save_word_tokenizer(tmp_path / "tok", "what colour is the red circle ?".split())
    torch.manual_seed(0)
    fields = dict(LM_CONFIGS["qwen2"], vocab_size=n, eos_token_id=1)
    saved = AutoModelForCausalLM.from_config(
        AutoConfig.for_model(fields.pop("model_type"), **fields)
    )
    saved.save_pretrained(tmp_path / "lm")
    cfg = model_config(
        "qwen2", pretrained=str(tmp_path / "lm"), tokenizer=str(tmp_path / "tok"), lm={}
    )
    tok = get_tokenizer(reader_tokenizer(cfg))
    assert isinstance(tok, HFTokenizer) and tok.vocab_size == n and tok.eot_id == 1
    assert tok.decode(tok.encode("what colour is the circle ?")) == "what colour is the circle ?"
    reader = build_reader(cfg, tok.vocab_size).eval()
    torch.testing.assert_close(reader.lm.lm_head.weight, saved.lm_head.weight)
    x = reader_inputs(k=0, vocab=n)
    with torch.no_grad():
        out = reader(**x)
        a = reader.assemble(**x)
        ref = saved.eval()(
            inputs_embeds=a.x, position_ids=a.pos
        ).logits  # its own default attention
    torch.testing.assert_close(
        out.logits, torch.log_softmax(ref[a.labels != IGNORE], -1), atol=1e-5, rtol=0
    )
    # the question before the picture is not the order a pretrained model learned: said, not refused
    with caplog.at_level(logging.WARNING, logger="rag_mm.model.factory"):
        build_reader(dataclasses.replace(cfg, question_first=True), tok.vocab_size)
    assert "model.question_first=true with model.pretrained" in caplog.text


def test_export_import_round_trip(tmp_path):
    from rag_mm.export import export_reader
    from rag_mm.model.factory import build_reader

    cfg = model_config("llama", copy_head=True)
    reader = tiny_hf_reader("llama", copy_head=True, seed=3).eval()
    with torch.no_grad():  # a trained reader's adapter is not its init: make it differ
        for p in reader.adapter_state().values():
            p.add_(torch.randn_like(p) * 0.1)
    overrides = export_reader(reader, tmp_path / "out", cfg)
    assert (tmp_path / "out" / "lm" / "model.safetensors").is_file()
    visual = torch.load(tmp_path / "out" / "open_clip_visual.pt", weights_only=True)
    assert visual and all(k.startswith("visual.") for k in visual)
    values = dict(o.split("=", 1) for o in overrides)
    imported_cfg = model_config(
        "llama",
        copy_head=True,
        lm={},
        pretrained=values["model.pretrained"],
        vision_checkpoint=values["model.vision_checkpoint"],
        adapter=values["model.adapter"],
    )
    torch.manual_seed(123)  # another init: everything must come from the files
    imported = build_reader(imported_cfg, 512).eval()
    x = reader_inputs(k=2)
    with torch.no_grad():
        assert torch.equal(reader(**x).logits, imported(**x).logits)
    wrong = model_config(
        "llama",
        copy_head=False,
        lm={},
        pretrained=values["model.pretrained"],
        adapter=values["model.adapter"],
    )
    with pytest.raises(ValueError, match="does not fit this reader"):
        build_reader(wrong, 512)


def _spread_worker(rank, world):
    """pp=2 (1F1B and zero-bubble), tp=2 and FSDP2 on the Hugging Face reader, in one process
    group."""
    from tests.parallel import tp_cases
    from tests.parallel.test_pipeline import _equivalence_worker

    pp = _equivalence_worker(rank, world, "hf_reader", ("1f1b", "zero_bubble"), 4, "auto")
    tp = tp_cases.suite(rank, world, ["hf_reader"])["hf_reader"]
    fsdp = tp_cases.spmd_case(rank, world, dict(dp_shard=2), "hf_reader")
    return pp, tp, fsdp


@pytest.mark.multirank
def test_pipeline_tensor_parallel_and_fsdp_equal_one_process():
    """The parallel runtime on the Hugging Face reader as on any model: the automatic pipeline
    partition (2 stages, 4 microbatches), the discovered tensor-parallel plan (2 ranks, nothing
    left replicated by the self-check) and FSDP2 (2 shards) give one process's loss and gradients
    (fp32, rtol 1e-4)."""
    from tests.distributed import run_ranks
    from tests.parallel.test_fsdp import _check as fsdp_check
    from tests.parallel.test_pipeline import _check
    from tests.parallel.test_tp import _check as tp_check

    results = run_ranks(_spread_worker, 2, timeout_s=300)
    _check([pp for pp, _, _ in results], "hf_reader")
    for _, tp, fsdp in results:
        fsdp_check(fsdp, "hf_reader fsdp2")  # loss, gradients, clipped AdamW step, as one process
        tp_check(tp, "hf_reader")
        assert not [line for line in tp["log"] if "left replicated" in line], tp["log"]
        assert any(".self_attn.q_proj" in n for n in tp["dtensors"]), tp["dtensors"]


def _world_words(root) -> list[str]:
    """Every word of a generated world's passages, questions and answers."""
    import json
    import re
    import tarfile
    from pathlib import Path

    words = set()
    for shard in Path(root).rglob("*.tar"):
        with tarfile.open(shard) as tar:
            for member in tar.getmembers():
                if member.name.endswith((".txt", ".json")):
                    text = tar.extractfile(member).read().decode()
                    if member.name.endswith(".json"):
                        text = str(json.loads(text).get("answer", ""))
                    words.update(re.findall(r"\w+|[^\w\s]", text))
    return sorted(words)


def test_trains_from_a_pretrained_directory(tiny_world, tmp_path):
    """`+experiment=demo_hf model.pretrained=DIR` on a family no other test uses (Mistral), with
    its own tokenizer: the learned retriever and the reader train, evaluation scores answers, and
    the reader started from the saved weights."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from rag_mm.config import compose
    from rag_mm.data.tokenizer import HFTokenizer
    from rag_mm.trainer import Trainer
    from tests.rag_mm.conftest import tiny_overrides

    n = save_word_tokenizer(tmp_path / "tok", _world_words(tiny_world))
    fields = dict(
        model_type="mistral",
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        vocab_size=n,
        eos_token_id=1,
        bos_token_id=None,
        pad_token_id=0,
    )
    torch.manual_seed(0)
    saved = AutoModelForCausalLM.from_config(
        AutoConfig.for_model(fields.pop("model_type"), **fields)
    )
    saved.save_pretrained(tmp_path / "lm")
    cfg = compose(
        [
            "+experiment=demo_hf",
            *tiny_overrides(tiny_world, tmp_path / "run"),
            f"model.pretrained={tmp_path / 'lm'}",
            f"model.tokenizer={tmp_path / 'tok'}",
            "retriever.top_k=2",
            "retriever.embed_dim=16",
            "retriever.vision_width=16",
            "retriever.warmup_steps=2",
            "retriever.bank_negatives=8",
            "retriever.pseudo_queries=4",
            "retriever.refresh_every=2",
            "max_steps=3",
            "ckpt_every=0",
        ]
    )
    t = Trainer(cfg)
    try:
        assert isinstance(t.tok, HFTokenizer) and t.tok.vocab_size == n
        start = t.rag.reader.lm.model.layers[0].mlp.up_proj.weight.detach().clone()
        torch.testing.assert_close(start, saved.model.layers[0].mlp.up_proj.weight)
        out = t.fit()
    finally:
        t.close()
    assert out["step"] == 3 and 0.0 <= out["test"]["acc"] <= 1.0 and "recall@5" in out["test"]
    assert not torch.equal(start, t.rag.reader.lm.model.layers[0].mlp.up_proj.weight)

    # the run's DCP checkpoint exported to Hugging Face / open_clip files, and a reader built back
    # from them (its tokenizer travels in lm/) reads as the trained one
    import json

    from omegaconf import OmegaConf

    from rag_mm.export import main as export_main
    from rag_mm.model.factory import build_reader

    (tmp_path / "run" / ".hydra").mkdir()
    # what `python -m rag_mm.train` saves
    OmegaConf.save(cfg, tmp_path / "run" / ".hydra" / "config.yaml")
    assert export_main([str(tmp_path / "run"), str(tmp_path / "out")]) == 0
    overrides = json.loads((tmp_path / "out" / "import.json").read_text())["overrides"]
    back = compose(
        ["+experiment=demo_hf", *tiny_overrides(tiny_world, tmp_path / "run2"), *overrides]
    )
    imported = build_reader(back.model, n).eval()
    x = reader_inputs(b=2, k=2, vocab=n)
    with torch.no_grad():
        assert torch.equal(t.rag.reader.eval()(**x).logits, imported(**x).logits)


def test_bad_hf_inputs_name_the_key(tiny_world, tmp_path):
    """Wrong Hugging Face reader settings stop the run before any work with a message naming the
    key, never a traceback."""
    from rag_mm.config import ConfigError, compose, validate
    from tests.rag_mm.conftest import tiny_overrides
    from tests.rag_mm.test_train import run_module

    base = tiny_overrides(tiny_world, tmp_path / "run")
    (tmp_path / "tok").mkdir()
    cases = [
        (["model=hf"], "model.family=hf needs model.pretrained"),
        (
            ["model=hf_tiny", "model.lm.model_type=nosuch"],
            "model.lm.model_type='nosuch' is no model type",
        ),
        (["model=hf", f"model.pretrained={tmp_path}"], "is not a directory holding config.json"),
        (
            [
                "model=hf_tiny",
                f"model.tokenizer={tmp_path / 'tok'}",
                "retriever=learned",
                "retriever.fusion=sum",
            ],
            "set retriever.fusion=image",
        ),
        (["model=hf_tiny", f"model.adapter={tmp_path / 'none.safetensors'}"], "model.adapter="),
        (["model.pretrained=/x"], "model.pretrained needs model.family=hf"),
    ]
    for extra, message in cases:
        with pytest.raises(ConfigError, match=re.escape(message)):
            validate(compose([*base, *extra]))
    # a family that looks its attention up itself passes validation and is refused at build
    res = run_module(
        ["-m", "rag_mm.train", *base, "model=hf_tiny", "model.lm.model_type=falcon"], timeout=180
    )
    assert res.returncode == 2, res.stderr[-2000:]
    assert "AttentionInterface" in res.stderr and "Traceback" not in res.stderr + res.stdout, (
        res.stderr[-2000:]
    )
