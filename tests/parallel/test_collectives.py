"""parallel.collectives: one collective over many tensors through one flat buffer."""

from __future__ import annotations

import pytest
import torch

from parallel.collectives import flat_collective


def test_flat_collective_writes_back_each_tensor_in_its_shape():
    ts = [torch.arange(6.0).view(2, 3), torch.tensor(5.0), torch.ones(4)]
    before = [t.clone() for t in ts]
    calls = []

    def double(buf):
        calls.append(buf.shape)
        buf.mul_(2)

    views = flat_collective(ts, double)
    assert calls == [torch.Size([11])]  # one call on the whole concatenation
    for t, v, b in zip(ts, views, before, strict=True):
        assert v.shape == b.shape and torch.equal(t, 2 * b) and torch.equal(v, 2 * b)


def test_flat_collective_without_write_back_leaves_the_inputs():
    ts = [torch.ones(2, 2), torch.full((3,), 3.0)]
    views = flat_collective(ts, lambda buf: buf.add_(1), write_back=False)
    assert torch.equal(ts[0], torch.ones(2, 2)) and torch.equal(views[0], torch.full((2, 2), 2.0))
    assert torch.equal(views[1], torch.full((3,), 4.0))


def test_flat_collective_on_nothing_calls_nothing():
    assert flat_collective([], lambda buf: pytest.fail("called")) == []


def _mean_worker(rank, world):
    from parallel.collectives import all_reduce_mean_

    ts = [torch.full((2, 3), float(rank)), torch.tensor([rank * 10.0])]
    flat_collective(ts, all_reduce_mean_)
    return [t.tolist() for t in ts]


@pytest.mark.multirank
def test_flat_mean_over_ranks():
    from tests.distributed import run_ranks

    for out in run_ranks(_mean_worker, 2):
        assert out == [[[0.5] * 3] * 2, [5.0]]
