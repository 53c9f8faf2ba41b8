"""Pipeline overhead and partition speed-up on CPU gloo ranks (one thread each).

1. MLP (8 blocks Linear(D, D) + ReLU, D=512, batch 256), 2 ranks, uniform split, 1F1B, m in
   2, 4, 8, 16: T1 = one process, one thread, the same m microbatches with gradient accumulation;
   efficiency = T1 / (p * Tpipe); overhead = (m / (m + p - 1)) / efficiency - 1 (what the
   pipeline costs beyond its unavoidable bubble); ``floor``: the same overhead for a runtime that
   costs nothing on this split (``stage_floor``: each rank's own work timed without the pipeline,
   so floor > 0 is what the split itself costs: the last stage's loss and extra dX, cache and
   memory effects of two busy cores); the measured bubble fraction from the timeline,
   and the time each rank spent blocked in receives. Beside it, in the same run, torch's own
   ``Schedule1F1B`` over gloo with the same even split (``--torch-ref``), and our runtime with the
   shared-memory lanes off (``--p2p gloo``) for comparison.
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


def mlp(d: int = D) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(d, d), nn.ReLU()) for _ in range(BLOCKS)])


def mse(out, tgt):
    return torch.nn.functional.mse_loss(out, tgt)


def t_single(m: int, steps: int) -> tuple[float, float]:
    """(wall, CPU) seconds per step of one process running the same m microbatches (with the
    host allocator set up as ``parallelize`` sets it up for the pipeline ranks: same conditions)."""
    from parallel.host_malloc import steady_malloc

    steady_malloc()
    model = mlp()
    x, y = torch.randn(BATCH, D), torch.randn(BATCH, D)
    times, cpus = [], []
    for s in range(steps + 3):
        t0, c0 = time.perf_counter(), time.process_time()
        for xi, yi in zip(x.tensor_split(m), y.tensor_split(m)):
            (mse(model(xi), yi) / m).backward()
        if s >= 3:
            times.append(time.perf_counter() - t0)
            cpus.append(time.process_time() - c0)
        model.zero_grad()
    return statistics.median(times), statistics.median(cpus)


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


def torch_1f1b(rank, m, steps, d=D, batch=BATCH):
    """torch.distributed.pipelining's 1F1B over gloo, hand-made even split: the reference."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    part = nn.Sequential(*list(mlp(d).children())[rank * BLOCKS // 2:(rank + 1) * BLOCKS // 2])
    x, y = torch.randn(batch, d), torch.randn(batch, d)
    sched = Schedule1F1B(PipelineStage(part, rank, 2, torch.device("cpu")), m, loss_fn=mse)
    times = []
    for s in range(steps + 3):
        dist.barrier()
        t0 = time.perf_counter()
        sched.step(x) if rank == 0 else sched.step(target=y)
        if s >= 3:
            times.append(time.perf_counter() - t0)
        for q in part.parameters():
            q.grad = None
    return {"t": statistics.median(times)}


def pipe_mlp(rank, m, steps, schedule, p2p="auto", stage_path="eager", d=D, batch=BATCH):
    import parallel
    from parallel.timeline import bubble_fraction, gather

    model = mlp(d)
    x, y = torch.randn(batch, d), torch.randn(batch, d)
    cfg = parallel.ParallelConfig(pp=2, microbatches=m, schedule=schedule, partition="uniform", p2p=p2p,
                                  stage_path=stage_path)
    pm = parallel.parallelize(model, cfg, (x,))
    times, waits, bubbles, cpus = [], [], [], []
    for s in range(steps + 3):
        dist.barrier()
        t0, c0 = time.perf_counter(), time.process_time()
        pm.train_step((x,), target=y, loss_fn=mse)
        dt, dc = time.perf_counter() - t0, time.process_time() - c0
        ev = gather(pm.events)
        if s >= 3:
            times.append(dt)
            cpus.append(dc)
            waits.append(pm.transport.wait_s)
            bubbles.append(bubble_fraction(ev))
        pm.zero_grad()
    floor = stage_floor(rank, m, steps, x, y) if d == D else 0.0
    return {"t": statistics.median(times), "wait": statistics.median(waits), "bubble": statistics.median(bubbles),
            "floor": floor,
            "cpu": statistics.median(cpus), "p2p": {k: [c is not None for c in v] for k, v in pm.transport.lanes.items()},
            "events": [e.__dict__ for e in ev] if rank == 0 else None}


def stage_floor(rank, m, steps, x, y):
    """Seconds per step of this rank's own share of the work with no pipeline around it: its four
    blocks' forward and backward on the m microbatches (the last stage with the loss and the dX of
    its first block, which the pipeline needs and one process does not), both ranks at once as in
    the pipeline. ``max over ranks x (m + p - 1) / m`` is the step time of a runtime that costs
    nothing on this split; the rest of Tpipe is the runtime's (messages, replay, the end-of-step
    sync)."""
    blocks = list(mlp(x.shape[1]).children())
    per = BLOCKS // 2
    mine = nn.Sequential(*blocks[rank * per:(rank + 1) * per])
    h = nn.Sequential(*blocks[:per])(x).detach() if rank else x
    hs, ys = h.tensor_split(m), y.tensor_split(m)
    times = []
    for s in range(steps + 3):
        dist.barrier()
        t0 = time.perf_counter()
        for hi, yi in zip(hs, ys):
            if rank == 0:
                out = mine(hi)
                out.backward(torch.full_like(out, 1e-3))
            else:
                (mse(mine(hi.clone().requires_grad_(True)), yi) / m).backward()
        if s >= 3:
            times.append(time.perf_counter() - t0)
        mine.zero_grad()
    return statistics.median(times)


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
    times, cpus = [], []
    for s in range(steps + 2):
        dist.barrier()
        t0, c0 = time.perf_counter(), time.process_time()
        pm.train_step(inputs, loss_fn=lambda out, _: out.loss)
        if s >= 2:
            times.append(time.perf_counter() - t0)
            cpus.append(time.process_time() - c0)
        pm.zero_grad()
    return {"t": statistics.median(times), "cpu": statistics.median(cpus),
            "table": pm.partition.table() if rank == 0 else ""}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--ms", default="2,4,8,16")
    ap.add_argument("--schedule", default="1f1b")
    ap.add_argument("--p2p", default="auto", help="pipeline messages: auto (shared memory) | shm | gloo")
    ap.add_argument("--stage-path", default="eager", help="MLP stages: eager (module replay) | graph (torch.export split)")
    ap.add_argument("--compare", type=int, default=1, help="also time --p2p gloo and torch's Schedule1F1B")
    ap.add_argument("--probe", type=int, default=1, help="also time the runtime alone (width-8 MLP)")
    ap.add_argument("--reader-steps", type=int, default=8)
    ap.add_argument("--reader-reps", type=int, default=3, help="interleaved uniform/auto repetitions")
    ap.add_argument("--out", default="")
    ap.add_argument("--trace", default="", help="write the m=8 Chrome trace + PNG with this path prefix")
    a = ap.parse_args()
    torch.set_num_threads(1)
    p = 2
    res = {"mlp": [], "reader": {}}
    print(f"MLP {BLOCKS}x Linear({D},{D})+ReLU, batch {BATCH}, p={p}, {a.schedule}, 1 thread/rank, gloo")
    print(f"load average before: {os.getloadavg()[0]:.1f}")
    print(f"{'m':>3} {'T1 ms':>8} {'Tpipe ms':>9} {'eff':>6} {'overhead':>9} {'floor':>7} {'bubble':>7} {'theory':>7} "
          f"{'recv wait ms':>14} {'CPU ms T1/2 | r0,r1':>20} {'gloo lanes':>11} {'torch 1F1B':>11}")

    def overhead(m, t1, tp):
        return (m / (m + p - 1)) / (t1 / (p * tp)) - 1

    for m in [int(x) for x in a.ms.split(",") if x]:
        t1, c1 = t_single(m, a.steps)
        r = spawn(pipe_mlp, p, m=m, steps=a.steps, schedule=a.schedule, p2p=a.p2p, stage_path=a.stage_path)
        tp = max(x["t"] for x in r)
        eff = t1 / (p * tp)
        floor = max(x["floor"] for x in r) * (m + p - 1) / m
        row = dict(m=m, t1=t1, tpipe=tp, efficiency=eff, overhead=overhead(m, t1, tp), bubble=r[0]["bubble"],
                   tfloor=floor, theory=(p - 1) / (m + p - 1), wait=[x["wait"] for x in r], cpu1=c1, cpu=[x["cpu"] for x in r],
                   lanes=r[0]["p2p"])
        if a.compare:  # same run, same load: our runtime over gloo only, and torch's own 1F1B
            tg = max(x["t"] for x in spawn(pipe_mlp, p, m=m, steps=a.steps, schedule=a.schedule, p2p="gloo"))
            tt = max(x["t"] for x in spawn(torch_1f1b, p, m=m, steps=a.steps))
            t1b, _ = t_single(m, a.steps)  # T1 again: the load drifts; both T1s are averaged
            t1 = row["t1"] = (t1 + t1b) / 2
            row.update(overhead=overhead(m, t1, tp), efficiency=t1 / (p * tp), tpipe_gloo=tg,
                       overhead_gloo=overhead(m, t1, tg), tpipe_torch=tt, overhead_torch=overhead(m, t1, tt))
        row["overhead_floor"] = overhead(m, t1, floor)
        res["mlp"].append(row)
        extra = f" {row['overhead_gloo']:>11.1%} {row['overhead_torch']:>11.1%}" if a.compare else ""
        print(f"{m:>3} {t1 * 1e3:>8.2f} {tp * 1e3:>9.2f} {row['efficiency']:>6.3f} {row['overhead']:>9.1%} {row['overhead_floor']:>7.1%} "
              f"{row['bubble']:>7.1%} {row['theory']:>7.1%} {row['wait'][0] * 1e3:>6.1f},{row['wait'][1] * 1e3:>6.1f} "
              f"{c1 * 500:>8.1f} | {row['cpu'][0] * 1e3:.1f},{row['cpu'][1] * 1e3:.1f}{extra}", flush=True)
        if a.trace and m == 8:
            from parallel.timeline import Event, plot, to_chrome_trace

            ev = [Event(**d) for d in r[0]["events"]]  # the shared-memory run's
            to_chrome_trace(ev, a.trace + ".json")
            plot(ev, a.trace + ".png", title=f"MLP p=2 m=8 {a.schedule}")
    if a.probe:
        # the runtime's own cost: the same 8 blocks at width 8 (compute ~nothing), 4 rows per
        # microbatch; every microbatch's forward and backward cross both ranks, so a step is about
        # m x (both ranks' per-microbatch runtime work + 2 hand-overs)
        m = 16
        tp = max(x["t"] for x in spawn(pipe_mlp, p, m=m, steps=a.steps, schedule=a.schedule, d=8, batch=4 * m))
        tt = max(x["t"] for x in spawn(torch_1f1b, p, m=m, steps=a.steps, d=8, batch=4 * m))
        res["runtime_probe"] = {"m": m, "ours_us_per_mb": tp / m * 1e6, "torch_us_per_mb": tt / m * 1e6}
        print(f"runtime cost (width-8 MLP, m={m}): ours {tp / m * 1e6:.0f} us per microbatch, "
              f"torch Schedule1F1B {tt / m * 1e6:.0f} us", flush=True)
    if a.reader_steps:
        # interleaved repetitions (uniform, auto, uniform, auto, ...): the machine is shared, so
        # load drifts; the speed-up is the median of the per-pair ratios
        # CPU seconds per rank and step (process_time: compute, plus the receive loop's spinning)
        # say what the wall clock cannot on a shared host: how the work is split between the ranks
        ts: dict[str, list[float]] = {"uniform": [], "auto": []}
        cs: dict[str, list[float]] = {"uniform": [], "auto": []}
        for rep in range(a.reader_reps):
            for part in ("uniform", "auto"):
                r = spawn(pipe_reader, p, partition=part, steps=a.reader_steps, m=4)
                ts[part].append(max(x["t"] for x in r))
                cs[part].append(max(x["cpu"] for x in r))
                per_rank = ", ".join(f"{x['cpu'] * 1e3:.0f}" for x in r)
                print(f"reader (dim 128, 4 blocks, 2-layer ViT, batch 32, m=4) rep {rep} {part:>8}: "
                      f"{ts[part][-1] * 1e3:.1f} ms/step, CPU ms per rank {per_rank}"
                      f" (load {os.getloadavg()[0]:.1f})", flush=True)
                if rep == 0:
                    print(r[0]["table"])
        ratios = [u / t for u, t in zip(ts["uniform"], ts["auto"])]
        cratios = [u / t for u, t in zip(cs["uniform"], cs["auto"])]
        res["reader"] = {"uniform": statistics.median(ts["uniform"]), "auto": statistics.median(ts["auto"]),
                         "ratios": ratios, "cpu_ratios": cratios}
        print(f"busiest rank's CPU, uniform / auto: {', '.join(f'{x:.2f}' for x in cratios)}")
        print(f"auto vs uniform speed-up: per pair {', '.join(f'{x:.2f}' for x in ratios)}; "
              f"median {statistics.median(ratios):.2f}x")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
