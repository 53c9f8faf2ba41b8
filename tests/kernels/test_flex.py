"""FlexAttention backend against the plain-PyTorch reference on the CPU, and the ``auto`` table.

Dense, causal, retrieval (padding rows, empty documents) and packed varlen layouts, forward and
backward, fp32 and bf16, through eager flex_attention (compiling costs seconds per shape), plus one
compiled case. The ``auto`` choice per layout under a monkeypatched CPU capability, with its log.
"""

from __future__ import annotations

import logging
import re

import pytest
import torch

from parallel.kernels import attention as A
from parallel.kernels import autotune
from parallel.kernels import flex as F

pytestmark = pytest.mark.skipif(not F.available()[0], reason=F.available()[1])


def _case(layout: str, dtype=torch.float32, S: int = 37, D: int = 16, seed: int = 0):
    """q, k, v and keyword arguments; S = 37 is not a multiple of any block size."""
    gen = torch.Generator().manual_seed(seed)
    if layout == "varlen":
        # an empty sequence; 2 tokens past the end
        cu = torch.tensor([0, 9, 9, 30, 33], dtype=torch.int32)
        shape, extra = (35, 2, D), dict(cu_seqlens=cu, max_seqlen=21, causal=bool(seed % 2))
    else:
        shape, extra = (2, 2, S, D), {"causal": layout == "causal"}
        if layout == "retrieval":
            # row 0: docs 0..9, an empty doc, 10..20, query 20..29, padding 29..36
            # row 1: an empty first doc, doc 0..17, query 17..37 (no padding)
            extra = {
                "seg_offsets": torch.tensor(
                    [[0, 10, 10, 20, 29], [0, 0, 17, 17, S]], dtype=torch.int32
                )
            }
    q, k, v, g = (torch.randn(shape, generator=gen).to(dtype) for _ in range(4))
    return q, k, v, g, extra


def _out_and_grads(fn, q, k, v, g, extra):
    q, k, v = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    o = fn(q, k, v, extra)
    return [o.detach(), *torch.autograd.grad(o, (q, k, v), g)]


def _flex(compiled):
    def fn(q, k, v, extra):
        if "cu_seqlens" in extra:
            return F.flex_varlen_attention(
                q, k, v, extra["cu_seqlens"], causal=extra["causal"], compiled=compiled
            )
        return F.flex_attention(q, k, v, compiled=compiled, **extra)

    return fn


def _reference(q, k, v, extra):
    if "cu_seqlens" in extra:
        return A.reference_varlen_attention(q, k, v, extra["cu_seqlens"], causal=extra["causal"])
    return A.reference_attention(q, k, v, **extra)


LAYOUTS = ["dense", "causal", "retrieval", "varlen"]
NAMES = ["out", "dq", "dk", "dv"]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("seed", [0, 1])
def test_fp32_matches_reference(layout, seed):
    q, k, v, g, extra = _case(layout, seed=seed)
    got = _out_and_grads(_flex(False), q, k, v, g, extra)
    ref = _out_and_grads(_reference, q, k, v, g, extra)
    for name, a, b in zip(NAMES, got, ref):
        torch.testing.assert_close(
            a,
            b,
            atol=2e-5,
            rtol=1e-4,
            msg=lambda m: f"{layout} {name}: {m}",  # noqa: B023
        )


@pytest.mark.parametrize("layout", LAYOUTS)
def test_bf16_close_to_fp32_reference(layout):
    """bf16 in, fp32 reference on the same (bf16-rounded) inputs: error within a few bf16 ulps of
    O(1)."""
    q, k, v, g, extra = _case(layout, torch.bfloat16, seed=2)
    got = _out_and_grads(_flex(False), q, k, v, g, extra)
    ref = _out_and_grads(_reference, q.float(), k.float(), v.float(), g.float(), extra)
    for name, a, b in zip(NAMES, got, ref):
        assert a.dtype == torch.bfloat16
        # bf16 keeps 8 mantissa bits (eps 2^-8 = 0.0039); outputs and gradients here are O(1) after
        # one rounding of the result and of a few O(1) intermediates
        torch.testing.assert_close(
            a.float(),
            b,
            atol=3e-2,
            rtol=2e-2,
            msg=lambda m: f"{layout} {name}: {m}",  # noqa: B023
        )


def test_padding_rows_and_empty_docs_zero():
    q, k, v, g, extra = _case("retrieval")
    got = _out_and_grads(_flex(False), q, k, v, g, extra)
    for name, t in zip(NAMES, got):
        assert t[0, :, 29:].abs().max() == 0, f"{name} nonzero on padding rows"
    for seed in (0, 1):  # non-causal and causal
        q, k, v, g, extra = _case("varlen", seed=seed)
        got = _out_and_grads(_flex(False), q, k, v, g, extra)
        for name, t in zip(NAMES, got):
            assert t[33:].abs().max() == 0, f"varlen {name} nonzero past cu_seqlens[-1]"


def test_compiled_retrieval_matches_reference():
    """The inductor kernel (compiled once, S and head size above the CPU gate) on the retrieval
    layout."""
    ok, why = F._compile_gate(torch.device("cpu"))
    if not ok:
        pytest.skip(f"flex compile unavailable: {why}")
    S, D = 80, 32
    q, k, v, g, _ = _case("retrieval", S=S, D=D, seed=4)
    extra = {
        "seg_offsets": torch.tensor([[0, 30, 30, 50, 71], [0, 0, 40, 41, S]], dtype=torch.int32)
    }
    got = _out_and_grads(_flex(True), q, k, v, g, extra)
    ref = _out_and_grads(_reference, q, k, v, g, extra)
    for name, a, b in zip(NAMES, got, ref):
        torch.testing.assert_close(
            a,
            b,
            atol=2e-5,
            rtol=1e-4,
            msg=lambda m: f"compiled {name}: {m}",  # noqa: B023
        )
    assert not F._compile_off, f"compile fell back to eager: {F._compile_off}"


def test_flex_traced_into_a_compiled_graph_matches_reference():
    """Inside ``torch.compile`` (Inductor, fullgraph) the block mask and its key bounds are built
    in the graph from the offsets, and flex is lowered with them, as in a compiled block's
    evaluation: forward (the CPU has no flex backward to lower), grouped K/V heads, padding rows and
    an empty document, against the reference."""
    ok, why = F._compile_gate(torch.device("cpu"))
    if not ok:
        pytest.skip(f"flex compile unavailable: {why}")
    B, Hq, Hkv, S, D = 2, 4, 2, 96, 32
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(B, Hq, S, D, generator=gen)
    k, v = (torch.randn(B, Hkv, S, D, generator=gen) for _ in range(2))
    offsets = torch.tensor([[0, 30, 30, 55, 80], [0, 20, 41, 60, S]], dtype=torch.int32)

    def call(q, k, v, offsets):
        return A.attention(q, k, v, seg_offsets=offsets, backend="flex")

    with torch.no_grad():
        got = torch.compile(call, backend="inductor", fullgraph=True)(q, k, v, offsets)
        rep = Hq // Hkv
        ref = A.reference_attention(
            q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1), seg_offsets=offsets
        )
    torch.testing.assert_close(got, ref, atol=2e-5, rtol=1e-4)


def test_block_tensors_op_is_create_block_mask():
    """The opaque op an inference graph builds its BlockMask from gives create_block_mask's block
    tensors: counts of partial and full blocks per query block and the blocks they list, on
    random retrieval layouts (empty documents, padding, lengths off the 128 grid) and causal."""
    from torch.nn.attention.flex_attention import create_block_mask

    gen = torch.Generator().manual_seed(3)
    for S in (96, 300, 700):
        rows = []
        for _ in range(4):
            d1, d2, q = (int(torch.randint(0, S // 3, (1,), generator=gen)) for _ in range(3))
            rows.append([0, d1, d1 + d2, d1 + d2 + q + 1])
        for offsets in (torch.tensor(rows, dtype=torch.int32), None):
            got = F._block_tensors_op(offsets, S, torch.device("cpu"))
            if offsets is None:
                bm = create_block_mask(F._causal, None, None, S, S, device="cpu")
            else:
                bm = F._retrieval_block_mask(offsets, S, "cpu")
            want = (bm.kv_num_blocks, bm.kv_indices, bm.full_kv_num_blocks, bm.full_kv_indices)
            assert [t.shape for t in got] == [t.shape for t in want]
            for n_got, i_got, n_want, i_want in ((*got[:2], *want[:2]), (*got[2:], *want[2:])):
                assert torch.equal(n_got, n_want), (S, offsets)
                listed = torch.arange(i_want.shape[-1]) < n_want[..., None]  # the entries read
                assert torch.equal(i_got[listed], i_want[listed]), (S, offsets)


def test_inference_graph_takes_the_block_tensors_from_the_opaque_op():
    """A compiled inference graph gets the BlockMask's block tensors from ``rag_flex::
    block_tensors`` (traced, Inductor fuses their building into the flex kernel, which faults on
    CUDA), and still matches the reference."""
    seen = []

    def backend(gm, example_inputs):
        seen.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm.forward

    B, H, S, D = 2, 2, 40, 16
    gen = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(B, H, S, D, generator=gen) for _ in range(3))
    offsets = torch.tensor([[0, 10, 10, 30], [0, 12, 25, S]], dtype=torch.int32)

    def call(q, k, v, offsets):
        return F.flex_attention(q, k, v, seg_offsets=offsets)

    with torch.no_grad():
        got = torch.compile(call, backend=backend, fullgraph=True)(q, k, v, offsets)
        ref = A.reference_attention(q, k, v, seg_offsets=offsets)
    assert any("rag_flex.block_tensors" in t for t in seen), seen
    torch.testing.assert_close(got, ref, atol=2e-5, rtol=1e-4)


def test_retrieval_bounds_are_the_layout():
    """The retrieval mask as one key interval per row (``retrieval_bounds``) allows exactly the
    reference layout's pairs, on random layouts with empty documents, padding and no documents."""
    from torch.nn.attention.flex_attention import create_mask

    from parallel.kernels.attention_ref import layout_mask

    gen = torch.Generator().manual_seed(0)
    for _ in range(30):
        B, S = 3, 40
        n_seg = int(torch.randint(1, 5, (1,), generator=gen))  # 0 to 3 documents and the query
        lengths = torch.randint(0, 10, (B, n_seg), generator=gen)
        offsets = torch.cat([torch.zeros(B, 1, dtype=torch.long), lengths.cumsum(1)], 1)
        lo, hi = F.retrieval_bounds(offsets.to(torch.int32), S)
        got = create_mask(F._interval_mask_mod(lo, hi), B, None, S, S, device="cpu")
        assert torch.equal(got, layout_mask(offsets, S).expand_as(got)), offsets.tolist()


def test_block_mask_cached_per_layout():
    """An offsets layout's mask is cached by the offsets tensor itself (its values are never read
    back to the host): the layers of a forward share it; another tensor, or the same one changed
    in place, gets a new one; the entry goes with its tensor."""
    seg = torch.tensor([[0, 5, 9, 16]], dtype=torch.int32)
    a = F.block_mask_for(seq_len=16, device="cpu", seg_offsets=seg)
    assert F.block_mask_for(seq_len=16, device="cpu", seg_offsets=seg) is a
    assert F.block_mask_for(seq_len=16, device="cpu", seg_offsets=seg.clone()) is not a
    seg[0, 1] = 6
    b = F.block_mask_for(seq_len=16, device="cpu", seg_offsets=seg)
    assert b is not a
    n = len(F._cache)
    del seg
    assert len(F._cache) == n - 1
    assert F.block_mask_for(seq_len=16, device="cpu", causal=True) is F.block_mask_for(
        seq_len=16, device="cpu", causal=True
    )
    assert F.block_mask_for(seq_len=16, device="cpu") is None


def test_backend_switch_routes_flex(monkeypatch):
    calls = []
    real = F.flex_attention
    monkeypatch.setattr(
        F, "flex_attention", lambda *a, **kw: calls.append("flex") or real(*a, **kw)
    )
    q, k, v, _, extra = _case("causal")
    torch.testing.assert_close(
        A.attention(q, k, v, backend="flex", **extra),
        A.reference_attention(q, k, v, **extra),
        atol=2e-5,
        rtol=1e-4,
    )
    assert calls == ["flex"]


def test_flex_missing_raises_and_auto_skips(monkeypatch, caplog):
    monkeypatch.setattr(F, "_flex_attention", None)
    q = torch.randn(1, 1, 8, 16)
    with pytest.raises(RuntimeError, match=re.escape(f"torch {torch.__version__}")):
        A.attention(q, q, q, backend="flex")
    ok, why = A._flex_gate(q)
    assert not ok and torch.__version__ in why
    # auto on CUDA logs why flex was skipped; the CUDA rule is checked without a GPU
    monkeypatch.setattr(A, "_flex_gate", lambda q: (False, why))
    assert A._auto_cuda(q, "retrieval", True, "ok") == (
        "fused",
        f"retrieval on CUDA: flex unavailable ({why}); fused kernel skips masked blocks",
    )


def test_cuda_rule():
    q = torch.randn(1, 1, 8, 16)
    assert A._auto_cuda(q, "dense", True, "ok")[0] == "sdpa"
    assert A._auto_cuda(q, "causal", True, "ok")[0] == "sdpa"


# ----------------------------------------------------------------------------- auto table
EXPECTED = {
    "avx2": {"dense": "fused", "causal": "fused", "packed": "fused", "retrieval": "fused"},
    "avx512": {"dense": "fused", "causal": "fused", "packed": "fused", "retrieval": "fused"},
    "generic": {"dense": "sdpa", "causal": "sdpa", "packed": "fused", "retrieval": "fused"},
    "default": {"dense": "sdpa", "causal": "sdpa", "packed": "fused", "retrieval": "fused"},
}


@pytest.mark.parametrize("cap", sorted(EXPECTED))
def test_auto_table_by_cpu_capability(monkeypatch, caplog, cap):
    # the fixed rule (measuring is tests/kernels/test_autotune.py)
    monkeypatch.setenv(autotune.ENV, "0")
    monkeypatch.setattr(A, "cpu_capability", lambda: cap)
    monkeypatch.setattr(A, "fused_available", lambda: (True, "fused kernels built"))
    monkeypatch.setattr(A, "_logged", set())
    used = []
    monkeypatch.setattr(A, "sdpa_attention", lambda *a, **kw: used.append("sdpa"))
    monkeypatch.setattr(A, "sdpa_varlen_attention", lambda *a, **kw: used.append("sdpa"))
    import parallel.kernels._attention_ops as ops

    monkeypatch.setattr(ops, "fused_forward", lambda *a, **kw: used.append("fused"))
    q = torch.randn(1, 2, 8, 16)
    seg = torch.tensor([[0, 3, 8]], dtype=torch.int32)
    cu = torch.tensor([0, 8], dtype=torch.int32)
    with caplog.at_level(logging.INFO, logger=A.__name__):
        for _ in range(2):  # logged once per (layout, dtype)
            A.attention(q, q, q, backend="auto")
            A.attention(q, q, q, causal=True, backend="auto")
            A.varlen_attention(
                q[0].transpose(0, 1), q[0].transpose(0, 1), q[0].transpose(0, 1), cu, 8
            )
            A.attention(q, q, q, seg_offsets=seg, backend="auto")
    assert used == [EXPECTED[cap][lay] for lay in ("dense", "causal", "packed", "retrieval")] * 2
    msgs = [r.getMessage() for r in caplog.records if "attention backend" in r.getMessage()]
    assert len(msgs) == 4, msgs
    row = cap if cap in A.CPU_AUTO_TABLE else f"generic (no row for {cap})"
    for lay, msg in zip(("dense", "causal", "packed", "retrieval"), msgs):
        assert msg.startswith(
            f"attention backend: {EXPECTED[cap][lay]} ({lay} float32 on a {row} CPU"
        ), msg


def test_cpu_capability_reads_torch_without_the_extension(monkeypatch):
    monkeypatch.setattr(A, "fused_available", lambda: (False, "no C++ compiler"))
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")
    assert A.cpu_capability() == "avx512"


def test_cpu_capability_is_the_kernel_isa():
    ok, why = A.fused_available()
    if not ok:
        pytest.skip(why)
    assert A.cpu_capability() == A.kernel_isa() == torch.ops.rag_attn.cpu_isa()
    assert A.kernel_isa(best=True) in ("avx512", "avx2", "generic")
