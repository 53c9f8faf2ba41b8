"""Fused attention (csrc/attention) and FlexAttention against SDPA on the CPU: TFLOP/s, time
ratios and the ``auto`` choice, and peak extra memory.

    python scripts/bench/attention.py --out bench_attention.json [--threads 2] [--quick]
        [--backward] [--dtypes float32,bfloat16] [--head-dims 64,128] [--no-flex]

Every point times ``fused`` at each vector ISA the CPU has (``fused:avx512``, ``fused:avx2``,
``fused:generic``, capped by ``RAG_ATTN_ISA``; ``fused`` is the one the process runs by default),
``sdpa``, ``flex`` (compiled flex_attention with a cached block mask; compilation happens in the
warm-up) and ``auto`` (``backend="auto"``: measured on its first call, in the warm-up, into a fresh
cache unless ``--autotune-cache`` names one) and reports each one's time over SDPA's (``ratios``:
below 1 is faster than SDPA) and ``auto_vs_best``: the fastest of auto's candidates (the fused
ISAs and SDPA) over auto's time (1 = auto took the fastest; the goal is >= 0.95).

    python scripts/bench/attention.py --quick --dtypes float32 --head-dims 64 --no-flex \
        --cases dense,causal,retrieval    # benchmarks/attention_cpu_auto_*.md

Cases (forward pass, B*H = 4, head size 64 and 128, fp32 and bf16, sequence 512..4096):

* dense / causal: ``rag_attn`` vs ``F.scaled_dot_product_attention(is_causal=...)``;
  FLOPs = 4*B*S^2*H*D, half for causal (FlashAttention's convention).
* packed: 4 sequences of lengths S, S/2, S/4, S/4 (50% padding at max length S) through
  ``varlen_attention`` vs padding to S + key-padding mask + SDPA + unpacking.
* retrieval: 8 documents of 0.1*S and a 0.2*S query, vs SDPA with the dense layout mask.
  For packed and retrieval the TFLOP/s count only useful FLOPs (4*H*D per allowed query-key pair),
  so the ratio equals the speed-up.

``--device cuda`` (the GPU figure): dense and causal, bf16 and fp16, B=4 x H=16, against SDPA
restricted to its flash backend (``sdpa_kernel(FLASH_ATTENTION)``), timed with CUDA events; goal
>= 0.7x flash's TFLOP/s.

``--backward`` adds dense and causal rows timed forward + backward (``.backward(grad)`` of the
output; FLOPs = 3.5x the forward's, FlashAttention-2's convention of backward = 2.5x forward).

Timings interleave the two implementations and report medians; peak extra memory is the growth of
the process's peak RSS (VmHWM) during one call, in a fresh subprocess per point (Linux only).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from parallel.kernels import attention as A  # noqa: E402
from rag_mm.components.metrics import strict_dumps  # noqa: E402  (null, never NaN, in the report)

H = 4  # heads (B = 1): B*H = 4 work groups keep 2 threads busy in both implementations


def make_case(case: str, S: int, D: int, dtype: torch.dtype, backend: str = "fused"):
    """Returns (backend_fn, sdpa_fn, useful_flops); ``backend`` is any of ``A.BACKENDS``."""
    fns, sdpa, flops = make_fns(case, S, D, dtype, (backend,))
    return fns[backend], sdpa, flops


def make_fns(case: str, S: int, D: int, dtype: torch.dtype, backends):
    """({backend: fn}, sdpa_fn, useful_flops), every fn on the same inputs (equally warm in
    cache)."""
    g = torch.Generator().manual_seed(0)
    rnd = lambda *shape: torch.randn(*shape, generator=g).to(dtype)  # noqa: E731
    scale = D**-0.5
    if case in ("dense", "causal"):
        q, k, v = (rnd(1, H, S, D) for _ in range(3))
        c = case == "causal"
        flops = 4 * S * S * H * D / (2 if c else 1)
        return (
            {b: (lambda b=b: A.attention(q, k, v, causal=c, backend=b)) for b in backends},
            lambda: F.scaled_dot_product_attention(q, k, v, is_causal=c, scale=scale),
            flops,
        )
    if case == "packed":
        lens = [S, S // 2, S // 4, S // 4]  # mean S/2: 50% padding when padded to S
        cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
        T = int(cu[-1])
        q, k, v = (rnd(T, H, D) for _ in range(3))
        flops = sum(4 * L * L * H * D for L in lens)
        return (
            {b: (lambda b=b: A.varlen_attention(q, k, v, cu, S, backend=b)) for b in backends},
            lambda: A.sdpa_varlen_attention(q, k, v, cu, S),
            flops,
        )
    if case == "retrieval":
        doc, n_docs = S // 10, 8
        bounds = [i * doc for i in range(n_docs + 1)] + [S]
        seg = torch.tensor([bounds], dtype=torch.int32)
        q, k, v = (rnd(1, H, S, D) for _ in range(3))
        pairs = int(A.layout_mask(seg, S).sum())
        return (
            {b: (lambda b=b: A.attention(q, k, v, seg_offsets=seg, backend=b)) for b in backends},
            lambda: A.sdpa_attention(q, k, v, seg_offsets=seg),
            4 * pairs * H * D,
        )
    raise ValueError(case)


def at_isa(fn, isa: str):
    """``fn`` with the fused CPU kernels pinned to ``isa`` for the call."""

    def run():
        with A.pinned_isa(isa):
            return fn()

    return run


def auto_probe(case: str, S: int, D: int, dtype: torch.dtype) -> torch.Tensor:
    """A tensor of q's shape for ``A.select_backend`` (its key: packed takes (T, H, D))."""
    if case == "packed":
        return torch.empty(2 * S, H, D, dtype=dtype)  # lengths S, S/2, S/4, S/4: T = 2S
    return torch.empty(1, H, S, D, dtype=dtype)


def _commit() -> str | None:
    try:
        return subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            cwd=Path(__file__).resolve().parent,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def make_train_case(case: str, S: int, D: int, dtype: torch.dtype):
    """dense / causal forward + backward: (fused_fn, sdpa_fn, flops)."""
    g = torch.Generator().manual_seed(0)
    q, k, v, grad = (torch.randn(1, H, S, D, generator=g).to(dtype) for _ in range(4))
    q, k, v = (t.requires_grad_(True) for t in (q, k, v))
    c = case == "causal"

    def fused():
        A.attention(q, k, v, causal=c, backend="fused").backward(grad)

    def sdpa():
        F.scaled_dot_product_attention(q, k, v, is_causal=c, scale=D**-0.5).backward(grad)

    return fused, sdpa, 3.5 * 4 * S * S * H * D / (2 if c else 1)


def time_many(
    fns, reps: int, grad: bool = False, stat=statistics.median, clock=time.perf_counter
) -> list[float]:
    """Seconds per call of each fn (``stat`` of the timed calls: median, or ``min`` for the fastest
    call, which other load on a shared machine can only lengthen; ``clock``: wall time, or
    ``time.thread_time`` for one thread's CPU time), calls interleaved (a load spike hits all alike)
    in an order rotated every round."""
    ctx = torch.enable_grad if grad else torch.no_grad
    with ctx():
        for fn in fns:  # warm-up: builds, compiles, block masks
            fn()
    times = [[] for _ in fns]
    order = list(zip(fns, times))
    for r in range(reps):
        # rotated each round: what runs right after another implementation (its allocations, its
        # cache footprint) differs by position, so every fn takes every position in turn
        for fn, acc in order[r % len(order) :] + order[: r % len(order)]:
            t = clock()
            with ctx():
                fn()
            acc.append(clock() - t)
    return [stat(t) for t in times]


def peak_extra_mib(case: str, S: int, D: int, dtype: str, impl: str, threads: int) -> float:
    """Peak RSS growth of one call (Linux VmHWM, reset through /proc/self/clear_refs first)."""
    code = (
        "import resource, torch, sys; sys.path.insert(0, %r)\n"  # noqa: UP031
        "from scripts.bench.attention import make_case\n"
        "torch.set_num_threads(%d)\n"
        "from parallel.kernels import attention as A; A.fused_available()\n"
        "pick = lambda c: c[0] if %r == 'fused' else c[1]\n"
        "with torch.no_grad(): pick(make_case(%r, 64, %d, getattr(torch, %r)))()\n"  # lazy init
        "fn = pick(make_case(%r, %d, %d, getattr(torch, %r)))\n"
        "hwm = lambda: int([ln for ln in open('/proc/self/status') "
        "if ln.startswith('VmHWM')][0].split()[1])\n"
        "open('/proc/self/clear_refs', 'w').write('5')\n"  # reset the peak to the current RSS
        "base = hwm()\n"  # inputs exist already
        "with torch.no_grad(): fn()\n"
        "print((hwm() - base) / 1024)\n"
    ) % (str(Path(__file__).resolve().parents[2]), threads, impl, case, D, dtype, case, S, D, dtype)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return float(out.stdout.strip().splitlines()[-1])


def cuda_main(args) -> None:
    """TFLOP/s of the fused CUDA kernel against SDPA's flash backend (forward, and forward +
    backward with ``--backward``)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    if not torch.cuda.is_available():
        sys.exit("--device cuda: no CUDA device")
    ok, why = A.fused_available()
    if ok:
        ok, why = A._fused_supports(torch.empty(1, 1, 1, 64, device="cuda", dtype=torch.bfloat16))
    if not ok:
        sys.exit(f"fused CUDA attention unavailable: {why}")
    B, Hc = 4, 16
    results = []
    for dtype in (torch.bfloat16, torch.float16):
        for D in (64, 128):
            for case in ("dense", "causal") + (
                ("dense+bwd", "causal+bwd") if args.backward else ()
            ):
                for S in [512, 1024] if args.quick else [512, 1024, 2048, 4096]:
                    bwd, c = case.endswith("+bwd"), case.startswith("causal")
                    q, k, v, g = (
                        torch.randn(B, Hc, S, D, device="cuda", dtype=dtype) for _ in range(4)
                    )
                    if bwd:
                        q, k, v = (t.requires_grad_(True) for t in (q, k, v))

                    def fused(q=q, k=k, v=v, g=g, bwd=bwd, c=c):
                        out = A.attention(q, k, v, causal=c, backend="fused")
                        if bwd:
                            out.backward(g)

                    def flash(q=q, k=k, v=v, g=g, bwd=bwd, c=c):
                        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                            out = F.scaled_dot_product_attention(q, k, v, is_causal=c)
                        if bwd:
                            out.backward(g)

                    times = []
                    for fn in (fused, flash):
                        for _ in range(3):
                            fn()
                        start, end = (
                            torch.cuda.Event(enable_timing=True),
                            torch.cuda.Event(enable_timing=True),
                        )
                        start.record()
                        for _ in range(args.reps * 4):
                            fn()
                        end.record()
                        torch.cuda.synchronize()
                        times.append(start.elapsed_time(end) / 1e3 / (args.reps * 4))
                    flops = (3.5 if bwd else 1.0) * 4 * B * S * S * Hc * D / (2 if c else 1)
                    row = dict(
                        case=case,
                        dtype=str(dtype).removeprefix("torch."),
                        head_dim=D,
                        seq=S,
                        fused_tflops=flops / times[0] / 1e12,
                        flash_tflops=flops / times[1] / 1e12,
                        ratio=times[1] / times[0],
                    )
                    results.append(row)
                    print(
                        f"{row['dtype']:>8} D={D:<3} {case:<10} S={S:<5} fused "
                        f"{row['fused_tflops']:6.1f} TFLOP/s  flash {row['flash_tflops']:6.1f} "
                        f"TFLOP/s  x{row['ratio']:.2f}",
                        flush=True,
                    )
    report = dict(
        machine=dict(
            gpu=torch.cuda.get_device_name(), torch=torch.__version__, cuda=torch.version.cuda
        ),
        target="fused >= 0.7x flash",
        results=results,
        ratio_median=statistics.median(r["ratio"] for r in results),
    )
    Path(args.out).write_text(strict_dumps(report, indent=1))
    print(f"median fused / flash: {report['ratio_median']:.2f}x")


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--out", default="bench_attention.json")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help="seq 512 and 1024 only, no memory")
    ap.add_argument("--memory-seqs", default="512,1024,2048,4096")
    ap.add_argument(
        "--memory-only", action="store_true", help="add the memory table to an existing --out"
    )
    ap.add_argument(
        "--backward", action="store_true", help="also time dense/causal forward + backward"
    )
    ap.add_argument(
        "--device",
        default="cpu",
        choices=["cpu", "cuda"],
        help="cuda: against SDPA's flash backend",
    )
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--head-dims", default="64,128")
    ap.add_argument(
        "--no-flex", action="store_true", help="skip flex (its first call per shape compiles)"
    )
    ap.add_argument(
        "--cases", default="dense,causal,packed,retrieval", help="forward cases to time"
    )
    ap.add_argument(
        "--stat",
        default="median",
        choices=["median", "min"],
        help=(
            "per point: median of the timed calls, or the fastest call (steadier on a loaded "
            "machine)"
        ),
    )
    ap.add_argument(
        "--cpu-time",
        action="store_true",
        help="time the calling thread's CPU time, not wall time (needs --threads 1; what "
        "auto's measurement uses with one thread): other processes' load does not count",
    )
    ap.add_argument(
        "--autotune-cache", default=None, help="auto's cache file (default: a fresh temporary one)"
    )
    args = ap.parse_args()
    from parallel.kernels import autotune

    tmp_cache = None
    if args.autotune_cache:
        os.environ[autotune.CACHE_ENV] = args.autotune_cache
    else:
        import tempfile

        tmp_cache = tempfile.mkdtemp(prefix="attn_autotune_")
        os.environ[autotune.CACHE_ENV] = os.path.join(tmp_cache, "attn_autotune.json")
    if args.device == "cuda":
        return cuda_main(args)

    torch.set_num_threads(args.threads)
    stat = min if args.stat == "min" else statistics.median
    if args.cpu_time and args.threads != 1:
        sys.exit(
            "--cpu-time needs --threads 1 (other threads' work is not the calling thread's CPU "
            "time)"
        )
    clock = time.thread_time if args.cpu_time else time.perf_counter
    ok, why = A.fused_available()
    if not ok:
        sys.exit(f"fused attention unavailable: {why}")
    from parallel.kernels import flex

    flex_ok = not args.no_flex and flex.available()[0]
    seqs = [512, 1024] if args.quick else [512, 1024, 2048, 4096]
    results = []
    if args.memory_only:
        seqs = []
    default_isa = A.kernel_isa()
    isas = list(A.ISAS[: A.ISAS.index(A._isa_cap()) + 1])
    for dtype in (getattr(torch, d) for d in args.dtypes.split(",")):
        for D in (int(d) for d in args.head_dims.split(",")):
            cases = args.cases.split(",") + (["dense+bwd", "causal+bwd"] if args.backward else [])
            for case in cases:
                for S in seqs:
                    bwd = case.endswith("+bwd")
                    reps = args.reps if S <= 2048 else max(2, args.reps // 2)
                    if bwd:
                        fused, sdpa, flops = make_train_case(case.removesuffix("+bwd"), S, D, dtype)
                        fns = {"fused": fused, "sdpa": sdpa}
                    else:
                        names = ("fused", "auto") + (("flex",) if flex_ok else ())
                        by, sdpa, flops = make_fns(case, S, D, dtype, names)
                        fns = {f"fused:{isa}": at_isa(by["fused"], isa) for isa in isas}
                        fns["sdpa"] = sdpa
                        if flex_ok:
                            fns["flex"] = by["flex"]
                        fns["auto"] = by["auto"]
                    times = dict(
                        zip(
                            fns,
                            time_many(list(fns.values()), reps, grad=bwd, stat=stat, clock=clock),
                        )
                    )
                    if not bwd:
                        times["fused"] = times[f"fused:{default_isa}"]
                    layout = case.removesuffix("+bwd")
                    row = dict(
                        case=case,
                        dtype=str(dtype).removeprefix("torch."),
                        head_dim=D,
                        seq=S,
                        fused_tflops=flops / times["fused"] / 1e12,
                        sdpa_tflops=flops / times["sdpa"] / 1e12,
                        speedup=times["sdpa"] / times["fused"],
                        **{f"{k}_ms": t * 1e3 for k, t in times.items()},
                        ratios={k: t / times["sdpa"] for k, t in times.items() if k != "sdpa"},
                    )
                    if not bwd:
                        row["auto_picks"] = A.select_backend(
                            "auto", auto_probe(case, S, D, dtype), layout
                        )[0]
                        best = min(
                            t for k, t in times.items() if k.startswith("fused:") or k == "sdpa"
                        )
                        row["auto_vs_best"] = best / times["auto"]
                    results.append(row)
                    print(
                        f"{row['dtype']:>8} D={D:<3} {case:<9} S={S:<5} sdpa "
                        f"{times['sdpa'] * 1e3:7.2f} ms  "
                        + "  ".join(f"{k} x{r:.2f}" for k, r in row["ratios"].items())
                        + (
                            f"  (auto -> {row['auto_picks']}, best/auto {row['auto_vs_best']:.2f})"
                            if not bwd
                            else ""
                        ),
                        flush=True,
                    )
    memory = []
    if not args.quick:
        for case in ("dense", "retrieval"):
            for S in [int(s) for s in args.memory_seqs.split(",")]:
                row = dict(case=case, dtype="float32", head_dim=64, seq=S)
                for impl in ("fused", "sdpa"):
                    row[f"{impl}_peak_extra_mib"] = peak_extra_mib(
                        case, S, 64, "float32", impl, args.threads
                    )
                memory.append(row)
                print(
                    f"memory {case:<9} S={S:<5} fused +{row['fused_peak_extra_mib']:.1f} MiB  "
                    f"sdpa +{row['sdpa_peak_extra_mib']:.1f} MiB",
                    flush=True,
                )

    def summary(case, dtype):
        sp = [r["speedup"] for r in results if r["case"] == case and r["dtype"] == dtype]
        return dict(min=min(sp), median=statistics.median(sp), max=max(sp)) if sp else None

    def ratio_summary(case, dtype):
        rows = [r for r in results if r["case"] == case and r["dtype"] == dtype]
        if not rows:
            return None
        out = {k: statistics.median(r["ratios"][k] for r in rows) for k in rows[0]["ratios"]}
        out["auto_max"] = max(r["ratios"]["auto"] for r in rows) if "auto" in out else None
        out["auto_vs_best_min"] = min(
            (r["auto_vs_best"] for r in rows if "auto_vs_best" in r), default=None
        )
        out["auto_picks"] = sorted({r.get("auto_picks") for r in rows} - {None})
        return out

    cases = ("dense", "causal", "packed", "retrieval", "dense+bwd", "causal+bwd")
    dtypes = ("float32", "bfloat16")
    model, flags = autotune._cpu_description()
    report = dict(
        machine=dict(
            cpu=model,
            isa_flags=sorted(f for f in flags.split() if f.startswith(("avx", "fma"))),
            kernel_isa=default_isa,
            isa_cap=A._isa_cap(),
            threads=args.threads,
            torch=torch.__version__,
            commit=_commit(),
            cores=os.cpu_count(),
            note="compare ratios within one run (other load shifts absolute times)",
        ),
        flops="4*B*S^2*H*D (half for causal); packed/retrieval count allowed pairs only",
        targets={"dense": 1.0, "causal": 1.3, "packed": 2.0, "retrieval": 2.0},
        timed="forward only (no_grad) unless the case ends in +bwd (forward + backward)",
        stat=f"{args.stat} of {args.reps} interleaved timed calls per point, "
        + ("the thread's CPU time" if args.cpu_time else "wall time"),
        command=" ".join(sys.argv),
        speedup_summary={f"{c}/{d}": summary(c, d) for c in cases for d in dtypes},
        ratio_note=(
            "median over points of time / SDPA's time (below 1: faster than SDPA); auto_max: "
            "worst point; auto_vs_best_min: worst point of (fastest fused ISA or SDPA) / auto"
        ),
        ratio_summary={
            f"{c}/{d}": ratio_summary(c, d)
            for c in cases
            for d in dtypes
            if ratio_summary(c, d) is not None
        },
        results=results,
        memory=memory,
    )
    if args.memory_only:
        report = json.loads(Path(args.out).read_text())
        report["memory"] = memory
    Path(args.out).write_text(strict_dumps(report, indent=1))
    print(strict_dumps(report.get("ratio_summary"), indent=1))
    if tmp_cache:
        import shutil

        shutil.rmtree(tmp_cache, ignore_errors=True)


if __name__ == "__main__":
    main()
