"""Memory savers, measured: per-rank memory of FSDP2 vs plain data parallel on 2 gloo ranks, and
the activation memory activation checkpointing saves on the reader.

    python scripts/bench/memory.py [--dim 384 --layers 8] [--json out.json]

Per rank we report (1) model state bytes after an AdamW step: this rank's parameters + gradients
+ optimizer state (local shards of DTensors), and (2) the process's peak resident memory growth
from just before the model is built to after two steps (ru_maxrss; includes activations,
collective buffers and allocator slack). Activation memory = bytes autograd saves for backward
(distinct storages, parameters excluded) in one forward of the reader.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))


def _reader(dim, layers):
    from rag_mm.config import ModelConfig

    torch.manual_seed(0)
    cfg = ModelConfig(dim=dim, layers=layers, heads=max(1, dim // 64), vision_width=128, vision_layers=2,
                      vision_head_width=32, attention_backend="auto")
    g = torch.Generator().manual_seed(1)
    B = 8
    inputs = dict(image=torch.randn(B, 3, 32, 32, generator=g), q_ids=torch.randint(0, 1000, (B, 20), generator=g),
                  q_len=torch.full((B,), 20), a_ids=torch.randint(0, 1000, (B, 8), generator=g),
                  a_len=torch.full((B,), 8), doc_image=torch.randn(B, 2, 3, 32, 32, generator=g),
                  doc_ids=torch.randint(0, 1000, (B, 2, 40), generator=g), doc_len=torch.full((B, 2), 40))
    return cfg, inputs


def _rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _state_bytes(model, opt) -> int:
    def loc(t):
        return t.to_local() if hasattr(t, "to_local") else t

    total = 0
    for p in model.parameters():
        total += loc(p).numel() * loc(p).element_size()
        if p.grad is not None:
            total += loc(p.grad).numel() * loc(p.grad).element_size()
    for st in opt.state.values():
        for v in st.values():
            if torch.is_tensor(v):
                total += loc(v).numel() * loc(v).element_size()
    return total


def dp_rank_fn(rank, world, mode, dim, layers):
    from parallel.config import ParallelConfig
    from parallel.mesh import build_mesh
    from parallel.spmd import parallelize_spmd
    from rag_mm.model import Reader

    cfg, inputs = _reader(dim, layers)
    rss0 = _rss()
    model = Reader(cfg, vocab_size=1000)
    if mode == "fsdp":
        pc = ParallelConfig(dp_shard=world)
        parallelize_spmd(model, pc, build_mesh(pc, world, "cpu"))
    else:  # plain data parallel: full replica, gradients all-reduced
        from torch.nn.parallel import DistributedDataParallel

        model = DistributedDataParallel(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=False)
    for _ in range(2):
        out = model(**inputs)
        out.loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=False)
    return dict(state=_state_bytes(model, opt), rss_growth=_rss() - rss0)


def activation_bytes(dim, layers, mode):
    from parallel.memory import apply_activation_checkpointing
    from rag_mm.model import Reader

    cfg, inputs = _reader(dim, layers)
    model = Reader(cfg, vocab_size=1000)
    apply_activation_checkpointing(list(model.blocks), mode, 2)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen, total = set(), [0]

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params and ptr not in seen:
            seen.add(ptr)
            total[0] += t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(**inputs).loss
    loss.backward()
    return total[0]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dim", type=int, default=384)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    from tests.distributed import run_ranks

    res = {"dim": a.dim, "layers": a.layers}
    for mode in ("ddp", "fsdp"):
        r = run_ranks(dp_rank_fn, 2, mode, a.dim, a.layers, timeout_s=600)
        res[mode] = r
    for k in ("state", "rss_growth"):
        res[f"fsdp_vs_ddp_{k}"] = max(x[k] for x in res["fsdp"]) / max(x[k] for x in res["ddp"])
    for mode in ("none", "full", "every_n"):
        res[f"activation_bytes_{mode}"] = activation_bytes(a.dim, a.layers, mode)
    res["ac_full_reduction"] = res["activation_bytes_none"] / res["activation_bytes_full"]
    res["ac_every2_reduction"] = res["activation_bytes_none"] / res["activation_bytes_every_n"]
    print(json.dumps(res, indent=1))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
