"""CUDA side of the fused attention: the CUDA build through the project's own build, which runs
without a GPU (scripts/cuda_build.py, `make cuda-build`), and the numerical tests of
test_attention.py repeated on a CUDA device (``-m gpu``)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.utils import cpp_extension

from parallel.kernels import _build
from parallel.kernels import attention as A

from .test_attention import LAYOUTS, make_case, out_and_grads

ROOT = Path(__file__).resolve().parents[2]


def _cuda_build():
    spec = importlib.util.spec_from_file_location("cuda_build", ROOT / "scripts" / "cuda_build.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["cuda_build"] = mod
    spec.loader.exec_module(mod)
    return mod


def _toolkit(cb) -> Path | None:
    """A CUDA toolkit already on this machine: `make cuda-build`'s PyPI one, else torch's
    CUDA_HOME."""
    for folder in sorted(cb.toolkit_cache().glob("cuda*/toolkit.json")):
        home = cb._cuda_home_in(folder.parent)
        if home is not None:
            return home
    home = cpp_extension.CUDA_HOME
    return Path(home) if home and (Path(home) / "bin" / "nvcc").exists() else None


def test_every_cuda_source_is_built_and_its_kernels_are_found():
    """Each .cu of csrc/ belongs to an extension, and the op check reads each one's CUDA kernels."""
    cb = _cuda_build()
    exts = cb.extensions()
    assert cb.orphan_sources(exts, _build.CSRC) == []
    ops = {e.name: cb.declared_cuda_ops([_build.CSRC / s for s in e.cuda_sources]) for e in exts}
    assert ops["rag_mm_attention"] == ["rag_attn::bwd", "rag_attn::fwd"]
    assert ops["rmm_comm"] == [
        "rmm_comm::dequantize_int8",
        "rmm_comm::dequantize_sum_int8",
        "rmm_comm::quantize_int8",
        "rmm_comm::quantize_int8_ef",
    ]


def test_a_cuda_source_no_extension_builds_is_reported(tmp_path):
    cb = _cuda_build()
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "k.cu").write_text("")
    (tmp_path / "a" / "new.cu").write_text("")
    assert cb.orphan_sources([cb.Extension("x", [], ["a/k.cu"])], tmp_path) == ["a/new.cu"]


def test_cuda_build_names_a_source_that_does_not_compile(tmp_path, monkeypatch, capsys):
    """A .cu that stops compiling fails the build (exit status 1) naming the extension, the
    source and nvcc's first error; compiled by the real build path with nvcc, no GPU needed."""
    cb = _cuda_build()
    home = _toolkit(cb)
    if home is None or torch.version.cuda is None:
        pytest.skip("no CUDA toolkit here (run `make cuda-build`) or a CPU-only torch")
    monkeypatch.setattr(cpp_extension, "CUDA_HOME", str(home))
    monkeypatch.setenv("RAG_MM_EXT_CACHE", str(tmp_path / "ext"))
    monkeypatch.setenv(_build.ARCHS_ENV, "80")
    (tmp_path / "ok.cpp").write_text("int rag_mm_test_ok = 0;\n")
    (tmp_path / "broken.cu").write_text("__global__ void k() { this is not CUDA; }\n")
    ext = cb.Extension(
        f"rag_mm_broken_{os.getpid()}", [str(tmp_path / "ok.cpp")], [str(tmp_path / "broken.cu")]
    )
    records, status = cb.build_all([ext], verbose=False)
    assert status == 1 and not records[0]["ok"]
    assert "broken.cu(1): error" in records[0]["reason"] and records[0]["archs"] == ["80"]
    assert f"FAILED: {ext.name} ({tmp_path / 'broken.cu'})" in capsys.readouterr().err


def test_cuda_build_without_a_toolkit_says_so(tmp_path, capsys):
    cb = _cuda_build()
    assert cb.main(["--cuda-home", str(tmp_path)]) == 2
    assert f"--cuda-home {tmp_path}: no bin/nvcc there" in capsys.readouterr().err


@pytest.mark.slow
def test_cuda_build_compiles_and_registers_every_cuda_op(tmp_path):
    """`make cuda-build` end to end: nvcc (fetched from PyPI unless cached) compiles every .cu for
    sm_80 and sm_90, each library loads on this machine and its CUDA kernels reach the dispatcher.
    Skipped only when there is nothing to build with (exit status 2); a compile failure fails."""
    if torch.version.cuda is None:
        pytest.skip("a CPU-only torch")
    out = tmp_path / "cuda_build.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "cuda_build.py"), "--quiet", "--json", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
    )
    if proc.returncode == 2:
        pytest.skip(proc.stderr.strip()[-500:])
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    summary = json.loads(out.read_text())
    assert {"80", "90"} <= set(summary["archs"])
    cuda_ops = {op for op, keys in summary["ops"].items() if "CUDA" in keys}
    assert {
        "rag_attn::fwd",
        "rag_attn::bwd",
        "rmm_comm::quantize_int8",
        "rmm_comm::dequantize_sum_int8",
    } <= cuda_ops


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
        torch.testing.assert_close(
            g.float(),
            r.float(),
            **tol,
            msg=lambda m: f"{layout} {name}: {m}",  # noqa: B023
        )


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize(
    "dtypes", [(torch.float32, torch.bfloat16), (torch.bfloat16, torch.float16)]
)
def test_cuda_mixed_dtypes_raise(dtypes):
    """The CUDA kernels read q, k and v as q's element type: another dtype for k and v is refused,
    forward and backward, never read as the wrong type."""
    ok, why = A.fused_available()
    assert ok, why
    q = torch.randn(1, 2, 30, 16, device="cuda", dtype=dtypes[0])
    k, v = (torch.randn(1, 2, 30, 16, device="cuda", dtype=dtypes[1]) for _ in range(2))
    seg = torch.tensor([[0, 10, 20, 30]], dtype=torch.int32, device="cuda")
    with pytest.raises(RuntimeError, match="same dtype"):
        A.attention(q, k, v, seg_offsets=seg, backend="fused")
    out, lse = torch.ops.rag_attn.fwd(q, q, q, seg, None, 0, False, 0.25)
    with pytest.raises(RuntimeError, match="same dtype"):
        torch.ops.rag_attn.bwd(out, q, k, v, out, lse, seg, None, 0, False, 0.25)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_opcheck():
    ok, why = A.fused_available()
    assert ok, why
    q, k, v = (torch.randn(2, 2, 70, 32, device="cuda", requires_grad=True) for _ in range(3))
    seg = torch.tensor([[0, 20, 40, 60], [0, 10, 10, 70]], dtype=torch.int32, device="cuda")
    torch.library.opcheck(torch.ops.rag_attn.fwd, (q, k, v, seg, None, 0, False, 32**-0.5))
