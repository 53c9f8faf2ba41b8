"""How well does the layout planner predict real runs? Its per-rank memory and step time for a
handful of layouts on 4 gloo ranks (CPU processes), against the same layouts run for real through
``parallel.parallelize``.

    OMP_NUM_THREADS=1 .venv/bin/python scripts/bench/plan_accuracy.py
        [--model llama|gpt2|reader|gpt2,reader] [--steps 5] [--rounds 1]
        [--layouts dp4,fsdp4,hsdp2x2,pp2_dp2,pp2_fsdp2,tp2_dp2,tp2_fsdp2,pp2_tp2] [--json out.json]

Models (``--model``, a comma list runs each in turn, one JSON section each), all random init, fp32,
AdamW, ``--global-batch`` samples per step (split over the data-parallel ranks, and under a
pipeline into ``--microbatches`` microbatches, 1F1B):

- ``llama`` (default): a Hugging Face ``LlamaForCausalLM`` (``--layers`` x ``--dim``, 4 heads,
  2 KV heads, vocab ``--vocab``; 3.4 M parameters at the defaults), ``--seq`` tokens per sequence;
- ``gpt2``: a Hugging Face ``GPT2LMHeadModel`` of the same size (``--layers`` x ``--dim``,
  4 heads, vocab ``--vocab``, tied embeddings, dropout off), ``--seq`` tokens per sequence;
- ``reader``: rag_mm's own ``Reader`` (as ``tests/parallel/pipeline_cases.py::reader_case``, but
  wider: ``--reader-dim`` 128, ``--layers`` blocks, 4 heads, a 2-layer ViT of width 128, sdpa
  attention, vocab ``--vocab``), ``--reader-docs`` documents per query (a 32 px picture, 16
  patches, and 24 text tokens each), a 12-token question and an answer of 2-6 tokens; the loss is
  ``out.loss`` (per answer token) and microbatches are weighted by their answer tokens.

A layout that cannot run for a model (it fails on the ranks) is recorded under ``skipped`` with
its error, and the others go on.

Predicted: ``parallel.plan_layout`` on the ``local`` cluster preset with ``devices_per_node`` =
the world size, calibrated by ``parallel.cluster.calibrate`` (single-thread matmul FLOP/s, a gloo
all-reduce between as many processes as the run uses, FSDP2's and DTensor's fixed host work per
unit and per sharded call on those processes), fp32, no checkpointing, no offload. Per
layout: the fullest rank's memory by kind (params, grads, optimizer, gathered, activations), its
training state (params + grads + optimizer) and peak (everything), and the step time with its
breakdown. Pipeline layouts run on the planner's own stage split (``--partition planner``,
default: the partitioner's search on the planner's FLOPs trace, as ``Planner.stages`` does) so
that a memory difference is the memory model's, not a different cut; ``--partition auto`` lets
the runtime trace, time and split the model itself.

Measured, per rank, in one group of ``world`` spawned gloo processes (one thread each) that runs
the layouts one after another:

- ``state``: parameters + gradients + optimizer state, counted from the actual tensors (the local
  shards of DTensors) right after the last optimizer step, before gradients are cleared;
  AdamW's ``step`` counters (one scalar per parameter tensor) are in the optimizer part;
- ``peak`` (unless ``--no-peak``): parameters + optimizer state resident before one extra step,
  plus the largest total the c10 CPU allocator reached above that during ``train_step`` (the
  profiler's "Total Allocated", gradients cleared to None first): activations, gradients, FSDP's
  gathered parameters and communication buffers. Allocations on gloo's own threads are not seen;
- ``step time``: the median over ``--steps`` steps after ``--warmup`` (in each of ``--rounds``
  passes over the layouts, the passes alternating their order) of the slowest rank's
  ``train_step`` (forward, backward, gradient reduction: what the planner models; ranks start
  each step at a barrier), and separately the optimizer step (not modelled by the planner).

Output: one JSON object on stdout: the calibration, the machine and library versions, and under
``models`` one section per model: per layout predicted vs measured and the ratios (measured /
predicted), the ranking of the layouts by predicted and by measured step time (Spearman's rho and
concordant pairs), ``median_relative_error`` of the step time (|measured - predicted| / measured),
``spearman_rho``, ``first_choice`` (the planner's fastest predicted layout among those measured,
its measured time against the fastest measured, ``within_10pct``), and the model's achieved FLOP/s
in one process against the calibrated matmul rate. Summaries use the layouts that were measured
and that the planner says fit. Progress goes to stderr.

What to expect on a small shared CPU host: memory close (it is counted, not timed); time far off
in absolute terms: 4 ranks share the cores they get (2 on the reference VM), a small model's
kernels run well below a 512-square matmul's rate, and per-op Python/dispatcher overhead, which
the planner does not model, dominates at these sizes.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from rag_mm.components.metrics import strict_dumps  # noqa: E402  (null, never NaN, in the report)

# name -> layout (degrees; pp > 1 layouts take --microbatches); the world is their product
LAYOUTS = {
    "dp4": dict(pp=1, tp=1, dp_replicate=4, dp_shard=1),
    "fsdp4": dict(pp=1, tp=1, dp_replicate=1, dp_shard=4),
    "hsdp2x2": dict(pp=1, tp=1, dp_replicate=2, dp_shard=2),
    "pp2_dp2": dict(pp=2, tp=1, dp_replicate=2, dp_shard=1),
    "pp2_fsdp2": dict(pp=2, tp=1, dp_replicate=1, dp_shard=2),
    "tp2_dp2": dict(pp=1, tp=2, dp_replicate=2, dp_shard=1),
    "tp2_fsdp2": dict(pp=1, tp=2, dp_replicate=1, dp_shard=2),
    "pp2_tp2": dict(pp=2, tp=2, dp_replicate=1, dp_shard=1),
    "pp4": dict(pp=4, tp=1, dp_replicate=1, dp_shard=1),
}
DEFAULT_LAYOUTS = "dp4,fsdp4,hsdp2x2,pp2_dp2,pp2_fsdp2,tp2_dp2,tp2_fsdp2,pp2_tp2"
MODELS = ("llama", "gpt2", "reader")


def log(msg: str) -> None:
    print(f"[plan_accuracy {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------- the model


def build_model(m: dict):
    torch.manual_seed(0)
    if m["kind"] == "gpt2":
        from transformers import GPT2Config, GPT2LMHeadModel

        cfg = GPT2Config(
            n_layer=m["layers"],
            n_embd=m["dim"],
            n_head=m["heads"],
            vocab_size=m["vocab"],
            n_positions=max(128, m["seq"]),
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            bos_token_id=m["vocab"] - 1,
            eos_token_id=m["vocab"] - 1,
        )
        return GPT2LMHeadModel(cfg)
    if m["kind"] == "reader":
        from rag_mm.config import ModelConfig
        from rag_mm.model import Reader

        cfg = ModelConfig(
            dim=m["dim"],
            layers=m["layers"],
            heads=m["heads"],
            vision_width=m["vision_width"],
            vision_layers=m["vision_layers"],
            vision_head_width=32,
            attention_backend="sdpa",
        )
        return Reader(cfg, m["vocab"])
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        num_hidden_layers=m["layers"],
        hidden_size=m["dim"],
        num_attention_heads=m["heads"],
        num_key_value_heads=2,
        intermediate_size=2 * m["dim"],
        vocab_size=m["vocab"],
        max_position_embeddings=max(128, m["seq"]),
        tie_word_embeddings=False,
    )
    return LlamaForCausalLM(cfg)


def make_batch(m: dict, batch: int, seed: int = 1) -> tuple[dict, torch.Tensor | None]:
    g = torch.Generator().manual_seed(seed)
    if (
        m["kind"] == "reader"
    ):  # full-length documents and questions; answers of 2..la tokens (EOT included)
        k, lt, lq, la, v = m["docs"], m["doc_tokens"], m["q_tokens"], m["a_tokens"], m["vocab"]
        inputs = {
            "image": torch.randn(batch, 3, 32, 32, generator=g),
            "q_ids": torch.randint(0, v, (batch, lq), generator=g),
            "q_len": torch.full((batch,), lq),
            "a_ids": torch.randint(0, v, (batch, la), generator=g),
            "a_len": torch.randint(2, la + 1, (batch,), generator=g),
            "doc_image": torch.randn(batch, k, 3, 32, 32, generator=g),
            "doc_ids": torch.randint(0, v, (batch, k, lt), generator=g),
            "doc_len": torch.full((batch, k), lt),
        }
        return inputs, None
    ids = torch.randint(0, m["vocab"], (batch, m["seq"]), generator=g)
    target = torch.randint(0, m["vocab"], (batch, m["seq"]), generator=g)
    return {"input_ids": ids}, target


def lm_loss(out, target):
    logits = out.logits if hasattr(out, "logits") else out[0]
    return torch.nn.functional.cross_entropy(logits.float().flatten(0, -2), target.flatten())


def reader_loss(out, _target):
    return out.loss  # per-token mean of the (micro)batch


def reader_weight(inputs, _target) -> float:
    # answer tokens: microbatches combine to the full-batch token mean
    return float(inputs["a_len"].sum())


def loss_fns(m: dict) -> tuple:
    """(loss_fn, weight_fn) for ``train_step``."""
    return (reader_loss, reader_weight) if m["kind"] == "reader" else (lm_loss, None)


def model_info(m: dict, numel: int, a: argparse.Namespace, flops_per_sample: float) -> dict:
    common = {
        "parameters": numel,
        "layers": m["layers"],
        "dim": m["dim"],
        "heads": m["heads"],
        "vocab": m["vocab"],
        "global_batch": m["global_batch"],
        "microbatches_pp": a.microbatches,
        "dtype": "fp32",
        "optimizer": "AdamW",
        "trace_flops_per_sample": flops_per_sample,
    }
    if m["kind"] == "reader":
        return {
            "type": "rag_mm.model.Reader (random init, sdpa attention)",
            **common,
            "vision_width": m["vision_width"],
            "vision_layers": m["vision_layers"],
            "docs": m["docs"],
            "doc_text_tokens": m["doc_tokens"],
            "question_tokens": m["q_tokens"],
            "answer_tokens_max": m["a_tokens"],
            "loss": "out.loss, microbatches weighted by a_len.sum()",
        }
    if m["kind"] == "gpt2":
        return {"type": "GPT2LMHeadModel (random init, tied embeddings)", **common, "seq": m["seq"]}
    return {
        "type": "LlamaForCausalLM (random init)",
        **common,
        "kv_heads": 2,
        "intermediate": 2 * m["dim"],
        "seq": m["seq"],
    }


# ----------------------------------------------------------------------------- measured side


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _nbytes(t: torch.Tensor) -> int:
    t = _local(t)
    return t.numel() * t.element_size()


def state_bytes(params: list, opt: torch.optim.Optimizer) -> dict[str, int]:
    """Local bytes of parameters, gradients and optimizer state (DTensors: their local shard)."""
    out = {"params": 0, "grads": 0, "optimizer": 0}
    for p in params:
        out["params"] += _nbytes(p)
        if p.grad is not None:
            out["grads"] += _nbytes(p.grad)
    for st in opt.state.values():
        for v in st.values():
            if torch.is_tensor(v):
                out["optimizer"] += _nbytes(v)
    return out


def _step_peak(run) -> int:
    """The most bytes the c10 CPU allocator held during ``run()`` above what it held when ``run``
    began: the profiler's "Total Allocated" of its memory events, in time order, less its value
    before the first (the counter is only updated while a profiler runs, so it carries what earlier
    profiled runs allocated and others freed)."""
    import tempfile

    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        run()
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        with open(f.name) as g:
            events = json.load(g)["traceEvents"]
    mem = sorted((e for e in events if e.get("name") == "[memory]"), key=lambda e: e["ts"])
    if not mem:
        return 0
    base = mem[0]["args"]["Total Allocated"] - mem[0]["args"]["Bytes"]
    return max(0, max(e["args"]["Total Allocated"] for e in mem) - base)


def measure_layout(
    rank: int,
    world: int,
    spec: dict,
    m: dict,
    steps: int,
    warmup: int,
    partition: dict | None,
    peak: bool,
) -> dict:
    import gc

    import torch.distributed as dist

    import parallel
    from parallel.partition import Partition

    dp = spec["dp_replicate"] * spec["dp_shard"]
    mb = spec.get("microbatches", 1) if spec["pp"] > 1 else 1
    inputs, target = make_batch(m, m["global_batch"] // dp, seed=1)
    loss_fn, weight_fn = loss_fns(m)
    model = build_model(m)
    cfg = parallel.ParallelConfig(
        pp=spec["pp"],
        tp=spec["tp"],
        dp_replicate=spec["dp_replicate"],
        dp_shard=spec["dp_shard"],
        microbatches=mb,
        schedule="1f1b",
    )
    t0 = time.perf_counter()
    pm = parallel.parallelize(
        model,
        cfg,
        inputs,
        timeout_s=90,
        partition=Partition.from_dict(partition) if partition else None,
    )
    setup_s = time.perf_counter() - t0
    params = list(pm.parameters())
    opt = torch.optim.AdamW(params, lr=1e-4, foreach=False)
    fb, op, state = [], [], {}
    for i in range(warmup + steps):
        dist.barrier()
        t0 = time.perf_counter()
        pm.train_step(inputs, target=target, loss_fn=loss_fn, weight_fn=weight_fn)
        t1 = time.perf_counter()
        opt.step()
        t2 = time.perf_counter()
        if i >= warmup:
            fb.append(t1 - t0)
            op.append(t2 - t1)
        if i == warmup + steps - 1:
            state = state_bytes(params, opt)  # after the optimizer step, gradients still there
        opt.zero_grad(set_to_none=True)
    out = dict(
        pp_rank=pm.pp_rank,
        setup_s=setup_s,
        train_step_s=fb,
        optimizer_s=op,
        state=state,
        stages=list(pm.local_stages) if pm.partition is not None else [0],
    )
    if pm.partition is not None and rank == 0:
        out["partition"] = pm.partition.table()
    if peak:
        gc.collect()
        resident = state_bytes(params, opt)  # gradients are None now
        dist.barrier()
        extra = _step_peak(
            functools.partial(
                pm.train_step, inputs, target=target, loss_fn=loss_fn, weight_fn=weight_fn
            )
        )
        out["peak"] = dict(
            resident=resident["params"] + resident["optimizer"],
            step_extra=extra,
            total=resident["params"] + resident["optimizer"] + extra,
        )
        opt.zero_grad(set_to_none=True)
    del pm, opt, params, model
    gc.collect()
    dist.barrier()
    return out


def rank_main(
    rank: int, world: int, jobs: list, m: dict, steps: int, warmup: int, peak: bool, rounds: int = 1
) -> dict:
    """Every layout in turn, ``rounds`` times (in reverse order every other round, so that a shared
    host's slow drift falls on every layout alike; the step times of all rounds are pooled, peak
    memory is profiled in the first), in this one process group (spawning and importing once). A
    layout that raises on any rank is reported as ``{"error": ...}`` by every rank, and the next
    one runs."""
    import gc
    import traceback

    import torch.distributed as dist

    torch.set_num_threads(1)
    res = {}
    for rnd in range(rounds):
        for name, spec, part in jobs if rnd % 2 == 0 else jobs[::-1]:
            if "error" in res.get(name, {}):
                continue
            t0 = time.perf_counter()
            try:
                out = measure_layout(rank, world, spec, m, steps, warmup, part, peak and rnd == 0)
                err = None
            except Exception as e:  # noqa: BLE001 - reported, not raised: the other layouts still run
                out, err = None, f"{type(e).__name__}: {e}".strip()[:800]
                tb = traceback.format_exc()
                gc.collect()
            errors = [None] * world
            # the default group: a failed layout's sub-groups are not used
            dist.all_gather_object(errors, err)
            if any(errors):
                # the cause, not a peer's timeout waiting on it, where one rank says more than
                # "timed out"
                first = next((e for e in errors if e and "timed out" not in e), None) or next(
                    e for e in errors if e
                )
                res[name] = {
                    "error": first,
                    "errors": errors,
                    "failed_ranks": [r for r, e in enumerate(errors) if e],
                }
                if err:
                    log(f"{m['kind']} {name} failed on rank {rank}:\n{tb[-3000:]}")
            elif name in res:  # a later round: its step times join the first's
                res[name]["train_step_s"] += out["train_step_s"]
                res[name]["optimizer_s"] += out["optimizer_s"]
            else:
                res[name] = out
            if rank == 0:
                log(
                    f"{m['kind']}: measured {name} (round {rnd + 1}/{rounds}) in "
                    f"{time.perf_counter() - t0:.1f} s" + (" (failed)" if any(errors) else "")
                )
    return res


def measure_all(
    world: int, jobs: list, m: dict, steps: int, warmup: int, peak: bool, rounds: int = 1
) -> list[dict]:
    """The layouts in one group of ranks; if that group dies (a crash, a hang past the timeout),
    each layout again in a group of its own, so that one bad layout costs only itself."""
    from tests.distributed import run_ranks

    try:
        return run_ranks(
            rank_main, world, jobs, m, steps, warmup, peak, rounds, timeout_s=900 * rounds
        )
    except AssertionError as e:
        log(
            f"{m['kind']}: the group of ranks failed ({str(e)[-400:]}); retrying one layout per "
            "group"
        )
    res = [{} for _ in range(world)]
    for job in jobs:
        try:
            per = run_ranks(
                rank_main, world, [job], m, steps, warmup, peak, rounds, timeout_s=600 * rounds
            )
        except AssertionError as e:
            per = [{job[0]: {"error": str(e)[-800:], "failed_ranks": None}} for _ in range(world)]
        for r in range(world):
            res[r].update(per[r])
    return res


# ----------------------------------------------------------------------------- predicted side


def planner_partition(plan, k: int) -> dict | None:
    """The stage split ``Planner.stages(k)`` balances on (the same call), as a Partition dict the
    runtime can take; None where the planner uses the layer-list split instead."""
    from parallel.cost import CostConfig
    from parallel.partition import partition_trace

    pl, c = plan.planner, plan.cluster
    if pl.partition != "search":
        return None
    cfg = CostConfig(
        schedule="interleaved",
        microbatches=1,
        stages_per_rank=1,
        flops_per_s=c.flops_per_s("bf16"),
        bandwidth=c.inter_bandwidth / c.devices_per_node,
    )
    part = partition_trace(pl.flops_trace, k, "speed", cost_config=cfg)
    mine = [float(s.param_bytes) for s in part.stages]
    theirs = pl.stages(k)
    if isinstance(theirs, str) or [round(x) for x in mine] != [
        round(s.param_bytes) for s in theirs
    ]:
        raise RuntimeError(f"the reproduced {k}-stage split differs from the planner's ({mine})")
    return part.to_dict()


def model_step(m: dict, model, batch: int) -> None:
    """One forward + backward of ``model`` on ``batch`` samples (gradients cleared after)."""
    inputs, target = make_batch(m, batch)
    loss_fn, _ = loss_fns(m)
    loss_fn(model(**inputs), target).backward()
    model.zero_grad(set_to_none=True)


def achieved_flops(m: dict, flops_per_sample: float, batch: int, reps: int = 3) -> dict:
    """Forward + backward of the whole model on ``batch`` sequences in this process (one thread):
    the model's FLOPs (the planner's count) / the median time."""
    model = build_model(m)
    inputs, target = make_batch(m, batch)
    loss_fn, _ = loss_fns(m)
    times = []
    for _ in range(reps + 1):
        t0 = time.perf_counter()
        loss_fn(model(**inputs), target).backward()
        times.append(time.perf_counter() - t0)
        model.zero_grad(set_to_none=True)
    t = statistics.median(times[1:])
    return {"batch": batch, "fwd_bwd_s": t, "flops_per_s": flops_per_sample * batch / t}


# ----------------------------------------------------------------------------- comparison


def _ranks(xs: list[float]) -> list[float]:
    order = sorted(range(len(xs)), key=lambda i: xs[i])
    r = [0.0] * len(xs)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and xs[order[j + 1]] == xs[order[i]]:
            j += 1
        for k in range(i, j + 1):
            r[order[k]] = (i + j) / 2 + 1
        i = j + 1
    return r


def spearman(a: list[float], b: list[float]) -> float | None:
    if len(a) < 2:
        return None
    ra, rb = _ranks(a), _ranks(b)
    ma, mb = statistics.fmean(ra), statistics.fmean(rb)
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb))
    den = (sum((x - ma) ** 2 for x in ra) * sum((y - mb) ** 2 for y in rb)) ** 0.5
    return cov / den if den else None


def pairs(names: list[str], pred: list[float], meas: list[float]) -> dict:
    agree, disagree = [], []
    for i in range(len(names)):
        for j in range(i + 1, len(names)):
            same = (pred[i] - pred[j]) * (meas[i] - meas[j]) > 0
            (agree if same else disagree).append(f"{names[i]} vs {names[j]}")
    return {"agree": len(agree), "total": len(agree) + len(disagree), "disagreeing": disagree}


def _ratio(a: float, b: float) -> float | None:
    return round(a / b, 3) if b else None


def _mb(x: float) -> float:
    return round(x / 2**20, 3)


def machine() -> dict:
    model = ""
    try:
        with open("/proc/cpuinfo") as f:
            model = next(
                (ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), ""
            )
    except OSError:
        pass
    import transformers

    return {
        "platform": platform.platform(),
        "cpu": model or platform.processor(),
        "cpu_count": os.cpu_count(),
        "cores_allowed": len(os.sched_getaffinity(0)),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
    }


def first_choice(ok: list[str], p_t: list[float], m_t: list[float]) -> dict | None:
    """The planner's fastest predicted layout among the measured ones, against the fastest
    measured."""
    if not ok:
        return None
    i = min(range(len(ok)), key=lambda j: p_t[j])
    f = min(range(len(ok)), key=lambda j: m_t[j])
    return {
        "layout": ok[i],
        "predicted_s": p_t[i],
        "measured_s": m_t[i],
        "fastest_measured_layout": ok[f],
        "fastest_measured_s": m_t[f],
        "measured_over_fastest": _ratio(m_t[i], m_t[f]),
        "within_10pct": m_t[i] <= 1.1 * m_t[f],
    }


def model_dims(kind: str, a: argparse.Namespace) -> dict:
    m = dict(
        kind=kind,
        layers=a.layers,
        heads=4,
        vocab=a.vocab,
        seq=a.seq,
        global_batch=a.global_batch,
        dim=a.dim,
    )
    if kind == "reader":
        m.update(
            dim=a.reader_dim,
            vision_width=a.reader_dim,
            vision_layers=2,
            docs=a.reader_docs,
            doc_tokens=24,
            q_tokens=12,
            a_tokens=6,
        )
        m.pop("seq")
    return m


def run_model(kind: str, a: argparse.Namespace, cluster, specs: dict) -> dict:
    from parallel.cluster import measure_model
    from parallel.planner import plan_layout
    from parallel.trace import trace_model

    names = list(specs)
    m = model_dims(kind, a)
    model = build_model(m)
    numel = sum(p.numel() for p in model.parameters())
    trace_batch = 2
    example, _ = make_batch(m, trace_batch)
    t0 = time.perf_counter()
    trace = trace_model(model, example, passes=1)
    flops_per_sample = trace.modules[""].flops / trace_batch
    overhead_s = 0.0
    if (
        a.efficiency == "model"
    ):  # the model's own rate and per-call overhead, one process, one thread
        rate, overhead_s = measure_model(
            functools.partial(model_step, m, model),
            flops_per_sample,
            batches=sorted({1, 2, a.global_batch // a.world, 2 * a.global_batch // a.world}),
        )
        cluster = cluster.with_model_rate(rate)
        log(
            f"{kind}: measured {rate / 1e9:.2f} GFLOP/s ({cluster.compute_efficiency:.2f} of the "
            f"matmul rate), {overhead_s * 1e3:.1f} ms fixed per forward + backward"
        )
    # tp must divide the attention heads (the reader's ViT has vision_width / 32 heads: 4 here)
    tp_div = m["heads"] if kind == "reader" else None
    plan = plan_layout(
        model,
        example,
        cluster,
        global_batch=a.global_batch,
        schedules=("1f1b",),
        precisions=("fp32",),
        checkpointing=(False,),
        offload=(False,),
        tp_divisor=tp_div,
        overhead_s=overhead_s,
        trace=trace,
    )
    plan_s = time.perf_counter() - t0
    del model
    stats = plan.planner.stats
    log(f"{kind}: {numel / 1e6:.2f} M parameters, planned in {plan_s:.1f} s")
    preds, parts, skipped = {}, {}, {}
    for n, s in specs.items():
        lay = plan.estimate(precision="fp32", schedule="1f1b", **s)
        preds[n] = lay
        if s["pp"] > 1 and a.partition == "planner":
            try:
                parts[n] = planner_partition(plan, s["pp"])
            except Exception as e:  # noqa: BLE001 - the layout is then skipped, with the reason
                skipped[n] = {
                    "reason": f"planner partition: {type(e).__name__}: {e}",
                    "predicted_step_time_s": lay.step_time_s,
                }
        log(
            f"{kind}: predicted {n}: {lay.key}, fits={lay.fits}, "
            f"{_mb(lay.memory_bytes_per_device)} MiB, {lay.step_time_s * 1e3:.1f} ms"
            + ("" if lay.fits else f" ({'; '.join(lay.reasons)})")
        )
    stage_flops = {}
    for s in specs.values():
        if s["pp"] > 1 and not isinstance(ps := plan.planner.stages(s["pp"]), str):
            stage_flops[f"pp{s['pp']}"] = round(sum(p.flops for p in ps) / stats.flops, 3)
    diag = achieved_flops(m, flops_per_sample, a.global_batch // a.world)

    # --- measured
    run_names = [n for n in names if n not in skipped]
    log(
        f"{kind}: measuring {len(run_names)} layouts on {a.world} gloo ranks ({a.warmup} + "
        f"{a.steps} steps each)"
    )
    jobs = [(n, specs[n], parts.get(n)) for n in run_names]
    t0 = time.perf_counter()
    res = (
        measure_all(a.world, jobs, m, a.steps, a.warmup, not a.no_peak, a.rounds)
        if jobs
        else [{} for _ in range(a.world)]
    )
    measure_s = time.perf_counter() - t0

    # --- compare
    out_layouts = {}
    for n in run_names:
        lay, ranks = preds[n], [r[n] for r in res]
        if any("error" in r for r in ranks):
            err = next(r for r in ranks if "error" in r)
            skipped[n] = {
                "reason": err["error"],
                "failed_ranks": err["failed_ranks"],
                "errors_by_rank": err.get("errors"),
                "predicted_step_time_s": lay.step_time_s,
            }
            log(f"{kind}: {n} skipped: {err['error'][:300]}")
            continue
        timed = len(ranks[0]["train_step_s"])  # steps x rounds
        # the slowest rank
        steps_fb = [max(r["train_step_s"][i] for r in ranks) for i in range(timed)]
        steps_op = [max(r["optimizer_s"][i] for r in ranks) for i in range(timed)]
        t_fb, t_op = statistics.median(steps_fb), statistics.median(steps_op)
        full = max(ranks, key=lambda r: sum(r["state"].values()))
        st = full["state"]
        state = sum(st.values())
        # the training state of the rank holding the most (under a pipeline not always the fullest)
        pm = max(lay.memory_kinds_by_rank, key=lambda k: k["params"] + k["grads"] + k["optimizer"])
        p_state = pm["params"] + pm["grads"] + pm["optimizer"]
        entry = {
            "layout": specs[n],
            "planner_key": lay.key,
            "fits": lay.fits,
            "microbatch_size": lay.microbatch_size,
            "predicted": {
                "state_bytes": p_state,
                "peak_bytes": lay.memory_bytes_per_device,
                "peak_bytes_by_pp_rank": lay.memory_by_rank,
                "memory_bytes": dict(lay.memory),
                "memory_bytes_of_the_fullest_state": dict(pm),
                "step_time_s": lay.step_time_s,
                "breakdown_s": lay.breakdown,
                "reasons": lay.reasons,
            },
            "measured": {
                "state_bytes": state,
                "state_bytes_by_kind": st,
                "state_bytes_per_rank": [sum(r["state"].values()) for r in ranks],
                "pp_rank": [r["pp_rank"] for r in ranks],
                "train_step_s": t_fb,
                "train_step_s_all": [round(x, 4) for x in steps_fb],
                "optimizer_step_s": t_op,
                "setup_s": max(r["setup_s"] for r in ranks),
            },
            "ratio_measured_over_predicted": {
                "state": _ratio(state, p_state),
                "params": _ratio(st["params"], pm.get("params", 0.0)),
                "grads": _ratio(st["grads"], pm.get("grads", 0.0)),
                "optimizer": _ratio(st["optimizer"], pm.get("optimizer", 0.0)),
                "step_time": _ratio(t_fb, lay.step_time_s),
            },
            "relative_error_step_time": round(abs(t_fb - lay.step_time_s) / t_fb, 4)
            if t_fb
            else None,
        }
        if not a.no_peak:
            pk = max(ranks, key=lambda r: r["peak"]["total"])["peak"]
            entry["measured"]["peak_bytes"] = pk["total"]
            entry["measured"]["peak_detail"] = {
                **pk,
                "per_rank": [r["peak"]["total"] for r in ranks],
            }
            entry["ratio_measured_over_predicted"]["peak"] = _ratio(
                pk["total"], lay.memory_bytes_per_device
            )
            by_pp = [
                max(r["peak"]["total"] for r in ranks if r["pp_rank"] == q)
                for q in range(specs[n]["pp"])
            ]
            entry["measured"]["peak_bytes_by_pp_rank"] = by_pp
            entry["ratio_measured_over_predicted"]["peak_by_pp_rank"] = [
                _ratio(b, p) for b, p in zip(by_pp, lay.memory_by_rank)
            ]
        notes = []
        if specs[n]["pp"] > 1 and specs[n]["dp_shard"] > 1:
            notes.append(
                "predicted grads are the unsharded gradients a pipeline stage accumulates during "
                "the step (its peak); measured after the step, when FSDP has reduce-scattered "
                "them to a shard"
            )
        if specs[n]["pp"] > 1:
            notes.append(
                "peak: the fullest pipeline rank's, predicted and measured (by_pp_rank: each "
                "rank's)"
            )
        if notes:
            entry["notes"] = notes
        part_table = next((r.get("partition") for r in ranks if r.get("partition")), None)
        if part_table:
            entry["measured"]["partition"] = part_table.splitlines()
        out_layouts[n] = entry
        r = entry["ratio_measured_over_predicted"]
        log(
            f"{kind}: {n}: state {_mb(state)} / {_mb(p_state)} MiB (x{r['state']}), "
            f"step {t_fb * 1e3:.1f} / {lay.step_time_s * 1e3:.1f} ms (x{r['step_time']})"
            + (f", peak x{r['peak']}" if "peak" in r else "")
        )

    ok = [n for n in names if n in out_layouts and preds[n].fits]
    p_t = [preds[n].step_time_s for n in ok]
    m_t = [out_layouts[n]["measured"]["train_step_s"] for n in ok]
    rel = [out_layouts[n]["relative_error_step_time"] for n in ok]
    rho = spearman(p_t, m_t)
    return {
        "model": model_info(m, numel, a, flops_per_sample),
        "compute_model": {
            "efficiency": a.efficiency,
            "compute_efficiency": round(cluster.compute_efficiency, 4),
            "overhead_s_per_fwd_bwd": round(overhead_s, 5),
        },
        "median_relative_error": round(statistics.median(rel), 4) if rel else None,
        "spearman_rho": round(rho, 4) if rho is not None else None,
        "first_choice": first_choice(ok, p_t, m_t),
        "measured_layouts": len(out_layouts),
        "skipped": skipped,
        "diagnostics": {
            "model_fwd_bwd_one_process": diag,
            "model_flops_rate_over_calibrated_matmul": round(
                diag["flops_per_s"] / cluster.peak_flops["fp32"], 3
            ),
            "oversubscription_ranks_per_core": round(a.world / len(os.sched_getaffinity(0)), 2),
            "pipeline_stage_flops_sum_over_model_flops": stage_flops,
            "plan_s": round(plan_s, 2),
            "measure_s": round(measure_s, 1),
        },
        "layouts": out_layouts,
        "ranking_by_step_time": {
            "layouts": ok,
            "predicted_order": [n for _, n in sorted(zip(p_t, ok))],
            "measured_order": [n for _, n in sorted(zip(m_t, ok))],
            "spearman_rho": rho,
            "pairwise": pairs(ok, p_t, m_t),
        },
    }


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", default="llama", help=f"comma-separated, of {', '.join(MODELS)}")
    ap.add_argument(
        "--layouts", default=DEFAULT_LAYOUTS, help=f"comma-separated, of {', '.join(LAYOUTS)}"
    )
    ap.add_argument("--steps", type=int, default=5, help="timed steps per layout (after --warmup)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="measure every layout this many times, alternating the order; step times pooled",
    )
    ap.add_argument(
        "--world",
        type=int,
        default=4,
        help="gloo ranks (every layout's degrees must multiply to it)",
    )
    ap.add_argument("--dim", type=int, default=256, help="llama / gpt2 width")
    ap.add_argument("--reader-dim", type=int, default=128, help="reader width (text and vision)")
    ap.add_argument("--reader-docs", type=int, default=2, help="reader documents per query")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=2048)
    ap.add_argument("--seq", type=int, default=64, help="llama / gpt2 tokens per sequence")
    ap.add_argument(
        "--global-batch", type=int, default=16, help="samples per optimizer step, all ranks"
    )
    ap.add_argument(
        "--microbatches", type=int, default=4, help="pipeline microbatches (pp > 1 layouts)"
    )
    ap.add_argument(
        "--partition",
        choices=("planner", "auto"),
        default="planner",
        help="pipeline stages: the planner's split, or the runtime's own (traced and timed)",
    )
    ap.add_argument(
        "--no-peak", action="store_true", help="skip the profiled step that measures peak memory"
    )
    ap.add_argument(
        "--efficiency",
        choices=("model", "matmul"),
        default="model",
        help="compute rate: the model's own, with its fixed per-call overhead (fitted on its step "
        "time at batch 1, 2, the per-rank batch and twice it), or the calibrated matmul rate",
    )
    ap.add_argument("--json", default="", help="also write the JSON here")
    a = ap.parse_args()

    from parallel.cluster import Cluster, calibrate

    torch.set_num_threads(1)
    t_start = time.perf_counter()
    kinds = [k for k in a.model.split(",") if k]
    if not kinds or any(k not in MODELS for k in kinds):
        ap.error(f"--model: {a.model!r}; known: {', '.join(MODELS)}")
    names = [n for n in a.layouts.split(",") if n]
    bad = [n for n in names if n not in LAYOUTS]
    if bad:
        ap.error(f"unknown layouts {bad}; known: {sorted(LAYOUTS)}")
    specs = {}
    for n in names:
        s = dict(LAYOUTS[n])
        if s["pp"] * s["tp"] * s["dp_replicate"] * s["dp_shard"] != a.world:
            ap.error(f"layout {n} ({s}) does not use {a.world} ranks")
        if s["pp"] > 1:
            s["microbatches"] = a.microbatches
        specs[n] = s
    load0 = os.getloadavg()

    log(f"calibrating the local cluster on {a.world} ranks")
    t0 = time.perf_counter()
    cluster = calibrate(Cluster.preset("local", devices_per_node=a.world), ranks=a.world)
    calib_s = time.perf_counter() - t0

    models = {}
    for kind in kinds:
        t0 = time.perf_counter()
        models[kind] = run_model(kind, a, cluster, specs)
        models[kind]["total_s"] = round(time.perf_counter() - t0, 1)
        sec = models[kind]
        log(
            f"{kind}: median relative error {sec['median_relative_error']}, spearman "
            f"{sec['spearman_rho']}, first choice {sec['first_choice']}"
        )

    result = {
        "benchmark": "plan_accuracy",
        "world": a.world,
        "steps": a.steps,
        "warmup": a.warmup,
        "rounds": a.rounds,
        "partition": a.partition,
        "layouts": names,
        "cluster": {
            "name": cluster.name,
            "devices_per_node": cluster.devices_per_node,
            "fp32_flops_per_s": cluster.peak_flops["fp32"],
            "bf16_flops_per_s": cluster.peak_flops["bf16"],
            "link_bandwidth_Bps": cluster.intra_bandwidth,
            "link_latency_s": cluster.intra_latency_s,
            "fsdp_unit_s": cluster.fsdp_unit_s,
            "tp_call_s": cluster.tp_call_s,
            "calibrate_s": round(calib_s, 1),
        },
        "models": models,
        "machine": {**machine(), "loadavg_before": load0, "loadavg_after": os.getloadavg()},
        "total_s": round(time.perf_counter() - t_start, 1),
    }
    text = strict_dumps(result, indent=1)
    print(text)
    if a.json:
        with open(a.json, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
