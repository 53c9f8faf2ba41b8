"""A cluster description for the layout planner, its presets, and an alpha-beta model of the
collectives that run on it.

A collective over ``n`` ranks moving ``S`` bytes per rank costs ``steps * alpha + volume * S /
beta`` on the slowest link it crosses, with NCCL's algorithms (nccl-tests' PERFORMANCE.md formulas):

- ring all-reduce: ``2 (n - 1)`` steps, ``2 (n - 1) / n`` of the buffer over each link;
- tree all-reduce (double binary tree): ``2 ceil(log2 n)`` steps, about ``2 S`` over each link;
  NCCL picks whichever is faster, so small messages pay the tree's logarithmic latency;
- reduce-scatter / all-gather (ring): ``n - 1`` steps, ``(n - 1) / n`` of the (unsharded) buffer.

Link of a group: ranks are numbered node by node, and a mesh dimension of size ``n`` and stride
``s`` (the product of the inner dimensions) stays inside a node when ``n * s <= devices_per_node``.
A group spanning nodes crosses the nodes' network: every device of a node runs the same collective
at once in every layout planned here, so ``devices_per_node / members_per_node`` groups share a
node's network bandwidth (tp=16 over two nodes: one group per node gets the whole 400 Gb/s;
data parallel across nodes under tp=8: eight groups share it).

Presets live in ``conf/cluster/<name>.yaml``; ``calibrate()`` measures the local machine.
"""

from __future__ import annotations

import dataclasses
import math
import os
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

PRESET_DIR = Path(__file__).resolve().parents[1] / "conf" / "cluster"


@dataclass
class Cluster:
    """The machines a layout runs on. Bandwidths are bytes/s in one direction."""

    name: str = "custom"  # label for tables and JSON
    nodes: int = 1  # hosts
    # accelerators (or CPU ranks) per host; tensor parallel stays within one
    devices_per_node: int = 8
    device_memory_bytes: float = 40 * 2**30  # memory of one device
    # peak dense FLOP/s of one device per compute dtype ("fp32", "bf16")
    peak_flops: dict[str, float] = field(default_factory=lambda: {"fp32": 19.5e12, "bf16": 312e12})
    # fraction of peak a training step achieves on its matmuls (MFU)
    compute_efficiency: float = 0.5
    # share of one device's compute each rank gets: 1 on accelerators; cores / ranks where CPU
    # ranks outnumber the cores they run on and time-share them
    rank_share: float = 1.0
    intra_bandwidth: float = 300e9  # per device, to another device of its node (NVLink / NVSwitch)
    intra_latency_s: float = 5e-6  # per step of a collective inside a node
    inter_bandwidth: float = 50e9  # per node: all its network adapters together
    inter_latency_s: float = 20e-6  # per step of a collective between nodes
    host_bandwidth: float = 25e9  # per device, device <-> host memory (PCIe): CPU offload traffic
    host_memory_bytes: float = 1024 * 2**30  # per node: where CPU offload keeps state
    # per node: DRAM bandwidth a host-side Adam step streams at
    host_memory_bandwidth: float = 200e9
    usable_fraction: float = 0.9  # of device memory a plan may fill (CUDA context, allocator slack)
    # of the compute that data-parallel traffic can hide behind, the part it does hide behind: 1
    # where collectives run on their own engines (NCCL streams, copy engines), 0 on CPU ranks whose
    # gloo threads take the cores the compute needs
    comm_overlap: float = 1.0
    backend: str = "nccl"  # collective library the figures describe (informational)
    # host seconds the runtime's own bookkeeping adds per forward + backward beyond the collectives'
    # cost: per FSDP unit (its hooks, the all-gather's copy-in and copy-out) and per call of a
    # tensor-parallel-sharded module (DTensor dispatch, sharding propagation). Serial with the
    # compute on CPU ranks (``calibrate`` measures them); 0 in accelerator presets, where the host
    # runs ahead of the device and this work hides behind its kernels
    fsdp_unit_s: float = 0.0
    tp_call_s: float = 0.0

    @property
    def world(self) -> int:
        return self.nodes * self.devices_per_node

    def flops_per_s(self, dtype: str) -> float:
        """Achieved FLOP/s of one rank in ``dtype``: peak x efficiency x its share of the device."""
        return self.peak_flops[dtype] * self.compute_efficiency * self.rank_share

    def with_model_rate(self, flops_per_s: float, dtype: str = "fp32") -> Cluster:
        """This cluster with the efficiency of one model's measured FLOP rate on one device of it
        (``measure_model``): small models run their matmuls well below the rate a large matmul
        reaches, and do elementwise work a FLOP count barely sees."""
        if flops_per_s <= 0:
            raise ValueError(f"a model's FLOP rate must be positive (got {flops_per_s})")
        eff = flops_per_s / self.peak_flops[dtype]
        return dataclasses.replace(
            self, name=f"{self.name}, model efficiency {eff:.2f}", compute_efficiency=eff
        )

    @classmethod
    def preset(cls, name: str, **overrides) -> Cluster:
        """``conf/cluster/<name>.yaml`` with ``overrides`` (e.g. ``nodes=16``)."""
        path = PRESET_DIR / f"{name}.yaml"
        if not path.exists():
            known = sorted(p.stem for p in PRESET_DIR.glob("*.yaml"))
            raise ValueError(f"unknown cluster preset {name!r}; known: {known}")
        with open(path) as f:
            d = yaml.safe_load(f)
        d.update(overrides)
        d.setdefault("name", name)
        # YAML 1.1 reads "50.0e9" (no exponent sign) as a string: convert by the field's type
        types = {f.name: f.type for f in dataclasses.fields(cls)}
        for k, v in d.items():
            if types.get(k) == "float":
                d[k] = float(v)
            elif types.get(k) == "int":
                d[k] = int(v)
        d["peak_flops"] = {k: float(v) for k, v in d.get("peak_flops", {}).items()}
        return cls(**d)

    # ------------------------------------------------------------------ links and collectives

    def group_link(self, size: int, stride: int) -> tuple[float, float, bool]:
        """(bandwidth per group, latency, crosses nodes) of a mesh dimension of ``size`` ranks
        ``stride`` apart (see the module doc)."""
        dpn = self.devices_per_node
        if size * stride <= dpn:
            return self.intra_bandwidth, self.intra_latency_s, False
        per_node = max(1, min(size, dpn // stride)) if stride < dpn else 1
        share = self.inter_bandwidth * per_node / dpn
        return min(self.intra_bandwidth, share), self.inter_latency_s, True

    def all_reduce(self, nbytes: float, size: int, stride: int) -> float:
        """Seconds of an all-reduce of ``nbytes`` over a group: the faster of ring and tree."""
        if size <= 1 or nbytes <= 0:
            return 0.0
        bw, lat, _ = self.group_link(size, stride)
        ring = 2 * (size - 1) * lat + 2 * (size - 1) / size * nbytes / bw
        tree = 2 * math.ceil(math.log2(size)) * lat + 2 * nbytes / bw
        return min(ring, tree)

    def all_gather(self, nbytes: float, size: int, stride: int) -> float:
        """Seconds of an all-gather (or a reduce-scatter) whose unsharded buffer is ``nbytes``."""
        if size <= 1 or nbytes <= 0:
            return 0.0
        bw, lat, _ = self.group_link(size, stride)
        return (size - 1) * lat + (size - 1) / size * nbytes / bw

    reduce_scatter = all_gather

    def send(self, nbytes: float, stride: int) -> float:
        """Seconds of a point-to-point send to the rank ``stride`` away (a pipeline hand-over)."""
        if nbytes <= 0:
            return 0.0
        bw, lat, _ = self.group_link(2, stride)
        return lat + nbytes / bw

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


# ----------------------------------------------------------------------------- calibration


def _matmul_flops(dtype, n: int, seconds: float) -> float:
    import torch

    a = torch.randn(n, n, dtype=dtype)
    b = torch.randn(n, n, dtype=dtype)
    torch.mm(a, b)  # warm-up (allocations, kernel selection)
    reps, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        torch.mm(a, b)
        reps += 1
    return 2.0 * n**3 * reps / (time.perf_counter() - t0)


def _all_reduce_worker(rank: int, world: int, port: int, sizes: list[int], reps: int, out) -> None:
    """Seconds of one all-reduce per size, timed between bursts of compute on every rank (a
    training step's situation): the time a loop of (compute, all-reduce) takes over the compute
    alone. Where ranks outnumber the cores, a collective also waits for its peers to be scheduled,
    which an all-reduce timed alone never shows."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    a = torch.randn(256, 256)  # 34 MFLOP a product: a few ms of compute between collectives

    def loop(t: torch.Tensor | None) -> float:
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(reps):
            for _ in range(4):
                a @ a
            if t is not None:
                dist.all_reduce(t)
        dist.barrier()
        return (time.perf_counter() - t0) / reps

    times = []
    for n in sizes:
        t = torch.ones(n // 4)  # fp32 elements
        dist.all_reduce(t)
        times.append(max(loop(t) - loop(None), 1e-7))
    fsdp_unit, tp_call = _runtime_overheads(world, reps)
    if rank == 0:
        out.put((times, fsdp_unit, tp_call))
    dist.destroy_process_group()


def _runtime_overheads(world: int, reps: int) -> tuple[float, float]:
    """Seconds (per FSDP unit, per tensor-parallel module call) of one forward + backward of a
    stack of small linear layers, over the same stack unsharded plus the collectives the runtime
    issues for it, timed back to back in the same process group: FSDP2 (``fully_shard`` on each
    layer: two all-gathers and a reduce-scatter of its parameters a unit) and tensor parallel
    (column- / row-wise pairs, ``parallelize_module``: one all-reduce of a (4, 32) activation or
    gradient a call). The layers are so small that what is left is the runtime's fixed host work
    per unit and per call. The collectives are timed here, in the same loop shape as the models,
    rather than taken from the latency fit: that fit times them between bursts of compute, where
    a collective also waits for its peers to be scheduled, and would subtract more than the
    runtime ever waits for."""
    import torch
    import torch.distributed as dist
    import torch.nn as nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    layers, width = 8, 32  # 8 units / 4 column-row pairs; 32-wide layers: microseconds of compute
    mesh = init_device_mesh("cpu", (world,))
    x = torch.randn(4, width)

    def stack() -> nn.Sequential:
        torch.manual_seed(0)
        return nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])

    def timed(run: Callable[[], Any]) -> float:
        run()  # warm-up: lazy initialisation, sharding-propagation caches
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(reps):
            run()
        dist.barrier()
        return (time.perf_counter() - t0) / reps

    def step(m: nn.Module) -> Callable[[], Any]:
        return lambda: m(x).sum().backward()

    # one layer's parameters, padded to the ranks
    unit = -(-(width * width + width) // world) * world
    full, shard, act = torch.zeros(unit), torch.zeros(unit // world), torch.zeros(4, width)

    # the single-tensor collectives' names since torch 2.14; the older names before
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

    def fsdp_collectives() -> None:
        for _ in range(layers):
            gather(full, shard)  # forward
            gather(full, shard)  # backward
            scatter(shard, full)  # gradients

    def tp_collectives() -> None:
        for _ in range(layers):
            dist.all_reduce(act)

    sharded = stack()
    for layer in sharded:
        fully_shard(layer, mesh=mesh)
    fully_shard(sharded, mesh=mesh)
    tp_model = parallelize_module(
        stack(),
        mesh,
        {str(i): RowwiseParallel() if i % 2 else ColwiseParallel() for i in range(layers)},
    )
    loops = {
        "plain": step(stack()),
        "fsdp": step(sharded),
        "fsdp_collectives": fsdp_collectives,
        "tp": step(tp_model),
        "tp_collectives": tp_collectives,
    }
    # Each loop's time is the fastest of 5 interleaved rounds: noise on a shared host (another
    # process scheduled on the core, a late peer) only ever adds time, and one slow round of the
    # collectives would otherwise subtract more than the runtime's own work.
    best = dict.fromkeys(loops, float("inf"))
    for _ in range(5):
        for name, run in loops.items():
            best[name] = min(best[name], timed(run))
    fsdp = best["fsdp"] - best["fsdp_collectives"] - best["plain"]
    tp = best["tp"] - best["tp_collectives"] - best["plain"]
    return max(fsdp, 0.0) / layers, max(tp, 0.0) / layers


def measure_model(
    step: Callable[[int], Any],
    flops_per_sample: float,
    batches: Sequence[int] = (1, 8),
    reps: int = 3,
) -> tuple[float, float]:
    """(FLOP/s, seconds of fixed overhead per call) of one model on this device: ``step(b)`` runs
    its forward and backward on ``b`` samples; the median time of ``reps`` runs (after one warm-up)
    at each batch size is fitted by least squares to ``overhead + flops_per_sample * b / rate``.
    The overhead is what does not grow with the batch (per-operator dispatch, Python, kernel
    launches); the planner charges it once per microbatch on every tensor-parallel rank."""
    if len(set(batches)) < 2:
        raise ValueError(f"measure_model needs two or more batch sizes (got {list(batches)})")
    xs, ys = [], []
    for b in batches:
        times = []
        for _ in range(reps + 1):
            t0 = time.perf_counter()
            step(b)
            times.append(time.perf_counter() - t0)
        xs.append(float(b))
        ys.append(statistics.median(times[1:]))
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    if slope <= 0:  # noise larger than the batch's effect: all of it is rate, none overhead
        return flops_per_sample * mx / my, 0.0
    return flops_per_sample / slope, max(my - slope * mx, 0.0)


def calibrate(base: Cluster | None = None, *, ranks: int = 2, seconds: float = 0.3) -> Cluster:
    """Measure this machine: matmul FLOP/s (fp32, bf16; 512-square, ``seconds`` each, one thread,
    as one rank of a CPU job runs) and a gloo all-reduce between ``ranks`` local processes while
    they compute (8 B for the latency, 4 MiB for the bandwidth: alpha-beta fitted on the ring
    formula; ``_all_reduce_worker``), and the runtime's fixed work per FSDP unit and per
    tensor-parallel module call (``_runtime_overheads``). Seconds, not milliseconds: it starts
    ``ranks`` processes and times loops.
    Efficiency is 1: the matmul rate is what a step achieves on its matmuls (a model's own rate:
    ``Cluster.with_model_efficiency``). With more ranks than the cores this process may run on,
    ranks time-share the cores: ``rank_share`` = cores / ranks."""
    import multiprocessing as mp
    import socket

    import torch

    base = base or Cluster.preset("local")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        fp32 = _matmul_flops(torch.float32, 512, seconds)
        bf16 = _matmul_flops(torch.bfloat16, 512, seconds)
    finally:
        torch.set_num_threads(threads)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    small, big = 8, 4 * 2**20
    procs = [
        ctx.Process(target=_all_reduce_worker, args=(r, ranks, port, [small, big], 20, q))
        for r in range(ranks)
    ]
    for p in procs:
        p.start()
    (t_small, t_big), fsdp_unit, tp_call = q.get(timeout=180)
    for p in procs:
        p.join(timeout=60)
    n = ranks
    alpha = t_small / (2 * (n - 1))
    beta = 2 * (n - 1) / n * big / max(t_big - 2 * (n - 1) * alpha, 1e-9)
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    # cores per rank, at most 1
    share = min(1.0, len(os.sched_getaffinity(0)) / max(base.devices_per_node, 1))
    return dataclasses.replace(
        base,
        name="local (calibrated)",
        peak_flops={"fp32": fp32, "bf16": bf16},
        compute_efficiency=1.0,
        rank_share=share,
        intra_bandwidth=beta,
        intra_latency_s=alpha,
        inter_bandwidth=beta,
        inter_latency_s=alpha,
        device_memory_bytes=float(mem) / base.devices_per_node,
        host_memory_bytes=float(mem),
        fsdp_unit_s=fsdp_unit,
        tp_call_s=tp_call,
    )
