"""Reader training throughput: samples/s and model FLOPs utilisation (MFU), on the CPU or a GPU.

    python scripts/bench/train_throughput.py [--device cpu|cuda] [--threads 2] [--steps 20]
        [--batch 32] [--precision fp32|bf16] [--checkpointing] [--compile] [overrides...]

    python scripts/bench/train_throughput.py --device cuda --precision bf16 --batch 8 --checkpointing \
        model=llama3_2_1b retriever.top_k=2           # the ~1B Hugging Face reader preset on one GPU

The reader is the run's (``+experiment=demo`` plus the overrides: a preset such as
``model=llama3_2_1b`` builds the HF reader), built on the meta device and given random weights
directly on ``--device`` (``rag_mm.model.factory.materialize``: no CPU copy of a 1B model). A batch
is shaped like the run's: full-length questions, answers and documents, ``retriever.top_k``
documents per query, random ids and pictures. A step is forward, backward and the run's AdamW.

FLOPs per step are counted by ``torch.utils.flop_counter`` on one real forward + backward
(matmuls, convolutions and the attention ops it has formulas for: SDPA's flash / efficient / math
kernels; not the fused ``rag_attn`` op or flex, whose products are then missing, a slight
undercount at these sequence lengths). MFU = FLOPs per step / seconds per step / peak, with the
peak of the device's datasheet on a GPU (dense bf16 / fp16 tensor-core FLOP/s; TF32 for fp32) and
a large matmul measured in the same process on the CPU; the measured matmul rate is reported on
both. ``--checkpointing`` recomputes each block in backward (``parallel.memory``; the FLOPs of the
recomputation are not counted as useful). ``--compile`` compiles each block (``torch.compile``).
Prints one JSON object.
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
from pathlib import Path

import torch
from omegaconf import OmegaConf
from torch.utils.flop_counter import FlopCounterMode

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from parallel.memory import apply_activation_checkpointing  # noqa: E402
from parallel.spmd import find_blocks  # noqa: E402
from rag_mm.components.metrics import strict_dumps  # noqa: E402  (null, never NaN, in the report)
from rag_mm.components.optim import build_optimizer  # noqa: E402
from rag_mm.config import compose, reader_tokenizer  # noqa: E402
from rag_mm.data.tokenizer import get_tokenizer  # noqa: E402
from rag_mm.model.factory import build_reader, count_parameters, materialize  # noqa: E402

# dense tensor-core peak FLOP/s per device, from the vendors' datasheets (SXM parts; no sparsity)
GPU_PEAK = {  # name substring -> {dtype: FLOP/s}
    "H200": {"bf16": 989.4e12, "fp16": 989.4e12, "fp32": 494.7e12},
    "H100": {"bf16": 989.4e12, "fp16": 989.4e12, "fp32": 494.7e12},
    "A100": {"bf16": 312e12, "fp16": 312e12, "fp32": 156e12},
}


def matmul_rate(device: torch.device, dtype: torch.dtype, n: int, reps: int = 5) -> float:
    """Best-of FLOP/s of an n x n x n matmul (2 n^3 FLOPs) on ``device``."""
    a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
    a @ b
    best = float("inf")
    for _ in range(reps):
        _sync(device)
        t = time.perf_counter()
        a @ b
        _sync(device)
        best = min(best, time.perf_counter() - t)
    return 2 * n**3 / best


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def datasheet_peak(device: torch.device, precision: str) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((p[precision] for key, p in GPU_PEAK.items() if key in name), None)


def synthetic_batch(cfg, batch: int, vocab: int, device: torch.device) -> dict:
    """A batch shaped like the run's (``rag_mm.plan.example_inputs``), with random ids and pictures."""
    from rag_mm.plan import example_inputs

    g = torch.Generator().manual_seed(0)
    out = {}
    for k, v in example_inputs(cfg, batch).items():
        if k.endswith("_ids"):
            v = torch.randint(1, vocab, v.shape, generator=g)
        elif v.is_floating_point():
            v = torch.randn(v.shape, generator=g)
        out[k] = v.to(device)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--threads", type=int, default=2, help="intra-op threads (CPU)")
    ap.add_argument("--steps", type=int, default=20, help="timed steps (after 3 warm-up steps)")
    ap.add_argument("--batch", type=int, default=32, help="queries per step")
    ap.add_argument("--precision", choices=["fp32", "bf16"], default="fp32",
                    help="bf16: autocast over fp32 weights, as optim.precision=bf16 trains")
    ap.add_argument("--checkpointing", action="store_true", help="recompute each block in backward")
    ap.add_argument("--compile", action="store_true", help="torch.compile each block")
    ap.add_argument("--out", default="", help="also write the JSON to this file")
    ap.add_argument("overrides", nargs="*", help="training overrides, e.g. model=llama3_2_1b retriever.top_k=2")
    args = ap.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: no CUDA device here")
    torch.set_num_threads(args.threads)
    cfg = compose(["+experiment=demo", "run_dir=/tmp/unused", *args.overrides])
    model_cfg = OmegaConf.to_object(cfg.model)
    vocab = get_tokenizer(reader_tokenizer(model_cfg)).vocab_size
    torch.manual_seed(0)
    model = materialize(build_reader(model_cfg, vocab, meta=True), device)
    opt = build_optimizer(model, cfg.optim)
    batch = synthetic_batch(cfg, args.batch, vocab, device)
    dtype = torch.bfloat16 if args.precision == "bf16" else torch.float32
    ctx = torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.precision == "bf16")

    def fwd_bwd() -> None:
        with ctx:
            out = model(**batch)
        out.loss.backward()

    # the useful FLOPs: one forward + backward of the plain model (no recomputation, nothing compiled)
    with FlopCounterMode(display=False) as fc:
        fwd_bwd()
    model.zero_grad(set_to_none=True)
    flops = fc.get_total_flops()
    blocks = find_blocks(model)
    if args.checkpointing:
        apply_activation_checkpointing(blocks, "full", 1)
    if args.compile:
        for b in blocks:
            b.compile()

    def step() -> None:
        fwd_bwd()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(3):  # warm-up (and compilation)
        step()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times = []
    for _ in range(args.steps):
        _sync(device)
        t = time.perf_counter()
        step()
        _sync(device)
        times.append(time.perf_counter() - t)
    times.sort()
    median = times[len(times) // 2]
    measured = matmul_rate(device, dtype, 8192 if device.type == "cuda" else 2048)
    sheet = datasheet_peak(device, args.precision)
    peak = sheet or measured
    dev_name = torch.cuda.get_device_name(device) if device.type == "cuda" else \
        f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads"
    report = strict_dumps({
        "bench": "train_throughput", "device": dev_name, "torch": torch.__version__,
        "model": cfg.model.name, "family": cfg.model.family, "precision": args.precision, "batch": args.batch,
        "docs_per_query": cfg.retriever.top_k, "blocks": len(blocks), "checkpointing": args.checkpointing,
        "compile": args.compile,
        "params_M": round(count_parameters(model) / 1e6, 3),
        "step_s_median": round(median, 4), "samples_per_s": round(args.batch / median, 2),
        "flops_per_step_G": round(flops / 1e9, 2), "achieved_TFLOPs": round(flops / median / 1e12, 4),
        "peak_TFLOPs": round(peak / 1e12, 3), "peak_source": "datasheet" if sheet else "measured matmul",
        "matmul_TFLOPs": round(measured / 1e12, 3), "mfu": round(flops / median / peak, 4),
        "max_memory_GiB": round(torch.cuda.max_memory_allocated(device) / 2**30, 2) if device.type == "cuda" else None,
    })
    print(report)
    if args.out:
        Path(args.out).write_text(report + "\n")


if __name__ == "__main__":
    main()
