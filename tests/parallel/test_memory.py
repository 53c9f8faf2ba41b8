"""Activation checkpointing (full / every n-th block) and activation offloading on the reader:
same loss and gradients, fewer bytes kept for backward; meta-device init builds no storage."""

from __future__ import annotations

import pytest
import torch

from parallel.memory import (
    OffloadActivations,
    SavedBytes,
    apply_activation_checkpointing,
    apply_activation_offload,
    materialize,
    meta_init,
)
from parallel.spmd import find_blocks
from tests.parallel import tp_cases


def _saved_bytes_and_grads(model, inputs):
    """Bytes autograd keeps for backward (distinct storages, parameters excluded), and grads."""
    with SavedBytes(model) as saved:
        loss = tp_cases.run(model, inputs, tp_cases.reader_loss)
    loss.backward()
    return (
        saved.nbytes,
        float(loss),
        {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None},
    )


def _reader(layers=4):
    torch.manual_seed(0)
    return tp_cases.reader_factory(layers)


def test_activation_checkpointing_same_grads_less_memory():
    model, inputs = _reader()
    base_bytes, base_loss, base_grads = _saved_bytes_and_grads(model, inputs)
    model.zero_grad()
    blocks = model.blocks
    assert apply_activation_checkpointing(list(blocks), "full") == [0, 1, 2, 3]
    ac_bytes, ac_loss, ac_grads = _saved_bytes_and_grads(model, inputs)
    assert ac_loss == base_loss
    for n, g in base_grads.items():
        torch.testing.assert_close(ac_grads[n], g, rtol=1e-5, atol=1e-7)
    assert ac_bytes < base_bytes, (ac_bytes, base_bytes)
    # parameter names are untouched (no wrapper module)
    assert all("checkpoint" not in n for n, _ in model.named_parameters())


def test_every_nth_block():
    model, _ = _reader()
    assert apply_activation_checkpointing(list(model.blocks), "every_n", 2) == [1, 3]
    assert hasattr(model.blocks[1], "_ac_inner_forward") and not hasattr(
        model.blocks[0], "_ac_inner_forward"
    )
    with pytest.raises(ValueError, match="activation_checkpointing"):
        apply_activation_checkpointing(list(model.blocks), "selective")


def test_activation_offload_same_grads():
    model, inputs = _reader(2)
    _, base_loss, base_grads = _saved_bytes_and_grads(model, inputs)
    model.zero_grad()
    hooks = apply_activation_offload(find_blocks(model))
    _, loss, grads = _saved_bytes_and_grads(model, inputs)
    assert loss == base_loss and hooks.stats["packed"] > 0
    for n, g in base_grads.items():
        torch.testing.assert_close(grads[n], g, rtol=1e-5, atol=1e-7)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_activation_offload_moves_to_host_on_gpu():
    x = torch.randn(64, 1024, device="cuda", requires_grad=True)
    w = torch.randn(1024, 1024, device="cuda", requires_grad=True)
    hooks = OffloadActivations()
    # cuBLAS takes its workspace (32 MiB) from the allocator once
    torch.tanh(x.detach() @ w.detach())
    torch.cuda.synchronize()
    m0 = torch.cuda.memory_allocated()
    with hooks:
        y = torch.tanh(torch.tanh(x @ w) @ w)
    kept = torch.cuda.memory_allocated() - m0
    y.sum().backward()
    ref_x, ref_w = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    torch.tanh(torch.tanh(ref_x @ ref_w) @ ref_w).sum().backward()
    torch.testing.assert_close(x.grad, ref_x.grad)
    assert hooks.stats["offloaded"] >= 2
    assert kept < 3 * 64 * 1024 * 4, kept  # only y (+ nothing saved) stays on the GPU


def test_meta_init_allocates_no_parameter_storage():
    with meta_init():
        model, inputs = _reader(2)
    assert all(p.is_meta for p in model.parameters())
    assert all(not b.is_meta for b in model.buffers())  # buffers stay real
    materialize(model, "cpu")
    assert not any(p.is_meta for p in model.parameters())
    loss = tp_cases.run(model, inputs, tp_cases.reader_loss)
    assert torch.isfinite(loss)
