import pytest
import torch
import torch.distributed as dist

from tests.distributed import run_ranks


def _allreduce(rank, world):
    t = torch.full((3,), float(rank + 1))
    dist.all_reduce(t)
    return t.tolist()


@pytest.mark.multirank
def test_two_gloo_ranks_all_reduce():
    out = run_ranks(_allreduce, 2)
    assert out == [[3.0, 3.0, 3.0]] * 2
