"""Hierarchical all-reduce (shared memory + int8 inter-host stage), the gate, and the DDP hook."""

import os

import pytest
import torch
import torch.distributed as dist

from parallel.kernels import comm as K
from tests.distributed import run_ranks

pytestmark = [pytest.mark.multirank, pytest.mark.usefixtures("comm_built")]


def _hier(rank, world):
    # Simulate 2 hosts x 2 local ranks on this machine through the host-identity override.
    os.environ["RAG_MM_HOST_ID"] = f"node{rank // 2}"
    from parallel.comm_hooks import HierAllReduce, should_use_shm

    ok, why = should_use_shm(torch.zeros(1))
    assert not ok and "2 hosts" in why
    full = HierAllReduce(quantize=False)
    q8 = HierAllReduce(quantize=True, block_size=256)
    assert full.shm is not None and (full.n_hosts, full.n_local) == (2, 2)
    out = {}
    for n in (5, 10001):
        x = torch.randn(n, generator=torch.Generator().manual_seed(rank + n))
        ref = x.clone()
        dist.all_reduce(ref)
        y = x.clone()
        full.all_reduce_(y)
        torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5)
        z = x.clone()
        q8.all_reduce_(z, key=n)
        # two int8 roundings, each <= half a step of amax/127 per block
        rel = (z - ref).norm() / ref.norm()
        assert rel < 0.02, rel
        out[n] = rel.item()
    # byte count: same payload through both, counted with the same bus factors
    full.stats.reset()
    q8.stats.reset()
    big = torch.randn(1 << 16)
    full.all_reduce_(big.clone())
    q8.all_reduce_(big.clone(), key="big")
    return full.stats.inter_bytes, q8.stats.inter_bytes, out


def test_hierarchical_int8_two_simulated_hosts():
    res = run_ranks(_hier, 4, timeout_s=180)
    for fp32_bytes, int8_bytes, _ in res:
        assert fp32_bytes > 0 and fp32_bytes / int8_bytes >= 3.5, (fp32_bytes, int8_bytes)


def _ddp(rank, world):
    from torch.nn.parallel import DistributedDataParallel as DDP

    from parallel.comm_hooks import make_grad_reduce_hook

    names = []
    for kind in ("shm", "auto"):
        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Linear(33, 64), torch.nn.ReLU(), torch.nn.Linear(64, 5))
        ref_net = torch.nn.Sequential(
            torch.nn.Linear(33, 64), torch.nn.ReLU(), torch.nn.Linear(64, 5)
        )
        ref_net.load_state_dict(net.state_dict())
        ddp = DDP(net, bucket_cap_mb=0.005)  # several buckets
        ref = DDP(ref_net, bucket_cap_mb=0.005)
        hook, state = make_grad_reduce_hook(kind)
        ddp.register_comm_hook(state, hook)
        for step in range(3):
            x = torch.randn(8, 33, generator=torch.Generator().manual_seed(10 * rank + step))
            for m in (ddp, ref):
                m.zero_grad()
                m(x).square().mean().backward()
            for p, q in zip(ddp.parameters(), ref.parameters()):
                torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6)
        assert state.stats.intra_calls > 0  # the buckets went through shared memory
        names.append(type(state).__name__)
    return names


def test_ddp_hook_matches_default_allreduce():
    assert run_ranks(_ddp, 2, timeout_s=120) == [["GradReduceState"] * 2] * 2


def test_make_hook_rejects_unknown_kind():
    from parallel.comm_hooks import make_grad_reduce_hook

    with pytest.raises(ValueError, match="grad_reduce must be one of"):
        make_grad_reduce_hook("nccl_magic")


def _fsdp(rank, world):
    from torch.distributed.fsdp import fully_shard

    from parallel.comm_hooks import ShmReduceScatter

    grads = []
    for custom in (False, True):
        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Linear(17, 40), torch.nn.ReLU(), torch.nn.Linear(40, 3))
        fully_shard(net)
        rs = ShmReduceScatter(K.ShmGroup())
        if custom:
            net.set_custom_reduce_scatter(rs)
        x = torch.randn(6, 17, generator=torch.Generator().manual_seed(rank))
        net(x).square().mean().backward()
        assert rs.shm_calls == (1 if custom else 0)
        grads.append([p.grad.to_local().clone() for p in net.parameters()])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    return len(grads[0])


def test_fsdp2_shm_reduce_scatter_matches_default():
    from torch.distributed.fsdp import FSDPModule

    if not hasattr(FSDPModule, "set_custom_reduce_scatter"):
        pytest.skip("FSDP2 without a pluggable reduce-scatter")
    assert run_ranks(_fsdp, 2, timeout_s=120) == [4, 4]
