import os
import signal

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


def _rank_1_killed_mid_collective(rank, world):
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)  # no traceback, nothing on the queue
    dist.all_reduce(torch.ones(3))  # rank 0 waits on a peer that is gone


@pytest.mark.multirank
def test_a_rank_killed_without_a_word_is_named_before_its_peers_errors():
    with pytest.raises(AssertionError) as e:
        run_ranks(_rank_1_killed_mid_collective, 2, timeout_s=30)
    lines = str(e.value).splitlines()
    assert lines[0] == "rank 1: killed by SIGKILL, without reporting a result or an error"
    assert "rank 0:" in lines[1:]  # the survivor's own error follows
