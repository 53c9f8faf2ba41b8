"""Pipeline overhead and partition speed-up on CPU gloo ranks (one thread each).

1. MLP (8 blocks Linear(D, D) + ReLU, D=512, batch 256), 2 ranks, uniform split, 1F1B, m in
   2, 4, 8, 16: T1 = one process, one thread, the same m microbatches with gradient accumulation;
   efficiency = T1 / (p * Tpipe); overhead = (m / (m + p - 1)) / efficiency - 1 (what the
   pipeline costs beyond its unavoidable bubble); the measured bubble fraction from the timeline,
   and the time each rank spent blocked in receives.
2. The rag_mm reader on 2 ranks: step time with the auto partition against the uniform one.

    python scripts/bench/pipeline.py [--steps 20] [--out results.json]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

D, BATCH, BLOCKS = 512, 256, 8  # the reference setting of issue 5


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(D, D), nn.ReLU()) for _ in range(BLOCKS)])


def mse(out, tgt):
    return torch.nn.functional.mse_loss(out, tgt)


def t_single(m: int, steps: int) -> float:
    model = mlp()
    x, y = torch.randn(BATCH, D), torch.randn(BATCH, D)
    times = []
    for s in range(steps + 3):
        t0 = time.perf_counter()
        for xi, yi in zip(x.tensor_split(m), y.tensor_split(m)):
            (mse(model(xi), yi) / m).backward()
        if s >= 3:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _worker(rank, world, port, job, q):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=300))
    try:
        q.put((rank, job["fn"](rank, **job["kw"])))
    finally:
        dist.destroy_process_group()


def spawn(fn, world: int, **kw):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    ps = [ctx.Process(target=_worker, args=(r, world, port, {"fn": fn, "kw": kw}, q)) for r in range(world)]
    for p in ps:
        p.start()
    out = dict(q.get(timeout=900) for _ in ps)
    for p in ps:
        p.join()
    return [out[r] for r in range(world)]


def pipe_mlp(rank, m, steps, schedule):
    import parallel
    from parallel.timeline import bubble_fraction, gather

    model = mlp()
    x, y = torch.randn(BATCH, D), torch.randn(BATCH, D)
    cfg = parallel.ParallelConfig(pp=2, microbatches=m, schedule=schedule, partition="uniform")
    pm = parallel.parallelize(model, cfg, (x,))
    times, waits, bubbles = [], [], []
    for s in range(steps + 3):
        dist.barrier()
        t0 = time.perf_counter()
        pm.train_step((x,), target=y, loss_fn=mse)
        dt = time.perf_counter() - t0
        ev = gather(pm.events)
        if s >= 3:
            times.append(dt)
            waits.append(pm.transport.wait_s)
            bubbles.append(bubble_fraction(ev))
        pm.zero_grad()
    return {"t": statistics.median(times), "wait": statistics.median(waits), "bubble": statistics.median(bubbles),
            "events": [e.__dict__ for e in ev] if rank == 0 else None}


def reader_case(b):
    from rag_mm.config import ModelConfig
    from rag_mm.model import Reader

    torch.manual_seed(0)
    cfg = ModelConfig(dim=128, layers=4, heads=4, vision_width=128, vision_layers=2, vision_head_width=32,
                      attention_backend="reference")
    model = Reader(cfg, 49408)
    g = torch.Generator().manual_seed(1)
    k, lt, lq, la = 2, 24, 12, 6
    inputs = {
        "image": torch.randn(b, 3, 32, 32, generator=g), "q_ids": torch.randint(0, 49408, (b, lq), generator=g),
        "q_len": torch.full((b,), lq), "a_ids": torch.randint(0, 49408, (b, la), generator=g),
        "a_len": torch.full((b,), la), "doc_image": torch.randn(b, k, 3, 32, 32, generator=g),
        "doc_ids": torch.randint(0, 49408, (b, k, lt), generator=g), "doc_len": torch.full((b, k), lt),
    }
    return model, inputs


def pipe_reader(rank, partition, steps, m):
    import parallel

    model, inputs = reader_case(32)
    cfg = parallel.ParallelConfig(pp=2, microbatches=m, schedule="1f1b", partition=partition)
    pm = parallel.parallelize(model, cfg, inputs)
    times = []
    for s in range(steps + 2):
        dist.barrier()
        t0 = time.perf_counter()
        pm.train_step(inputs, loss_fn=lambda out, _: out.loss)
        if s >= 2:
            times.append(time.perf_counter() - t0)
        pm.zero_grad()
    return {"t": statistics.median(times), "table": pm.partition.table() if rank == 0 else ""}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--ms", default="2,4,8,16")
    ap.add_argument("--schedule", default="1f1b")
    ap.add_argument("--reader-steps", type=int, default=8)
    ap.add_argument("--reader-reps", type=int, default=3, help="interleaved uniform/auto repetitions")
    ap.add_argument("--out", default="")
    ap.add_argument("--trace", default="", help="write the m=8 Chrome trace + PNG with this path prefix")
    a = ap.parse_args()
    torch.set_num_threads(1)
    p = 2
    res = {"mlp": [], "reader": {}}
    print(f"MLP {BLOCKS}x Linear({D},{D})+ReLU, batch {BATCH}, p={p}, {a.schedule}, 1 thread/rank, gloo")
    print(f"{'m':>3} {'T1 ms':>8} {'Tpipe ms':>9} {'eff':>6} {'overhead':>9} {'bubble':>7} {'theory':>7} {'recv wait ms (r0,r1)':>22}")
    for m in [int(x) for x in a.ms.split(",") if x]:
        t1 = t_single(m, a.steps)
        r = spawn(pipe_mlp, p, m=m, steps=a.steps, schedule=a.schedule)
        tp = max(x["t"] for x in r)
        eff = t1 / (p * tp)
        over = (m / (m + p - 1)) / eff - 1
        row = dict(m=m, t1=t1, tpipe=tp, efficiency=eff, overhead=over, bubble=r[0]["bubble"],
                   theory=(p - 1) / (m + p - 1), wait=[x["wait"] for x in r])
        res["mlp"].append(row)
        print(f"{m:>3} {t1 * 1e3:>8.2f} {tp * 1e3:>9.2f} {eff:>6.3f} {over:>9.1%} {row['bubble']:>7.1%} "
              f"{row['theory']:>7.1%} {row['wait'][0] * 1e3:>10.2f},{row['wait'][1] * 1e3:>8.2f}")
        if a.trace and m == 8:
            from parallel.timeline import Event, plot, to_chrome_trace

            ev = [Event(**d) for d in r[0]["events"]]
            to_chrome_trace(ev, a.trace + ".json")
            plot(ev, a.trace + ".png", title=f"MLP p=2 m=8 {a.schedule}")
    if a.reader_steps:
        # interleaved repetitions (uniform, auto, uniform, auto, ...): the machine is shared, so
        # load drifts; the speed-up is the median of the per-pair ratios
        ts: dict[str, list[float]] = {"uniform": [], "auto": []}
        for rep in range(a.reader_reps):
            for part in ("uniform", "auto"):
                r = spawn(pipe_reader, p, partition=part, steps=a.reader_steps, m=4)
                ts[part].append(max(x["t"] for x in r))
                print(f"reader (dim 128, 4 blocks, 2-layer ViT, batch 32, m=4) rep {rep} {part:>8}: "
                      f"{ts[part][-1] * 1e3:.1f} ms/step")
                if rep == 0:
                    print(r[0]["table"])
        ratios = [u / t for u, t in zip(ts["uniform"], ts["auto"])]
        res["reader"] = {"uniform": statistics.median(ts["uniform"]), "auto": statistics.median(ts["auto"]),
                         "ratios": ratios}
        print(f"auto vs uniform speed-up: per pair {', '.join(f'{x:.2f}' for x in ratios)}; "
              f"median {statistics.median(ratios):.2f}x")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
