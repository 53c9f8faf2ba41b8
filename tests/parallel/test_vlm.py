"""Vision-language models (tiny, random-initialised transformers models, fp32) through the
parallel runtime against one process: LLaVA (CLIP + Llama) and PaliGemma (SigLIP + Gemma) under
pp=2 x dp_shard=2 and under tp=2 (what tensor parallel shards of them), the FSDP2 wrapping those
layouts rely on, and the warning naming a unit tensor parallel leaves replicated."""

from __future__ import annotations

import pytest

from tests.distributed import run_ranks
from tests.parallel import vlm_cases

RTOL = 1e-4


@pytest.mark.multirank
def test_fsdp_unit_keeps_its_class_name():
    """FSDP2 swaps a unit's class for ``FSDP<Name>``; transformers finds what a model can record
    (``output_hidden_states``) by the class's name, so the swapped tower returned no hidden states
    and LLaVA failed on them. The unit keeps its own class name, and returns them all."""
    for r in run_ranks(vlm_cases.fsdp_hidden_states_case, 2, timeout_s=120):
        assert r["fsdp"], r
        assert r["name"] == "CLIPVisionModel" and "transformers.models.clip" in r["cls"], r
        assert r["hidden"] == r["ref_hidden"] == vlm_cases.VISION["num_hidden_layers"] + 1, r
        assert r["err"] <= 1e-5, r


PP_DP = [(name, dict(pp=2, dp_shard=2)) for name in ("llava", "paligemma", "qwen2vl")]


@pytest.mark.multirank
def test_vlm_pp2_dp_shard2_matches_one_process():
    """FSDP2 under the pipeline: the first stage's units include the vision tower, which LLaVA
    calls with ``output_hidden_states=True`` (it died on ``hidden_states`` being None, and the
    second stage waited on it). Qwen2-VL changes its tower's output after the call (per-image
    splits in ``pooler_output``): the second stage must be handed the output as the call
    returned it. The step's loss and every gradient equal one process's."""
    res = run_ranks(vlm_cases.pipeline_suite, 4, PP_DP, timeout_s=300)
    for rank, per in enumerate(res):
        for name, r in per.items():
            assert abs(r["loss"] - r["ref"]) <= RTOL * abs(r["ref"]), (rank, name, r)
            assert r["n"] > 0 and r["fsdp_units"] > 0, (rank, name, r)
            assert r["err"] < RTOL, (rank, name, r)


@pytest.fixture(scope="module")
def tp_suite():
    return run_ranks(vlm_cases.tp_suite, 2, ["llava", "paligemma"], timeout_s=300)


@pytest.mark.multirank
@pytest.mark.parametrize("name", ["llava", "paligemma"])
def test_vlm_tp2_shards_every_block(tp_suite, name):
    """Every attention and MLP of both towers, and LLaVA's two-layer projector, is sharded and
    the step equals one process. LLaVA left 3 of its 4 language attentions replicated, silently:
    the self-check captured their inputs with the KV cache on (``LlavaForConditionalGeneration``
    takes ``use_cache`` only through ``**kwargs``), and a cache holding earlier layers' keys
    cannot be copied. PaliGemma's one-linear projector has no row-parallel partner: replicated."""
    for r in tp_suite:
        t = r[name]
        assert abs(t["loss"] - t["ref"]) <= RTOL * abs(t["ref"]), (name, t)
        assert t["err"] < RTOL, (name, t["err"], t["worst"])
        assert not t["warnings"], t["warnings"]
        whole = {"llava": [], "paligemma": ["model.multi_modal_projector.linear.weight"]}[name]
        assert t["whole"] == whole, t["whole"]
        assert t["fraction"] > 0.98, t["fraction"]


@pytest.mark.multirank
def test_unit_left_replicated_is_one_warning(tp_suite):
    """A unit the self-check leaves replicated is named in one WARNING line with its reason."""
    for r in tp_suite:
        lines = sorted(r["warnings"])
        assert len(lines) == 2, lines
        assert lines[0].startswith("tp: self-check: mix left replicated: max relative error"), lines
        assert lines[1].startswith("tp: self-check: skew left replicated: max relative error"), (
            lines
        )
        assert all("layout was" in line for line in lines), lines


@pytest.mark.multirank
def test_sharded_multihead_attention_cross_and_aliased(tp_suite):
    """nn.MultiheadAttention under tensor parallel as SigLIP's pooling head uses it (a learned
    probe attending over the tower's output, attention weights asked for: torch's default), and as
    a self-attention whose key and value are aliases of the query (what an FSDP2 unit receives):
    both sharded, outputs and gradients equal one process. Identity was the test for
    self-attention (the reader's vision attention, made an FSDP unit under pp x tp x dp_shard,
    raised "supports self-attention only"), and the weights came back None (SigLIP's head failed
    the self-check)."""
    for r in tp_suite:
        m = r["mha"]
        assert m["roles"] == {
            "mix": "rule:multihead_attention",
            "pool": "rule:multihead_attention",
        }, m["roles"]
        assert m["sharded"] == 1.0, m
        assert m["out_err"] < 1e-5 and m["err"] < RTOL, m


PP_TP_DP = [
    (name, dict(pp=2, tp=2, dp_shard=2))
    for name in ("llava", "mistral3", "paligemma_mqa", "gemma3")
]


@pytest.mark.multirank
@pytest.mark.slow
def test_vlm_pp2_tp2_dp_shard2_matches_one_process():
    """pp=2 x tp=2 x dp_shard=2 on 8 ranks: LLaVA and Mistral3 (2 key/value heads), PaliGemma and
    Gemma 3 with one key/value head (k / v replicated over the tp ranks, their gradients summed):
    the step's loss and every gradient equal one process's."""
    res = run_ranks(vlm_cases.pipeline_suite, 8, PP_TP_DP, timeout_s=600)
    for rank, per in enumerate(res):
        for name, r in per.items():
            assert abs(r["loss"] - r["ref"]) <= RTOL * abs(r["ref"]), (rank, name, r)
            assert r["n"] > 0, (rank, name, r)
            assert r["err"] < RTOL, (rank, name, r)
