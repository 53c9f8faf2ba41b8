"""Every layout composed on one mesh, through ``parallel.parallelize``, against one process (fp32,
rtol 1e-4): the step loss and every gradient (full tensors of the TP / FSDP shards), over two
steps, on the rag_mm reader and Hugging Face GPT-2 (tied embeddings across the cut) and Llama:

- pp=2 x tp=2 on 4 gloo ranks (slow grid);
- pp=2 x dp_shard=2 (FSDP2 under the pipeline) on 4 ranks, under 1F1B and zero-bubble, with each
  FSDP unit gathered and reduce-scattered once per step, not once per microbatch;
- pp=2 x tp=2 x dp_shard=2 on 8 ranks (Llama with sequence parallel: each stage's run of blocks is
  a region of its own, so tensors crossing the cut are whole); HSDP (dp_replicate=2 x dp_shard=2)
  under pp=2 in the slow grid.

Layouts that cannot work fail before training. (uniform or manual partitions where TP is on: the
auto one follows measured times, and may leave a stage with nothing to shard.)"""

from __future__ import annotations

import re

import pytest
import torch

from tests.distributed import run_ranks
from tests.parallel import tp_cases

RTOL = 1e-4
CASES = [
    ("gpt2", dict(pp=2, tp=2, partition="uniform")),
    ("reader", dict(pp=2, tp=2, partition="uniform")),
]


@pytest.mark.slow  # the default run covers pp x tp in the 8-rank pp x tp x dp_shard test below
@pytest.mark.multirank
def test_pp2_tp2_matches_one_process():
    res = run_ranks(tp_cases.pp_tp_suite, 4, CASES, timeout_s=300)
    assert sorted(next(iter(r.values()))["pp_rank"] for r in res) == [0, 0, 1, 1]
    _check(res, CASES, 4)
    for (
        case,
        _,
    ) in CASES:  # the two tp ranks of a stage hold the same parameter names; stages split the model
        names = [{k: v["names"] for k, v in r.items() if k.startswith(case)} for r in res]
        assert names[0] == names[1] and names[2] == names[3] and names[0] != names[2]


def _check(res, cases, world, fsdp_once=False):
    for rank, per in enumerate(res):
        for case, r in per.items():
            for loss in r[
                "losses"
            ]:  # two steps: gradients accumulate like plain autograd after zero_grad
                assert abs(loss - r["ref"]) <= RTOL * abs(r["ref"]), (
                    rank,
                    case,
                    r["losses"],
                    r["ref"],
                )
            assert r["n"] > 0 and r["err"] < RTOL, (rank, case, r["err"])
            assert r["dtensors"], f"rank {rank} {case}: nothing was sharded on this stage"
            assert r["group_timeouts_s"] and set(r["group_timeouts_s"].values()) == {60.0}, r[
                "group_timeouts_s"
            ]
            if fsdp_once:  # one all-gather and one reduce-scatter per unit and step (m = 4)
                assert r["fsdp_units"] > 0, (rank, case)
                assert r["collectives"] == {
                    "all_gather": r["fsdp_units"],
                    "reduce_scatter": r["fsdp_units"],
                }, (rank, case, r["collectives"], r["fsdp_units"])
    assert len(res) == world and all(len(per) == len(cases) for per in res)


FSDP_PP = [
    (name, dict(pp=2, dp_shard=2, schedule=s))
    for name in ("reader", "gpt2", "llama")
    for s in ("1f1b", "zero_bubble")
]


@pytest.mark.multirank
def test_fsdp_under_pipeline_matches_one_process():
    res = run_ranks(tp_cases.pp_tp_suite, 4, FSDP_PP, timeout_s=600)
    # pp outermost on the mesh
    assert [next(iter(r.values()))["pp_rank"] for r in res] == [
        0,
        0,
        1,
        1,
    ]
    _check(res, FSDP_PP, 4, fsdp_once=True)


PP_TP_DP = [
    ("reader", dict(pp=2, tp=2, dp_shard=2, partition="uniform")),
    ("llama", dict(pp=2, tp=2, dp_shard=2, partition="uniform", sequence_parallel=True)),
    # a block cut into units, all on stage 0: stage 1 replays its attention's own code on
    # stand-ins shaped like stage 0's sharded projections (its head sizes divided too)
    (
        "gpt2",
        dict(
            pp=2,
            tp=2,
            dp_shard=2,
            schedule="zero_bubble",
            split=[["transformer.h.1.attn.c_attn"], ["transformer.h.2"]],
        ),
    ),
]


@pytest.mark.multirank
def test_pp2_tp2_dp_shard2_matches_one_process():
    res = run_ranks(tp_cases.pp_tp_suite, 8, PP_TP_DP, timeout_s=900)
    assert [next(iter(r.values()))["pp_rank"] for r in res] == [0] * 4 + [1] * 4
    _check(res, PP_TP_DP, 8)
    for (
        per
    ) in res:  # FSDP shards the TP shards too (2-D dp_shard x tp), none left whole per dp rank
        assert all(not r["tp_not_fsdp"] for r in per.values()), {
            c: r["tp_not_fsdp"] for c, r in per.items()
        }
    for per in res:  # Llama with sequence parallel: one region per stage, whole tensors at the cut
        sp = next(r for case, r in per.items() if "sequence_parallel" in case)["sp_regions"]
        assert len(sp) == 1 and sp[0].startswith("sequence parallel over model.layers."), sp


HSDP_PP = [(name, dict(pp=2, dp_replicate=2, dp_shard=2)) for name in ("reader", "llama")]


@pytest.mark.slow
@pytest.mark.multirank
def test_hsdp_under_pipeline_matches_one_process():
    res = run_ranks(tp_cases.pp_tp_suite, 8, HSDP_PP, timeout_s=900)
    _check(res, HSDP_PP, 8)


def test_3d_layout_errors_before_training():
    from parallel import ParallelConfig
    from parallel.spmd import discover_tp_plan

    with pytest.raises(
        ValueError,
        match=r"pp\*dp_replicate\*dp_shard\*tp = 2\*1\*1\*2 = 4 does not match the world size 2",
    ):
        ParallelConfig(pp=2, tp=2).validate(2)
    torch.manual_seed(0)
    model, inputs = tp_cases.factory("gpt2")
    with pytest.raises(ValueError, match=r"tp=3 does not divide the head count"):
        discover_tp_plan(model, ParallelConfig(pp=2, tp=3), inputs)
    for bad, key in (
        (dict(pp=2, dp_shard=2, mixed_precision="bf16"), "mixed_precision='bf16' with pp=2"),
        (dict(pp=2, dp_shard=2, cpu_offload=True), "cpu_offload with pp=2"),
        (dict(pp=2, dp_shard=2, stage_path="graph"), "stage_path='graph' with tp=1, dp_shard=2"),
    ):
        with pytest.raises(ValueError, match=re.escape(key)):
            ParallelConfig(**bad).validate(4)
    # sequence parallel under pp is planned on the whole model (regions cut per stage later)
    plan = discover_tp_plan(model, ParallelConfig(pp=2, tp=2, sequence_parallel=True), inputs)
    assert plan.regions == [("transformer.h.0", "transformer.h.3")], plan.regions


def test_stage_plan_cuts_sequence_parallel_regions_per_run_of_held_blocks():
    """Each run of consecutive blocks a pipeline rank holds is a region of its own: one per stage
    under 1F1B, one per virtual stage under an interleaved schedule."""
    from torch import nn

    from parallel.spmd import stage_plan
    from parallel.tp.plan import TPPlan

    plan = TPPlan(regions=[("h.0", "h.5")])
    one_f_one_b = {f"h.{i}": {0 if i < 3 else 1} for i in range(6)}
    assert stage_plan(nn.Module(), plan, one_f_one_b, 1)[0].regions == [("h.3", "h.5")]
    # stages 0..2 of 2 blocks, ranks 0 1 0
    interleaved = {f"h.{i}": {(i // 2) % 2} for i in range(6)}
    assert stage_plan(nn.Module(), plan, interleaved, 0)[0].regions == [
        ("h.0", "h.1"),
        ("h.4", "h.5"),
    ]
    assert stage_plan(nn.Module(), plan, interleaved, 1)[0].regions == [("h.2", "h.3")]


def test_stage_plan_divides_head_sizes_of_pairs_other_ranks_shard():
    """Every pipeline rank divides the head sizes of each pair that one rank shards (its owner's
    code may be replayed on stand-ins of the sharded outputs there); a pair cut by the pipeline
    stays whole everywhere."""
    from parallel import ParallelConfig
    from parallel.spmd import discover_tp_plan, stage_plan

    torch.manual_seed(0)
    model, inputs = tp_cases.factory("gpt2")
    plan = discover_tp_plan(model, ParallelConfig(pp=2, tp=2), inputs)
    # blocks 0 and 1 on rank 0, 2 and 3 on rank 1, except block 1's c_proj (its attention pair is
    # cut)
    rank_of = {
        n: {0 if int(n.split(".")[2]) < 2 else 1} for n, _ in model.named_parameters() if ".h." in n
    }
    rank_of.update({n: {1} for n in rank_of if n.startswith("transformer.h.1.attn.c_proj.")})
    for me in (0, 1):
        part, notes = stage_plan(model, plan, rank_of, me)
        divided = {m for m, a, _ in part.divide if a == "split_size"}
        assert divided == {
            "transformer.h.0.attn",
            "transformer.h.2.attn",
            "transformer.h.3.attn",
        }, (me, divided)
        assert {(m, "num_heads", 0) for m in divided} <= set(part.divide)  # 0: by the tp degree
        owned = {o for o in part.owners.values()}
        assert owned == (
            {"transformer.h.0.attn", "transformer.h.0.mlp", "transformer.h.1.mlp"}
            if me == 0
            else {
                "transformer.h.2.attn",
                "transformer.h.2.mlp",
                "transformer.h.3.attn",
                "transformer.h.3.mlp",
            }
        )
        assert any(
            "transformer.h.1.attn.c_attn" in n and "cut by the pipeline" in n for n in notes
        ), notes
