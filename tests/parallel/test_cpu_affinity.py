"""bind_cores (parallel/cpu_affinity.py): one slice of the host's cores per local CPU rank."""

from __future__ import annotations

import os

import pytest

from parallel.cpu_affinity import plan_binding
from tests.distributed import run_ranks


def test_plan_binding_slices_the_cores_of_each_host():
    hosts = ["a", "a", "b", "b", "a"]
    allowed = [(0, 1, 2, 3, 4, 5)] * 5
    assert plan_binding(0, hosts, allowed)[0] == (0, 1)  # 3 ranks on host a: 2 cores each
    assert plan_binding(1, hosts, allowed)[0] == (2, 3)
    assert plan_binding(4, hosts, allowed)[0] == (4, 5)
    assert plan_binding(3, hosts, allowed)[0] == (3, 4, 5)  # 2 ranks on host b: 3 cores each


def test_plan_binding_leaves_bound_or_crowded_ranks_alone():
    cores, why = plan_binding(0, ["a"], [(0, 1)])
    assert cores is None and "one rank" in why
    cores, why = plan_binding(1, ["a", "a"], [(0,), (1,)])  # a launcher bound them already
    assert cores is None and "already bound" in why
    cores, why = plan_binding(0, ["a"] * 3, [(0, 1)] * 3)
    assert cores is None and "3 ranks" in why


def _bind_worker(rank, world):
    import torch

    from parallel.cpu_affinity import bind_cores

    before = sorted(os.sched_getaffinity(0))
    torch.set_num_threads(4)
    done = bind_cores(torch.device("cpu"))
    again = bind_cores(torch.device("cpu"))  # idempotent: the ranks are now bound differently
    return before, sorted(os.sched_getaffinity(0)), torch.get_num_threads(), done, again


@pytest.mark.multirank
@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="no CPU affinity API")
def test_bind_cores_gives_each_rank_its_own_cores():
    (b0, a0, n0, d0, g0), (b1, a1, n1, _, _) = run_ranks(_bind_worker, 2)
    if len(b0) < 2:
        assert a0 == b0 and "left as is" in d0
        return
    k = len(b0) // 2
    assert a0 == b0[:k] and a1 == b0[k : 2 * k], (d0, a0, a1)
    assert n0 == min(4, k) and n1 == min(4, k)  # intra-op threads capped at the slice
    assert "left as is" in g0 and "already bound" in g0
