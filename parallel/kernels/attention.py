"""Attention with one backend switch: ``auto`` | ``fused`` | ``flex`` | ``sdpa`` | ``reference``.

Layouts (all tensors ``(B, H, S, D)`` unless said otherwise):

* dense: every query attends to every key (``causal=False``) or to keys at or before it.
* retrieval block layout, given by ``seg_offsets`` (int32, ``(B, n_seg + 1)``, non-decreasing,
  ``seg_offsets[:, 0] == 0``): segments ``0 .. n_seg-2`` are documents, each attending only
  within itself; the last segment is the query, which attends to every document and causally to
  itself. Positions at or after ``seg_offsets[:, -1]`` are padding: they attend to nothing and
  their output is zero.
* packed variable length (``varlen_attention``): ``(T, H, D)`` tensors holding B sequences back
  to back, ``cu_seqlens`` (int32, ``(B + 1,)``) as in FlashAttention's varlen API.

The fused C++/CUDA kernels live in ``csrc/attention``; this module is their only Python face.
``flex`` is ``torch.nn.attention.flex_attention`` with a block mask per layout (``flex.py``).
``auto`` is chosen by measurement (``select_backend``, ``autotune.py``): on the first call of a key
(op, layout, dtype, head size, length bucket, threads) the candidates (the fused CPU kernel at
every vector ISA, SDPA; on CUDA also the fused kernel and, for masked layouts, flex) are checked
against ``reference_attention`` and timed for a bounded few milliseconds on the machine in use,
and the fastest correct one is cached on disk per machine. ``RAG_MM_ATTN_AUTOTUNE=0``, and calls
where nothing may be timed (torch.compile, fake / meta tensors, CUDA graph capture) without a
cached choice, take the fixed rule: per device, layout and CPU capability (``CPU_AUTO_TABLE``,
``_auto_cuda``). The choice and its reason are logged once per key.

Under torch.distributed nothing is measured at a call: ranks reach the first call of a key at
different moments (a pipeline stage may never reach it), so a collective there could deadlock and
ranks timing alone could choose different kernels, which round differently. Instead every rank
calls ``autotune(specs)`` at one well-defined point before the first step (a collective: rank 0
measures or reads its cache, broadcasts, every rank installs rank 0's choices); keys it did not
cover take the fixed rule on every rank.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os

import torch

from parallel.kernels import autotune as _tune

# the PyTorch paths (masks, reference, SDPA) live in attention_ref.py; re-exported as this module's
# API
from parallel.kernels.attention_ref import (  # noqa: F401
    layout_mask,
    pad_packed,
    reference_attention,
    reference_varlen_attention,
    sdpa_attention,
    sdpa_safe_mask,
    sdpa_varlen_attention,
)

log = logging.getLogger(__name__)

BACKENDS = ("auto", "fused", "flex", "sdpa", "reference")
LAYOUTS = ("dense", "causal", "packed", "retrieval")
_logged: set[tuple] = set()


def _log_once(layout: str, dtype: torch.dtype, backend: str, reason: str) -> None:
    if reason == "compiled":  # logged by ``_traced_choice`` while the graph was traced
        return
    key = (layout, dtype, backend, reason)
    if key not in _logged:
        _logged.add(key)
        log.info("attention backend: %s (%s)", backend, reason)


def _layout(causal: bool, seg_offsets) -> str:
    return "retrieval" if seg_offsets is not None else ("causal" if causal else "dense")


# ----------------------------------------------------------------------------- backend switch
_FUSED_DTYPES = {
    "cpu": (torch.float32, torch.bfloat16, torch.float64),
    "cuda": (torch.float32, torch.bfloat16, torch.float16),
}


def fused_available() -> tuple[bool, str]:
    """Whether the fused kernels from csrc/attention can be used, and why not.

    The first call builds the extension (or loads it from the cache); later calls are free.
    """
    from parallel.kernels import _attention_ops

    res = _attention_ops.load()
    return res.ok, ("fused kernels " + res.reason) if res.ok else res.reason


def _fused_supports(q: torch.Tensor) -> tuple[bool, str]:
    """Per-call gate: device, dtype and head size the kernels handle."""
    dev = q.device.type
    if dev not in _FUSED_DTYPES:
        return False, f"no fused kernel for device {dev!r}"
    if q.dtype not in _FUSED_DTYPES[dev]:
        return False, f"no fused {dev} kernel for dtype {q.dtype}"
    if dev == "cuda":
        if not torch._C._dispatch_has_kernel_for_dispatch_key("rag_attn::fwd", "CUDA"):
            return False, "extension was built without CUDA kernels"
        if q.shape[-1] > 256:
            return False, f"head size {q.shape[-1]} > 256"
    return True, "supported"


# Fixed CPU backend per layout, by the vector kernels the fused op runs (``kernel_isa``: picked at
# run time from the CPU's features, csrc/attention/cpu/isa.h). With the AVX2 or AVX-512
# micro-kernels the fused op is taken on every layout. The generic kernels (BLAS per tile + loops:
# CPUs without AVX2, other architectures, head sizes not a multiple of 8) keep SDPA's flash CPU
# kernel for dense and causal, and take the fused op for packed and retrieval, where it skips the
# masked blocks that SDPA's dense mask computes. ISAs without a row use the generic row. The table
# is the fallback of ``auto``: measurement (``_tuned``) decides unless RAG_MM_ATTN_AUTOTUNE=0 or
# nothing may be timed. Measurements: benchmarks/attention_cpu_*.md.
CPU_AUTO_TABLE = {
    "avx512": {"dense": "fused", "causal": "fused", "packed": "fused", "retrieval": "fused"},
    "avx2": {"dense": "fused", "causal": "fused", "packed": "fused", "retrieval": "fused"},
    "generic": {"dense": "sdpa", "causal": "sdpa", "packed": "fused", "retrieval": "fused"},
}


def kernel_isa(best: bool = False) -> str | None:
    """The vector ISA the fused CPU kernels run: "avx512", "avx2" or "generic".

    Chosen by the extension at run time from the CPU's features, capped by ``RAG_ATTN_ISA`` (read
    at its first call) or ``torch.ops.rag_attn.cpu_set_isa``; ``best=True`` gives the highest this
    CPU supports. None when the extension is unavailable.
    """
    ok, _ = fused_available()
    if not ok or not hasattr(torch.ops.rag_attn, "cpu_isa"):
        return None
    return torch.ops.rag_attn.cpu_isa(best)


def cpu_capability() -> str:
    """The ISA that picks the ``CPU_AUTO_TABLE`` row, lower case.

    The fused kernels' own ISA (``kernel_isa``) when the extension is available; else the one ATen
    dispatches to (``torch.backends.cpu.get_cpu_capability``, which honours
    ``ATEN_CPU_CAPABILITY``), else /proc/cpuinfo's flags.
    """
    isa = kernel_isa()
    if isa is not None:
        return isa
    try:
        return torch.backends.cpu.get_cpu_capability().lower().replace(" ", "_")
    except (AttributeError, RuntimeError):
        try:
            flags = open("/proc/cpuinfo").read()
        except OSError:
            return "default"
        return "avx512" if " avx512f" in flags else ("avx2" if " avx2" in flags else "default")


def _flex_gate(q: torch.Tensor) -> tuple[bool, str]:
    from parallel.kernels import flex

    ok, why = flex.available()
    if not ok:
        return False, why
    if q.device.type == "cuda":
        from torch.utils._triton import has_triton

        if not has_triton():
            return False, "flex on CUDA needs Triton"
        major, minor = torch.cuda.get_device_capability(q.device)
        if major < 8:
            return False, f"flex's Triton kernels target sm80+, device is sm{major}{minor}"
        if q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
            return False, f"no flex CUDA kernel for dtype {q.dtype}"
    return True, why


def _auto_cuda(q: torch.Tensor, layout: str, fused_ok: bool, fused_why: str) -> tuple[str, str]:
    """CUDA rule (from published figures; benchmarks/gpu_check_*.md): dense and causal -> SDPA,
    whose flash / cuDNN kernels are the fastest published ones for unmasked attention (FlexAttention
    reaches ~90% of FlashAttention-2 there, the fused kernel targets >= 0.7x). Masked layouts
    (packed, retrieval) -> flex on sm80+ with Triton: it skips masked 128 x 128 blocks where SDPA
    must take a dense mask (and so leaves its flash kernel), and its Triton kernels are autotuned
    upstream; else the fused CUDA kernel (also block-skipping); else SDPA."""
    if layout in ("dense", "causal"):
        return (
            "sdpa",
            f"{layout} on CUDA: SDPA's flash/cuDNN kernels are the fastest for unmasked attention",
        )
    ok, why = _flex_gate(q)
    if ok:
        return "flex", f"{layout} on CUDA: flex skips masked blocks ({why})"
    if fused_ok:
        return (
            "fused",
            f"{layout} on CUDA: flex unavailable ({why}); fused kernel skips masked blocks",
        )
    return "sdpa", f"{layout} on CUDA: flex unavailable ({why}), fused unavailable ({fused_why})"


def select_backend(
    requested: str, q: torch.Tensor, layout: str = "dense", *, grad: bool = False
) -> tuple[str, str]:
    """Resolve ``requested`` to a concrete backend and a human-readable reason.

    ``auto`` is measured (``_tuned``: the fastest correct candidate for the call's key, cached on
    disk) unless ``RAG_MM_ATTN_AUTOTUNE=0`` or nothing can be timed here; then the fixed rule
    decides: on the CPU ``CPU_AUTO_TABLE`` for ``cpu_capability()`` (the fused kernels' ISA; the
    generic row where q's dtype / head size take the generic kernels), on CUDA ``_auto_cuda``.
    ``grad``: the inputs require grad (forward and backward are timed together). A measured
    choice may be ``"fused:<isa>"``: the fused CPU kernel run at that vector ISA.
    """
    if requested == "auto":  # the hot path: a key decided before in this process
        fast = _fast_key(q, layout, grad)
        hit = _resolved_fast.get(fast)
        if hit is not None and hit[0] == _tune.generation():
            return hit[1]
    if requested not in BACKENDS:
        raise ValueError(f"attention backend must be one of {BACKENDS}, got {requested!r}")
    if layout not in LAYOUTS:
        raise ValueError(f"attention layout must be one of {LAYOUTS}, got {layout!r}")
    if requested in ("sdpa", "reference"):
        return requested, "requested"
    if requested == "flex":
        ok, why = _flex_gate(q)
        if not ok:
            raise RuntimeError(f"attention backend 'flex' requested but unavailable: {why}")
        return "flex", "requested"
    ok, why = fused_available()
    if ok:
        ok, why_not = _fused_supports(q)
        why = why if ok else why_not
    if requested == "fused":
        if not ok:
            raise RuntimeError(f"attention backend 'fused' requested but unavailable: {why}")
        return "fused", "requested"

    def fixed() -> tuple[str, str]:
        if q.device.type == "cuda":
            return _auto_cuda(q, layout, ok, why)
        if not ok:
            return "sdpa", f"fused unavailable: {why}"
        if q.device.type != "cpu":
            return "fused", why
        return _cpu_fixed_rule(q, layout)

    return _tuned(q, layout, grad, fixed, ok)


def _cpu_fixed_rule(q: torch.Tensor, layout: str) -> tuple[str, str]:
    cap = cpu_capability()
    if cap != "generic" and hasattr(torch.ops.rag_attn, "cpu_kernel"):
        # head sizes / dtypes the vector kernels do not take run the generic ones
        if torch.ops.rag_attn.cpu_kernel(q.dtype, q.shape[-1]) == "generic":
            cap = "generic"
    row = CPU_AUTO_TABLE.get(cap, CPU_AUTO_TABLE["generic"])
    table = cap if cap in CPU_AUTO_TABLE else f"generic (no row for {cap})"
    choice = row[layout]
    faster = (
        "SDPA is faster than the fused kernel"
        if choice == "sdpa"
        else "the fused kernel is faster than SDPA"
    )
    return choice, f"{layout} {str(q.dtype).removeprefix('torch.')} on a {table} CPU: {faster}"


# ----------------------------------------------------------------------------- measured auto
# heads are dim 1 in every layout: (B, H, S, D) and packed (T, H, D)
ISAS = ("generic", "avx2", "avx512")  # the fused CPU kernels' vector ISAs, lowest first
_machines: dict[str, tuple[str, dict]] = {}
_names_memo: dict[tuple, tuple[str, ...]] = {}


def _isa_cap() -> str | None:
    """The highest ISA auto may run: ``RAG_ATTN_ISA`` if set, else the CPU's best."""
    if kernel_isa() is None:
        return None
    return os.environ.get("RAG_ATTN_ISA") or kernel_isa(best=True)


def _candidate_names(q: torch.Tensor, layout: str, fused_ok: bool) -> tuple[str, ...]:
    """What ``auto`` chooses among for q's device, dtype and head size.

    CPU: SDPA and the fused kernel at every ISA up to ``_isa_cap`` that runs a kernel of its own for
    this dtype / head size (``cpu_kernel``: e.g. head size 40 runs the AVX2 kernel under avx512).
    Flex is left out on the CPU: its first call per shape compiles through Inductor (seconds to
    minutes), past any timing bound, and its CPU backward is the dense PyTorch formula.
    CUDA: SDPA, the fused kernel, and flex for the masked layouts (sm80+ with Triton).
    """
    memo = (q.device.type, q.dtype, q.shape[-1], layout, fused_ok, os.environ.get("RAG_ATTN_ISA"))
    if memo in _names_memo:
        return _names_memo[memo]
    names = ["sdpa"]
    if q.device.type == "cpu" and fused_ok:
        cap = _isa_cap()
        kernels = {}
        for isa in ISAS[: ISAS.index(cap) + 1] if cap in ISAS else ():
            with pinned_isa(isa):
                kernels.setdefault(torch.ops.rag_attn.cpu_kernel(q.dtype, q.shape[-1]), isa)
        names += [f"fused:{isa}" for isa in kernels.values()]
    elif q.device.type == "cuda":
        names += ["fused"] if fused_ok else []
        names += ["flex"] if layout in ("packed", "retrieval") and _flex_gate(q)[0] else []
    _names_memo[memo] = tuple(names)
    return _names_memo[memo]


def _machine(device: str) -> tuple[str, dict]:
    if device not in _machines:
        _machines[device] = _tune.machine(device, _isa_cap() if device == "cpu" else None)
    return _machines[device]


def _tune_key(q: torch.Tensor, layout: str, grad: bool) -> _tune.Key:
    # packed: (T, H, D), T tokens; else (B, H, S, D)
    S = q.shape[0] if layout == "packed" else q.shape[-2]
    return _tune.Key(
        "fwd+bwd" if grad else "fwd",
        layout,
        str(q.dtype).removeprefix("torch."),
        int(q.shape[-1]),
        _tune.seq_bucket(S),
        torch.get_num_threads(),
        q.device.type,
    )


def _tuned(q: torch.Tensor, layout: str, grad: bool, fixed, fused_ok: bool) -> tuple[str, str]:
    """``auto``'s measured choice for q's key (cached, else measured now when ``can_time``), or
    ``fixed()`` (the fixed rule) with the reason no measurement decides. A decided key is memoised
    per process (a dict lookup: no op call on the hot path)."""
    if not _tune.enabled():
        return fixed()
    names = _candidate_names(q, layout, fused_ok)
    if len(names) < 2:
        return fixed()
    key = _tune_key(q, layout, grad)
    memo = _resolved.get((key, names))
    if memo is not None and memo[0] == _tune.generation():
        _resolved_fast[_fast_key(q, layout, grad)] = memo
        return memo[1]
    rule = fixed()
    rec, why = _record(q, key, names, force=False)
    if rec is None:
        return rule[0], f"{rule[1]}; not measured: {why}"
    if rec["choice"] is None:
        out = rule[0], f"{rule[1]}; no candidate agreed with the reference ({rec['rejected']})"
    else:
        ms = ", ".join(f"{n} {t:.3g}" for n, t in sorted(rec["ms"].items(), key=lambda kv: kv[1]))
        out = rec["choice"], f"measured fastest for {key} (ms: {ms})"
    _resolved[(key, names)] = _resolved_fast[_fast_key(q, layout, grad)] = (_tune.generation(), out)
    return out


_resolved: dict[tuple, tuple] = {}  # (key, candidates) -> (autotune generation, (choice, reason))
# The same decisions by what a call can read in a few hundred nanoseconds: q's device, dtype, head
# size and length, the layout, grad, the thread count and the two environment switches. Skips the
# extension and candidate lookups (~8 us per call otherwise, 1-2% of a 0.5 ms attention call).
_resolved_fast: dict[tuple, tuple] = {}


def _fast_key(q: torch.Tensor, layout: str, grad: bool) -> tuple:
    S = q.shape[0] if layout == "packed" else q.shape[-2]
    return (
        q.device,
        q.dtype,
        q.shape[-1],
        S,
        layout,
        grad,
        torch.get_num_threads(),
        os.environ.get(_tune.ENV),
        os.environ.get("RAG_ATTN_ISA"),
    )


def _record(q: torch.Tensor, key: _tune.Key, names, force: bool) -> tuple[dict | None, str]:
    """The record deciding ``key``: the pinned or cached one if its choice is still a candidate,
    else a new measurement when allowed (``force``: also under torch.distributed, for rank 0 in
    ``autotune``); (None, why not) when nothing decides."""
    mid, desc = _machine(q.device.type)
    rec = _tune.lookup(key, mid, distributed=not force)
    if rec is not None and (rec["choice"] is None or rec["choice"] in names):
        return rec, "cached"
    ok, why = _tune.can_time(q)
    if not ok and not (force and why.startswith("torch.distributed")):
        return None, why
    # The candidates run their own forwards and backwards, apart from the caller's context: no
    # autocast, and an identity pair of saved-tensor hooks (the innermost pair applies). Inside an
    # activation-checkpointed block the block's hooks would otherwise capture the candidates'
    # saved tensors, and each candidate's backward would recompute the whole block (on CUDA from
    # the autograd device thread, which then waits on the tuner's lock: a hang).
    with (
        torch.autocast(q.device.type, enabled=False),
        torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t),
    ):
        return _tune.tune(key, mid, desc, *_tune.attention_case(key, names, _run_named)), "measured"


def pinned_isa(isa: str | None):
    """Context manager: run the fused CPU kernels at ``isa`` inside the block (forward, and the
    backward of what the block's forward recorded); no effect for None, under torch.compile, or
    without the extension."""
    from parallel.kernels._attention_ops import cpu_isa_pinned

    return cpu_isa_pinned(isa)


TuneSpec = _tune.TuneSpec


def autotune(specs: list[TuneSpec], group=None) -> dict[str, str]:
    """Measure ``auto``'s choice for every spec before the first step; key -> choice.

    Under torch.distributed a collective: every rank of ``group`` calls it at the same point with
    the same specs; rank 0 measures (or reads its cache) and broadcasts, and every rank runs rank
    0's choices (see ``autotune.py``). Without a process group it measures locally. Keys that
    ``RAG_MM_ATTN_AUTOTUNE=0`` or a missing candidate leave unmeasured keep the fixed rule.
    """

    def local() -> dict[str, dict]:
        recs = {}
        for s in specs:
            if not _tune.enabled():
                break
            q = torch.empty((1, 1, s.seq_len, s.head_dim), dtype=s.dtype, device=s.device)
            if s.layout == "packed":
                q = q[0].transpose(0, 1)  # (T, 1, D)
            ok, _ = fused_available()
            names = _candidate_names(q, s.layout, ok and _fused_supports(q)[0])
            if len(names) < 2:
                continue
            key = _tune_key(q, s.layout, s.grad)
            rec, _ = _record(q, key, names, force=True)
            if rec is not None:
                recs[key.shape_id()] = rec
        return recs

    return {k: r["choice"] for k, r in _tune.share(local, group).items()}


def _scale(q, scale):
    return 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)


def _needs_grad(*ts) -> bool:
    return torch.is_grad_enabled() and any(t.requires_grad for t in ts)


def _run_named(name: str, q, k, v, kw: dict):
    """Backend ``name`` on one tuning case (``autotune.attention_case``'s keyword arguments)."""
    if "cu_seqlens" in kw:
        return _varlen_with(name, q, k, v, kw["cu_seqlens"], kw["max_seqlen"], False, None)
    return _attention_with(name, q, k, v, kw.get("causal", False), kw.get("seg_offsets"), None)


def _split(chosen: str) -> tuple[str, str | None]:
    """ "fused:avx2" -> ("fused", "avx2"); a plain backend -> (backend, None)."""
    name, _, isa = chosen.partition(":")
    return name, isa or None


_override: list[str] = []  # the innermost ``override_backend`` in effect (a stack)


@contextlib.contextmanager
def override_backend(name: str):
    """Run every ``attention`` / ``varlen_attention`` call inside the block on backend ``name``
    whatever the caller asked for (FLOP counting runs SDPA, whose FLOPs have formulas)."""
    if name not in BACKENDS[1:]:
        raise ValueError(f"override_backend takes one of {BACKENDS[1:]}, got {name!r}")
    _override.append(name)
    try:
        yield
    finally:
        _override.pop()


def _resolve(backend: str, q, layout: str, grad: bool) -> tuple[str, str]:
    if _override:
        return _override[-1], "override_backend"
    if torch.compiler.is_compiling():  # decided once per compiled graph, as a constant
        S = q.shape[0] if layout == "packed" else q.shape[-2]
        choice = _traced_choice(
            backend, str(q.device), q.dtype, int(q.shape[-1]), int(S), layout, grad
        )
        return choice, "compiled"
    return select_backend(backend, q, layout, grad=grad)


@torch._dynamo.assume_constant_result
def _traced_choice(
    backend: str, device: str, dtype: torch.dtype, head_dim: int, seq: int, layout: str, grad: bool
) -> str:
    """The backend for a call inside torch.compile: what an eager call of the same key chooses
    (run in Python while the graph is traced, its answer a constant of the graph, so resolving it
    breaks no graph; a cached measurement decides, else the fixed rule)."""
    shape = (seq, 1, head_dim) if layout == "packed" else (1, 1, seq, head_dim)
    q = torch.empty(shape, dtype=dtype, device=device)
    _tune._tracing[0] += 1  # nothing is timed while a graph is traced
    try:
        chosen, reason = select_backend(backend, q, layout, grad=grad)
    finally:
        _tune._tracing[0] -= 1
    _log_once(layout, dtype, chosen, f"{reason} (inside torch.compile)")
    return chosen


def attention(
    q, k, v, *, causal: bool = False, seg_offsets=None, backend: str = "auto", scale=None
):
    """Attention over ``(B, H, S, D)`` tensors through the chosen backend (see module doc).

    Grouped-query attention: k and v may have ``Hkv`` heads where ``Hkv`` divides q's ``H``; query
    heads ``g * H / Hkv .. (g + 1) * H / Hkv - 1`` share K/V head ``g`` (HF's ``repeat_kv``).
    q, k and v must share one dtype."""
    if k.shape[1] != v.shape[1] or q.shape[1] % k.shape[1]:
        raise ValueError(
            f"attention: k and v need one head count dividing q's (q {q.shape[1]}, "
            f"k {k.shape[1]}, v {v.shape[1]} heads)"
        )
    layout = _layout(causal, seg_offsets)
    chosen, reason = _resolve(backend, q, layout, _needs_grad(q, k, v))
    _log_once(layout, q.dtype, chosen, reason)
    return _attention_with(chosen, q, k, v, causal, seg_offsets, scale)


def _attention_with(chosen: str, q, k, v, causal, seg_offsets, scale):
    chosen, isa = _split(chosen)
    groups = q.shape[1] // k.shape[1]
    if chosen == "flex":  # grouped-query heads natively (no copy of K/V)
        from parallel.kernels.flex import flex_attention

        return flex_attention(q, k, v, causal=causal, seg_offsets=seg_offsets, scale=scale)
    if groups > 1:  # the other kernels take as many K/V heads as query heads
        # (SDPA's enable_gqa would leave its memory-efficient kernel for the math path under a mask)
        k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    if chosen == "reference":
        return reference_attention(q, k, v, causal=causal, seg_offsets=seg_offsets, scale=scale)
    if chosen == "fused":
        from parallel.kernels._attention_ops import fused_forward

        if seg_offsets is not None:
            seg_offsets = seg_offsets.to(device=q.device, dtype=torch.int32)
        with pinned_isa(isa):
            return fused_forward(
                q,
                k,
                v,
                seg_offsets=seg_offsets,
                causal=causal and seg_offsets is None,
                scale=_scale(q, scale),
            )
    return sdpa_attention(q, k, v, causal=causal, seg_offsets=seg_offsets, scale=scale)


def varlen_attention(
    q, k, v, cu_seqlens, max_seqlen: int, *, causal: bool = False, backend: str = "auto", scale=None
):
    """Packed variable-length attention over ``(T, H, D)`` tensors (FlashAttention's varlen API).

    ``cu_seqlens`` (int32, ``(B + 1,)``) holds the sequence boundaries; ``max_seqlen`` the longest
    sequence. Tokens at or after ``cu_seqlens[-1]`` get zero output.
    """
    chosen, reason = _resolve(backend, q, "packed", _needs_grad(q, k, v))
    _log_once("packed", q.dtype, chosen, reason)
    return _varlen_with(chosen, q, k, v, cu_seqlens, max_seqlen, causal, scale)


def _varlen_with(chosen: str, q, k, v, cu_seqlens, max_seqlen, causal, scale):
    chosen, isa = _split(chosen)
    if chosen == "flex":
        from parallel.kernels.flex import flex_varlen_attention

        return flex_varlen_attention(q, k, v, cu_seqlens, causal=causal, scale=scale)
    if chosen == "reference":
        return reference_varlen_attention(q, k, v, cu_seqlens, causal=causal, scale=scale)
    if chosen == "fused":
        from parallel.kernels._attention_ops import fused_forward

        cu = cu_seqlens.to(device=q.device, dtype=torch.int32)
        with pinned_isa(isa):
            return fused_forward(
                q, k, v, cu_seqlens=cu, max_seqlen=max_seqlen, causal=causal, scale=_scale(q, scale)
            )
    return sdpa_varlen_attention(q, k, v, cu_seqlens, max_seqlen, causal=causal, scale=scale)
