"""Block-wise int8 quantisation kernels against the plain-PyTorch reference (CPU; CUDA marked)."""

import tempfile

import pytest
import torch

from parallel.kernels import comm as K

pytestmark = pytest.mark.usefixtures("comm_built")


@pytest.mark.parametrize(
    "shape,block", [((1000,), 256), ((3, 517), 64), ((2, 5000), 2048), ((7,), 256)]
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantize_matches_reference(shape, block, dtype):
    x = (torch.randn(shape) * torch.logspace(-3, 2, shape[-1])).to(dtype)
    x[..., :3] = 0.0  # an all-zero block must give scale 0, q 0 (when the block is that small)
    q, s = K.quantize_int8(x, block)
    qr, sr = K.quantize_int8_ref(x, block)
    assert q.dtype == torch.int8 and s.shape == sr.shape
    torch.testing.assert_close(s, sr, rtol=1e-6, atol=0)
    # rounding of exact .5 ties may differ by one ulp of y * inv; allow a step of 1 on a few
    assert (q.int() - qr.int()).abs().max() <= 1
    assert (q != qr).float().mean() < 1e-3
    deq = K.dequantize_int8(q, s, block)
    torch.testing.assert_close(deq, K.dequantize_int8_ref(q, s, block), rtol=0, atol=0)
    # quantisation error is at most half a step per block
    step = s.repeat_interleave(block, -1)[..., : shape[-1]]
    assert ((deq - x.float()).abs() <= 0.501 * step + 1e-6).all()  # ties round either way


def test_error_feedback_keeps_the_running_sum():
    """With error feedback the sum of dequantised outputs tracks the sum of inputs (residual
    stays bounded); without it the error accumulates."""
    torch.manual_seed(0)
    err = torch.zeros(4096)
    total_in = torch.zeros(4096)
    total_ef = torch.zeros(4096)
    total_plain = torch.zeros(4096)
    for _ in range(50):
        x = torch.randn(4096) * 1e-2 + 1e-4  # a small bias that plain rounding keeps losing
        total_in += x
        q, s = K.quantize_int8(x, 256, err)
        total_ef += K.dequantize_int8(q, s, 256)
        q, s = K.quantize_int8(x, 256)
        total_plain += K.dequantize_int8(q, s, 256)
    torch.testing.assert_close(total_ef + err, total_in, rtol=1e-5, atol=1e-5)
    assert (total_ef - total_in).abs().mean() < 0.5 * (total_plain - total_in).abs().mean()
    # and the fused kernel's residual equals the reference's
    e1, e2 = torch.zeros(1000), torch.zeros(1000)
    x = torch.randn(1000)
    K.quantize_int8(x, 128, e1)
    K.quantize_int8_ref(x, 128, e2)
    torch.testing.assert_close(e1, e2, rtol=0, atol=1e-6)


def test_dequantize_sum():
    q = torch.randint(-127, 128, (3, 2, 300), dtype=torch.int8)
    s = torch.rand(3, 2, 3)
    torch.testing.assert_close(
        K.dequantize_sum_int8(q, s, 128), K.dequantize_sum_int8_ref(q, s, 128)
    )


def test_opcheck_quant_ops():
    x = torch.randn(4, 300)
    for op, args in [
        (torch.ops.rmm_comm.quantize_int8.default, (x, 128)),
        (torch.ops.rmm_comm.quantize_int8_ef.default, (x, torch.zeros(4, 300), 128)),
        (torch.ops.rmm_comm.dequantize_int8.default, K.quantize_int8(x, 128) + (128,)),
        (torch.ops.rmm_comm.dequantize_sum_int8.default, K.quantize_int8(x, 128) + (128,)),
    ]:
        torch.library.opcheck(op, args)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_quantize_matches_reference(dtype):
    assert K.load().with_cuda, K.load().reason
    x = (torch.randn(5, 3000) * 3).to(dtype).cuda()
    err = torch.zeros(5, 3000, device="cuda")
    q, s = K.quantize_int8(x, 256, err)
    err_ref = torch.zeros(5, 3000)
    qr, sr = K.quantize_int8_ref(x.cpu(), 256, err_ref)
    torch.testing.assert_close(s.cpu(), sr, rtol=1e-5, atol=0)
    assert (q.cpu().int() - qr.int()).abs().max() <= 1
    torch.testing.assert_close(err.cpu(), err_ref, rtol=0, atol=2 * sr.max().item())
    deq = K.dequantize_sum_int8(q[None].expand(2, -1, -1), s[None].expand(2, -1, -1), 256)
    torch.testing.assert_close(deq.cpu(), 2 * K.dequantize_int8_ref(q.cpu(), s.cpu(), 256))


@pytest.mark.slow
def test_cuda_sources_compile_with_nvcc():
    """The .cu files compile with this machine's nvcc against the installed torch headers."""
    from parallel.kernels._build import cuda_build_possible

    can, why = cuda_build_possible()
    if not can:
        pytest.skip(why)
    with tempfile.TemporaryDirectory() as d:
        ok, msg = K.cuda_compile_check(d)
    assert ok, msg
