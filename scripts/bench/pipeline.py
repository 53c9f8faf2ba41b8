"""Pipeline overhead and partition speed-up on CPU gloo ranks (one thread each).

1. MLP (8 blocks Linear(D, D) + ReLU, D=512, batch 256), 2 ranks, uniform split, m in 2, 4, 8,
   16, one row per variant: our schedules (``--schedule``; ``NAME+bind``: ranks bound to cores
   as ``bind_cores`` binds them), and beside them our first schedule with the shared-memory
   lanes off (``@gloo``) and torch's own ``Schedule1F1B`` over gloo with the same even split
   (``torch_1f1b``). T1 = one process,
   one thread, the same m microbatches with gradient accumulation; efficiency = T1 / (p * Tpipe);
   overhead = (m / (m + p - 1)) / efficiency - 1 (what the pipeline costs beyond its unavoidable
   bubble). ``floor``: the same overhead for a runtime that costs nothing on this split
   (``_Floor``: each rank's own work timed without the pipeline, so floor > 0 is what the
   split itself costs: the last stage's loss and extra dX, cache and memory effects of two busy
   cores); ``vs floor``: Tpipe against that zero-cost runtime's step time, i.e. what our runtime
   itself costs. Also the measured bubble fraction from the timeline and the time each rank spent
   blocked in receives. Everything of one m is timed in the same processes, in ``--reps``
   interleaved rounds of ``--steps`` steps; overheads are paired within a round and the cells are
   medians. ``--steps 1`` pairs every pipeline step with a T1 step and a floor step.
2. The rag_mm reader on 2 ranks: step time with the auto partition against the uniform one.

    python scripts/bench/pipeline.py [--steps 20] [--reps 3] [--out results.json]
"""

from __future__ import annotations

import argparse
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
from rag_mm.components.metrics import strict_dumps  # noqa: E402  (null, never NaN, in the report)

D, BATCH, BLOCKS = 512, 256, 8  # the reference setting: an 8-block MLP, batch 256


def mlp(d: int = D) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(d, d), nn.ReLU()) for _ in range(BLOCKS)])


def mse(out, tgt):
    return torch.nn.functional.mse_loss(out, tgt)


class _Single:
    """T1: one process running the same m microbatches with gradient accumulation (in a pipeline
    rank's process: the host allocator and core binding are as ``parallelize`` set them up for the
    pipeline, same conditions). Built once, so rounds of one step each can alternate with the
    pipeline's steps."""

    def __init__(self, m: int):
        self.m, self.model = m, mlp()
        self.x, self.y = torch.randn(BATCH, D), torch.randn(BATCH, D)

    def time(self, steps: int, warm: int = 3) -> tuple[float, float]:
        """(wall, CPU) median seconds per step."""
        times, cpus = [], []
        for s in range(steps + warm):
            t0, c0 = time.perf_counter(), time.process_time()
            for xi, yi in zip(self.x.tensor_split(self.m), self.y.tensor_split(self.m)):
                (mse(self.model(xi), yi) / self.m).backward()
            if s >= warm:
                times.append(time.perf_counter() - t0)
                cpus.append(time.process_time() - c0)
            self.model.zero_grad()
        return statistics.median(times), statistics.median(cpus)


BARRIER = dist.barrier


def _tight_barrier():
    """The step clock starts when a barrier releases. gloo's barrier (loopback TCP) released the
    two ranks up to 1-4 ms apart in some steps, and that skew landed in the step time of the rank
    released first; a shared-memory all-reduce of one number releases both within microseconds. Used
    for every timed loop here (ours, torch's, the floor), so all are measured alike."""
    from parallel.kernels import comm

    if not comm.available()[0]:
        return dist.barrier
    group, one = comm.ShmGroup(), torch.zeros(1)
    return lambda: group.all_reduce_(one)


def _worker(rank, world, port, job, q):
    global BARRIER
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=300))
    BARRIER = _tight_barrier()
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
    ps = [
        ctx.Process(target=_worker, args=(r, world, port, {"fn": fn, "kw": kw}, q))
        for r in range(world)
    ]
    for p in ps:
        p.start()
    out = dict(q.get(timeout=900) for _ in ps)
    for p in ps:
        p.join()
    return [out[r] for r in range(world)]


class _Variant:
    """One way of running the pipelined MLP step on this rank: ours (a schedule name;
    ``:whole_drain`` for ``split_drain=False``, ``:engine_w`` for W without its nn.Linear fast path,
    ``@gloo`` for the shared-memory lanes off) or ``torch_1f1b`` (torch.distributed.pipelining's
    Schedule1F1B over gloo with a hand-made even split: the reference)."""

    def __init__(self, rank, name, m, d, batch, stage_path):
        import parallel

        self.name, self.pm = name, None
        self.engine_w = False  # ":engine_w": W without the nn.Linear fast path (split_backward.py)
        x, y = torch.randn(batch, d), torch.randn(batch, d)
        if name == "torch_1f1b":
            from torch.distributed.pipelining import PipelineStage, Schedule1F1B

            part = nn.Sequential(
                *list(mlp(d).children())[rank * BLOCKS // 2 : (rank + 1) * BLOCKS // 2]
            )
            sched = Schedule1F1B(PipelineStage(part, rank, 2, torch.device("cpu")), m, loss_fn=mse)
            self.run = (lambda: sched.step(x)) if rank == 0 else (lambda: sched.step(target=y))
            self.params = list(part.parameters())
            return
        schedule, _, p2p = name.partition("@")
        schedule, _, opt = schedule.partition(":")
        self.engine_w = opt == "engine_w"
        cfg = parallel.ParallelConfig(
            pp=2,
            microbatches=m,
            schedule=schedule,
            partition="uniform",
            p2p=p2p or "auto",
            stage_path=stage_path,
            split_drain=opt != "whole_drain",
        )
        self.pm = pm = parallel.parallelize(mlp(d), cfg, (x,))
        self.run = lambda: pm.train_step((x,), target=y, loss_fn=mse)
        self.params = list(pm.parameters())

    def time(self, steps, warm=3):
        """Median seconds per step (and CPU seconds, receive waits, bubble, events of the last)."""
        from parallel.pipeline import split_backward
        from parallel.timeline import bubble_fraction, gather

        # set per variant: variants alternate in one process
        split_backward.LINEAR_FAST_PATH = not self.engine_w
        times, waits, bubbles, cpus, ev = [], [], [], [], []
        for s in range(steps + warm):
            BARRIER()
            t0, c0 = time.perf_counter(), time.process_time()
            self.run()
            dt, dc = time.perf_counter() - t0, time.process_time() - c0
            if self.pm is not None:
                ev = gather(self.pm.events)
            if s >= warm:
                times.append(dt)
                cpus.append(dc)
                if self.pm is not None:
                    waits.append(self.pm.transport.wait_s)
                    bubbles.append(bubble_fraction(ev))
            for q in self.params:
                q.grad = None
        med = statistics.median
        return {
            "t": med(times),
            "cpu": med(cpus),
            "wait": med(waits) if waits else 0.0,
            "bubble": med(bubbles) if bubbles else 0.0,
            "events": [e.__dict__ for e in ev],
        }


def _binding():
    """(this rank's allowed cores, the slice ``bind_cores`` would bind it to or None)."""
    from parallel.comm_hooks import hosts_of
    from parallel.cpu_affinity import plan_binding

    allowed: list = [None] * dist.get_world_size()
    dist.all_gather_object(allowed, tuple(sorted(os.sched_getaffinity(0))))
    return allowed[dist.get_rank()], plan_binding(dist.get_rank(), hosts_of(), allowed)[0]


def mlp_suite(rank, m, steps, reps, variants, stage_path="eager", d=D, batch=BATCH, t1=True):
    """Every variant, the floor and T1 timed in the same two processes, in ``reps`` interleaved
    rounds of ``steps`` steps each (the machine is shared: load drifts within seconds, so what is
    compared is timed side by side). ``steps=1``: every round is one step of each, so T1, the
    floor and the pipeline are paired step by step (after one warm-up round of 3 steps each): on a
    shared host speed drifts over tens of seconds (benchmarks/pipeline_cpu_*.md).
    T1 runs on rank 0 while rank 1 blocks in a gloo barrier (no spinning).

    ``NAME+bind`` times pipeline NAME with every thread of both ranks bound to the cores
    ``bind_cores=True`` would give them (``parallel.cpu_affinity``; the binding is set before and
    undone after, so bound and free runs alternate in the same processes), against a T1 and a
    floor bound the same way."""
    from parallel.cpu_affinity import _set_all_threads

    free_cores, bound_cores = _binding()
    names = list(dict.fromkeys(v.removesuffix("+bind") for v in variants))
    vs = {n: _Variant(rank, n, m, d, batch, stage_path) for n in names}
    modes = [False] + ([True] if any(v.endswith("+bind") for v in variants) and bound_cores else [])
    x, y = torch.randn(batch, d), torch.randn(batch, d)
    floor = _Floor(rank, m, x, y) if t1 else None
    single = _Single(m) if t1 and rank == 0 else None
    rounds = []
    per_step = steps == 1
    for i in range(reps + per_step):
        warm = 3 if not per_step or i == 0 else 0
        r = {}
        for bind in modes:
            _set_all_threads(bound_cores if bind else free_cores)
            sfx = "+bind" if bind else ""
            for v in variants:
                if v.endswith("+bind") == bind:
                    r[v] = vs[v.removesuffix("+bind")].time(steps, warm)
            if t1:
                r["floor" + sfx] = floor.time(steps, warm)
                dist.barrier()
                r["t1" + sfx] = single.time(steps, warm)[0] if rank == 0 else 0.0
                dist.barrier()
        _set_all_threads(free_cores)
        if not (per_step and i == 0):
            rounds.append(r)
    pm = next((v.pm for v in vs.values() if v.pm is not None), None)
    # the shared-memory rings (lanes.py) of the first variant
    lanes = (
        sorted(
            f"{'to' if out else 'from'} rank {peer}: stage {st} {kind}"
            for (peer, out, kind, st) in pm.transport.lanes
        )
        if pm is not None
        else []
    )
    return {"rounds": rounds, "lanes": lanes, "cores": [list(free_cores), list(bound_cores or ())]}


class _Floor:
    """This rank's own share of the work with no pipeline around it: its four blocks' forward and
    backward on the m microbatches (the last stage with the loss and the dX of its first block,
    which the pipeline needs and one process does not), both ranks at once as in the pipeline.
    ``max over ranks x (m + p - 1) / m`` of its step time is the step time of a runtime that costs
    nothing on this split; the rest of Tpipe is the runtime's (messages, replay, the end-of-step
    sync)."""

    def __init__(self, rank, m, x, y):
        blocks = list(mlp(x.shape[1]).children())
        per = BLOCKS // 2
        self.rank, self.m = rank, m
        self.mine = nn.Sequential(*blocks[rank * per : (rank + 1) * per])
        h = nn.Sequential(*blocks[:per])(x).detach() if rank else x
        self.hs, self.ys = h.tensor_split(m), y.tensor_split(m)

    def time(self, steps, warm=3):
        times = []
        for s in range(steps + warm):
            BARRIER()
            t0 = time.perf_counter()
            for hi, yi in zip(self.hs, self.ys):
                if self.rank == 0:
                    out = self.mine(hi)
                    out.backward(torch.full_like(out, 1e-3))
                else:
                    (mse(self.mine(hi.clone().requires_grad_(True)), yi) / self.m).backward()
            if s >= warm:
                times.append(time.perf_counter() - t0)
            self.mine.zero_grad()
        return statistics.median(times)


def reader_case(b):
    from rag_mm.config import ModelConfig
    from rag_mm.model import Reader

    torch.manual_seed(0)
    cfg = ModelConfig(
        dim=128,
        layers=4,
        heads=4,
        vision_width=128,
        vision_layers=2,
        vision_head_width=32,
        attention_backend="reference",
    )
    model = Reader(cfg, 49408)
    g = torch.Generator().manual_seed(1)
    k, lt, lq, la = 2, 24, 12, 6
    inputs = {
        "image": torch.randn(b, 3, 32, 32, generator=g),
        "q_ids": torch.randint(0, 49408, (b, lq), generator=g),
        "q_len": torch.full((b,), lq),
        "a_ids": torch.randint(0, 49408, (b, la), generator=g),
        "a_len": torch.full((b,), la),
        "doc_image": torch.randn(b, k, 3, 32, 32, generator=g),
        "doc_ids": torch.randint(0, 49408, (b, k, lt), generator=g),
        "doc_len": torch.full((b, k), lt),
    }
    return model, inputs


def pipe_reader(rank, partition, steps, m):
    import parallel

    model, inputs = reader_case(32)
    cfg = parallel.ParallelConfig(pp=2, microbatches=m, schedule="1f1b", partition=partition)
    pm = parallel.parallelize(model, cfg, inputs)
    times, cpus = [], []
    for s in range(steps + 2):
        BARRIER()
        t0, c0 = time.perf_counter(), time.process_time()
        pm.train_step(inputs, loss_fn=lambda out, _: out.loss)
        if s >= 2:
            times.append(time.perf_counter() - t0)
            cpus.append(time.process_time() - c0)
        pm.zero_grad()
    return {
        "t": statistics.median(times),
        "cpu": statistics.median(cpus),
        "table": pm.partition.table() if rank == 0 else "",
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--ms", default="2,4,8,16")
    ap.add_argument(
        "--schedule",
        default="1f1b,eager_1f1b,zero_bubble,eager_1f1b+bind",
        help="comma-separated, each timed in the same processes; NAME+bind: with the ranks bound "
        "to cores as bind_cores=True binds them, against a T1 and floor bound alike",
    )
    ap.add_argument(
        "--reps", type=int, default=3, help="interleaved rounds; cells are medians over them"
    )
    ap.add_argument(
        "--stage-path",
        default="eager",
        help="MLP stages: eager (module replay) | graph (torch.export split)",
    )
    ap.add_argument(
        "--compare",
        type=int,
        default=1,
        help="also time the first schedule with the shared-memory lanes off (@gloo) and torch's "
        "Schedule1F1B",
    )
    ap.add_argument(
        "--probe", type=int, default=1, help="also time the runtime alone (width-8 MLP)"
    )
    ap.add_argument("--reader-steps", type=int, default=8)
    ap.add_argument(
        "--reader-reps", type=int, default=3, help="interleaved uniform/auto repetitions"
    )
    ap.add_argument("--out", default="")
    ap.add_argument(
        "--trace", default="", help="write the m=8 Chrome trace + PNG with this path prefix"
    )
    a = ap.parse_args()
    torch.set_num_threads(1)
    p = 2
    res = {"mlp": [], "reader": {}}
    print(f"MLP {BLOCKS}x Linear({D},{D})+ReLU, batch {BATCH}, p={p}, 1 thread/rank, gloo")
    print(f"load average before: {os.getloadavg()[0]:.1f}")
    print(
        f"{'m':>3} {'variant':>22} {'T1 ms':>8} {'Tpipe ms':>9} {'overhead':>9} {'floor':>7} "
        f"{'vs floor':>8} {'bubble':>7} {'theory':>7} {'recv wait ms r0,r1':>19} "
        f"{'T1/2 ms | CPU ms r0,r1':>23}  overhead per round"
    )

    def overhead(m, t1, tp):
        return (m / (m + p - 1)) / (t1 / (p * tp)) - 1

    med = statistics.median
    variants = [x for x in a.schedule.split(",") if x]
    first = next((x for x in variants if not x.endswith("+bind")), "1f1b")
    if a.compare:
        variants += [first + "@gloo", "torch_1f1b"]
    for m in [int(x) for x in a.ms.split(",") if x]:
        r = spawn(
            mlp_suite,
            p,
            m=m,
            steps=a.steps,
            reps=a.reps,
            variants=variants,
            stage_path=a.stage_path,
        )
        rounds = list(zip(*(x["rounds"] for x in r)))  # per round: (rank 0's, rank 1's)
        for v in variants:
            if v not in rounds[0][0]:
                print(f"{m:>3} {v:>22} not timed: no core binding on this host ({r[0]['cores']})")
                continue
            sfx = "+bind" if v.endswith("+bind") else ""
            t1s = [rr[0]["t1" + sfx] for rr in rounds]
            floors = [max(x["floor" + sfx] for x in rr) * (m + p - 1) / m for rr in rounds]
            tps = [max(x[v]["t"] for x in rr) for rr in rounds]
            ovs = [overhead(m, t1, tp) for t1, tp in zip(t1s, tps)]  # paired within a round
            row = dict(
                m=m,
                variant=v,
                t1=med(t1s),
                tpipe=med(tps),
                overhead=med(ovs),
                overheads=ovs,
                overhead_floor=med(overhead(m, t1, f) for t1, f in zip(t1s, floors)),
                over_floor=med(tp / f - 1 for tp, f in zip(tps, floors)),
                bubble=med(rr[0][v]["bubble"] for rr in rounds),
                theory=(p - 1) / (m + p - 1),
                wait=[med(rr[k][v]["wait"] for rr in rounds) for k in range(p)],
                cpu=[med(rr[k][v]["cpu"] for rr in rounds) for k in range(p)],
                lanes=r[0]["lanes"],
                cores=[x["cores"] for x in r],
            )
            res["mlp"].append(row)
            print(
                f"{m:>3} {v:>22} {row['t1'] * 1e3:>8.2f} {row['tpipe'] * 1e3:>9.2f} "
                f"{row['overhead']:>9.1%} {row['overhead_floor']:>7.1%} {row['over_floor']:>8.1%} "
                f"{row['bubble']:>7.1%} {row['theory']:>7.1%} "
                f"{row['wait'][0] * 1e3:>9.1f},{row['wait'][1] * 1e3:>6.1f} "
                f"{row['t1'] * 500:>8.1f} | {row['cpu'][0] * 1e3:.1f},{row['cpu'][1] * 1e3:.1f}  "
                + " ".join(f"{x:.1%}" for x in ovs),
                flush=True,
            )
            if a.trace and m == 8 and v != "torch_1f1b":
                from parallel.timeline import Event, plot, to_chrome_trace

                ev = [Event(**d) for d in rounds[-1][0][v]["events"]]
                to_chrome_trace(ev, f"{a.trace}_{v}.json")
                plot(ev, f"{a.trace}_{v}.png", title=f"MLP p=2 m=8 {v}")
    if a.probe:
        # the runtime's own cost: the same 8 blocks at width 8 (compute ~nothing), 4 rows per
        # microbatch; every microbatch's forward and backward cross both ranks, so a step is about
        # m x (both ranks' per-microbatch runtime work + 2 hand-overs)
        m = 16
        r = spawn(
            mlp_suite,
            p,
            m=m,
            steps=a.steps,
            reps=1,
            variants=[first, "torch_1f1b"],
            d=8,
            batch=4 * m,
            t1=False,
        )
        tp, tt = (max(x["rounds"][0][v]["t"] for x in r) for v in (first, "torch_1f1b"))
        res["runtime_probe"] = {
            "m": m,
            "ours_us_per_mb": tp / m * 1e6,
            "torch_us_per_mb": tt / m * 1e6,
        }
        print(
            f"runtime cost (width-8 MLP, m={m}): ours {tp / m * 1e6:.0f} us per microbatch, "
            f"torch Schedule1F1B {tt / m * 1e6:.0f} us",
            flush=True,
        )
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
                print(
                    f"reader (dim 128, 4 blocks, 2-layer ViT, batch 32, m=4) rep {rep} {part:>8}: "
                    f"{ts[part][-1] * 1e3:.1f} ms/step, CPU ms per rank {per_rank}"
                    f" (load {os.getloadavg()[0]:.1f})",
                    flush=True,
                )
                if rep == 0:
                    print(r[0]["table"])
        ratios = [u / t for u, t in zip(ts["uniform"], ts["auto"])]
        cratios = [u / t for u, t in zip(cs["uniform"], cs["auto"])]
        res["reader"] = {
            "uniform": statistics.median(ts["uniform"]),
            "auto": statistics.median(ts["auto"]),
            "ratios": ratios,
            "cpu_ratios": cratios,
        }
        print(f"busiest rank's CPU, uniform / auto: {', '.join(f'{x:.2f}' for x in cratios)}")
        print(
            f"auto vs uniform speed-up: per pair {', '.join(f'{x:.2f}' for x in ratios)}; "
            f"median {statistics.median(ratios):.2f}x"
        )
    if a.out:
        with open(a.out, "w") as f:
            f.write(strict_dumps(res, indent=1))


if __name__ == "__main__":
    main()
