"""The non-finite check's accelerator path (``rag_mm.components.nonfinite``) on real numbers: the
decision stays on the device, the fused AdamW update skips itself, and the skipped steps are logged
and counted at the next flush as the host path counts them. Run on the CPU (fused AdamW has a CPU
kernel) with the guard put on its device path by hand."""

from __future__ import annotations

import logging

import pytest
import torch

from rag_mm.components.nonfinite import NonFiniteGuard, skips_on_device


def _setup(limit: int = 10, window: int = 4):
    torch.manual_seed(0)
    lin = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(lin.parameters(), lr=0.1, weight_decay=0.1, fused=True)
    assert skips_on_device(opt) and not skips_on_device(torch.optim.AdamW(lin.parameters()))
    guard = NonFiniteGuard(opt, torch.device("cpu"), limit=limit, window=window)
    assert not guard.on_device  # the host decides on the CPU ...
    guard.on_device = True  # ... the accelerator path, taken here by hand
    return lin, opt, guard


def _step(lin, opt, guard, step: int, poison: bool) -> None:
    x = torch.randn(8, 4)
    loss = lin(x).square().mean() * (float("nan") if poison else 1.0)
    loss.backward()
    gnorm = torch.nn.utils.clip_grad_norm_(lin.parameters(), 1.0)
    assert guard.check(step, loss.detach(), gnorm)  # the device path always goes on to opt.step()
    opt.step()
    opt.zero_grad(set_to_none=True)


def _state(lin, opt):
    return [t.clone() for p in lin.parameters() for t in (p, *opt.state[p].values())]


def test_a_non_finite_step_leaves_weights_and_moments_untouched(caplog):
    lin, opt, guard = _setup()
    _step(lin, opt, guard, 0, poison=False)
    before = _state(lin, opt)
    with caplog.at_level(logging.WARNING, logger="rag_mm.components.nonfinite"):
        _step(lin, opt, guard, 1, poison=True)
        after = _state(lin, opt)
        assert all(torch.equal(a, b) for a, b in zip(before, after)), (
            "the fused update did not skip itself"
        )
        assert "non-finite" not in caplog.text  # nothing read back yet
        _step(lin, opt, guard, 2, poison=False)
        # a finite step updates
        assert not all(torch.equal(a, b) for a, b in zip(after, _state(lin, opt)))
        guard.flush()
    assert (
        caplog.text.count("non-finite loss or gradient at step 1: step skipped (1 in a row)") == 1
    )
    assert caplog.text.count("non-finite") == 1 and guard.bad_run == 0
    assert all(torch.isfinite(p).all() for p in lin.parameters())


def test_too_many_in_a_row_abort_at_the_flush():
    lin, opt, guard = _setup(limit=3, window=8)
    for step in range(5):
        _step(lin, opt, guard, step, poison=True)
    with pytest.raises(FloatingPointError, match="4 consecutive non-finite steps"):
        guard.flush()


def test_a_full_window_is_read_before_it_overflows(caplog):
    lin, opt, guard = _setup(window=2)
    with caplog.at_level(logging.WARNING, logger="rag_mm.components.nonfinite"):
        for step, poison in enumerate([True, False, True]):  # the third check flushes the first two
            _step(lin, opt, guard, step, poison)
        assert "at step 0" in caplog.text and "at step 2" not in caplog.text
        guard.flush()
    assert "at step 2: step skipped (1 in a row)" in caplog.text
