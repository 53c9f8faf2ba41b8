"""Reader training throughput: samples/s, MFU and HFU, on the CPU or a GPU.

    python scripts/bench/train_throughput.py [--device cpu|cuda] [--threads 2] [--steps 20]
        [--batch 32] [--precision fp32|bf16] [--checkpointing] [--compile]
        [--compile-scope blocks|model] [--cuda-graphs] [overrides...]

    # the ~1B Hugging Face reader preset on one GPU
    python scripts/bench/train_throughput.py --device cuda --precision bf16 --batch 8 \
        --checkpointing model=llama3_2_1b retriever.top_k=2

The reader is the run's (``+experiment=demo`` plus the overrides: a preset such as
``model=llama3_2_1b`` builds the HF reader), built on the meta device and given random weights
directly on ``--device`` (``rag_mm.model.factory.materialize``: no CPU copy of a 1B model). A batch
is shaped like the run's: full-length questions, answers and documents, ``retriever.top_k``
documents per query, random ids and pictures. A step is forward, backward and the run's AdamW.

FLOPs per step are counted once on the meta device (``stepbench.meta_flops``: nothing runs,
nothing is tuned or timed inside the counter; attention counted as SDPA's math path computes it).
``--steps`` steps run between two CUDA events after ``--warmup`` steps (which include ``auto``'s
attention tuning and compilation), with no synchronisation between steps. MFU = model FLOPs per
step / seconds per step / peak, against the datasheet peak of the exact part (``mfu``; on the CPU
there is none) and against a large bf16 / fp32 matmul measured in the same process
(``mfu_measured_peak``). HFU adds the recomputed forward of checkpointed blocks
(``--checkpointing``). The report names the attention backends that ran, the peak memory and the
losses. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import platform
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import stepbench as sb  # noqa: E402

from rag_mm.components.metrics import strict_dumps  # noqa: E402  (null, never NaN, in the report)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--threads", type=int, default=2, help="intra-op threads (CPU)")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps first (tuning, compiling)")
    ap.add_argument("--steps", type=int, default=20, help="timed steps")
    ap.add_argument("--batch", type=int, default=32, help="queries per step")
    ap.add_argument(
        "--precision",
        choices=["fp32", "bf16", "bf16-params"],
        default="fp32",
        help="bf16: autocast over fp32 weights, as optim.precision=bf16 trains; "
        "bf16-params: the weights in bf16 too",
    )
    ap.add_argument("--checkpointing", action="store_true", help="recompute each block in backward")
    ap.add_argument("--compile", action="store_true", help="torch.compile each block")
    ap.add_argument(
        "--compile-scope",
        choices=["blocks", "model"],
        default="blocks",
        help="with --compile: each block, or the whole reader as one graph",
    )
    ap.add_argument(
        "--cuda-graphs",
        action="store_true",
        help="with --compile-scope model: replay the graph as CUDA graphs (reduce-overhead)",
    )
    ap.add_argument("--out", default="", help="also write the JSON to this file")
    ap.add_argument(
        "overrides", nargs="*", help="training overrides, e.g. model=llama3_2_1b retriever.top_k=2"
    )
    args = ap.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: no CUDA device here")
    if args.cuda_graphs and (not args.compile or args.compile_scope != "model"):
        ap.error(
            "--cuda-graphs replays the whole compiled reader: add --compile --compile-scope model"
        )
    if args.steps < 1 or args.warmup < 0 or args.batch < 1:
        ap.error("--steps and --batch must be >= 1, --warmup >= 0")
    torch.set_num_threads(args.threads)
    overrides = [o for o in args.overrides if not o.startswith("model.attention_backend=")]
    key = "model.attention_backend="
    backend = next((o.split("=", 1)[1] for o in args.overrides if o.startswith(key)), "auto")
    params = {"fp32": "fp32", "bf16": "fp32+autocast", "bf16-params": "bf16"}[args.precision]
    setup = sb.StepSetup(
        name="train_throughput",
        batch=args.batch,
        params=params,
        ac="full" if args.checkpointing else "none",
        attention=backend,
        compile=args.compile,
        compile_scope=args.compile_scope,
        compile_mode="reduce-overhead" if args.cuda_graphs else "default",
    )
    peaks = sb.device_peaks(device, "fp32" if args.precision == "fp32" else "bf16")
    row = sb.measure(overrides, setup, device, warmup=args.warmup, steps=args.steps, peaks=peaks)
    cfg, _, _ = sb.compose_run(overrides)
    dev_name = (
        peaks["device"]
        if device.type == "cuda"
        else f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads"
    )
    report = strict_dumps(
        {
            "bench": "train_throughput",
            "device": dev_name,
            "part": peaks["part"],
            "torch": torch.__version__,
            "model": cfg.model.name,
            "family": cfg.model.family,
            "precision": args.precision,
            "docs_per_query": cfg.retriever.top_k,
            "checkpointing": args.checkpointing,
            "flops_counted": "meta device, once (stepbench.meta_flops)",
            "peak_datasheet_TFLOPs": (
                None if peaks["datasheet"] is None else round(peaks["datasheet"] / 1e12, 1)
            ),
            "matmul_TFLOPs": round(peaks["measured"] / 1e12, 3),
            **row,
        }
    )
    print(report)
    if args.out:
        Path(args.out).write_text(report + "\n")


if __name__ == "__main__":
    main()
