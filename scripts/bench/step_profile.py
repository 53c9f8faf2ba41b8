"""A short ``torch.profiler`` trace of training steps, summarised: how busy the GPU was, device
time by kind of kernel, the top kernels, and the host syncs inside the step (gpu_verify's
``profile`` step).

Kinds are read from kernel names: ``gemm`` (cuBLAS / CUTLASS / nvjet / Triton mm templates),
``attention`` (flash, fmha, flex and other attention kernels), ``optimizer`` (multi-tensor and
fused Adam), ``memcpy`` (copies and fills), ``elementwise`` (everything else: Inductor's pointwise
and reduction kernels, casts, norms). Host syncs: CUDA runtime calls that wait for the device
(``cudaStreamSynchronize``, ``cudaDeviceSynchronize``, ``cudaEventSynchronize``), device-to-host
copies, and ``aten::_local_scalar_dense`` (``.item()`` and friends; the CPU's only witness).
"""

from __future__ import annotations

from collections import defaultdict

import torch

KINDS = (
    ("attention", ("flash", "fmha", "attention", "attn", "flex", "sdpa")),
    (
        "gemm",
        (
            "gemm",
            "cutlass",
            "nvjet",
            "xmma",
            "cublas",
            "mm_",
            "matmul",
            "triton_tem",
            "::mm",
            "addmm",
            "bmm",
            "::linear",
        ),
    ),
    ("optimizer", ("adam", "multi_tensor", "foreach")),
    ("memcpy", ("memcpy", "memset")),
)
SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")


def kind_of(name: str) -> str:
    low = name.lower()
    return next((k for k, words in KINDS if any(w in low for w in words)), "elementwise")


def _union_us(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


STEP_MARK = "profiled_step"  # a record_function range around each step: syncs are counted inside


def device_kernels(events) -> list:
    """The device work of a trace: its events on the CUDA timeline less the user annotations
    mirrored there (the step marks, an optimizer's ``Optimizer.step#AdamW.step`` range), which
    span kernels and would count their time twice."""
    cuda = torch.autograd.DeviceType.CUDA
    return [
        e
        for e in events
        if e.device_type == cuda
        and not getattr(e, "is_user_annotation", False)
        # by name too: a torch whose events lack the flag (older traces) still leaves these out
        and e.name != STEP_MARK
        and not e.name.startswith("Optimizer.")
    ]


def profile_steps(step, device: torch.device, steps: int = 2) -> dict:
    """Profile ``steps`` calls of ``step`` (already warmed up) and summarise."""
    from torch.profiler import ProfilerActivity, profile, record_function

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    if device.type == "cuda":
        torch.cuda.synchronize()
    with profile(activities=acts) as prof:
        for _ in range(steps):
            with record_function(STEP_MARK):
                step()
        if device.type == "cuda":
            torch.cuda.synchronize()  # the trace's end: outside every step's range
    events = prof.events()
    kernels = device_kernels(events)
    cpu = [e for e in events if e.device_type == torch.autograd.DeviceType.CPU]
    out: dict = {"steps": steps}
    # host calls that wait for the device, counted only inside a step's range (the profiler's own
    # start and stop synchronise the device too)
    windows = [(e.time_range.start, e.time_range.end) for e in cpu if e.name == STEP_MARK]
    inside = lambda e: any(a <= e.time_range.start <= b for a, b in windows)  # noqa: E731
    syncs = defaultdict(int)
    for e in cpu:
        if (e.name in SYNC_CALLS or e.name == "aten::_local_scalar_dense") and inside(e):
            syncs[e.name] += 1
    for e in kernels:  # device-to-host copies: only the steps run kernels in the trace
        if "dtoh" in e.name.lower() or "device -> pageable" in e.name.lower():
            syncs["memcpy DtoH"] += 1
    out["host_syncs"] = {k: v for k, v in syncs.items() if v}
    out["host_syncs_per_step"] = round(sum(syncs.values()) / steps, 2)
    if kernels:
        spans = [(e.time_range.start, e.time_range.end) for e in kernels]
        wall = max(b for _, b in spans) - min(a for a, _ in spans)
        out["gpu_busy"] = round(_union_us(spans) / wall, 4) if wall > 0 else None
        by_kind, by_name = defaultdict(float), defaultdict(float)
        for e in kernels:
            us = e.time_range.end - e.time_range.start
            by_kind[kind_of(e.name)] += us
            by_name[e.name] += us
        out["ms_per_step_by_kind"] = {
            k: round(v / 1e3 / steps, 3) for k, v in sorted(by_kind.items())
        }
        out["device_ms_per_step"] = round(sum(by_kind.values()) / 1e3 / steps, 3)
        out["window_ms_per_step"] = round(wall / 1e3 / steps, 3)
        out["kernels_per_step"] = round(len(kernels) / steps, 1)
        top = sorted(by_name.items(), key=lambda kv: -kv[1])[:10]
        out["top_kernels"] = [
            {"name": n[:120], "kind": kind_of(n), "ms_per_step": round(us / 1e3 / steps, 3)}
            for n, us in top
        ]
    else:  # the CPU: op time by kind from the profiler's own table
        by_kind = defaultdict(float)
        for row in prof.key_averages():
            if row.key.startswith("aten::"):
                by_kind[kind_of(row.key)] += row.self_cpu_time_total
        out["gpu_busy"] = None
        out["cpu_ms_per_step_by_kind"] = {
            k: round(v / 1e3 / steps, 3) for k, v in sorted(by_kind.items())
        }
    return out
