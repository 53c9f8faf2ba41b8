"""Grouped-query attention through ``parallel.kernels.attention.attention``: K/V with fewer heads
than q give what the same K/V repeated to q's heads give (HF's ``repeat_kv``), outputs and
gradients, on every CPU backend; flex reads them without a copy."""

from __future__ import annotations

import pytest
import torch

from parallel.kernels import attention as A
from parallel.kernels import flex


def _offsets():
    # 2 docs + query, padding
    return torch.tensor([[0, 20, 36, 60], [0, 12, 30, 44]], dtype=torch.int32)


@pytest.mark.parametrize("backend", ["reference", "sdpa", "flex"])
@pytest.mark.parametrize("layout", ["retrieval", "causal"])
def test_gqa_equals_repeated_heads(backend, layout):
    if backend == "flex" and not flex.available()[0]:
        pytest.skip(flex.available()[1])
    g = torch.Generator().manual_seed(0)
    B, H, Hkv, S, D = 2, 4, 2, 64, 16
    q, k, v = (torch.randn(B, h, S, D, generator=g, dtype=torch.float64) for h in (H, Hkv, Hkv))
    kw = {"seg_offsets": _offsets()} if layout == "retrieval" else {"causal": True}
    go = torch.randn(B, H, S, D, generator=g, dtype=torch.float64)

    def run(kk, vv):
        qq, kk, vv = (t.clone().requires_grad_() for t in (q, kk, vv))
        o = A.attention(qq, kk, vv, backend=backend, **kw)
        o.backward(go)
        return o, qq.grad, kk.grad, vv.grad

    o1, dq1, dk1, dv1 = run(k, v)
    o2, dq2, dk2, dv2 = run(k.repeat_interleave(2, 1), v.repeat_interleave(2, 1))
    torch.testing.assert_close(o1, o2)
    torch.testing.assert_close(dq1, dq2)
    # a shared K/V head's gradient is the sum over the query heads that read it
    torch.testing.assert_close(dk1, dk2.view(B, Hkv, 2, S, D).sum(2))
    torch.testing.assert_close(dv1, dv2.view(B, Hkv, 2, S, D).sum(2))


def test_flex_gets_kv_heads_uncopied(monkeypatch):
    if not flex.available()[0]:
        pytest.skip(flex.available()[1])
    seen = []
    real = flex._eager
    monkeypatch.setattr(
        flex, "_eager", lambda q, k, v, *a: (seen.append(k.shape[1]), real(q, k, v, *a))[1]
    )
    q, k, v = torch.randn(1, 4, 16, 8), torch.randn(1, 2, 16, 8), torch.randn(1, 2, 16, 8)
    with torch.no_grad():
        A.attention(q, k, v, causal=True, backend="flex")
    assert seen == [2]


def test_bad_head_counts_are_refused():
    q, k = torch.randn(1, 4, 8, 8), torch.randn(1, 3, 8, 8)
    with pytest.raises(ValueError, match="head count dividing"):
        A.attention(q, k, k, backend="sdpa")
