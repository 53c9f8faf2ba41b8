"""Loading, fake (meta) kernels and autograd of the ``rag_attn`` C++/CUDA ops.

The ops themselves are declared in ``csrc/attention/attention.cpp``:

* ``rag_attn::fwd(q, k, v, seg_offsets?, cu_seqlens?, max_seqlen, causal, scale) -> (out, lse)``
* ``rag_attn::bwd(grad_out, q, k, v, out, lse, seg_offsets?, cu_seqlens?, max_seqlen, causal, scale)
  -> (dq, dk, dv)``

This module builds the extension on first use (cached under ``_build.cache_dir()``), then gives
the ops a fake kernel (shapes only, for torch.compile / FakeTensor) and an autograd formula that
calls ``bwd`` with the saved log-sum-exp (FlashAttention-2 recomputation).

The CPU kernels' vector ISA is process-wide state of the extension (``cpu_set_isa``).
``cpu_isa_pinned`` sets it around one call and restores it; a forward inside such a block records
the pinned ISA and its backward runs at the same one, so a call that ``auto`` pinned to an ISA is
differentiated by that ISA's kernels whatever the process default is.
"""

from __future__ import annotations

import logging
import os
import threading

import torch

from parallel.kernels._build import BuildResult, load_extension

log = logging.getLogger(__name__)

EXT_NAME = "rag_mm_attention"
CPU_SOURCES = ["attention/attention.cpp", "attention/cpu/attention_cpu.cpp"]
CUDA_SOURCES = ["attention/cuda/attention_cuda.cu"]
# The architectures (sm_80 and up) are chosen by _build.cuda_archs, for every extension alike.
CUDA_FLAGS = ["--expt-relaxed-constexpr"]
DISABLE_ENV = "RAG_MM_DISABLE_FUSED_ATTENTION"

_lock = threading.Lock()
_result: BuildResult | None = None


def load() -> BuildResult:
    """Build (or reuse) the extension and register the Python-side pieces; idempotent."""
    global _result
    with _lock:
        if _result is not None:
            return _result
        if os.environ.get(DISABLE_ENV):
            _result = BuildResult(EXT_NAME, False, f"{DISABLE_ENV} is set")
            return _result
        if hasattr(torch.ops, "rag_attn") and hasattr(torch.ops.rag_attn, "fwd"):
            _result = BuildResult(EXT_NAME, True, "already loaded")  # e.g. an AOT build imported it
        else:
            # CUDA kernels are only worth compiling where a GPU can run them.
            cuda = CUDA_SOURCES if torch.cuda.is_available() else None
            _result = load_extension(EXT_NAME, CPU_SOURCES, cuda, extra_cuda_cflags=CUDA_FLAGS)
        if _result.ok:
            _register_python_side()
        return _result


def _eager_cpu(t: torch.Tensor) -> bool:
    """A real CPU tensor outside tracing: where the ISA may be read and set (no fake / functional
    tensors, no torch.compile graph)."""
    return (
        type(t) in (torch.Tensor, torch.nn.Parameter)
        and t.device.type == "cpu"
        and not torch.compiler.is_compiling()
        and hasattr(torch.ops.rag_attn, "cpu_isa")
    )


_pinned = threading.local()  # .isa: the ISA a cpu_isa_pinned block in this thread runs at


# (cpu_isa, cpu_set_isa) overloads, resolved once (the packet lookup costs ~1 us)
_isa_ops: tuple | None = None


def _isa_op_pair():
    global _isa_ops
    if _isa_ops is None:
        if not hasattr(torch.ops, "rag_attn") or not hasattr(torch.ops.rag_attn, "cpu_isa"):
            return None
        _isa_ops = (torch.ops.rag_attn.cpu_isa.default, torch.ops.rag_attn.cpu_set_isa.default)
    return _isa_ops


class cpu_isa_pinned:  # noqa: N801  (used as a context manager, like contextlib's)
    """Run the CPU kernels at ``isa`` inside the block, then restore the ISA in force; no effect for
    None or under torch.compile. One op call when ``isa`` is already in force, three otherwise.

    A class rather than a ``contextlib.contextmanager`` generator: it wraps every ``auto`` call that
    runs a pinned kernel, and the generator's machinery costs a few microseconds per call."""

    __slots__ = ("isa", "before", "outer")

    def __init__(self, isa: str | None):
        self.isa, self.before, self.outer = isa, None, None

    def __enter__(self):
        ops = None if self.isa is None or torch.compiler.is_compiling() else _isa_op_pair()
        if ops is None:
            self.isa = None
            return self
        self.before = ops[0](False)
        self.outer, _pinned.isa = getattr(_pinned, "isa", None), self.isa
        if self.before != self.isa:
            ops[1](self.isa)
        return self

    def __exit__(self, *exc):
        if self.isa is not None:
            if self.before != self.isa:
                _isa_ops[1](self.before)
            _pinned.isa = self.outer
        return False


def _lse_dtype(q: torch.Tensor) -> torch.dtype:
    return torch.float64 if q.dtype == torch.float64 else torch.float32


def _register_python_side() -> None:
    @torch.library.register_fake("rag_attn::fwd")
    def _fwd_fake(q, k, v, seg_offsets, cu_seqlens, max_seqlen, causal, scale):
        torch._check(q.shape == k.shape and q.shape == v.shape, lambda: "q, k, v must match")
        if cu_seqlens is not None:
            lse_shape = (q.shape[1], q.shape[0])  # (H, T)
        else:
            lse_shape = tuple(q.shape[:3])  # (B, H, S)
        return torch.empty_like(q, memory_format=torch.contiguous_format), q.new_empty(
            lse_shape, dtype=_lse_dtype(q)
        )

    @torch.library.register_fake("rag_attn::bwd")
    def _bwd_fake(grad_out, q, k, v, out, lse, seg_offsets, cu_seqlens, max_seqlen, causal, scale):
        mk = lambda t: torch.empty_like(t, memory_format=torch.contiguous_format)  # noqa: E731
        return mk(q), mk(k), mk(v)

    def _setup_context(ctx, inputs, output):
        q, k, v, seg_offsets, cu_seqlens, max_seqlen, causal, scale = inputs
        out, lse = output
        ctx.save_for_backward(q, k, v, out, lse, seg_offsets, cu_seqlens)
        ctx.max_seqlen, ctx.causal, ctx.scale = max_seqlen, causal, scale
        ctx.isa = getattr(_pinned, "isa", None)  # the forward's pinned ISA (None: the process's)
        ctx.mark_non_differentiable(lse)

    def _backward(ctx, grad_out, grad_lse):
        q, k, v, out, lse, seg_offsets, cu_seqlens = ctx.saved_tensors
        with cpu_isa_pinned(ctx.isa if _eager_cpu(q) else None):
            dq, dk, dv = torch.ops.rag_attn.bwd(
                grad_out,
                q,
                k,
                v,
                out,
                lse,
                seg_offsets,
                cu_seqlens,
                ctx.max_seqlen,
                ctx.causal,
                ctx.scale,
            )
        return dq, dk, dv, None, None, None, None, None

    torch.library.register_autograd("rag_attn::fwd", _backward, setup_context=_setup_context)


def fused_forward(q, k, v, *, seg_offsets=None, cu_seqlens=None, max_seqlen=0, causal=False, scale):
    """Differentiable call of ``rag_attn::fwd``; returns the output only."""
    out, _ = torch.ops.rag_attn.fwd(
        q, k, v, seg_offsets, cu_seqlens, int(max_seqlen), bool(causal), float(scale)
    )
    return out
