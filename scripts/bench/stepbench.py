"""What a reader training-step benchmark needs, shared by ``train_throughput.py`` and
``scripts/gpu_verify.py``: the reader and a batch shaped like the run's, the FLOPs of one step
counted on the meta device, the peak of the exact part, and steps timed between two events.

FLOPs (``meta_flops``): ``torch.utils.flop_counter.FlopCounterMode`` over one forward + backward
of the reader built on the meta device: no kernel runs, nothing is timed or tuned inside the
counter, and the count does not depend on which attention kernel a device would pick. Attention
is counted as SDPA's math path computes it, over all (S, S) scores of the (masked) layout, on
whatever device (``count_scope``), so a real-device count under the same scope agrees with it.
The useful FLOPs (MFU) leave out recomputation; the hardware FLOPs (HFU) add the forward of every
checkpointed block once more (PaLM, appendix B).

Peaks (``datasheet_peak``): dense tensor-core FLOP/s of the part's datasheet, parts told apart by
the name CUDA reports (H100 SXM / PCIe / NVL, H200, GH200, A100); ``matmul_peak`` measures a large
matmul on the device, the figure MFU is also given against.

Timing (``time_steps``): warm-up steps, then N steps between two CUDA events with no
synchronisation in between (a host clock around them on the CPU); the losses are read after the
last event.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.utils.flop_counter import FlopCounterMode

# Dense (no sparsity) tensor-core FLOP/s from NVIDIA's datasheets: (name test, part, bf16, tf32).
# Order matters: the first whose words all occur in the CUDA device name wins.
GPU_PARTS = (
    (("GH200",), "GH200", 989.4e12, 494.7e12),
    (("H200",), "H200", 989.4e12, 494.7e12),
    (("H100", "NVL"), "H100 NVL", 835.0e12, 417.5e12),
    (("H100", "PCIE"), "H100 PCIe", 756.0e12, 378.0e12),
    (("H100",), "H100 SXM", 989.4e12, 494.7e12),  # "H100 80GB HBM3" is the SXM5 part
    (("H800",), "H800 SXM", 989.4e12, 494.7e12),
    (("A100",), "A100", 312.0e12, 156.0e12),  # SXM and PCIe share the tensor-core peak
)


def datasheet_peak(name: str, precision: str) -> tuple[str | None, float | None]:
    """(part, dense FLOP/s) for a CUDA device name; ``precision`` bf16 / fp16 or fp32 (TF32)."""
    up = name.upper()
    for words, part, half, tf32 in GPU_PARTS:
        if all(w in up for w in words):
            return part, (tf32 if precision == "fp32" else half)
    return None, None


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def matmul_peak(device: torch.device, dtype: torch.dtype, n: int, reps: int = 10) -> float:
    """Best FLOP/s of an n x n x n matmul (2 n^3 FLOPs) over ``reps`` timed calls on random data
    (zeros run faster than real data on some parts)."""
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    for _ in range(3):
        a @ b
    best = float("inf")
    for _ in range(reps):
        if device.type == "cuda":
            t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            t0.record()
            a @ b
            t1.record()
            t1.synchronize()
            best = min(best, t0.elapsed_time(t1) / 1e3)
        else:
            t = time.perf_counter()
            a @ b
            best = min(best, time.perf_counter() - t)
    return 2 * n**3 / best


@dataclass
class Timing:
    step_s: float  # mean seconds per timed step (total between the two events / steps)
    losses: list[float]  # every step's loss, warm-up included, read after the last event
    warmup_s: float  # wall seconds of the warm-up steps (tuning and compilation included)


def time_steps(
    step: Callable[[], torch.Tensor], device: torch.device, warmup: int, steps: int
) -> Timing:
    """``warmup`` steps, then ``steps`` steps between two events with no host sync between them.
    ``step`` returns the loss (a detached tensor; it is not read until the end)."""
    t = time.perf_counter()
    losses = [step() for _ in range(warmup)]
    _sync(device)
    warmup_s = time.perf_counter() - t
    if device.type == "cuda":
        t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0.record()
        losses += [step() for _ in range(steps)]
        t1.record()
        t1.synchronize()
        total = t0.elapsed_time(t1) / 1e3
    else:
        t = time.perf_counter()
        losses += [step() for _ in range(steps)]
        total = time.perf_counter() - t
    return Timing(total / max(steps, 1), [float(x) for x in losses], warmup_s)


# ----------------------------------------------------------------------------- the reader
def compose_run(overrides: list[str]):
    """The run's config (``+experiment=demo`` plus ``overrides``) and its tokenizer's vocabulary."""
    from omegaconf import OmegaConf

    from rag_mm.config import compose, reader_tokenizer
    from rag_mm.data.tokenizer import get_tokenizer

    cfg = compose(["+experiment=demo", "run_dir=/tmp/unused", *overrides])
    model_cfg = OmegaConf.to_object(cfg.model)
    return cfg, model_cfg, get_tokenizer(reader_tokenizer(model_cfg)).vocab_size


def synthetic_batch(cfg, batch: int, vocab: int, device: torch.device | str) -> dict:
    """A batch shaped like the run's (``rag_mm.plan.example_inputs``: full-length texts,
    ``retriever.top_k`` documents), random ids and pictures from a fixed seed; meta: shapes only."""
    from rag_mm.plan import example_inputs

    g = torch.Generator().manual_seed(0)
    out = {}
    for k, v in example_inputs(cfg, batch).items():
        if str(device) != "meta":
            if k.endswith("_ids"):
                v = torch.randint(1, vocab, v.shape, generator=g)
            elif v.is_floating_point():
                v = torch.randn(v.shape, generator=g)
        out[k] = v.to(device)
    return out


def build_model(model_cfg, vocab: int, device: torch.device | str, seed: int = 0):
    """The reader with random weights on ``device`` (built on meta, then materialised there)."""
    from rag_mm.model.factory import build_reader, materialize

    torch.manual_seed(seed)
    return materialize(build_reader(model_cfg, vocab, meta=True), device)


@contextlib.contextmanager
def count_scope():
    """Attention as counted FLOPs see it: rag_mm's attention through SDPA, SDPA through its math
    path (plain matmuls, with a formula on every device)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from parallel.kernels.attention import override_backend

    with override_backend("sdpa"), sdpa_kernel([SDPBackend.MATH]):
        yield


@dataclass
class FlopCount:
    model: float  # forward + backward of the plain model (MFU's numerator per step)
    recompute: float  # the forward of the checkpointed blocks, run again in backward
    by_block: dict[str, float]  # forward FLOPs per block name

    @property
    def hardware(self) -> float:
        return self.model + self.recompute


def block_names(model: torch.nn.Module, blocks: list[torch.nn.Module]) -> list[str]:
    ids = {id(b) for b in blocks}
    return [n for n, m in model.named_modules() if id(m) in ids]


def count_flops(model: torch.nn.Module, batch: dict, checkpointed: list[str] = ()) -> FlopCount:
    """FLOPs of one forward + backward of ``model`` on ``batch`` (any device; meta runs no
    kernel), and of recomputing the blocks named in ``checkpointed``."""
    root = type(model).__name__
    with count_scope(), FlopCounterMode(display=False) as fc:
        out = model(**batch)
        fwd = {k: float(sum(v.values())) for k, v in fc.get_flop_counts().items()}
        out.loss.backward()
    model.zero_grad(set_to_none=True)
    by_block = {n: fwd.get(f"{root}.{n}", 0.0) for n in checkpointed}
    return FlopCount(float(fc.get_total_flops()), sum(by_block.values()), by_block)


def meta_flops(model_cfg, cfg, vocab: int, batch: int, checkpointed_blocks: bool) -> FlopCount:
    """``count_flops`` on the reader built on the meta device (the bench's count). With
    ``checkpointed_blocks`` every block of ``parallel.spmd.find_blocks`` counts as recomputed."""
    from parallel.spmd import find_blocks
    from rag_mm.model.factory import build_reader

    model = build_reader(model_cfg, vocab, meta=True).train()
    names = block_names(model, find_blocks(model)) if checkpointed_blocks else []
    return count_flops(model, synthetic_batch(cfg, batch, vocab, "meta"), names)


def attention_choices() -> list[dict]:
    """Every (layout, dtype, backend, reason) rag_mm's attention logged in this process."""
    from parallel.kernels import attention

    return [
        {"layout": lay, "dtype": str(dt).removeprefix("torch."), "backend": be, "why": why}
        for lay, dt, be, why in sorted(attention._logged, key=str)
        if why != "override_backend"
    ]


# ----------------------------------------------------------------------------- one configuration
@dataclass
class StepSetup:
    """One way to run the reader's training step (gpu_verify's A-E; train_throughput's flags)."""

    name: str = "step"
    batch: int = 8  # queries per step
    ac: str = "none"  # none | full: activation checkpointing of every block (find_blocks)
    params: str = "fp32"  # fp32 | fp32+autocast (bf16 matmuls, fp32 weights) | bf16 (weights too)
    attention: str = "auto"  # model.attention_backend
    compile: bool = False  # torch.compile each block
    # aot_eager: traced, partitioned, no code written (CPU dry runs)
    compile_backend: str = "inductor"
    # blocks | model: the whole reader as one graph, in its static layout (parallel.compile_scope)
    compile_scope: str = "blocks"
    compile_mode: str = "default"  # default | reduce-overhead: CUDA graphs (parallel.compile_mode)


def make_step(
    model, opt, batch: dict, autocast: bool, cuda_graphs: bool = False
) -> Callable[[], torch.Tensor]:
    """One training step (forward, backward, optimizer) returning the detached loss.
    ``cuda_graphs``: the model replays CUDA graphs: each step is marked as a new one and the loss
    copied out of the graph's memory (``parallel.ParallelModel`` does the same)."""
    device = next(model.parameters()).device
    ctx = torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast)

    def step() -> torch.Tensor:
        if cuda_graphs:
            torch.compiler.cudagraph_mark_step_begin()
        with ctx:
            loss = model(**batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach().clone() if cuda_graphs else loss.detach()

    step.batch = batch  # the inputs, for an evaluation forward after the timed steps
    return step


def _peak_memory(device: torch.device) -> float | None:
    return torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None


def prepare(overrides: list[str], setup: StepSetup, device: torch.device):
    """(config, model, blocks, step) for ``setup``: the reader with random weights on ``device``
    in the setup's dtype, its blocks checkpointed and compiled as asked, and its training step."""
    from parallel.compile import apply_compile, apply_compile_model
    from parallel.memory import apply_activation_checkpointing
    from parallel.spmd import find_blocks
    from rag_mm.components.optim import build_optimizer

    cfg, model_cfg, vocab = compose_run([*overrides, f"model.attention_backend={setup.attention}"])
    model = build_model(model_cfg, vocab, device).train()
    if setup.params == "bf16":
        model.to(torch.bfloat16)
    blocks = find_blocks(model)
    if setup.ac == "full":
        apply_activation_checkpointing(blocks, "full", 1)
    # the runtime's step 3 (parallel.compile); a graph break is counted, not fatal
    if setup.compile and setup.compile_scope == "model":
        model.packed_devices = ()  # the static layout, as rag_mm's SpreadRag sets it
        apply_compile_model(model, setup.compile_backend, setup.compile_mode, fullgraph=False)
    elif setup.compile:
        apply_compile(blocks, setup.compile_backend, fullgraph=False)
    batch = synthetic_batch(cfg, setup.batch, vocab, device)
    if setup.params == "bf16":  # pictures in the weights' dtype
        batch = {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in batch.items()}
    opt = build_optimizer(model, cfg.optim)
    graphs = setup.compile and setup.compile_mode == "reduce-overhead"
    step = make_step(model, opt, batch, setup.params == "fp32+autocast", graphs)
    return (cfg, model_cfg, vocab), model, blocks, step


def measure(
    overrides: list[str],
    setup: StepSetup,
    device: torch.device,
    *,
    warmup: int,
    steps: int,
    peaks: dict,
    counts: dict | None = None,
    evaluate: bool = False,
) -> dict:
    """Build the reader for ``setup``, run ``warmup`` + ``steps`` training steps, report.
    ``evaluate``: then one forward in eval mode without autograd on the same batch (what an
    evaluation runs: a compiled model compiles it as an inference graph), its loss as
    ``eval_loss``.

    ``peaks``: {"datasheet": FLOP/s or None, "measured": FLOP/s} of the device for this precision.
    ``counts``: a memo of meta counts shared between calls (keyed by model and batch)."""
    from parallel.kernels import attention
    from rag_mm.model.factory import count_parameters

    (cfg, model_cfg, vocab), model, blocks, step = prepare(overrides, setup, device)
    key = (tuple(overrides), setup.batch)
    counts = {} if counts is None else counts
    if key not in counts:
        counts[key] = meta_flops(model_cfg, cfg, vocab, setup.batch, True)
    model_flops = counts[key].model
    hw_flops = counts[key].hardware if setup.ac == "full" else model_flops
    attention._logged.clear()  # log-once set: cleared so this run's choices are the ones reported
    from torch._dynamo.utils import counters

    breaks_before = sum(counters["graph_break"].values())
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    timing = time_steps(step, device, warmup, steps)
    s = timing.step_s
    eval_loss = None
    if evaluate:
        model.eval()
        graphs = setup.compile and setup.compile_mode == "reduce-overhead"
        with (
            torch.no_grad(),
            torch.autocast(
                device.type, dtype=torch.bfloat16, enabled=setup.params == "fp32+autocast"
            ),
        ):
            if graphs:
                torch.compiler.cudagraph_mark_step_begin()
            eval_loss = round(float(model(**step.batch).loss), 5)
    sheet, meas = peaks.get("datasheet"), peaks["measured"]
    ratio = lambda f, p: round(f / s / p, 4) if p else None  # noqa: E731
    return {
        "config": setup.name,
        "batch": setup.batch,
        "ac": setup.ac,
        "params": setup.params,
        "attention_requested": setup.attention,
        "compile": setup.compile,
        "compile_scope": setup.compile_scope if setup.compile else None,
        "compile_mode": setup.compile_mode if setup.compile else None,
        "params_M": round(count_parameters(model) / 1e6, 3),
        "blocks": len(blocks),
        "warmup": warmup,
        "warmup_s": round(timing.warmup_s, 2),
        "steps": steps,
        "step_ms": round(s * 1e3, 3),
        "samples_per_s": round(setup.batch / s, 2),
        "compile_backend": setup.compile_backend if setup.compile else None,
        "graph_breaks": (
            sum(counters["graph_break"].values()) - breaks_before if setup.compile else None
        ),
        "model_tflop_per_step": round(model_flops / 1e12, 4),
        "hardware_tflop_per_step": round(hw_flops / 1e12, 4),
        "achieved_tflops": round(model_flops / s / 1e12, 3),
        "mfu": ratio(model_flops, sheet),
        "mfu_measured_peak": ratio(model_flops, meas),
        "hfu": ratio(hw_flops, sheet or meas),
        "attention_ran": attention_choices(),
        "peak_gib": None if _peak_memory(device) is None else round(_peak_memory(device), 2),
        "loss": [round(x, 5) for x in timing.losses],
        **({"eval_loss": eval_loss} if evaluate else {}),
    }


def device_peaks(device: torch.device, precision: str, n: int | None = None) -> dict:
    """The part, its datasheet peak for ``precision`` and a measured matmul peak (bf16 for bf16 /
    autocast runs, fp32 otherwise)."""
    dtype = torch.float32 if precision == "fp32" else torch.bfloat16
    n = n or (8192 if device.type == "cuda" else 512)
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        part, sheet = datasheet_peak(name, precision)
    else:
        import platform

        name, part, sheet = platform.processor() or platform.machine(), None, None
    return {
        "device": name,
        "part": part,
        "datasheet": sheet,
        "measured": matmul_peak(device, dtype, n),
        "matmul_n": n,
        "matmul_dtype": str(dtype).removeprefix("torch."),
    }
