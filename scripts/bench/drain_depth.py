"""How deep the split drain should go: step times paired step by step in the same two processes.

The pipelined MLP of ``pipeline.py`` (8 x Linear(512, 512) + ReLU, batch 256, 2 CPU ranks, one
thread each) is built once per drain depth (``parallel.pipeline.schedule.DRAIN_DEPTH``: 0 = no
split, 1 = the last backward as I then W, k = the last k backwards as I with their W's after the
last I). Every step runs each depth once, in turn, behind a shared-memory barrier, so all depths
see the same machine state; a depth's figure is the median over steps of its step time divided by
depth 0's in the same step. This resolves differences of 1-2% on a machine whose step times drift
by 10% within a minute, which separate runs cannot.

    python scripts/bench/drain_depth.py [--ms 2,4,8,16] [--depths 0,1,2,3] [--steps 150]
        [--out f.json]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, os.path.dirname(__file__))

from pipeline import BATCH, D, _tight_barrier, mlp, mse, spawn  # noqa: E402 - the same model, loss, launcher

from rag_mm.components.metrics import strict_dumps  # noqa: E402  (null, never NaN, in the report)


def paired(rank, m, depths, steps, schedule):
    import parallel
    from parallel.pipeline import schedule as sched

    barrier = _tight_barrier()
    x, y = torch.randn(BATCH, D), torch.randn(BATCH, D)
    pms = {}
    for d in depths:  # the depth is read when parallelize builds the orders
        sched.DRAIN_DEPTH = d
        cfg = parallel.ParallelConfig(pp=2, microbatches=m, schedule=schedule, partition="uniform")
        pms[d] = parallel.parallelize(mlp(), cfg, (x,))
    times: dict[int, list[float]] = {d: [] for d in depths}
    for _ in range(steps + 3):
        for d, pm in pms.items():
            barrier()
            t0 = time.perf_counter()
            pm.train_step((x,), target=y, loss_fn=mse)
            times[d].append(time.perf_counter() - t0)
            pm.zero_grad()
    return {d: t[3:] for d, t in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ms", default="2,4,8,16")
    ap.add_argument("--depths", default="0,1,2,3")
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--schedule", default="eager_1f1b", help="gpipe | 1f1b | eager_1f1b")
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    depths = [int(d) for d in a.depths.split(",")]
    res = []
    print(
        f"MLP 8x Linear({D},{D})+ReLU, batch {BATCH}, p=2, {a.schedule}; load average "
        f"{os.getloadavg()[0]:.1f}"
    )
    for m in [int(x) for x in a.ms.split(",") if x]:
        r = spawn(paired, 2, m=m, depths=depths, steps=a.steps, schedule=a.schedule)
        # the slower rank
        per_step = {d: [max(t0, t1) for t0, t1 in zip(r[0][d], r[1][d])] for d in depths}
        base = per_step[depths[0]]
        for d in depths:
            rel = statistics.median(t / b for t, b in zip(per_step[d], base))
            row = {
                "m": m,
                "depth": d,
                "step_ms": statistics.median(per_step[d]) * 1e3,
                "vs_first": rel,
            }
            res.append(row)
            print(strict_dumps(row), flush=True)
    if a.out:
        with open(a.out, "w") as f:
            f.write(strict_dumps(res, indent=1))


if __name__ == "__main__":
    main()
