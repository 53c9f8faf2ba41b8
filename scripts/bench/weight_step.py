"""The split backward's weight step (W) with and without its nn.Linear fast path, step-paired.

The pipelined MLP of ``pipeline.py`` (8 x Linear(512, 512) + ReLU, batch 256, 2 CPU ranks, one
thread each) runs with ``parallel.pipeline.split_backward.LINEAR_FAST_PATH`` on in even steps and
off (W through the autograd engine, one start per layer) in odd steps, in the same two processes
behind a shared-memory barrier. Reported per schedule and m: the median per-step ratio fast /
engine (below 1: the fast path is faster), the median step times, and per rank the median
duration of each action kind (F, B, I, W) from the timeline. Which actions split: every backward
under zero_bubble, the last ``DRAIN_DEPTH`` backwards of the non-first ranks under the 1F1B family.

    python scripts/bench/weight_step.py [--schedules zero_bubble,eager_1f1b] [--ms 8,16]
        [--steps 40]
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


def paired(rank, m, steps, schedule):
    import parallel
    from parallel.pipeline import split_backward

    barrier = _tight_barrier()
    x, y = torch.randn(BATCH, D), torch.randn(BATCH, D)
    cfg = parallel.ParallelConfig(pp=2, microbatches=m, schedule=schedule, partition="uniform")
    pm = parallel.parallelize(mlp(), cfg, (x,))
    times: dict[bool, list[float]] = {True: [], False: []}
    events: dict[bool, dict[str, list[float]]] = {True: {}, False: {}}
    warm = 4
    for s in range(2 * steps + warm):
        fast = s % 2 == 0
        split_backward.LINEAR_FAST_PATH = fast
        barrier()
        t0 = time.perf_counter()
        pm.train_step((x,), target=y, loss_fn=mse)
        dt = time.perf_counter() - t0
        pm.zero_grad()
        if s < warm:
            continue
        times[fast].append(dt)
        for e in pm.events:
            if e.kind in ("F", "B", "I", "W"):
                events[fast].setdefault(e.kind, []).append(e.end - e.start)
    split_backward.LINEAR_FAST_PATH = True
    return {
        "times": times,
        "action_us": {
            ("fast" if f else "engine"): {
                k: statistics.median(v) * 1e6 for k, v in events[f].items()
            }
            for f in (True, False)
        },
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--schedules", default="zero_bubble,eager_1f1b")
    ap.add_argument("--ms", default="8,16")
    ap.add_argument("--steps", type=int, default=40, help="steps per variant (they alternate)")
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    torch.set_num_threads(1)
    print(
        f"MLP 8x Linear({D},{D})+ReLU, batch {BATCH}, p=2, 1 thread/rank; load average "
        f"{os.getloadavg()[0]:.1f}"
    )
    res = []
    for schedule in a.schedules.split(","):
        for m in (int(v) for v in a.ms.split(",")):
            r = spawn(paired, 2, m=m, steps=a.steps, schedule=schedule)
            # a step's time is the slower rank's
            fast, engine = (
                [max(t) for t in zip(*(x["times"][f] for x in r))] for f in (True, False)
            )
            row = {
                "schedule": schedule,
                "m": m,
                "ratio_fast_over_engine": statistics.median(a / b for a, b in zip(fast, engine)),
                "step_ms": {
                    "fast": statistics.median(fast) * 1e3,
                    "engine": statistics.median(engine) * 1e3,
                },
                "action_us": [x["action_us"] for x in r],
            }
            res.append(row)
            print(strict_dumps(row), flush=True)
    if a.out:
        with open(a.out, "w") as f:
            f.write(strict_dumps(res, indent=1))


if __name__ == "__main__":
    main()
