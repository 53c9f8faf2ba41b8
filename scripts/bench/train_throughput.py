"""Reader training throughput: samples/s and model FLOPs utilisation (MFU).

    python scripts/bench/train_throughput.py [--threads 2] [--steps 20] [--precision fp32|bf16] [overrides...]

FLOPs per step are counted by torch.utils.flop_counter on one real forward + backward (the
vision tower, every projection and MLP, the answer-only LM head), nothing estimated. The counter
does not see inside the attention kernels (SDPA's masked CPU path or the fused op), so MFU here
excludes the QK^T and PV products: a slight undercount at the demo's ~60-180 tokens. The peak is
a large matmul measured in the same process with the same threads and dtype.
MFU = (FLOPs per step / seconds per step) / peak. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import platform
import time

import torch
from torch.utils.flop_counter import FlopCounterMode

from rag_mm.config import compose
from rag_mm.model import Reader
from rag_mm.optim import build_optimizer


def matmul_peak(dtype: torch.dtype, n: int = 2048, reps: int = 5) -> float:
    """Best-of FLOP/s of an n x n x n matmul (2 n^3 FLOPs)."""
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    a @ b
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t)
    return 2 * n**3 / best


def synthetic_batch(cfg, batch: int, k: int) -> dict:
    """Shapes of a demo batch: k documents of ~21 text tokens, questions of ~8, answers of 2."""
    g = torch.Generator().manual_seed(0)
    s = cfg.model.image_size
    x = dict(
        image=torch.randn(batch, 3, s, s, generator=g),
        q_ids=torch.randint(1, 49000, (batch, 9), generator=g), q_len=torch.full((batch,), 8),
        a_ids=torch.randint(1, 49000, (batch, 2), generator=g), a_len=torch.full((batch,), 2),
    )
    if k:
        x.update(doc_image=torch.randn(batch, k, 3, s, s, generator=g),
                 doc_ids=torch.randint(1, 49000, (batch, k, 22), generator=g), doc_len=torch.full((batch, k), 21))
    return x


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--docs", type=int, default=1, help="documents per query (1 = oracle, 5 = top-5)")
    ap.add_argument("--precision", choices=["fp32", "bf16"], default="fp32")
    ap.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. model=base")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    cfg = compose(["+experiment=demo", "run_dir=/tmp/unused", *args.overrides])
    torch.manual_seed(0)
    model = Reader(cfg.model, 49408)
    opt = build_optimizer(model, cfg.optim)
    batch = synthetic_batch(cfg, args.batch, args.docs)
    dtype = torch.bfloat16 if args.precision == "bf16" else torch.float32
    ctx = torch.autocast("cpu", dtype=torch.bfloat16) if args.precision == "bf16" else torch.autocast("cpu", enabled=False)

    def step() -> None:
        with ctx:
            out = model(**batch)
        out.loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    with FlopCounterMode(display=False) as fc:
        with ctx:
            out = model(**batch)
        out.loss.backward()
    opt.zero_grad(set_to_none=True)
    flops = fc.get_total_flops()
    for _ in range(3):  # warm-up
        step()
    times = []
    for _ in range(args.steps):
        t = time.perf_counter()
        step()
        times.append(time.perf_counter() - t)
    times.sort()
    median = times[len(times) // 2]
    peak = matmul_peak(dtype)
    print(json.dumps({
        "bench": "train_throughput",
        "machine": f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads",
        "torch": torch.__version__, "precision": args.precision, "batch": args.batch, "docs_per_query": args.docs,
        "params_M": round(sum(p.numel() for p in model.parameters()) / 1e6, 3),
        "step_s_median": round(median, 4), "samples_per_s": round(args.batch / median, 1),
        "flops_per_step_G": round(flops / 1e9, 2), "achieved_GFLOPs": round(flops / median / 1e9, 1),
        "matmul_peak_GFLOPs": round(peak / 1e9, 1), "mfu": round(flops / median / peak, 4),
    }))


if __name__ == "__main__":
    main()
