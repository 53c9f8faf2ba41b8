"""Tensor parallel on 2 gloo ranks against one process (fp32): loss and every gradient, on the
rag_mm reader and Hugging Face / open_clip models; forward collectives per layer; layout errors."""

from __future__ import annotations

import pytest
import torch

from tests.distributed import run_ranks
from tests.parallel import tp_cases

RTOL = 1e-4


def _check(res: dict, name: str) -> None:
    assert abs(res["loss"] - res["ref"]) <= RTOL * abs(res["ref"]) + 1e-6, (name, res["loss"], res["ref"])
    assert res["gerr"] < RTOL, (name, res["gerr"])
    assert res["gerr_global"] < RTOL, (name, res["gerr_global"])
    assert res["dtensors"], f"{name}: nothing was sharded"


@pytest.fixture(scope="module")
def default_suite():
    return run_ranks(tp_cases.suite, 2, ["reader", "gpt2"], ["llama"], ["llama"], timeout_s=240)


@pytest.mark.multirank
@pytest.mark.parametrize("case", ["reader", "gpt2", "llama+sp", "llama+loss_parallel"])
def test_tp2_matches_one_process(default_suite, case):
    for rank_res in default_suite:
        _check(rank_res[case], case)


@pytest.mark.multirank
def test_tp_plan_roles(default_suite):
    r = default_suite[0]
    gpt2 = r["gpt2"]["roles"]
    # GPT-2's fused c_attn (Conv1D, q|k|v) feeds c_proj; the MLP's c_fc feeds its c_proj via GELU
    assert gpt2["transformer.h.0.attn.c_attn"] == "colwise" and gpt2["transformer.h.0.attn.c_proj"] == "rowwise"
    assert gpt2["transformer.h.0.mlp.c_fc"] == "colwise" and gpt2["transformer.h.0.mlp.c_proj"] == "rowwise"
    # tied wte / lm_head: left replicated, and logged
    assert gpt2["lm_head"] == "replicate" and gpt2["transformer.wte"] == "replicate"
    assert any("tied parameter" in line for line in r["gpt2"]["log"])
    assert any("num_heads: 4 -> 2" in line for line in r["gpt2"]["log"])
    llama = r["llama+loss_parallel"]["roles"]
    assert llama["model.embed_tokens"] == "vocab_embedding" and llama["lm_head"] == "lm_head"
    reader = r["reader"]["roles"]
    assert reader["blocks.0.mlp.fc"] == "colwise" and reader["blocks.0.mlp.proj"] == "rowwise"
    assert reader["vision.transformer.resblocks.0.attn"] == "rule:multihead_attention"
    assert reader["lm_head"] == "replicate"  # tied to tok_emb


@pytest.mark.multirank
@pytest.mark.slow
def test_tp2_model_grid():
    res = run_ranks(tp_cases.suite, 2, ["llama", "bert", "open_clip"], ["gpt2", "bert", "reader"], timeout_s=600)
    for rank_res in res:
        for case, r in rank_res.items():
            _check(r, case)


@pytest.mark.multirank
def test_forward_collectives_per_layer():
    plain = run_ranks(tp_cases.layer_collectives, 2, "llama", False)[0]
    sp = run_ranks(tp_cases.layer_collectives, 2, "llama", True)[0]
    assert len(plain) == 4 and len(sp) == 4
    # one all-reduce after attention's row-parallel o_proj, one after the MLP's down_proj
    assert all(c == {"all_reduce": 2} for c in plain), plain
    # sequence parallel: the all-reduce becomes reduce-scatter + all-gather; the first layer also
    # splits its input (no collective) and the last gathers its output (one more all-gather)
    assert all(c.get("reduce_scatter") == 2 and "all_reduce" not in c for c in sp), sp
    assert [c["all_gather"] for c in sp] == [2, 2, 2, 3], sp


def test_head_count_not_divisible_fails_before_sharding():
    from parallel.tp import discover_plan

    torch.manual_seed(0)
    model, inputs = tp_cases.factory("gpt2")
    before = {n: p.clone() for n, p in model.named_parameters()}
    with pytest.raises(ValueError, match=r"tp=3 does not divide the head count .*num_heads=4"):
        discover_plan(model, 3, example_inputs=inputs)
    assert all(torch.equal(p, before[n]) and type(p) is torch.nn.Parameter for n, p in model.named_parameters())


def test_bad_mesh_layout_fails_with_message():
    from parallel.config import ParallelConfig
    from parallel.mesh import build_mesh

    with pytest.raises(ValueError, match=r"does not match the world size 4"):
        build_mesh(ParallelConfig(pp=1, dp_shard=1, tp=2), world_size=4, device_type="cpu")


def test_discovery_without_names():
    """Pairs come from the dataflow: renaming every module does not change the plan's shape."""
    from parallel.tp import discover_plan

    class Anon(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a = torch.nn.Linear(8, 32)
            self.b = torch.nn.Linear(8, 32)
            self.z = torch.nn.Linear(32, 8)
            self.n = torch.nn.LayerNorm(8)
            self.y = torch.nn.Linear(8, 8)

        def forward(self, x):
            h = self.z(torch.nn.functional.silu(self.a(x)) * self.b(x))
            return self.y(self.n(h))  # a norm between: y is not z's partner

    plan = discover_plan(Anon(), 2, example_inputs=(torch.randn(2, 8),))
    roles = {n: e.role for n, e in plan.entries.items()}
    assert roles == {"a": "colwise", "b": "colwise", "z": "rowwise", "y": "replicate"}, roles
