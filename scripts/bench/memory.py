"""Memory savers, measured: per-rank memory of FSDP2 vs plain data parallel (DDP) on 2 gloo ranks,
and the activation memory activation checkpointing saves on the reader.

    python scripts/bench/memory.py [--json out.json] [--shapes 768x8x2,384x8x8]

Each shape is ``dim x layers x batch`` of the rag_mm reader (2 documents of 40 tokens per query at
batch 8, 1 document at smaller batches). Per rank, for DDP and FSDP2 (2 AdamW steps, fp32):

- ``state``: parameters + gradients + Adam moments after a step (local shards of DTensors): what
  FSDP shards, so 0.5x on 2 ranks by construction;
- ``peak``: the peak of live tensor bytes, as the c10 CPU allocator counts them ("Total Allocated"
  of the profiler's memory events; tracking starts before the model is built, so it covers the
  model, gradients, optimizer state, activations, FSDP's all-gather / reduce-scatter buffers and
  DDP's gradient buckets, and nothing else): this is what the "<= 0.6x per rank" goal means;
- ``rss``: the process's peak resident memory growth from just before the model is built, after
  imports and a warm-up step of a tiny reader (current RSS sampled every 0.5 ms; malloc's mmap
  threshold is pinned so freed tensors go back to the OS): adds the allocator's slack, gloo's and
  the runtime's own buffers and caches, which no data parallel scheme shards. Measured in a first
  run, without the profiler.

Under a pipeline (``--pipeline``, 4 ranks): pp=2 x dp_shard=2 (FSDP2 inside each stage) against
pp=2 x dp_replicate=2 (each stage replicated, gradients all-reduced), same partition (balanced by
parameters), 4 microbatches, 1F1B: the per-rank ``state`` as above (the larger rank's) and the
step time (median of 5 steps after 2 warm-up ones, the slower rank's).

Why an activation-heavy shape misses the goal: FSDP shards only the model state; activations
(batch 8 with 2 retrieved documents: ~290 MB on 384 x 8 against ~250 MB of state) and FSDP's
unsharded working set (the gathered block, its full gradient before the reduce-scatter, the root's
parameters, kept unsharded between forward and backward) are the same on every rank.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
from rag_mm.components.metrics import strict_dumps  # noqa: E402  (null, never NaN, in the report)

# freed tensors' pages go back to the OS at once (glibc otherwise raises its mmap threshold after
# the first large free and keeps later blocks in the heap), so RSS follows the live bytes
os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", str(1 << 20))


def _reader(dim, layers, batch=8):
    from rag_mm.config import ModelConfig

    torch.manual_seed(0)
    cfg = ModelConfig(
        dim=dim,
        layers=layers,
        heads=max(1, dim // 64),
        vision_width=128,
        vision_layers=2,
        vision_head_width=32,
        attention_backend="auto",
    )
    g = torch.Generator().manual_seed(1)
    B, k = batch, (2 if batch >= 8 else 1)
    inputs = dict(
        image=torch.randn(B, 3, 32, 32, generator=g),
        q_ids=torch.randint(0, 1000, (B, 20), generator=g),
        q_len=torch.full((B,), 20),
        a_ids=torch.randint(0, 1000, (B, 8), generator=g),
        a_len=torch.full((B,), 8),
        doc_image=torch.randn(B, k, 3, 32, 32, generator=g),
        doc_ids=torch.randint(0, 1000, (B, k, 40), generator=g),
        doc_len=torch.full((B, k), 40),
    )
    return cfg, inputs


def _rss_now() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _state_bytes(model, opt) -> int:
    def loc(t):
        return t.to_local() if hasattr(t, "to_local") else t

    total = 0
    for p in model.parameters():
        total += loc(p).numel() * loc(p).element_size()
        if p.grad is not None:
            total += loc(p.grad).numel() * loc(p.grad).element_size()
    for st in opt.state.values():
        for v in st.values():
            if torch.is_tensor(v):
                total += loc(v).numel() * loc(v).element_size()
    return total


def _train(mode, world, dim, layers, batch):
    from parallel.config import ParallelConfig
    from parallel.mesh import build_mesh
    from parallel.spmd import parallelize_spmd
    from rag_mm.model import Reader

    cfg, inputs = _reader(dim, layers, batch)
    model = Reader(cfg, vocab_size=1000)
    if mode == "fsdp":
        pc = ParallelConfig(dp_shard=world)
        parallelize_spmd(model, pc, build_mesh(pc, world, "cpu"))
    # plain data parallel, as the trainer runs it: full replica, gradients all-reduced in buckets
    else:
        from torch.nn.parallel import DistributedDataParallel

        model = DistributedDataParallel(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=False)
    for _ in range(2):
        out = model(**inputs)
        out.loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=False)
    return _state_bytes(model, opt)


class _RssSampler:
    """Peak of the current RSS, sampled every 0.5 ms on a thread (ru_maxrss would also remember
    peaks from before the measured region: imports, an earlier run)."""

    def __enter__(self):
        import threading

        self.base = self.peak = _rss_now()
        self._stop = threading.Event()

        def run():
            while not self._stop.wait(5e-4):
                self.peak = max(self.peak, _rss_now())

        self._t = threading.Thread(target=run, daemon=True)
        self._t.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join()
        self.peak = max(self.peak, _rss_now())


def _warm_up() -> None:
    """Imports and one-time loads (the attention extension, dispatch caches) before the measured
    region: they are the process's fixed cost, not the training state's."""
    import parallel.mesh  # noqa: F401
    import parallel.spmd  # noqa: F401
    from rag_mm.model import Reader

    cfg, inputs = _reader(64, 2, 2)
    cfg.heads = 1
    Reader(cfg, vocab_size=1000)(**inputs).loss.backward()


def dp_rank_fn(rank, world, mode, dim, layers, batch=8):
    """Per-rank state, peak RSS growth (a plain run) and allocator-tracked peak (a profiled run)."""
    import gc

    from torch.profiler import ProfilerActivity, profile

    _warm_up()
    with _RssSampler() as rss:
        _train(mode, world, dim, layers, batch)
    gc.collect()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        state = _train(mode, world, dim, layers, batch)
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        with open(f.name) as g:
            events = json.load(g)["traceEvents"]
    totals = [e["args"]["Total Allocated"] for e in events if e.get("name") == "[memory]"]
    return dict(state=state, peak=max(totals), rss=rss.peak - rss.base)


def pipeline_rank_fn(rank, world, mode, dim, layers, batch=8, steps=5):
    """Per-rank state and step times of the reader over pp=2 with FSDP or replicated stages."""
    import time

    import parallel
    from rag_mm.model import Reader

    cfg, inputs = _reader(dim, layers, batch)
    model = Reader(cfg, vocab_size=1000)
    dp = dict(dp_shard=2) if mode == "pp_fsdp" else dict(dp_replicate=2)
    pc = parallel.ParallelConfig(
        pp=2, microbatches=4, schedule="1f1b", partition="parameters", **dp
    )
    pm = parallel.parallelize(model, pc, inputs)
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-4, foreach=False)
    times = []
    for i in range(2 + steps):
        t0 = time.perf_counter()
        pm.train_step(inputs, loss_fn=lambda out, _t: out.loss)
        opt.step()
        opt.zero_grad(set_to_none=False)
        if i >= 2:
            times.append(time.perf_counter() - t0)
    return dict(state=_state_bytes(pm, opt), step_s=times, pp_rank=pm.pp_rank)


def pipeline_compare(shape: str) -> dict:
    from tests.distributed import run_ranks

    dim, layers, batch = (int(x) for x in shape.split("x"))
    r = {
        mode: run_ranks(pipeline_rank_fn, 4, mode, dim, layers, batch, timeout_s=1800)
        for mode in ("pp_dp", "pp_fsdp")
    }
    out = {"shape": shape}
    for mode, ranks in r.items():
        out[f"{mode}_state_bytes"] = max(x["state"] for x in ranks)
        # slower rank
        steps = [max(x["step_s"][i] for x in ranks) for i in range(len(ranks[0]["step_s"]))]
        out[f"{mode}_step_s"] = sorted(steps)[len(steps) // 2]
    out["fsdp_vs_dp_state"] = out["pp_fsdp_state_bytes"] / out["pp_dp_state_bytes"]
    out["fsdp_vs_dp_step_time"] = out["pp_fsdp_step_s"] / out["pp_dp_step_s"]
    return out


def activation_bytes(dim, layers, mode):
    from parallel.memory import SavedBytes, apply_activation_checkpointing
    from rag_mm.model import Reader

    cfg, inputs = _reader(dim, layers)
    model = Reader(cfg, vocab_size=1000)
    apply_activation_checkpointing(list(model.blocks), mode, 2)
    with SavedBytes(model) as saved:
        loss = model(**inputs).loss
    loss.backward()
    return saved.nbytes


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument(
        "--shapes",
        default="768x8x2,384x8x8",
        help=(
            "reader dim x layers x batch, comma-separated (first: state-dominated, the goal's case)"
        ),
    )
    ap.add_argument(
        "--activations", default="384x8", help="dim x layers for the activation-checkpointing table"
    )
    ap.add_argument(
        "--pipeline",
        default="384x8x8",
        help="dim x layers x batch of the pp=2 comparison ('' skips)",
    )
    ap.add_argument(
        "--only",
        choices=("all", "pipeline"),
        default="all",
        help="pipeline: the pp=2 comparison alone",
    )
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    from tests.distributed import run_ranks

    res = {"shapes": {}}
    if a.pipeline:
        res["pipeline"] = pipeline_compare(a.pipeline)
        print("pipeline", strict_dumps(res["pipeline"]), flush=True)
    if a.only == "pipeline":
        print(strict_dumps(res, indent=1))
        if a.json:
            with open(a.json, "w") as f:
                f.write(strict_dumps(res, indent=1))
        return
    for shape in a.shapes.split(","):
        dim, layers, batch = (int(x) for x in shape.split("x"))
        r = {
            mode: run_ranks(dp_rank_fn, 2, mode, dim, layers, batch, timeout_s=1200)
            for mode in ("ddp", "fsdp")
        }
        for k in ("state", "peak", "rss"):  # per rank: the larger of the two ranks
            r[f"fsdp_vs_ddp_{k}"] = max(x[k] for x in r["fsdp"]) / max(x[k] for x in r["ddp"])
        res["shapes"][shape] = r
        print(shape, {k: round(v, 3) for k, v in r.items() if k.startswith("fsdp_vs")}, flush=True)
    dim, layers = (int(x) for x in a.activations.split("x"))
    for mode in ("none", "full", "every_n"):
        res[f"activation_bytes_{mode}"] = activation_bytes(dim, layers, mode)
    res["ac_full_reduction"] = res["activation_bytes_none"] / res["activation_bytes_full"]
    res["ac_every2_reduction"] = res["activation_bytes_none"] / res["activation_bytes_every_n"]
    print(strict_dumps(res, indent=1))
    if a.json:
        with open(a.json, "w") as f:
            f.write(strict_dumps(res, indent=1))


if __name__ == "__main__":
    main()
