"""Benchmark of the automatic partitioner, printing JSON.

1. Speed: partitioning a model of >= 1000 modules (tracing excluded), for 2, 4 and 8 stages, on
   a deep model (200 small blocks), a wide one (8 blocks of 127 modules, so the partitioner
   must descend into blocks) and a flat one (1000 leaves: the dynamic program runs on 1000 units).
   Target: <= 2 s.
2. Quality: on the test models, the largest stage cost of ``auto`` over the exact optimum of the
   same units (dynamic program), and the largest stage time of the baselines (DeepSpeed uniform
   and parameters, torchgpipe balance_by_time over the hand-written layer list) over ``auto``'s.

    OMP_NUM_THREADS=1 .venv/bin/python scripts/bench/partition.py [--markdown] [--skip-quality]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import parallel  # noqa: E402
from parallel.trace import trace_model  # noqa: E402
from rag_mm.components.metrics import strict_dumps  # noqa: E402  (null, never NaN, in the report)


class Block(nn.Module):
    def __init__(self, d: int, depth: int):
        super().__init__()
        # depth x (Linear, LayerNorm, GELU, Linear) + the block + the ModuleList = 4 depth + 2
        self.layers = nn.ModuleList(
            nn.Sequential(nn.Linear(d, d), nn.LayerNorm(d), nn.GELU(), nn.Linear(d, d))
            for _ in range(depth)
        )

    def forward(self, x):
        for layer in self.layers:
            x = x + layer(x)
        return x


class Stack(nn.Module):
    def __init__(self, blocks: int, depth: int, d: int = 16):
        super().__init__()
        self.blocks = nn.ModuleList(Block(d, depth) for _ in range(blocks))
        self.head = nn.Linear(d, 1)

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def speed(repeats: int = 3) -> list[dict]:
    out = []
    for label, blocks, depth in (("deep", 200, 1), ("wide", 8, 25), ("flat", 0, 0)):
        # flat: 1000 leaves in one nn.Sequential, so the dynamic program runs over 1000 units
        model = (
            Stack(blocks, depth)
            if blocks
            else nn.Sequential(*[nn.Linear(16, 16) for _ in range(1000)])
        )
        n_mod = len(list(model.modules()))
        tr = trace_model(model, (torch.randn(4, 16),), passes=3)
        for k in (2, 4, 8):
            times = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                part = parallel.partition_trace(tr, k)
                times.append(time.perf_counter() - t0)
            out.append(
                {
                    "model": label,
                    "modules": n_mod,
                    "stages": k,
                    "units": len(part.units),
                    "partition_s": round(statistics.median(times), 4),
                    "max_s": round(max(times), 4),
                }
            )
            print(strict_dumps(out[-1]), file=sys.stderr, flush=True)
    return out


def quality() -> list[dict]:
    from tests.parallel.partition_models import MODELS
    from tests.parallel.test_partition import exact_optimum

    out = []
    for name, factory in MODELS.items():
        torch.manual_seed(0)
        model, inputs = factory()
        tr = trace_model(model, inputs, passes=5)
        for k in (2, 4, 8):
            part = parallel.partition_trace(tr, k)
            got, best = exact_optimum(part)
            row = {
                "model": name,
                "stages": k,
                "units": len(part.units),
                "auto_vs_optimum": round(got / best, 4),
                "auto_max_stage_ms": round(part.max_time * 1e3, 3),
                "ideal_ms": round(sum(s.compute_time for s in part.stages) / k * 1e3, 3),
            }
            for method in ("uniform", "parameters", "time"):
                base = parallel.baseline_partition(tr, k, method)
                row[f"{method}_vs_auto"] = round(base.max_time / part.max_time, 3)
                row["layers"] = len(base.units)
            mem = parallel.partition_trace(tr, k, objective="memory")
            row["memory_objective_peak_vs_speed"] = round(mem.max_memory / part.max_memory, 3)
            out.append(row)
            print(strict_dumps(row), file=sys.stderr, flush=True)
    return out


def markdown(rows: list[dict]) -> str:
    lines = [
        "| model | stages | units (auto) | layers (baselines) | auto / optimum | uniform / auto | "
        "parameters / auto | time / auto | auto max stage ms (ideal) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['model']} | {r['stages']} | {r['units']} | {r['layers']} | "
            f"{r['auto_vs_optimum']:.3f} | {r['uniform_vs_auto']:.2f} | "
            f"{r['parameters_vs_auto']:.2f} | {r['time_vs_auto']:.2f} | "
            f"{r['auto_max_stage_ms']:.2f} ({r['ideal_ms']:.2f}) |"
        )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument(
        "--markdown", action="store_true", help="also print the quality table as markdown"
    )
    ap.add_argument("--skip-quality", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(1)
    res = {"torch": torch.__version__, "speed": speed()}
    if not args.skip_quality:
        res["quality"] = quality()
    print(strict_dumps(res, indent=1))
    if args.markdown and "quality" in res:
        print(markdown(res["quality"]))


if __name__ == "__main__":
    main()
