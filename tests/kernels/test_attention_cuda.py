"""CUDA side of the fused attention: an nvcc compile check that runs without a GPU, and the
numerical tests of test_attention.py repeated on a CUDA device (``-m gpu``)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from torch.utils import cpp_extension

from parallel.kernels import _attention_ops
from parallel.kernels import attention as A

from .test_attention import LAYOUTS, make_case, out_and_grads

HAVE_NVCC = cpp_extension.CUDA_HOME is not None and (Path(cpp_extension.CUDA_HOME) / "bin" / "nvcc").exists()


@pytest.mark.slow
@pytest.mark.skipif(not HAVE_NVCC or torch.version.cuda is None, reason="needs nvcc and a CUDA build of torch")
def test_cuda_sources_compile_with_nvcc(tmp_path):
    ok, log = _attention_ops.compile_cuda_check(str(tmp_path))
    assert ok, log[-4000:]
    assert any(p.suffix == ".o" for p in tmp_path.iterdir())


def _cuda(t):
    return t.cuda() if isinstance(t, torch.Tensor) else t


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_matches_reference(layout, dtype):
    ok, why = A.fused_available()
    assert ok, why
    q, k, v, extra = make_case(layout, dtype, seed=11)
    q, k, v = (t.cuda() for t in (q, k, v))
    extra = {key: _cuda(val) for key, val in extra.items()}
    grad = torch.randn_like(q)
    got = out_and_grads("fused", q, k, v, extra, grad)
    ref = out_and_grads("reference", q, k, v, extra, grad)
    tol = dict(atol=1e-4, rtol=1e-3) if dtype == torch.float32 else dict(atol=3e-2, rtol=3e-2)
    for name, g, r in zip(["out", "dq", "dk", "dv"], got, ref):
        torch.testing.assert_close(g.float(), r.float(), **tol, msg=lambda m: f"{layout} {name}: {m}")  # noqa: B023


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_opcheck():
    ok, why = A.fused_available()
    assert ok, why
    q, k, v = (torch.randn(2, 2, 70, 32, device="cuda", requires_grad=True) for _ in range(3))
    seg = torch.tensor([[0, 20, 40, 60], [0, 10, 10, 70]], dtype=torch.int32, device="cuda")
    torch.library.opcheck(torch.ops.rag_attn.fwd, (q, k, v, seg, None, 0, False, 32**-0.5))


def test_compile_check_reports_nvcc_errors(tmp_path, monkeypatch):
    """A broken source must make the check fail (so the compile test can fail)."""
    if not HAVE_NVCC or shutil.which("c++") is None:
        pytest.skip("needs nvcc")
    bad = tmp_path / "bad.cu"
    bad.write_text("this is not C++\n")
    monkeypatch.setattr(_attention_ops, "CUDA_SOURCES", [str(bad)])
    ok, log = _attention_ops.compile_cuda_check(str(tmp_path))
    assert not ok and "error" in log.lower()
