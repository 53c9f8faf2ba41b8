"""The zero-bubble backward split (parallel/pipeline/split_backward.py) gives exactly the gradients
of one full backward, and W does not redo the input chain."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from parallel.pipeline.split_backward import backward_input, backward_weight


class Shapes(nn.Module):
    """Every way a parameter can meet a stage's input path."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)  # on the input path
        self.shared = nn.Linear(8, 8)  # applied twice on the path: one intermediate below another
        self.emb = nn.Embedding(10, 8)  # of the raw microbatch only: off the input path (orphan)
        self.side = nn.Linear(8, 8)  # on the path, and also straight into a second output
        self.scale = nn.Parameter(torch.tensor(1.5))  # a scalar parameter multiplying the path

    def forward(self, h, ids):
        x = torch.relu(self.a(h)) + self.emb(ids)
        x = self.shared(torch.tanh(self.shared(x))) * self.scale
        y = self.side(x)
        return y, self.side.weight.sum() * 0.1 + self.emb.weight[0].sum()


def _full(model, h, ids, gy):
    h = h.detach().requires_grad_(True)
    y, z = model(h, ids)
    torch.autograd.backward([y, z], [gy, torch.ones_like(z)])
    return h.grad, {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("seed", [0, 1])
def test_split_matches_full_backward(seed):
    torch.manual_seed(seed)
    model = Shapes().double()
    h, ids, gy = (
        torch.randn(4, 8, dtype=torch.double),
        torch.randint(0, 10, (4,)),
        torch.randn(4, 8, dtype=torch.double),
    )
    ref_dh, ref = _full(model, h, ids, gy)
    model.zero_grad()
    x = h.detach().requires_grad_(True)
    y, z = model(x, ids)
    (dh,), work = backward_input([y, z], [gy, torch.ones_like(z)], [x], list(model.parameters()))
    torch.testing.assert_close(dh, ref_dh)
    assert all(p.grad is None for p in model.parameters()), "I must not touch the weights"
    names = {id(p): n for n, p in model.named_parameters()}
    # the embedding only meets the path at the sum; side.weight also reaches the second output
    assert sorted(names[id(p)] for p in work.orphans) == ["emb.weight", "side.weight"]
    backward_weight(work)
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, ref[n], msg=n)
    # a second microbatch accumulates, as autograd does
    y, z = model(x, ids)
    _, work = backward_input([y, z], [gy, torch.ones_like(z)], [x], list(model.parameters()))
    backward_weight(work)
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, 2 * ref[n], msg=n)


def test_weight_step_does_no_input_gradient_work():
    """Counted matrix products: I computes each layer's dX, W each dW, none twice."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm):
                self.n += 1
            return func(*args, **(kwargs or {}))

    torch.manual_seed(0)
    layers = 4
    model = nn.Sequential(*[nn.Linear(16, 16) for _ in range(layers)])
    x = torch.randn(8, 16, requires_grad=True)
    y = model(x)
    with Count() as ci:
        _, work = backward_input([y], [torch.ones_like(y)], [x], list(model.parameters()))
    with Count() as cw:
        backward_weight(work)
    assert (ci.n, cw.n) == (layers, layers)


class Linears(nn.Module):
    """W's ``nn.Linear`` fast path and the graphs it must leave to the engine."""

    def __init__(self):
        super().__init__()
        from transformers.pytorch_utils import Conv1D

        self.seq = nn.Linear(8, 8)  # (B, T, 8) input: a view, then addmm (fast path)
        self.nobias = nn.Linear(8, 8, bias=False)  # mm (fast path)
        self.conv1d = Conv1D(8, 8)  # GPT-2's: addmm with the weight itself as mat2 (fast path)
        self.hooked = nn.Linear(8, 8)  # a gradient hook on its weight (engine: the hook must run)
        self.hooked.weight.register_hook(lambda g: 2 * g)
        self.scaled = nn.Linear(8, 8)  # addmm with beta != 1 (engine)

    def forward(self, h):
        h = self.conv1d(torch.tanh(self.nobias(torch.relu(self.seq(h)))))
        s = torch.addmm(
            self.scaled.bias, h.reshape(-1, 8), self.scaled.weight.t(), beta=0.5
        ).view_as(h)
        return self.hooked(torch.sigmoid(s))


def test_linear_fast_path_matches_engine():
    from torch.utils._python_dispatch import TorchDispatchMode

    class Fused(TorchDispatchMode):  # in-place accumulating GEMMs: only the fast path issues them
        def __init__(self):
            super().__init__()
            self.n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.n += func.overloadpacket is torch.ops.aten.addmm_
            return func(*args, **(kwargs or {}))

    torch.manual_seed(0)
    model = Linears().double()
    h, gy = torch.randn(2, 3, 8, dtype=torch.double), torch.randn(2, 3, 8, dtype=torch.double)
    x = h.clone().requires_grad_(True)
    model(x).backward(gy)
    ref = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    for step in (1, 2):  # the first W creates .grad, the second accumulates into it
        y = model(x)
        _, work = backward_input([y], [gy], [x], list(model.parameters()))
        with Fused() as f:
            backward_weight(work)
        for n, p in model.named_parameters():
            torch.testing.assert_close(p.grad, step * ref[n], msg=f"{n} after {step} microbatches")
    assert f.n == 3, f"fused accumulations of seq, nobias and conv1d expected, got {f.n}"
