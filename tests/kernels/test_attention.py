"""Fused attention (csrc/attention) against the plain-PyTorch reference, on the CPU.

Every layout (dense, causal, retrieval block layout, packed varlen) forward and backward, fp32 and
bf16, random shapes; opcheck on each layout; fp64 gradcheck; the backend switch and its fallback;
each vector ISA the CPU has (generic, AVX2, AVX-512) forced in turn, forward and backward.
When a C++ compiler is present the extension must build: a build failure fails these tests.
"""

from __future__ import annotations

import logging
import os

import pytest
import torch

from parallel.kernels import _attention_ops, _build, autotune
from parallel.kernels import attention as A


@pytest.fixture(scope="module")
def fused():
    ok, why = A.fused_available()
    if not ok:
        has_cc, _ = _build.compiler_available()
        if has_cc and _attention_ops.DISABLE_ENV not in os.environ:
            pytest.fail(f"compiler present but the attention extension did not build: {why}")
        pytest.skip(f"fused attention unavailable: {why}")
    return torch.ops.rag_attn


# ----------------------------------------------------------------------------- random layouts
def random_seg_offsets(gen: torch.Generator, B: int, S: int, n_docs: int) -> torch.Tensor:
    """(B, n_docs + 2) int32: n_docs documents (some possibly empty), a query, then padding."""
    rows = []
    for _ in range(B):
        end = int(torch.randint(S // 2, S + 1, (1,), generator=gen))  # up to half padding
        cuts = torch.randint(0, end + 1, (n_docs,), generator=gen).sort().values.tolist()
        rows.append([0, *cuts, end])
    return torch.tensor(rows, dtype=torch.int32)


def random_cu_seqlens(gen: torch.Generator, B: int, max_len: int) -> torch.Tensor:
    lens = torch.randint(0, max_len + 1, (B,), generator=gen)
    lens[0] = max_len  # the longest sequence is max_len
    return torch.cat([torch.zeros(1, dtype=torch.long), lens.cumsum(0)]).to(torch.int32)


def make_case(layout: str, dtype, seed: int):
    """q, k, v and the keyword arguments of one random case of ``layout``."""
    gen = torch.Generator().manual_seed(seed)
    H = int(torch.randint(1, 4, (1,), generator=gen))
    D = [16, 32, 64, 80][int(torch.randint(0, 4, (1,), generator=gen))]
    if layout == "varlen":
        B = int(torch.randint(1, 5, (1,), generator=gen))
        cu = random_cu_seqlens(gen, B, int(torch.randint(40, 200, (1,), generator=gen)))
        T = int(cu[-1]) + 3  # 3 trailing tokens outside every sequence: zero output
        shape = (T, H, D)
        extra = dict(cu_seqlens=cu, max_seqlen=int((cu[1:] - cu[:-1]).max()), causal=bool(seed % 2))
    else:
        B = int(torch.randint(1, 3, (1,), generator=gen))
        S = int(torch.randint(30, 300, (1,), generator=gen))
        shape = (B, H, S, D)
        extra = {"causal": layout == "causal"}
        if layout == "retrieval":
            extra = {
                "seg_offsets": random_seg_offsets(
                    gen, B, S, int(torch.randint(0, 5, (1,), generator=gen))
                )
            }
    q, k, v = (torch.randn(shape, generator=gen, dtype=torch.float32).to(dtype) for _ in range(3))
    return q, k, v, extra


def run(backend: str, q, k, v, extra):
    if "cu_seqlens" in extra:
        return A.varlen_attention(
            q,
            k,
            v,
            extra["cu_seqlens"],
            extra["max_seqlen"],
            causal=extra["causal"],
            backend=backend,
        )
    return A.attention(q, k, v, backend=backend, **extra)


def out_and_grads(backend, q, k, v, extra, grad):
    q, k, v = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    o = run(backend, q, k, v, extra)
    return [o.detach(), *torch.autograd.grad(o, (q, k, v), grad)]


LAYOUTS = ["dense", "causal", "retrieval", "varlen"]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("seed", [0, 1])
def test_fp32_matches_reference(fused, layout, seed):
    q, k, v, extra = make_case(layout, torch.float32, seed)
    grad = torch.randn_like(q)
    got = out_and_grads("fused", q, k, v, extra, grad)
    ref = out_and_grads("reference", q, k, v, extra, grad)
    for name, g, r in zip(["out", "dq", "dk", "dv"], got, ref):
        torch.testing.assert_close(
            g,
            r,
            atol=2e-5,
            rtol=1e-4,
            msg=lambda m: f"{layout} {name}: {m}",  # noqa: B023
        )


@pytest.mark.parametrize("layout", LAYOUTS)
def test_bf16_within_twice_lowp_error(fused, layout):
    """bf16 kernel error against the fp64 truth <= 2x that of a pure-bf16 reference (+ slack)."""
    q, k, v, extra = make_case(layout, torch.bfloat16, seed=3)
    grad = torch.randn_like(q)
    truth = [
        t.double()
        for t in out_and_grads("reference", *(t.double() for t in (q, k, v)), extra, grad.double())
    ]
    got = out_and_grads("fused", q, k, v, extra, grad)
    base = _lowp_reference_errors(q, k, v, extra, grad, truth)
    for name, g, t, b in zip(["out", "dq", "dk", "dv"], got, truth, base):
        err = (g.double() - t).abs().max().item()
        assert err <= 2 * b + 1e-2, (
            f"{layout} {name}: bf16 error {err:.4g} vs pure-bf16 reference {b:.4g}"
        )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layout", ["dense", "causal", "retrieval"])
def test_long_odd_offsets(fused, layout, dtype):
    """Several key blocks (S > 256), a query-tile tail, odd segment offsets (bf16 pairs keys)."""
    S, D = 587, 48
    gen = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(2, 2, S, D, generator=gen).to(dtype) for _ in range(3))
    grad = torch.randn(2, 2, S, D, generator=gen).to(dtype)
    extra = {"causal": layout == "causal"}
    if layout == "retrieval":
        extra = {
            "seg_offsets": torch.tensor(
                [[0, 101, 230, 231, 377, 571], [0, 3, 300, 301, 500, 587]], dtype=torch.int32
            )
        }
    got = out_and_grads("fused", q, k, v, extra, grad)
    truth = out_and_grads("reference", *(t.double() for t in (q, k, v)), extra, grad.double())
    tol = 2e-5 if dtype == torch.float32 else 5e-2
    for name, g, t in zip(["out", "dq", "dk", "dv"], got, truth):
        torch.testing.assert_close(g.double(), t, atol=tol, rtol=0, msg=lambda m: f"{name}: {m}")  # noqa: B023


def _lowp_reference_errors(q, k, v, extra, grad, truth):
    """Reference attention with every intermediate rounded to bf16 (scores, probs, output)."""

    def lowp(q, k, v, causal=False, seg_offsets=None):
        S = q.shape[-2]
        s = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5  # bf16 matmul
        allowed = (
            A.layout_mask(seg_offsets, S)
            if seg_offsets is not None
            else (torch.ones(S, S, dtype=torch.bool).tril() if causal else None)
        )
        if allowed is not None:
            s = s.masked_fill(~allowed, float("-inf"))
        p = torch.nan_to_num(torch.softmax(s, -1), nan=0.0)
        return p @ v

    def run_lowp(q, k, v):
        if "cu_seqlens" in extra:
            out = torch.zeros_like(q)
            b = extra["cu_seqlens"].tolist()
            parts = []
            for a, e in zip(b[:-1], b[1:]):
                seq = lambda t, a=a, e=e: t[a:e].transpose(0, 1)[None]  # noqa: E731
                parts.append((a, e, lowp(seq(q), seq(k), seq(v), causal=extra["causal"])))
            for a, e, o in parts:
                out = out.index_copy(0, torch.arange(a, e), o[0].transpose(0, 1))
            return out
        return lowp(q, k, v, **extra)

    q, k, v = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    o = run_lowp(q, k, v)
    got = [o.detach(), *torch.autograd.grad(o, (q, k, v), grad)]
    return [(g.double() - t).abs().max().item() for g, t in zip(got, truth)]


def test_padding_rows_zero(fused):
    q, k, v = (torch.randn(1, 2, 40, 16, requires_grad=True) for _ in range(3))
    seg = torch.tensor([[0, 10, 20, 30]], dtype=torch.int32)  # rows 30..39 are padding
    o = A.attention(q, k, v, seg_offsets=seg, backend="fused")
    assert o[:, :, 30:].abs().max() == 0
    o.sum().backward()
    assert q.grad[:, :, 30:].abs().max() == 0 and k.grad[:, :, 30:].abs().max() == 0


def test_noncontiguous_inputs(fused):
    """(B, S, H, D) projections viewed as (B, H, S, D), as a model produces them."""
    x = torch.randn(3, 2, 50, 3, 32).unbind(0)
    q, k, v = (t.transpose(1, 2) for t in x)
    torch.testing.assert_close(
        A.attention(q, k, v, causal=True, backend="fused"),
        A.reference_attention(q, k, v, causal=True),
        atol=2e-5,
        rtol=1e-4,
    )


def test_mixed_dtypes_raise(fused):
    """fp32 q with bf16 k and v (what RoPE under autocast can hand attention): the kernel reads
    all three buffers as q's dtype, so it must refuse rather than read bf16 bytes as fp32."""
    q = torch.randn(1, 2, 30, 16)
    k, v = (torch.randn(1, 2, 30, 16, dtype=torch.bfloat16) for _ in range(2))
    seg = torch.tensor([[0, 10, 20, 30]], dtype=torch.int32)
    with pytest.raises(RuntimeError, match="same dtype"):
        A.attention(q, k, v, seg_offsets=seg, backend="fused")


# ----------------------------------------------------------------------------- opcheck / gradcheck
def _op_args(layout, dtype, seed=5, small=True):
    q, k, v, extra = make_case(layout, dtype, seed)
    if small:  # gradcheck is O(numel^2): shrink
        if layout == "varlen":
            cu = torch.tensor([0, 7, 7, 19], dtype=torch.int32)
            q, k, v = (torch.randn(21, 2, 8, dtype=dtype) for _ in range(3))
            extra = dict(cu_seqlens=cu, max_seqlen=12, causal=True)
        else:
            q, k, v = (torch.randn(1, 2, 19, 8, dtype=dtype) for _ in range(3))
            if layout == "retrieval":
                extra = {"seg_offsets": torch.tensor([[0, 5, 5, 11, 17]], dtype=torch.int32)}
    seg = extra.get("seg_offsets")
    cu = extra.get("cu_seqlens")
    causal = extra.get("causal", False) and seg is None
    q, k, v = (t.requires_grad_(True) for t in (q, k, v))
    return (q, k, v, seg, cu, extra.get("max_seqlen", 0), causal, q.shape[-1] ** -0.5)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_opcheck(fused, layout):
    torch.library.opcheck(fused.fwd, _op_args(layout, torch.float32, small=False))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_gradcheck_fp64(fused, layout):
    args = _op_args(layout, torch.float64)

    def f(q, k, v):
        return fused.fwd(q, k, v, *args[3:])[0]

    assert torch.autograd.gradcheck(f, args[:3], eps=1e-6, atol=1e-5)


def test_bwd_opcheck(fused):
    q, k, v, seg, cu, ms, causal, scale = _op_args("retrieval", torch.float32)
    out, lse = fused.fwd(q, k, v, seg, cu, ms, causal, scale)
    args = (
        torch.randn_like(out),
        q.detach(),
        k.detach(),
        v.detach(),
        out.detach(),
        lse,
        seg,
        cu,
        ms,
        causal,
        scale,
    )
    torch.library.opcheck(fused.bwd, args)


# ----------------------------------------------------------------------------- baselines + switch
@pytest.mark.parametrize("layout", ["retrieval", "varlen"])
def test_sdpa_baselines_match_reference(layout):
    """The SDPA paths (dense mask / padded) the benchmark compares against compute the same
    thing."""
    q, k, v, extra = make_case(layout, torch.float32, seed=7)
    torch.testing.assert_close(
        run("sdpa", q, k, v, extra), run("reference", q, k, v, extra), atol=2e-5, rtol=1e-4
    )


def test_auto_picks_fused_with_reason(fused, caplog, monkeypatch):
    monkeypatch.setenv(autotune.ENV, "0")  # the fixed rule (measuring is test_autotune.py)
    q = torch.randn(1, 1, 4, 8)
    assert A.select_backend("auto", q, "retrieval")[0] == "fused"  # fused on every CPU row
    assert A.select_backend("auto", q.half())[0] == "sdpa"  # no fp16 CPU kernel: says why
    assert "float16" in A.select_backend("auto", q.half())[1]
    with pytest.raises(ValueError):
        A.select_backend("flash", q)


def test_fallback_to_sdpa_logged_once(monkeypatch, caplog):
    monkeypatch.setattr(
        A, "fused_available", lambda: (False, "no C++ compiler ('c++' not on PATH)")
    )
    monkeypatch.setattr(A, "_logged", set())
    q, k, v = (torch.randn(1, 2, 16, 8) for _ in range(3))
    with caplog.at_level(logging.INFO, logger=A.__name__):
        for _ in range(3):
            out = A.attention(q, k, v, causal=True, backend="auto")
    torch.testing.assert_close(
        out, A.reference_attention(q, k, v, causal=True), atol=2e-5, rtol=1e-4
    )
    msgs = [r.getMessage() for r in caplog.records if "attention backend" in r.getMessage()]
    assert msgs == [
        "attention backend: sdpa (fused unavailable: no C++ compiler ('c++' not on PATH))"
    ]
    with pytest.raises(RuntimeError, match="unavailable"):
        A.attention(q, k, v, backend="fused")


# ----------------------------------------------------------------------------- per-ISA kernels
# The op picks its vector kernels at run time (csrc/attention/cpu/isa.h): AVX-512, AVX2 or the
# generic BLAS + loops path. Each ISA this CPU supports is forced in turn (rag_attn::cpu_set_isa,
# the in-process twin of RAG_ATTN_ISA) and checked on every layout, with query-tile and key-block
# tails (S = 299: 4 full 64-row tiles + 43 rows, whose last 8-lane chunk holds 3; key blocks of
# 128 (AVX2) or 256 (AVX-512) + 43); head size 20 takes the generic kernels under every ISA.
ISA_ORDER = ["generic", "avx2", "avx512"]


def _available_isas() -> list[str]:
    ok, _ = A.fused_available()
    if not ok:
        return ["generic"]
    best = A.kernel_isa(best=True)
    return ISA_ORDER[: ISA_ORDER.index(best) + 1]


@pytest.fixture
def force_isa(fused):
    """Set the kernel ISA for one test; restores the CPU's default afterwards."""
    before = fused.cpu_isa()

    def force(isa: str) -> None:
        if isa not in _available_isas():
            pytest.skip(f"this CPU has no {isa}")
        fused.cpu_set_isa(isa)
        assert fused.cpu_isa() == isa

    yield force
    fused.cpu_set_isa(before)


def _isa_case(layout: str, dtype, D: int, seed: int = 11):
    gen = torch.Generator().manual_seed(seed)
    if layout == "varlen":
        cu = torch.tensor([0, 299, 300, 313, 390], dtype=torch.int32)  # 299, 1, 13 and 77 tokens
        shape = (393, 2, D)  # 3 tokens after the last sequence
        extra = dict(cu_seqlens=cu, max_seqlen=299, causal=True)
    else:
        shape = (1, 2, 299, D)
        extra = {"causal": layout == "causal"}
        if layout == "retrieval":
            extra = {"seg_offsets": torch.tensor([[0, 37, 37, 170, 171, 290]], dtype=torch.int32)}
    q, k, v = (torch.randn(shape, generator=gen).to(dtype) for _ in range(3))
    return q, k, v, extra, torch.randn(shape, generator=gen).to(dtype)


@pytest.mark.parametrize("isa", ISA_ORDER)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_forced_isa_matches_reference(force_isa, fused, isa, dtype, layout):
    force_isa(isa)
    # head size 64 (every vector kernel) on dense / retrieval, 40 (AVX2 kernels, also when avx512 is
    # forced: D % 16 != 0) on causal / varlen
    D = 64 if layout in ("dense", "retrieval") else 40
    q, k, v, extra, grad = _isa_case(layout, dtype, D)
    got = out_and_grads("fused", q, k, v, extra, grad)
    truth = out_and_grads("reference", *(t.double() for t in (q, k, v)), extra, grad.double())
    # fp32: the kernels' fp32 accumulation; bf16: inputs and outputs rounded to bf16 (8 bits)
    tol = dict(atol=2e-5, rtol=1e-4) if dtype == torch.float32 else dict(atol=5e-2, rtol=0)
    for name, g, t in zip(["out", "dq", "dk", "dv"], got, truth):
        torch.testing.assert_close(
            g.double(),
            t,
            **tol,
            msg=lambda m: f"{isa} {layout} D={D} {name}: {m}",  # noqa: B023
        )


@pytest.mark.parametrize("isa", ISA_ORDER)
def test_kernel_choice_per_isa(force_isa, fused, isa):
    """Which kernel a (dtype, head size) runs under each ISA; the rest goes to the generic one."""
    force_isa(isa)
    vec = {"generic": "generic", "avx2": "avx2", "avx512": "avx512"}[isa]
    assert fused.cpu_kernel(torch.float32, 64) == vec
    assert fused.cpu_kernel(torch.float32, 40) == ("generic" if isa == "generic" else "avx2")
    assert fused.cpu_kernel(torch.float32, 20) == "generic"  # D % 8 != 0
    assert fused.cpu_kernel(torch.float64, 64) == "generic"
    q, k, v = (torch.randn(1, 2, 70, 20) for _ in range(3))  # the generic path under every ISA
    torch.testing.assert_close(
        A.attention(q, k, v, causal=True, backend="fused"),
        A.reference_attention(q, k, v, causal=True),
        atol=2e-5,
        rtol=1e-4,
    )


def test_isa_env_override_and_auto_reason(fused):
    """RAG_ATTN_ISA caps the ISA from the first call on; auto's reason names the kernel ISA."""
    import subprocess
    import sys

    code = (
        "import torch; from parallel.kernels import attention as A; A.fused_available(); "
        "print(torch.ops.rag_attn.cpu_isa(), A.cpu_capability(), "
        "A.select_backend('auto', torch.randn(1, 1, 8, 64), 'retrieval')[1])"
    )
    env = dict(os.environ, RAG_ATTN_ISA="generic", **{autotune.ENV: "0"})
    res = subprocess.run(
        [sys.executable, "-c", code],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
    )
    assert res.returncode == 0, res.stderr[-2000:]
    isa, cap, reason = res.stdout.split(maxsplit=2)
    assert (isa, cap) == ("generic", "generic") and "generic" in reason, res.stdout
    with pytest.raises(RuntimeError, match="unknown CPU ISA"):
        fused.cpu_set_isa("sse9")
