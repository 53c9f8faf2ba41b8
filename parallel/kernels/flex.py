"""FlexAttention (``torch.nn.attention.flex_attention``) for the layouts of ``attention.py``.

Every layout becomes a ``mask_mod`` over per-position tensors (segment ids or key bounds) and a
``BlockMask`` built from it (block-sparse: fully masked 128 x 128 tiles are skipped):

* dense: no block mask; causal: ``kv_idx <= q_idx``.
* retrieval (``seg_offsets``, ``(B, n_seg + 1)``): a document row sees its own document; a query
  row sees every document and causally its own segment; padding rows see nothing (zero output,
  zero gradient). The documents come first and the query last, so every row sees one interval of
  keys, ``lo[q] <= kv < hi[q]``: ``[start, end)`` of its document, ``[0, q]`` for a query row,
  empty for padding. The ``mask_mod`` reads two (B, S) bounds per query row and compares the key
  index with them; no per-key lookup (a segment-id formulation, ``seg[q] == seg[kv]``, gathers
  per key too and runs the kernel slower: ``scripts/bench/flex_tune.py``).
* packed varlen (``cu_seqlens``, ``(B + 1,)``): the ``(T, H, D)`` tensors are viewed as one batch
  row ``(1, H, T, D)`` and every token sees its own sequence (causally if asked): FlexAttention's
  document masking. Tokens past ``cu_seqlens[-1]`` are padding.

The ids and bounds are tensors captured by the ``mask_mod``, so a new layout of the same shape
reuses the compiled kernel (integers in the closure would be guarded on and recompile).
Block masks are cached per layout: a causal mask per length and device, an offsets layout per
offsets tensor (by identity, so no value is read back to the host; every layer of a forward gets
the same tensor and so one mask). Building one evaluates the mask on every (q, kv) pair on the
device (tens of ms at S = 1024 on a CPU): once per forward.

Compilation: without ``torch.compile`` flex_attention runs an unfused implementation that
materializes the (S, S) scores, so the kernel is compiled (the CPU needs a C++ compiler for
inductor's C++ template, CUDA needs Triton). If compiling is impossible or fails, the eager
implementation is used and a log line says why. ``RAG_MM_FLEX_COMPILE=0`` forces eager.

Backward: flex_attention's autograd works on CUDA. On the CPU it refuses inputs that require grad
("FlexAttention does not support backward on CPU", torch 2.5 .. 2.14), so there the forward is flex
under no_grad and the backward recomputes the probabilities from the same ``mask_mod`` and applies
the softmax-attention gradient in plain PyTorch (dense (S, S) per batch row).
"""

from __future__ import annotations

import collections
import functools
import logging
import os
import threading
import warnings
import weakref

import torch

log = logging.getLogger(__name__)

try:  # torch >= 2.5
    from torch.nn.attention.flex_attention import BlockMask, create_block_mask, create_mask
    from torch.nn.attention.flex_attention import flex_attention as _flex_attention
except ImportError:  # older torch: available() says so
    BlockMask = create_block_mask = create_mask = _flex_attention = None

QUERY_SEG = 2**30  # segment id of retrieval query rows: above any document index
PAD_SEG = -1  # segment id of padding positions (after the last offset)
CACHE_SIZE = 64  # block masks kept; one per distinct layout in flight is plenty
COMPILE_ENV = "RAG_MM_FLEX_COMPILE"  # "0": never compile, use eager flex_attention
# Inductor's CPU flex template gave wrong outputs (errors O(1) or NaN, varying from run to run) for
# small tiles: S = 40 with head size 8 or 16, S = 72 with head size 8 (torch 2.14.1, AVX2); S >= 64
# with head size >= 32 was right in every trial. Smaller problems run eager flex on the CPU, which
# for them costs little (the scores matrix is small).
CPU_COMPILE_MIN_SEQ = 64
CPU_COMPILE_MIN_HEAD = 32
# One compiled flex_attention serves every mask kind (each mask_mod's code), dtype and shape; each
# is a cache entry of the same frame, and past dynamo's default limit of 8 it would silently run
# eager. Five mask kinds x three dtypes x static + dynamic shapes stay below this.
RECOMPILE_LIMIT = 64


def available() -> tuple[bool, str]:
    """Whether this torch has flex_attention, and why not."""
    if _flex_attention is None:
        return (
            False,
            f"torch {torch.__version__} has no torch.nn.attention.flex_attention (needs torch >= "
            "2.5)",
        )
    return True, f"flex_attention of torch {torch.__version__}"


def _require() -> None:
    ok, why = available()
    if not ok:
        raise RuntimeError(f"attention backend 'flex' unavailable: {why}")


# ----------------------------------------------------------------------------- masks
def _causal(b, h, q_idx, kv_idx):
    return kv_idx <= q_idx


def _interval_mask_mod(lo: torch.Tensor, hi: torch.Tensor):
    """``lo``, ``hi`` (B, S) int32: row q of batch row b sees the keys ``lo <= kv < hi``."""

    def mask_mod(b, h, q_idx, kv_idx):
        return (kv_idx >= lo[b, q_idx]) & (kv_idx < hi[b, q_idx])

    return mask_mod


def _document_mask_mod(seg: torch.Tensor):
    """``seg`` (1, T) int32: sequence index per token, ``PAD_SEG`` past the last one."""

    def mask_mod(b, h, q_idx, kv_idx):
        sq = seg[b, q_idx]
        return (sq == seg[b, kv_idx]) & (sq >= 0)

    return mask_mod


def _document_causal_mask_mod(seg: torch.Tensor):
    def mask_mod(b, h, q_idx, kv_idx):
        sq = seg[b, q_idx]
        return (sq == seg[b, kv_idx]) & (sq >= 0) & (kv_idx <= q_idx)

    return mask_mod


def retrieval_segments(seg_offsets: torch.Tensor, seq_len: int) -> torch.Tensor:
    """(B, n_seg + 1) offsets -> (B, S) int32 segment ids (documents, QUERY_SEG, PAD_SEG)."""
    pos = torch.arange(seq_len, device=seg_offsets.device, dtype=seg_offsets.dtype)
    B, n_seg = seg_offsets.shape[0], seg_offsets.shape[1] - 1
    idx = torch.searchsorted(
        seg_offsets[:, 1:].contiguous(), pos.expand(B, -1).contiguous(), right=True
    )
    seg = torch.where(idx == n_seg - 1, QUERY_SEG, idx)  # (B, S)
    return torch.where(idx >= n_seg, PAD_SEG, seg).to(torch.int32)


def _bounds(seg_offsets: torch.Tensor, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    seg = retrieval_segments(seg_offsets, seq_len).long()  # (B, S)
    pos = torch.arange(seq_len, device=seg.device).expand_as(seg)
    doc = seg.clamp(0, max(seg_offsets.shape[1] - 3, 0))  # a valid document index for every row
    offsets = seg_offsets.long()
    is_q, is_pad = seg == QUERY_SEG, seg == PAD_SEG
    lo = torch.where(is_q | is_pad, 0, offsets.gather(1, doc))
    hi = torch.where(is_q, pos + 1, torch.where(is_pad, 0, offsets.gather(1, doc + 1)))
    return lo.to(torch.int32), hi.to(torch.int32)


# The bounds are an opaque op inside a compiled graph, so Inductor hands the flex kernel two
# materialised buffers: as plain pointwise ops it may leave them unrealised when nothing else reads
# them (an inference graph), and its CPU flex lowering then refuses them (it asks the unrealised
# node for its name). Outside a graph the op is a plain call.
@torch.library.custom_op("rag_flex::retrieval_bounds", mutates_args=())
def _bounds_op(seg_offsets: torch.Tensor, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    return _bounds(seg_offsets, seq_len)


@_bounds_op.register_fake
def _(seg_offsets: torch.Tensor, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    shape = (seg_offsets.shape[0], seq_len)
    return tuple(seg_offsets.new_empty(shape, dtype=torch.int32) for _ in range(2))


def retrieval_bounds(seg_offsets: torch.Tensor, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, n_seg + 1) offsets -> (B, S) int32 ``lo``, ``hi``: the keys each row sees (module
    doc)."""
    return _bounds_op(seg_offsets, seq_len)


def _retrieval_block_mask(seg_offsets: torch.Tensor, seq_len: int, device):
    lo, hi = retrieval_bounds(seg_offsets.to(device), seq_len)
    return create_block_mask(
        _interval_mask_mod(lo, hi), lo.shape[0], None, seq_len, seq_len, device=device
    )


def packed_segments(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """(B + 1,) cumulative lengths -> (1, T) int32 sequence ids (PAD_SEG past the last one)."""
    pos = torch.arange(total, device=cu_seqlens.device, dtype=cu_seqlens.dtype)
    idx = torch.searchsorted(cu_seqlens[1:].contiguous(), pos, right=True)  # (T,)
    return torch.where(idx >= cu_seqlens.numel() - 1, PAD_SEG, idx).to(torch.int32)[None]


_cache: collections.OrderedDict = collections.OrderedDict()
_cache_lock = threading.Lock()


def _cached(key, build, owner: torch.Tensor | None = None):
    """The value cached under ``key``, else ``build()``'s. ``owner``: the offsets tensor the mask
    was built from; the entry lives only as long as that very tensor, unchanged in place."""
    with _cache_lock:
        hit = _cache.get(key)
        if hit is not None and (owner is None or (hit[1]() is owner and hit[2] == owner._version)):
            _cache.move_to_end(key)
            return hit[0]
    value = build()
    ref = None
    if owner is not None:
        ref = weakref.ref(owner, lambda _r, key=key: _drop(key, _r))
    with _cache_lock:
        _cache[key] = (value, ref, None if owner is None else owner._version)
        while len(_cache) > CACHE_SIZE:
            _cache.popitem(last=False)
    return value


def _drop(key, ref) -> None:
    with _cache_lock:
        hit = _cache.get(key)
        if hit is not None and hit[1] is ref:
            del _cache[key]


def block_mask_for(
    *, seq_len: int, device, causal: bool = False, seg_offsets=None, cu_seqlens=None
):
    """The ``BlockMask`` of one layout (None for dense attention), built on ``device``.

    Offsets layouts are cached by the offsets tensor itself (its identity and version, never its
    values: reading them would copy them to the host and wait for the device, in every layer), so
    the layers of one forward share one mask and a new batch's offsets build a new one."""
    _require()
    device = torch.device(device)
    if seg_offsets is not None:
        key = ("retrieval", id(seg_offsets), seq_len, str(device))

        return _cached(
            key, lambda: _retrieval_block_mask(seg_offsets, seq_len, device), owner=seg_offsets
        )
    if cu_seqlens is not None:
        key = ("packed", id(cu_seqlens), causal, seq_len, str(device))

        def build():
            seg = packed_segments(cu_seqlens.to(device), seq_len)
            mod = _document_causal_mask_mod(seg) if causal else _document_mask_mod(seg)
            return create_block_mask(mod, 1, None, seq_len, seq_len, device=device)

        return _cached(key, build, owner=cu_seqlens)
    if causal:
        return _cached(
            ("causal", seq_len, str(device)),
            lambda: create_block_mask(_causal, None, None, seq_len, seq_len, device=device),
        )
    return None


# ----------------------------------------------------------------------------- compile
_compiled_fn = None
_compile_off: dict[str, str] = {}  # device type -> why flex runs eager there
_compile_lock = threading.Lock()


def _compile_gate(device: torch.device) -> tuple[bool, str]:
    if device.type in _compile_off:
        return False, _compile_off[device.type]
    if os.environ.get(COMPILE_ENV, "1") == "0":
        return False, f"{COMPILE_ENV}=0"
    return _toolchain(device.type, os.environ.get("CXX", "c++"))


@functools.cache
def _toolchain(device_type: str, cxx: str) -> tuple[bool, str]:
    """Whether inductor can write the flex kernel for ``device_type``: looked up once per process
    and compiler (a PATH search costs more than a small kernel's call; every eager call asks)."""
    if device_type == "cpu":
        from parallel.kernels._build import compiler_available

        ok, why = compiler_available()
        if not ok:
            return False, f"inductor's CPU flex kernel needs a C++ compiler: {why}"
    elif device_type == "cuda":
        from torch.utils._triton import has_triton

        if not has_triton():
            return False, "inductor's CUDA flex kernel needs Triton, which is not installed"
    return True, "compiled"


def _disable_compile(device: torch.device, why: str) -> None:
    with _compile_lock:
        if device.type not in _compile_off:
            _compile_off[device.type] = why
            log.warning(
                "flex attention on %s runs eager (unfused, materializes the scores): %s",
                device.type,
                why,
            )


def _compiled():
    global _compiled_fn
    with _compile_lock:
        if _compiled_fn is None:
            _compiled_fn = torch.compile(_flex_attention)
        return _compiled_fn


def _compile_errors() -> tuple[type[BaseException], ...]:
    errs: list[type[BaseException]] = [torch._dynamo.exc.TorchDynamoException]
    import torch._inductor.exc as inductor_exc

    errs += [
        e
        for e in (
            getattr(inductor_exc, "InductorError", None),
            getattr(inductor_exc, "CppCompileError", None),
        )
        if e is not None
    ]
    return tuple(errs)


def _eager(q, k, v, block_mask, scale):
    with (
        warnings.catch_warnings()
    ):  # "called without torch.compile()": the choice is logged once instead
        warnings.simplefilter("ignore", UserWarning)
        return _flex_attention(q, k, v, block_mask=block_mask, scale=scale, **_gqa(q, k))


def _gqa(q, k) -> dict:
    """``enable_gqa`` when K/V have fewer heads than q (flex maps head h to K/V head h // g)."""
    return {"enable_gqa": True} if k.shape[1] != q.shape[1] else {}


def _run(q, k, v, block_mask, scale, compiled: bool | None):
    """One flex_attention call, compiled when allowed and working, else eager."""
    if compiled is None:
        ok, why = _compile_gate(q.device)
        if not ok:
            _disable_compile(q.device, why)
        small = q.shape[-2] < CPU_COMPILE_MIN_SEQ or q.shape[-1] < CPU_COMPILE_MIN_HEAD
        compiled = ok and not (q.device.type == "cpu" and small)
    if compiled:
        limit = (
            "recompile_limit"
            if hasattr(torch._dynamo.config, "recompile_limit")
            else "cache_size_limit"
        )
        try:
            with torch._dynamo.config.patch(**{limit: RECOMPILE_LIMIT}):
                return _compiled()(q, k, v, block_mask=block_mask, scale=scale, **_gqa(q, k))
        except _compile_errors() as e:
            _disable_compile(
                q.device,
                f"torch.compile failed: {type(e).__name__}: {str(e).splitlines()[0][:200]}",
            )
    return _eager(q, k, v, block_mask, scale)


# ----------------------------------------------------------------------------- CPU autograd
def _dense_backward(q, k, v, grad_out, mask_mod, mask_batch, scale):
    """Softmax-attention gradients with the mask from ``mask_mod`` (fp32 math for 16-bit inputs).

    P = softmax(scale * Q K^T) on allowed pairs (rows with none: P = 0), dV = P^T dO,
    dS = P * (dO V^T - rowsum(P * dO V^T)), dQ = scale * dS K, dK = scale * dS^T Q.
    """
    B, H, S, _ = q.shape
    acc = torch.promote_types(q.dtype, torch.float32)
    mask = None
    if mask_mod is not None:
        mask = create_mask(mask_mod, mask_batch, None, S, S, device=q.device)  # (Bm, 1, S, S)
    grads = [torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in (q, k, v)]
    for b in range(B):  # one (H, S, S) score block at a time
        qb, kb, vb, dob = (t[b].to(acc) for t in (q, k, v, grad_out))  # (H, S, D)
        s = torch.matmul(qb, kb.transpose(-1, -2)) * scale  # (H, S, S)
        if mask is not None:
            s = s.masked_fill(~mask[b if mask.shape[0] > 1 else 0], float("-inf"))
        p = torch.nan_to_num(torch.softmax(s, dim=-1), nan=0.0)
        dp = torch.matmul(dob, vb.transpose(-1, -2))  # (H, S, S)
        ds = p * (dp - (p * dp).sum(-1, keepdim=True))
        grads[0][b] = (torch.matmul(ds, kb) * scale).to(q.dtype)
        grads[1][b] = (torch.matmul(ds.transpose(-1, -2), qb) * scale).to(k.dtype)
        grads[2][b] = torch.matmul(p.transpose(-1, -2), dob).to(v.dtype)
    return grads


class _FlexCPU(torch.autograd.Function):
    """flex_attention forward, plain-PyTorch backward (flex has no CPU backward)."""

    @staticmethod
    def forward(ctx, q, k, v, block_mask, scale, compiled):
        ctx.save_for_backward(q, k, v)
        ctx.mask_mod = None if block_mask is None else block_mask.mask_mod
        ctx.mask_batch = None if block_mask is None else block_mask.shape[0]
        ctx.scale = scale
        return _run(q.detach(), k.detach(), v.detach(), block_mask, scale, compiled)

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v = ctx.saved_tensors
        dq, dk, dv = _dense_backward(q, k, v, grad_out, ctx.mask_mod, ctx.mask_batch, ctx.scale)
        return dq, dk, dv, None, None, None


def _call(q, k, v, block_mask, scale, compiled):
    needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    if needs_grad and q.device.type == "cpu":  # the dense CPU backward: as many K/V heads as q
        groups = q.shape[1] // k.shape[1]
        if groups > 1:
            k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
        return _FlexCPU.apply(q, k, v, block_mask, scale, compiled)
    return _run(q, k, v, block_mask, scale, compiled)


# ----------------------------------------------------------------------------- entry points
def flex_attention(
    q, k, v, *, causal: bool = False, seg_offsets=None, scale=None, compiled: bool | None = None
):
    """``(B, H, S, D)`` attention, dense / causal / retrieval layout (see ``attention.attention``).

    ``compiled``: None compiles where possible (see module doc), False forces eager flex.
    """
    _require()
    S = q.shape[-2]
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    cpu_grad = (
        q.device.type == "cpu"
        and torch.is_grad_enabled()
        and any(t.requires_grad for t in (q, k, v))
    )
    if torch.compiler.is_compiling() and not cpu_grad:  # (flex has no CPU backward: see _FlexCPU)
        # inside a compiled block: the mask is built in the graph from the offsets (no cache to
        # look up) and flex_attention is traced into it, so Inductor writes its kernels there
        mask = _build_block_mask(S, q.device, causal and seg_offsets is None, seg_offsets)
        return _flex_attention(q, k, v, block_mask=mask, scale=scale, **_gqa(q, k))
    mask = block_mask_for(
        seq_len=S, device=q.device, causal=causal and seg_offsets is None, seg_offsets=seg_offsets
    )
    return _call(q, k, v, mask, scale, compiled)


_BLOCK = 128  # create_block_mask's default sparse block, on both sides


# Inside a compiled graph the BlockMask's block tensors come from one opaque op too. Traced as
# plain ops (the dense mask, its block sums, the sort that orders the indices), an inference graph
# has nothing else reading them and Inductor fuses their building into the flex kernel as a
# prologue; on CUDA that fused kernel faults (an illegal memory access, torch 2.11, the 1B's
# retrieval layout). A training graph happens to realise them (the backward saves them); the op
# keeps them out of every kernel's prologue by construction, whatever the graph. Its body computes
# them on the device from the dense mask in plain ops (create_block_mask's vmap over the mask_mod
# cannot run below the dispatcher's autograd key, where an op's body runs); no value reaches the
# host.
@torch.library.custom_op("rag_flex::block_tensors", mutates_args=())
def _block_tensors_op(
    seg_offsets: torch.Tensor | None, seq_len: int, device: torch.device
) -> list[torch.Tensor]:
    kv = torch.arange(seq_len, device=device)
    if seg_offsets is None:
        allowed = (kv[None, :] <= kv[:, None])[None]  # (1, S, S) causal
    else:
        lo, hi = _bounds(seg_offsets.to(device), seq_len)  # (B, S) each
        allowed = (kv >= lo[..., None]) & (kv < hi[..., None])  # (B, S, S)
    n = -(-seq_len // _BLOCK)
    pad = n * _BLOCK - seq_len  # rows and keys past S: masked, so a block holding them is partial
    allowed = torch.nn.functional.pad(allowed, (0, pad, 0, pad))
    tiles = allowed.view(allowed.shape[0], n, _BLOCK, n, _BLOCK)
    full = tiles.all(4).all(2)  # (B, n, n): every pair allowed, the kernel skips the mask_mod
    partial = tiles.any(4).any(2) & ~full  # some pairs allowed
    out = []
    for blocks in (partial, full):
        # the kv blocks of each query block, listed first in ascending order (create_block_mask's)
        idx = torch.argsort(blocks.to(torch.int8), dim=-1, descending=True, stable=True)
        out += [blocks.sum(-1, dtype=torch.int32)[:, None], idx.to(torch.int32)[:, None]]
    return [t.contiguous() for t in out]


@_block_tensors_op.register_fake
def _(seg_offsets: torch.Tensor | None, seq_len: int, device: torch.device) -> list[torch.Tensor]:
    B = 1 if seg_offsets is None else seg_offsets.shape[0]
    n = -(-seq_len // _BLOCK)  # blocks per side
    new = lambda *shape: torch.empty(shape, dtype=torch.int32, device=device)  # noqa: E731
    return [new(B, 1, n), new(B, 1, n, n), new(B, 1, n), new(B, 1, n, n)]


def _build_block_mask(S: int, device, causal: bool, seg_offsets):
    """The layout's BlockMask inside a compiled graph: block tensors from ``_block_tensors_op``,
    the ``mask_mod`` over the bounds op's buffers."""
    if seg_offsets is None and not causal:
        return None
    mod = _causal
    if seg_offsets is not None:
        seg_offsets = seg_offsets.to(device)
        mod = _interval_mask_mod(*retrieval_bounds(seg_offsets, S))
    kv_n, kv_i, full_n, full_i = _block_tensors_op(seg_offsets, S, torch.device(device))
    return BlockMask.from_kv_blocks(
        kv_n, kv_i, full_n, full_i, BLOCK_SIZE=_BLOCK, mask_mod=mod, seq_lengths=(S, S)
    )


def flex_varlen_attention(
    q, k, v, cu_seqlens, *, causal: bool = False, scale=None, compiled: bool | None = None
):
    """Packed ``(T, H, D)`` attention over the sequences of ``cu_seqlens`` (zero past the last)."""
    _require()
    T = q.shape[0]
    mask = block_mask_for(seq_len=T, device=q.device, causal=causal, cu_seqlens=cu_seqlens)
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    as_batch = lambda t: t.transpose(0, 1)[None]  # noqa: E731  (T, H, D) -> (1, H, T, D)
    return _call(as_batch(q), as_batch(k), as_batch(v), mask, scale, compiled)[0].transpose(0, 1)
