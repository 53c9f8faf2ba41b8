"""The steps of ``scripts/gpu_verify.py`` (run in its worker process): each takes a ``Ctx`` and
returns a JSON-able dict. See gpu_verify.py for what each measures and the fields it reports.
"""

from __future__ import annotations

import importlib.metadata
import math
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import stepbench as sb  # noqa: E402

# The 1B reader as the H100 run measured it, and its dry-run stand-in (same code, tiny shapes).
# (the preset's 128,256-row vocabulary kept, as that run had it: model.trim_vocab=false)
ONE_B = ["model=llama3_2_1b", "retriever.top_k=2", "model.trim_vocab=false"]
TINY = ["model=hf_tiny", "retriever.top_k=2"]
# gpu_verify's step configurations: A = today's bench (full AC, autocast over fp32 weights, auto
# attention, eager); each later one adds one change; E is D at twice the batch.
CONFIGS = {
    "A": dict(ac="full", params="fp32+autocast", attention="auto", compile=False),
    "B": dict(ac="none", params="fp32+autocast", attention="auto", compile=False),
    "C": dict(ac="none", params="bf16", attention="flex", compile=False),
    "D": dict(ac="none", params="bf16", attention="flex", compile=True),
    "E": dict(ac="none", params="bf16", attention="flex", compile=True, batch_scale=2),
}


@dataclass
class Ctx:
    device: torch.device
    dry: bool  # CPU, tiny shapes, compile through aot_eager (no C++ code generation)
    warmup: int
    steps: int
    results: dict  # step name -> its record so far (the profile step reads the configs')
    counts: dict = field(default_factory=dict)  # meta FLOP counts shared by the configs
    peaks: dict | None = None

    @property
    def overrides(self) -> list[str]:
        return TINY if self.dry else ONE_B

    @property
    def batch(self) -> int:
        return 2 if self.dry else 8

    @property
    def compile_backend(self) -> str:
        return "aot_eager" if self.dry else "inductor"

    def device_peaks(self) -> dict:
        if self.peaks is None:
            self.peaks = sb.device_peaks(self.device, "bf16", None if not self.dry else 256)
        return self.peaks


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _release(device) -> None:
    import gc

    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


# ----------------------------------------------------------------------------- probe
def _nvidia_smi() -> dict:
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return {"nvidia_smi": "not found"}
    fields = (
        "name",
        "clocks.sm",
        "clocks.max.sm",
        "clocks.mem",
        "clocks.max.mem",
        "power.draw",
        "power.limit",
        "temperature.gpu",
        "driver_version",
        "persistence_mode",
    )
    try:
        proc = subprocess.run(
            [exe, f"--query-gpu={','.join(fields)}", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=15,
        )
        out = proc.stdout.splitlines()[0]
    except (OSError, subprocess.TimeoutExpired, IndexError) as e:
        return {"nvidia_smi": f"failed: {e}", "stderr": locals().get("proc") and proc.stderr[-300:]}
    return dict(zip(fields, (v.strip() for v in out.split(","))))


def _version(mod: str) -> str | None:
    try:
        return importlib.metadata.version(mod)
    except importlib.metadata.PackageNotFoundError:
        return None


def _gemm_rate(device, m: int, k: int, n: int, reps: int = 10) -> float:
    a = torch.randn(m, k, device=device, dtype=torch.bfloat16)
    b = torch.randn(k, n, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    ms = []
    for _ in range(reps):
        ms.append(_time_ms(device, lambda: a @ b))
    return 2 * m * k * n / (min(ms) / 1e3)


def _time_ms(device, fn) -> float:
    import time

    if device.type == "cuda":
        t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0.record()
        fn()
        t1.record()
        t1.synchronize()
        return t0.elapsed_time(t1)
    t = time.perf_counter()
    fn()
    return (time.perf_counter() - t) * 1e3


def probe(ctx: Ctx) -> dict:
    import inspect

    from parallel.kernels import attention as A
    from parallel.kernels import flex

    d = ctx.device
    out = {
        "device": d.type,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": sys.version.split()[0],
        "versions": {
            m: _version(m) for m in ("triton", "transformers", "open_clip_torch", "faiss-cpu")
        },
    }
    if d.type == "cuda":
        p = torch.cuda.get_device_properties(d)
        out |= {
            "name": p.name,
            "capability": f"{p.major}.{p.minor}",
            "sms": p.multi_processor_count,
            "memory_gib": round(p.total_memory / 2**30, 1),
            "smi": _nvidia_smi(),
        }
    peaks = ctx.device_peaks()
    out |= {
        "part": peaks["part"],
        "datasheet_bf16_tflops": None if peaks["datasheet"] is None else peaks["datasheet"] / 1e12,
        "matmul_bf16_tflops": round(peaks["measured"] / 1e12, 2),
        "matmul_n": peaks["matmul_n"],
    }
    m, k, n = (7032, 2048, 8192) if not ctx.dry else (256, 128, 384)  # the 1B's MLP up-projection
    out["gemm_1b_mlp_tflops"] = round(_gemm_rate(d, m, k, n) / 1e12, 2)
    nbytes = (1 << 30) if not ctx.dry else (1 << 24)
    src = torch.empty(nbytes, dtype=torch.uint8, device=d)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = min(_time_ms(d, lambda: dst.copy_(src)) for _ in range(5))
    out["copy_gbps"] = round(2 * nbytes / (best / 1e3) / 1e9, 1)  # bytes read + written
    fa = flex.available()[0]
    out["features"] = {
        "flex": fa,
        "flex_enable_gqa": fa
        and "enable_gqa" in inspect.signature(flex._flex_attention).parameters,
        "varlen_attn": _has("torch.nn.attention.varlen", "varlen_attn"),
        "fused_extension": A.fused_available()[1],
    }
    return out


def _has(module: str, name: str) -> bool:
    try:
        return hasattr(importlib.import_module(module), name)
    except ImportError:
        return False


# ----------------------------------------------------------------------------- the 1B step
def setup_for(name: str, ctx: Ctx) -> sb.StepSetup:
    c = dict(CONFIGS[name])
    scale = c.pop("batch_scale", 1)
    return sb.StepSetup(
        name=name, batch=ctx.batch * scale, compile_backend=ctx.compile_backend, **c
    )


def step_config(name: str, ctx: Ctx) -> dict:
    setup = setup_for(name, ctx)
    try:
        row = sb.measure(
            ctx.overrides,
            setup,
            ctx.device,
            warmup=ctx.warmup,
            steps=ctx.steps,
            peaks=ctx.device_peaks(),
            counts=ctx.counts,
        )
    except torch.OutOfMemoryError as e:
        mem = torch.cuda.max_memory_allocated() / 2**30 if ctx.device.type == "cuda" else None
        row = {
            "config": name,
            "batch": setup.batch,
            "oom": str(e).splitlines()[0][:300],
            "peak_gib_before_oom": None if mem is None else round(mem, 2),
        }
    finally:
        _release(ctx.device)
    row["model"] = ctx.overrides[0].split("=", 1)[1]
    return row


# ----------------------------------------------------------------------------- attention
def _retrieval_case(ctx: Ctx, gen: torch.Generator):
    """The 1B's layout: 2 documents of up to 296 tokens and a question of up to 287 per row,
    padded to S = 879 (tiny on the dry run). Lengths drawn at random per row."""
    B, Hq, Hkv, D, doc, qry = (8, 32, 8, 64, 296, 287) if not ctx.dry else (2, 4, 2, 16, 24, 20)
    S = 2 * doc + qry
    rows = []
    for _ in range(B):
        d1, d2 = (int(torch.randint(doc // 2, doc + 1, (1,), generator=gen)) for _ in range(2))
        q = int(torch.randint(qry // 2, qry + 1, (1,), generator=gen))
        rows.append([0, d1, d1 + d2, d1 + d2 + q])
    rows[0] = [0, doc, 2 * doc, S]  # one full-length row
    offsets = torch.tensor(rows, dtype=torch.int32, device=ctx.device)
    return B, Hq, Hkv, D, S, offsets


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().float(), b.detach().float()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def attention(ctx: Ctx) -> dict:
    """rag_mm's attention on the retrieval layout at the 1B's shapes, bf16, grouped K/V heads as
    the HF path hands them over: each backend's output and gradients against an fp32
    reference on the same inputs, forward and forward + backward milliseconds (median of 10)."""
    from parallel.kernels import attention as A
    from parallel.kernels import flex
    from parallel.kernels.attention_ref import layout_mask

    d = ctx.device
    gen = torch.Generator().manual_seed(0)
    B, Hq, Hkv, D, S, offsets = _retrieval_case(ctx, gen)
    dt = torch.bfloat16
    mk = lambda h: torch.randn(B, h, S, D, generator=gen).to(d, dt)  # noqa: E731
    q, k, v = mk(Hq), mk(Hkv), mk(Hkv)  # grouped K/V heads: flex reads them, the others repeat them
    rep = Hq // Hkv
    go = torch.randn(B, Hq, S, D, generator=gen).to(d, dt)
    valid = (torch.arange(S, device=d)[None] < offsets[:, -1:])[:, None, :, None]  # (B, 1, S, 1)
    allowed = layout_mask(offsets.long(), S)
    pairs = int(allowed.sum())
    out = {
        "shape": {
            "B": B,
            "Hq": Hq,
            "Hkv": Hkv,
            "D": D,
            "S": S,
            "dtype": "bfloat16",
            "offsets_row0": offsets[0].tolist(),
            "allowed_pairs": pairs,
            "dense_pairs": B * S * S,
        }
    }
    # useful FLOPs: QK^T and PV over the allowed pairs (4 D per pair per head); backward 2.5x
    useful = 4 * D * Hq * pairs

    def ref_grads():
        qr, kr, vr = (t.float().requires_grad_() for t in (q, k, v))
        o = A.reference_attention(
            qr, kr.repeat_interleave(rep, 1), vr.repeat_interleave(rep, 1), seg_offsets=offsets
        )
        o.backward(go.float())
        return o.detach(), qr.grad, kr.grad, vr.grad

    ref = ref_grads()
    names = ["sdpa", "flex", "fused"]
    backends = {}
    ok_fused, why_fused = A.fused_available()
    for name in names:
        if name == "fused" and not ok_fused:
            backends[name] = {"not_run": f"{why_fused} (gpu_verify.py --build builds it)"}
            continue
        if name == "flex" and not flex.available()[0]:
            backends[name] = {"not_run": flex.available()[1]}
            continue
        try:
            backends[name] = _bench_backend(name, q, k, v, go, offsets, ref, valid, useful, d)
        except Exception as e:  # one backend failing must not hide the others
            backends[name] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"}
    out["backends"] = backends
    if "fwdbwd_ms" in backends.get("sdpa", {}) and "fwdbwd_ms" in backends.get("flex", {}):
        out["flex_over_sdpa_fwdbwd"] = round(
            backends["flex"]["fwdbwd_ms"] / backends["sdpa"]["fwdbwd_ms"], 3
        )
    # the same two inside torch.compile, as the compiled blocks run them (flex has no CPU
    # backward: its CPU path is a hand-written autograd.Function, so the CPU traces SDPA only)
    traced = {}
    for name in ("sdpa", "flex") if d.type == "cuda" else ("sdpa",):
        if "fwdbwd_ms" not in backends.get(name, {}):  # not run, or failed eager
            continue
        try:
            traced[name] = _bench_backend(
                name, q, k, v, go, offsets, ref, valid, useful, d, compiled=True
            )
        except Exception as e:  # one backend failing must not hide the others
            traced[name] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"}
    out["compiled"] = traced
    if all("fwdbwd_ms" in traced.get(n, {}) for n in ("sdpa", "flex")):
        out["compiled_flex_over_sdpa_fwdbwd"] = round(
            traced["flex"]["fwdbwd_ms"] / traced["sdpa"]["fwdbwd_ms"], 3
        )
    if flex.available()[0]:
        bm = flex.block_mask_for(seq_len=S, device=d, seg_offsets=offsets)
        partial = int(bm.kv_num_blocks.sum())
        full = 0 if bm.full_kv_num_blocks is None else int(bm.full_kv_num_blocks.sum())
        nq = math.ceil(S / bm.BLOCK_SIZE[0])
        nk = math.ceil(S / bm.BLOCK_SIZE[1])
        out["block_mask"] = {
            "block": list(bm.BLOCK_SIZE),
            "computed": partial + full,
            "full": full,
            "partial": partial,
            "total": B * nq * nk,
        }
    out["mixed_dtype"] = _mixed_dtype(q, k, v, offsets, ref[0], ok_fused)
    return out


def _bench_backend(name, q, k, v, go, offsets, ref, valid, useful, d, compiled=False) -> dict:
    """One backend: errors against the reference, milliseconds (median of 10) and the host's
    microseconds to issue one forward (20 back to back, no sync: above the device's time, the
    call is bound by its Python). ``compiled``: the call traced by ``torch.compile`` (fullgraph),
    as it runs inside the runtime's compiled blocks, dispatch and mask building in the graph."""
    from parallel.kernels import attention as A

    def call(q_, k_, v_):
        return A.attention(q_, k_, v_, seg_offsets=offsets, backend=name)

    if compiled:
        call = torch.compile(call, fullgraph=True)
    qg, kg, vg = (t.detach().clone().requires_grad_() for t in (q, k, v))
    o = call(qg, kg, vg)
    o.backward(go)
    errs = {
        "out": _rel(o * valid, ref[0] * valid),
        "dq": _rel(qg.grad, ref[1]),
        "dk": _rel(kg.grad, ref[2]),
        "dv": _rel(vg.grad, ref[3]),
    }
    pad_zero = bool((o * ~valid).abs().max() == 0)

    def fwd():
        with torch.no_grad():
            call(q, k, v)

    def fwdbwd():
        call(qg, kg, vg).backward(go)

    for fn in (fwd, fwdbwd):
        fn()
    f_ms = sorted(_time_ms(d, fwd) for _ in range(10))[5]
    fb_ms = sorted(_time_ms(d, fwdbwd) for _ in range(10))[5]
    _sync(d)
    t0 = time.perf_counter()
    for _ in range(20):
        fwd()
    host_us = (time.perf_counter() - t0) / 20 * 1e6
    _sync(d)
    return {
        "max_rel_err": round(max(errs.values()), 5),
        "rel_err": {n: round(e, 5) for n, e in errs.items()},
        "padding_rows_zero": pad_zero,
        "fwd_ms": round(f_ms, 3),
        "fwdbwd_ms": round(fb_ms, 3),
        "fwd_host_us": round(host_us, 1),
        "fwd_useful_tflops": round(useful / (f_ms / 1e3) / 1e12, 2),
        "fwdbwd_useful_tflops": round(3.5 * useful / (fb_ms / 1e3) / 1e12, 2),
    }


def _mixed_dtype(q, k, v, offsets, ref_out, ok_fused: bool) -> dict:
    """q in fp32, k and v in bf16 (what RoPE under autocast hands attention today): each backend
    must equal the bf16 result's accuracy or raise, never read the buffers as another dtype."""
    from parallel.kernels import attention as A
    from parallel.kernels import flex

    res = {}
    for name in ("sdpa", "flex", "fused"):
        if name == "fused" and not ok_fused:
            res[name] = "not run (extension not built)"
            continue
        try:
            with torch.no_grad():
                if name == "flex":  # eager: a failed compile here would turn compiled flex off
                    o = flex.flex_attention(q.float(), k, v, seg_offsets=offsets, compiled=False)
                else:
                    o = A.attention(q.float(), k, v, seg_offsets=offsets, backend=name)
            res[name] = f"ran, rel err {_rel(o, ref_out):.3g}"
        except Exception as e:
            res[name] = f"raised {type(e).__name__}: {str(e).splitlines()[0][:160]}"
    return res


# ----------------------------------------------------------------------------- demo reader
def demo(ctx: Ctx) -> dict:
    """The demo reader (``+experiment=demo``, batch 32, bf16 autocast) eager, each block
    compiled, the whole reader compiled as one graph, and that graph replayed as CUDA graphs
    (a GPU only: Inductor's). Rows are appended as they finish."""
    batch = 32 if not ctx.dry else 4
    rows = []
    ctx.results.setdefault("demo", {})["result"] = {"rows": rows}
    runs = [
        ("eager", False, "blocks", "default"),
        ("compiled_blocks", True, "blocks", "default"),
        ("compiled_model", True, "model", "default"),
    ]
    if ctx.device.type == "cuda" and ctx.compile_backend == "inductor":
        runs.append(("compiled_model_cuda_graphs", True, "model", "reduce-overhead"))
    for name, comp, scope, mode in runs:
        setup = sb.StepSetup(
            name=name,
            batch=batch,
            ac="none",
            params="fp32+autocast",
            attention="auto",
            compile=comp,
            compile_backend=ctx.compile_backend,
            compile_scope=scope,
            compile_mode=mode,
        )
        rows.append(
            sb.measure(
                [],
                setup,
                ctx.device,
                warmup=ctx.warmup,
                steps=max(ctx.steps, 10 if not ctx.dry else 1),
                peaks=ctx.device_peaks(),
                counts=ctx.counts,
                evaluate=True,
            )
        )
        _release(ctx.device)
    # each compiled row's step time against eager's, and whether its losses are eager's (the
    # training steps' and the evaluation forward's after them)
    eager = rows[0]
    return {
        "rows": rows,
        "speedup_over_eager": {
            r["config"]: round(eager["step_ms"] / r["step_ms"], 3) for r in rows[1:]
        },
        "losses_match_eager": {
            r["config"]: _close(r["loss"] + [r["eval_loss"]], eager["loss"] + [eager["eval_loss"]])
            for r in rows[1:]
        },
    }


def _close(a: list[float], b: list[float], tol: float = 2e-2) -> bool:
    """The same loss curve to bf16 autocast's precision (relative ``tol`` at every step)."""
    return len(a) == len(b) and all(abs(x - y) <= tol * max(abs(y), 1e-6) for x, y in zip(a, b))


# ----------------------------------------------------------------------------- profile
def profile(ctx: Ctx) -> dict:
    """Two steps of the fastest configuration measured so far (samples/s), after one warm-up."""
    from step_profile import profile_steps

    done = [r.get("result") or {} for n, r in ctx.results.items() if n.startswith("step_")]
    ok = [(r["samples_per_s"], r["config"]) for r in done if "samples_per_s" in r]
    # the dry run profiles B: the plumbing, without compiling again on a CPU
    name = max(ok)[1] if ok and not ctx.dry else "B"
    setup = setup_for(name, ctx)
    try:
        _, _, _, step = sb.prepare(ctx.overrides, setup, ctx.device)
        step()
        out = {"config": name, "batch": setup.batch, **profile_steps(step, ctx.device, 2)}
    finally:
        _release(ctx.device)
    return out


def search(ctx: Ctx) -> dict:
    """The memory search of a learned-retriever step, at the flat limit: exact search on the device
    (``retriever.exact.TorchFlatIndex``, one matmul and a top-k; ``retriever.search=device``)
    against faiss's Flat index on the host (the query embeddings copied there and the ids back,
    ``retriever.search=faiss``), B queries, top 4; best of 20 each, and whether they agree."""
    import torch.nn.functional as F

    from retriever.exact import TorchFlatIndex
    from retriever.index import build_index
    from retriever.index_choice import FLAT_MAX_DOCS

    n, dim, B, k = (4096, 64, 8, 4) if ctx.dry else (FLAT_MAX_DOCS, 256, 32, 4)
    g = torch.Generator().manual_seed(0)
    x = F.normalize(torch.randn(n, dim, generator=g), dim=-1)  # (N, E) the memory
    q = F.normalize(torch.randn(B, dim, generator=g), dim=-1).to(ctx.device)  # (B, E)
    on_device = TorchFlatIndex(x, device=ctx.device)
    on_host = build_index(x.numpy(), factory="Flat")

    def via_host():
        _, ids = on_host.search(q.cpu().numpy(), k)
        return torch.from_numpy(ids).to(ctx.device)

    rows = {}
    for name, fn in (("device", lambda: on_device.search(q, k)[1]), ("faiss_host", via_host)):
        for _ in range(3):
            fn()
        rows[name] = min(_time_ms(ctx.device, fn) for _ in range(20))
    agree = bool(torch.equal(on_device.search(q, k)[1].cpu(), via_host().cpu()))
    _release(ctx.device)
    return {
        "docs": n,
        "dim": dim,
        "queries": B,
        "k": k,
        "device_ms": rows["device"],
        "faiss_host_ms": rows["faiss_host"],
        "faiss_over_device": rows["faiss_host"] / max(rows["device"], 1e-9),
        "same_ids": agree,
    }


def learned(ctx: Ctx) -> dict:
    """The demo's training step with its learned retriever and the device search
    (``retriever.search=device``), through the trainer's step path (``SpreadRag.train_step``, the
    clipper, AdamW): the query encoding, the search, the reader over 4 documents, pdist over each
    document alone, the contrastive terms with pseudo-queries and bank negatives. A memory of
    random documents, batch 32 (4 on the dry run), bf16 autocast; the warm-up's step and the
    joint step, each timed over ``steps`` and profiled over 2 for host syncs inside the step."""
    from step_profile import profile_steps

    from rag_mm.components.optim import build_optimizer
    from rag_mm.config import compose
    from rag_mm.data.documents import DocumentStore
    from rag_mm.distributed.spread import SpreadRag
    from rag_mm.model.rag import RagModel
    from retriever.encoders import DualEncoder
    from retriever.memory import RetrievalMemory

    B, N = (32, 1024) if not ctx.dry else (4, 64)
    cfg = compose(["+experiment=demo", "retriever.search=device", f"data.batch_size={B}"])
    r, m = cfg.retriever, cfg.model
    dev, g = ctx.device, torch.Generator().manual_seed(0)
    _, _, vocab = sb.compose_run([])
    torch.manual_seed(0)
    reader = sb.build_model(m, vocab, dev).train()
    if ctx.dry:  # the accelerator's static layout on the CPU too: the count is the GPU's
        reader.packed_devices = ()
    ids = torch.arange(N) * 3 + 1
    store = DocumentStore(
        ids,
        torch.randn(N, 3, m.image_size, m.image_size, generator=g),
        torch.randint(1, vocab, (N, m.max_doc_text), generator=g),
        torch.randint(1, m.max_doc_text + 1, (N,), generator=g),
        [""] * N,
        {},
    ).to(dev)
    enc = DualEncoder(r, m.image_size).to(dev).train()
    memory = RetrievalMemory(
        enc, store.images, store.text_ids, store.text_len, ids, device=dev, on_device=True
    )
    memory.refresh()
    spread = SpreadRag(RagModel(reader, store, r, enc, memory), cfg, dev)
    opt = build_optimizer(spread, cfg.optim)
    x = {
        k: v.to(dev)
        for k, v in sb.synthetic_batch(cfg, B, vocab, "cpu").items()
        if k in ("image", "q_ids", "q_len", "a_ids", "a_len")
    }
    x["gold"] = ids[torch.randint(0, N, (B,), generator=g)].to(dev)
    out: dict = {"batch": B, "docs": N}

    def step_of(kind: str):
        def step() -> torch.Tensor:
            # bf16 autocast on the dry run too: the CPU meets the GPU run's dtypes
            with torch.autocast(dev.type, dtype=torch.bfloat16):
                tokens = spread.step_answer_tokens([x]) if kind == "joint" else None
                res = spread.train_step(x, answer_tokens=tokens, loss=kind)
            spread.clip_grad_norm_(1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            return res.loss

        return step

    try:
        for kind in ("retriever", "joint"):
            step = step_of(kind)
            for _ in range(ctx.warmup):
                step()
            _sync(dev)
            t0 = time.perf_counter()
            losses = [step() for _ in range(ctx.steps)]
            _sync(dev)
            s = (time.perf_counter() - t0) / ctx.steps
            prof = profile_steps(step, dev, 2)
            out[kind] = {
                "step_ms": round(s * 1e3, 3),
                "samples_per_s": round(B / s, 1),
                "host_syncs": prof["host_syncs"],
                "host_syncs_per_step": prof["host_syncs_per_step"],
                "loss": [round(float(v), 5) for v in losses],
            }
    finally:
        _release(dev)
    return out


STEPS = {
    "probe": probe,
    **{f"step_{n}": (lambda ctx, n=n: step_config(n, ctx)) for n in CONFIGS},
    "attention": attention,
    "demo": demo,
    "profile": profile,
    "search": search,
    "learned": learned,
}
