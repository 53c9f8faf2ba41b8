"""Plan Llama-3.2-1B- and Llama-3.1-8B-shaped models on 16 x p4d (128 A100-40GB) with the layout
planner, compare tensor parallel across nodes with a pipeline across nodes, and check whether
the 8B model trains on one 80 GB H100.

    .venv/bin/python scripts/bench/plan_scale.py [--seq 2048] [--global-batch 512] [--top 5]

The models are built on the meta device (no memory, no weights) and traced there: FLOPs stand in
for time. Attention runs through ``FlashLikeAttention``, which saves what FlashAttention saves
(q, k, v, the output and the per-row log-sum-exp) and recomputes the scores in backward, so the
trace's activation bytes are those of a GPU run with flash attention, not the S x S scores of the
math path. Its FLOPs are those of full (not causal-halved) attention: 2 matmuls forward, 5 backward.

Prints JSON on stdout (tables on stderr).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from parallel.cluster import Cluster  # noqa: E402
from parallel.planner import Plan, plan_layout  # noqa: E402
from rag_mm.components.metrics import strict_dumps  # noqa: E402  (null, never NaN, in the report)


class FlashLikeAttention(torch.autograd.Function):
    """Causal attention saving (q, k, v, out, lse) like FlashAttention 2; GQA by repeating k / v
    heads inside (only the unrepeated ones are saved)."""

    @staticmethod
    def forward(ctx, q, k, v, scale: float):  # q (B, H, S, D); k, v (B, Hkv, S, D)
        rep = q.shape[1] // k.shape[1]
        kr, vr = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        s = (q @ kr.transpose(-1, -2)) * scale  # (B, H, S, S), never saved
        mask = torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).triu(1)
        s = s.masked_fill(mask, float("-inf"))
        lse = torch.logsumexp(s, -1)  # (B, H, S)
        out = torch.softmax(s, -1) @ vr  # (B, H, S, D)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.scale, ctx.rep = scale, rep
        return out

    @staticmethod
    def backward(ctx, g):  # g (B, H, S, D)
        q, k, v, out, lse = ctx.saved_tensors
        rep, scale = ctx.rep, ctx.scale
        kr, vr = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        s = (q @ kr.transpose(-1, -2)) * scale
        mask = torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).triu(1)
        p = torch.exp(s.masked_fill(mask, float("-inf")) - lse.unsqueeze(-1))  # (B, H, S, S)
        dv = p.transpose(-1, -2) @ g
        dp = g @ vr.transpose(-1, -2)
        ds = p * (dp - (g * out).sum(-1, keepdim=True)) * scale
        dq = ds @ kr
        dk = ds.transpose(-1, -2) @ q

        def fold(t):  # (B, H, S, D) -> (B, Hkv, S, D): sum the repeated heads
            b, h, s_, d = t.shape
            return t.view(b, h // rep, rep, s_, d).sum(2)

        return dq, fold(dk), fold(dv), None


def flash_like(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """HF attention interface: (B, H, S, D) in, (B, S, H, D) out."""
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    out = FlashLikeAttention.apply(query, key, value, scale)
    return out.transpose(1, 2).contiguous(), None


SHAPES = {
    # Llama-3.2-1B: 16 layers of width 2048, GQA 32/8 heads, tied embeddings
    "llama-1b": dict(
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=128256,
        tie_word_embeddings=True,
    ),
    # Llama-3.1-8B: 32 layers of width 4096, GQA 32/8 heads, untied
    "llama-8b": dict(
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=128256,
        tie_word_embeddings=False,
    ),
}


def build(name: str, seq: int):
    from transformers import AttentionInterface, LlamaConfig, LlamaForCausalLM

    # HF treats names with "flash" as kernels
    AttentionInterface.register("lse_attention", flash_like)
    cfg = LlamaConfig(**SHAPES[name], max_position_embeddings=max(seq, 2048))
    cfg._attn_implementation = "lse_attention"
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    ids = torch.zeros(1, seq, dtype=torch.long, device="meta")  # one sequence per trace
    return model, (ids,)


def brief(lay) -> dict:
    # the runtime's ParallelConfig that runs it
    return {
        "layout": lay.key,
        "fits": lay.fits,
        "step_time_s": round(lay.step_time_s, 4),
        "mfu": round(lay.mfu, 3),
        "memory_gib": round(lay.memory_bytes_per_device / 2**30, 2),
        "memory_gib_by_kind": {k: round(v / 2**30, 2) for k, v in lay.memory.items()},
        "breakdown_s": {k: round(v, 4) for k, v in lay.breakdown.items()},
        "reasons": lay.reasons,
        "precision": lay.precision,
        "grad_accum": lay.grad_accum,
        "config": dataclasses.asdict(lay.config),
    }


def best_of(plan: Plan, candidates: list[dict]) -> object:
    lays = [plan.estimate(**c) for c in candidates]
    fit = [lay for lay in lays if lay.fits]
    return (
        min(fit, key=lambda lay: lay.step_time_s)
        if fit
        else min(lays, key=lambda lay: lay.memory_bytes_per_device)
    )


def compare_tp_vs_pipeline(plan: Plan, cluster: Cluster) -> dict:
    """TP over two nodes (tp=16) against TP inside a node with a 2-stage pipeline across nodes, at
    the same data-parallel degree; each family at its best options (FSDP split, checkpointing,
    microbatches), bf16. The pipeline is shown with plain 1F1B and with the best schedule."""
    dpn = cluster.devices_per_node
    dp = cluster.world // (2 * dpn)
    splits = [(dp // s, s) for s in (1, 2, 4, 8, 16, 32, 64, 128) if dp % s == 0]
    accum = (1, 2, 4, 8, 16, 32)
    common = [
        dict(precision="bf16", activation_checkpointing=ac, dp_replicate=r, dp_shard=s)
        for ac in (False, True)
        for r, s in splits
    ]
    tp_across = best_of(
        plan, [dict(pp=1, tp=2 * dpn, microbatches=a, **c) for a in accum for c in common]
    )
    pipe = {}
    for scheds, label in (
        (("1f1b",), "pipeline_1f1b"),
        (("1f1b", "interleaved_1f1b", "zero_bubble", "zbv"), "pipeline_best"),
    ):
        pipe[label] = best_of(
            plan,
            [
                dict(pp=2, tp=dpn, microbatches=2 * f, schedule=sc, **c)
                for sc in scheds
                for f in (1, 2, 4, 8, 16)
                for c in common
            ],
        )
    a, b = tp_across, pipe["pipeline_1f1b"]
    # per-block TP all-reduce of one microbatch, to say where the difference comes from
    out = {
        "tp_across_nodes": brief(a),
        **{k: brief(v) for k, v in pipe.items()},
        "pipeline_1f1b_over_tp_across": round(b.step_time_s / a.step_time_s, 3),
        "pipeline_best_over_tp_across": round(pipe["pipeline_best"].step_time_s / a.step_time_s, 3),
    }
    bw16, lat16, _ = cluster.group_link(2 * dpn, 1)
    bw8, lat8, _ = cluster.group_link(dpn, 1)
    out["why"] = (
        f"tp={2 * dpn} runs its 4 all-reduces per block and microbatch over the nodes' network "
        f"({bw16 / 1e9:.0f} GB/s per group, {lat16 * 1e6:.0f} us per step, {2 * (2 * dpn - 1)} "
        f"ring steps) instead of NVSwitch ({bw8 / 1e9:.0f} GB/s, {lat8 * 1e6:.0f} us): TP "
        f"communication {a.breakdown['tp_comm']:.3f} s vs {b.breakdown['tp_comm']:.3f} s per "
        "step; the pipeline pays instead one activation hand-over per microbatch and stage "
        f"boundary ({b.breakdown['pp_comm']:.3f} s) and a bubble ({b.breakdown['bubble']:.3f} s); "
        f"compute is about the same ({a.breakdown['compute']:.3f} s vs "
        f"{b.breakdown['compute']:.3f} s: the same devices per replica)."
    )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--global-batch", type=int, default=512)
    ap.add_argument("--nodes", type=int, default=16)
    ap.add_argument("--top", type=int, default=5)
    args = ap.parse_args()
    cluster = Cluster.preset("p4d", nodes=args.nodes)
    result: dict = {
        "cluster": f"{cluster.nodes} x {cluster.name}",
        "seq_len": args.seq,
        "global_batch": args.global_batch,
        "models": {},
    }
    for name in SHAPES:
        model, inputs = build(name, args.seq)
        t0 = time.perf_counter()
        plan = plan_layout(model, inputs, cluster, global_batch=args.global_batch)
        secs = time.perf_counter() - t0
        print(f"\n== {name}\n{plan.table(args.top, 2)}", file=sys.stderr)
        result["models"][name] = {
            "parameters": plan.parameters,
            "trace_and_plan_s": round(secs, 2),
            "considered": len(plan.layouts),
            "fitting": len(plan.fitting),
            "top": [brief(lay) for lay in plan.fitting[: args.top]],
            "tp_across_nodes_vs_pipeline": compare_tp_vs_pipeline(plan, cluster),
        }
        if name == "llama-8b":
            # one H100-80GB, 4 sequences per step
            one = Cluster.preset("h100", nodes=1, devices_per_node=1)
            single = plan_layout(
                plan.planner.trace, inputs, one, global_batch=4, trace_samples=1, tp_divisor=32
            )
            print(f"\n== {name} on one H100-80GB\n{single.table(3, 3)}", file=sys.stderr)
            no_off = [lay for lay in single.layouts if not lay.cpu_offload and lay.microbatch_size]
            result["llama-8b_on_one_h100_80gb"] = {
                "global_batch": 4,
                "fits_without_offload": any(lay.fits for lay in no_off),
                "fits_with_offload": any(lay.fits for lay in single.layouts if lay.cpu_offload),
                "best": brief(single.best) if single.best else None,
                "without_offload_closest": brief(
                    min(no_off, key=lambda lay: lay.memory_bytes_per_device)
                ),
            }
    print(strict_dumps(result, indent=1))


if __name__ == "__main__":
    main()
