"""Shared-memory collectives vs gloo: latency, algbw and busbw (nccl-tests formulas), JSON out.

    python scripts/bench/comm.py --world 2 --out runs/bench/comm.json

For each op and message size S (bytes; for all-gather the gathered output, for reduce-scatter
the input, as nccl-tests counts them): t = mean time per call, the slowest rank's;
algbw = S / t; busbw = algbw * 2(n-1)/n (all-reduce) or algbw * (n-1)/n (all-gather,
reduce-scatter). Point to point: one-way latency = half a ping-pong round trip.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

from rag_mm.components.metrics import strict_dumps  # noqa: E402  (null, never NaN, in the report)

BUS = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
}
DEFAULT_SIZES = [4 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20]


def _time(fn, budget_s: float, min_iters: int = 5, max_iters: int = 2000) -> float:
    """Mean seconds per call; all ranks run the same number of iterations (agreed up front)."""
    for _ in range(2):  # warm-up (page faults, first-touch)
        fn()
    dist.barrier()
    t0 = time.perf_counter()
    fn()
    one = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
    dist.all_reduce(one, op=dist.ReduceOp.MAX)
    iters = int(max(min_iters, min(max_iters, budget_s / max(one.item(), 1e-7))))
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    dt = torch.tensor([(time.perf_counter() - t0) / iters], dtype=torch.float64)
    dist.all_reduce(dt, op=dist.ReduceOp.MAX)
    return dt.item()


def _rank(rank, world, port, args, q):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=600))
    from parallel.kernels import comm as K

    g = K.ShmGroup(chunk_bytes=args.chunk_bytes)
    rows = []
    for op in args.ops:
        for size in args.sizes:
            n = size // 4  # fp32 elements
            if op == "all_reduce":
                x = torch.ones(n)
                cases = {
                    "shm": lambda x=x: g.all_reduce_(x),
                    "gloo": lambda x=x: dist.all_reduce(x),
                }
            elif op == "all_gather":
                x, out = torch.ones(n // world), torch.empty(n // world * world)
                cases = {
                    "shm": lambda: g.all_gather_into_tensor(out, x),
                    "gloo": lambda: dist.all_gather_into_tensor(out, x),
                }
            else:
                x, out = torch.ones(n // world * world), torch.empty(n // world)
                cases = {
                    "shm": lambda: g.reduce_scatter_tensor(out, x),
                    "gloo": lambda: dist.reduce_scatter_tensor(out, x),
                }
            for backend, fn in cases.items():
                t = _time(fn, args.budget)
                algbw = size / t / 1e9
                rows.append(
                    dict(
                        op=op,
                        backend=backend,
                        bytes=size,
                        world=world,
                        time_us=t * 1e6,
                        algbw_GBps=algbw,
                        busbw_GBps=algbw * BUS[op](world),
                    )
                )
                if rank == 0:
                    print(
                        f"{op:15s} {backend:5s} {size:>10d} B  {t * 1e6:10.1f} us  "
                        f"algbw {algbw:7.3f} GB/s  busbw {algbw * BUS[op](world):7.3f} GB/s",
                        flush=True,
                    )
    # point to point between ranks 0 and 1: ping-pong, one-way = round trip / 2
    p2p_group = dist.new_group([0, 1])
    if rank < 2:
        fwd, bwd = K.ShmChannel(0, 1), K.ShmChannel(1, 0)
        for size in args.p2p_sizes:
            buf = torch.ones(size // 4)

            def shm_pingpong():
                if rank == 0:
                    fwd.send(buf)
                    bwd.recv(buf)
                else:
                    fwd.recv(buf)
                    bwd.send(buf)

            def gloo_pingpong():
                if rank == 0:
                    dist.send(buf, 1)
                    dist.recv(buf, 1)
                else:
                    dist.recv(buf, 0)
                    dist.send(buf, 0)

            for backend, fn in (("shm", shm_pingpong), ("gloo", gloo_pingpong)):
                t = _time_pair(fn, args.budget, p2p_group)
                rows.append(
                    dict(
                        op="p2p_one_way",
                        backend=backend,
                        bytes=size,
                        world=2,
                        time_us=t / 2 * 1e6,
                        algbw_GBps=size / (t / 2) / 1e9,
                        busbw_GBps=size / (t / 2) / 1e9,
                    )
                )
                if rank == 0:
                    print(
                        f"p2p one-way     {backend:5s} {size:>10d} B  {t / 2 * 1e6:10.1f} us",
                        flush=True,
                    )
    dist.barrier()
    q.put((rank, rows))
    g.close()
    dist.destroy_process_group()


def _time_pair(fn, budget_s, group) -> float:
    for _ in range(3):
        fn()
    dist.barrier(group=group)
    t0 = time.perf_counter()
    fn()
    one = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
    dist.all_reduce(one, op=dist.ReduceOp.MAX, group=group)
    iters = int(max(10, min(20000, budget_s / max(one.item(), 1e-7))))
    dist.barrier(group=group)
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    dt = torch.tensor([(time.perf_counter() - t0) / iters], dtype=torch.float64)
    dist.all_reduce(dt, op=dist.ReduceOp.MAX, group=group)
    return dt.item()


def summarize(rows: list[dict]) -> dict:
    """shm / gloo ratios: latency speed-up and bandwidth ratio per (op, size)."""
    by = {(r["op"], r["bytes"], r["backend"]): r for r in rows}
    out = {}
    for (op, size, backend), r in by.items():
        if backend != "shm" or (op, size, "gloo") not in by:
            continue
        g = by[(op, size, "gloo")]
        out[f"{op}@{size}"] = dict(
            latency_speedup=g["time_us"] / r["time_us"],
            busbw_ratio=r["busbw_GBps"] / g["busbw_GBps"],
        )
    return out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument(
        "--ops",
        nargs="+",
        default=["all_reduce", "all_gather", "reduce_scatter"],
        choices=list(BUS),
    )
    ap.add_argument(
        "--sizes", nargs="+", type=int, default=DEFAULT_SIZES, help="message bytes (fp32)"
    )
    ap.add_argument("--p2p-sizes", nargs="+", type=int, default=[8 << 10, 1 << 20])
    ap.add_argument("--budget", type=float, default=0.3, help="seconds of timed calls per case")
    ap.add_argument("--chunk-bytes", type=int, default=None, help="shm buffer half (default 1 MiB)")
    ap.add_argument("--out", type=str, default=None, help="JSON file to write")
    args = ap.parse_args(argv)

    from tests.distributed import free_port

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_rank, args=(r, args.world, port, args, q)) for r in range(args.world)
    ]
    for p in procs:
        p.start()
    results = dict(q.get() for _ in range(args.world))
    for p in procs:
        p.join()
    rows = results[0]
    report = dict(
        bench="comm",
        world=args.world,
        dtype="float32",
        torch=torch.__version__,
        host=platform.node(),
        cpus=os.cpu_count(),
        chunk_bytes=args.chunk_bytes,
        formulas=dict(
            algbw="S / t",
            busbw_all_reduce="algbw * 2(n-1)/n",
            busbw_all_gather_reduce_scatter="algbw * (n-1)/n",
            p2p="one-way = ping-pong round trip / 2",
        ),
        rows=rows,
        summary=summarize(rows),
    )
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(strict_dumps(report, indent=1))
    print(strict_dumps(report["summary"], indent=1))
    return report


if __name__ == "__main__":
    main()
