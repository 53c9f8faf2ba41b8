"""Gradient accumulation at 2 data-parallel ranks: the step time with the gradients synchronised
once per optimizer step (``train_step(sync=...)`` true on the last micro-step only: what the
trainer does) against synchronised on every micro-step (``sync=True`` on each: what it did
before), step-paired in the same two processes.

The reader is the run's (``+experiment=demo`` plus the overrides, ``retriever=none``: the reader
alone, closed book), random weights, spread by ``parallel.parallelize`` as plain data parallel
(``dp_replicate=2``, ``--grad-reduce`` choosing the reducer); a batch is shaped like the run's
(``train_throughput.synthetic_batch``). One optimizer step = ``--accum`` micro-steps of
``--batch`` queries per rank, the one clipper, AdamW. The two variants alternate step by step
behind a barrier; a step's time is the slower rank's. Reported: median step times, the median
per-step ratio once / each (below 1: syncing once is faster), and the gradient all-reduces per
optimizer step counted in each variant. Prints one JSON object.

    python scripts/bench/accum_sync.py [--accum 4] [--batch 8] [--steps 20] [--grad-reduce pg]
        [overrides...]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, os.path.dirname(__file__))

from pipeline import _tight_barrier, spawn  # noqa: E402 - the same launcher and step clock
from train_throughput import synthetic_batch  # noqa: E402

from rag_mm.components.metrics import strict_dumps  # noqa: E402  (null, never NaN, in the report)


def paired(
    rank: int, accum: int, batch: int, steps: int, grad_reduce: str, overrides: list[str]
) -> dict:
    import torch.distributed as dist
    from omegaconf import OmegaConf

    import parallel
    from rag_mm.config import compose, reader_tokenizer
    from rag_mm.data.tokenizer import get_tokenizer
    from rag_mm.model.factory import build_reader, materialize

    barrier = _tight_barrier()
    cfg = compose(["+experiment=demo", "run_dir=/tmp/unused", "retriever=none", *overrides])
    model_cfg = OmegaConf.to_object(cfg.model)
    vocab = get_tokenizer(reader_tokenizer(model_cfg)).vocab_size
    torch.manual_seed(0)
    reader = materialize(build_reader(model_cfg, vocab, meta=True), torch.device("cpu"))
    x = synthetic_batch(cfg, batch, vocab, torch.device("cpu"))
    pm = parallel.parallelize(
        reader, parallel.ParallelConfig(dp_replicate=2, grad_reduce=grad_reduce), x
    )
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-4)
    grad_numel = sum(p.numel() for p in pm.parameters() if p.requires_grad)
    calls = [0]
    original = dist.all_reduce

    def counting(t, *a, **k):  # the gradient bucket: every reader parameter in one flat buffer
        calls[0] += t.numel() == grad_numel
        return original(t, *a, **k)

    dist.all_reduce = counting
    times: dict[str, list[float]] = {"once": [], "each": []}
    reduces: dict[str, list[int]] = {"once": [], "each": []}
    warm = 4
    for s in range(2 * steps + warm):
        variant = "once" if s % 2 == 0 else "each"
        barrier()
        calls[0] = 0
        t0 = time.perf_counter()
        for i in range(accum):
            pm.train_step(
                x, loss_fn=lambda out, _: out.loss / accum, sync=variant == "each" or i == accum - 1
            )
        pm.clip_grad_norm_(1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        dt = time.perf_counter() - t0
        if s >= warm:
            times[variant].append(dt)
            reduces[variant].append(calls[0])
    dist.all_reduce = original
    return {"times": times, "reduces": reduces, "params_M": grad_numel / 1e6}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--accum", type=int, default=4, help="micro-steps per optimizer step (optim.grad_accum)"
    )
    ap.add_argument("--batch", type=int, default=8, help="queries per micro-step per rank")
    ap.add_argument(
        "--steps", type=int, default=20, help="timed optimizer steps per variant (they alternate)"
    )
    ap.add_argument(
        "--grad-reduce", default="pg", help="parallel.grad_reduce: pg | auto | shm | hier_int8"
    )
    ap.add_argument("--out", default="", help="also write the JSON to this file")
    ap.add_argument("overrides", nargs="*", help="training overrides, e.g. model.n_layers=4")
    a = ap.parse_args()
    r = spawn(
        paired,
        2,
        accum=a.accum,
        batch=a.batch,
        steps=a.steps,
        grad_reduce=a.grad_reduce,
        overrides=a.overrides,
    )
    once, each = ([max(t) for t in zip(*(x["times"][v] for x in r))] for v in ("once", "each"))
    report = strict_dumps(
        {
            "bench": "accum_sync",
            "device": f"{platform.processor() or platform.machine()}, 2 gloo ranks, 1 thread each",
            "torch": torch.__version__,
            "load_average": round(os.getloadavg()[0], 1),
            "accum": a.accum,
            "batch_per_rank": a.batch,
            "grad_reduce": a.grad_reduce,
            "reader_params_M": round(r[0]["params_M"], 3),
            "steps_per_variant": a.steps,
            "step_s_median": {
                "once": round(statistics.median(once), 4),
                "each": round(statistics.median(each), 4),
            },
            "ratio_once_over_each": round(statistics.median(o / e for o, e in zip(once, each)), 4),
            "grad_all_reduces_per_step": {
                v: sorted(set(r[0]["reduces"][v])) for v in ("once", "each")
            },
        }
    )
    print(report)
    if a.out:
        with open(a.out, "w") as f:
            f.write(report + "\n")


if __name__ == "__main__":
    main()
