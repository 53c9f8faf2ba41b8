"""Shared-memory collectives and channels on real gloo ranks, against torch.distributed."""

import os

import pytest
import torch
import torch.distributed as dist

from parallel.kernels import comm as K
from tests.distributed import run_ranks

pytestmark = [pytest.mark.multirank, pytest.mark.usefixtures("comm_built")]

# Odd sizes; with the 4 KiB-chunk group every size above 1024 fp32 elements runs through the
# chunk loop, and on 4 ranks above 256 KiB (70001 fp32 elements) through two-shot all-reduce.
SIZES = [1, 257, 70001]


def _inputs(rank, n, dtype, noncontig):
    g = torch.Generator().manual_seed(1000 * rank + n)
    if noncontig:  # every other column of a (n, 2) tensor
        return torch.randn(n, 2, generator=g)[:, 0].to(dtype)
    return torch.randn(n, generator=g).to(dtype)


def _check_collectives(rank, world):
    groups = [K.ShmGroup(), K.ShmGroup(chunk_bytes=4096)]  # default 1 MiB halves; tiny halves
    checked = 0
    for g in groups:
        for n in SIZES:
            for dtype in (torch.float32, torch.bfloat16):
                for noncontig in (n % 2 == 1, n % 2 == 0)[: 1 + (n < 1000)]:
                    x = _inputs(rank, n, dtype, noncontig)
                    # all-reduce: reference is gloo on fp32 (our bf16 accumulates in fp32)
                    ref = x.float().clone()
                    dist.all_reduce(ref)
                    y = x.clone()
                    g.all_reduce_(y)
                    tol = (
                        dict(rtol=1e-6, atol=1e-5)
                        if dtype == torch.float32
                        else dict(rtol=8e-3, atol=8e-3)
                    )
                    torch.testing.assert_close(y.float(), ref.to(dtype).float(), **tol)
                    assert torch.equal(g.all_reduce(x), y)
                    # bitwise identical on every rank
                    allv = [torch.empty_like(y.float()) for _ in range(world)]
                    dist.all_gather(allv, y.float())
                    assert all(torch.equal(allv[0], v) for v in allv)
                    # all-gather into a flat tensor, like dist.all_gather_into_tensor
                    out = torch.empty(world * n, dtype=dtype)
                    g.all_gather_into_tensor(out, x)
                    ref_ag = torch.empty(world * n, dtype=torch.float32)
                    dist.all_gather_into_tensor(ref_ag, x.float().contiguous())
                    assert torch.equal(out.float(), ref_ag.to(dtype).float())
                    # reduce-scatter of (world * n) elements
                    big = _inputs(rank, world * n, dtype, noncontig)
                    out = torch.empty(n, dtype=dtype)
                    g.reduce_scatter_tensor(out, big)
                    ref_rs = torch.empty(n, dtype=torch.float32)
                    dist.reduce_scatter_tensor(ref_rs, big.float().contiguous())
                    torch.testing.assert_close(out.float(), ref_rs.to(dtype).float(), **tol)
                    checked += 1
    # shapes of the functional ops, and autograd through them (adjoint collectives)
    g = groups[0]
    x = torch.randn(4, 3, requires_grad=True)
    y = g.all_gather(x)
    assert y.shape == (world, 4, 3)
    y.sum().backward()
    torch.testing.assert_close(x.grad, torch.full((4, 3), float(world)))
    z = g.reduce_scatter(torch.ones(world * 2, 5))
    assert z.shape == (2, 5) and torch.equal(z, torch.full((2, 5), float(world)))
    torch.library.opcheck(
        torch.ops.rmm_comm.all_reduce.default,
        (torch.randn(10), g.handle),
        test_utils=("test_schema", "test_faketensor"),
    )
    torch.library.opcheck(
        torch.ops.rmm_comm.all_gather.default,
        (torch.randn(3, 2), g.handle),
        test_utils=("test_schema", "test_faketensor"),
    )
    for grp in groups:
        grp.close()
    return checked, sorted(e for e in os.listdir("/dev/shm") if e.startswith("rmm_"))


@pytest.mark.parametrize("world", [2, 4])
def test_collectives_match_gloo(world):
    before = {e for e in os.listdir("/dev/shm") if e.startswith("rmm_")}
    res = run_ranks(_check_collectives, world, timeout_s=240)
    assert all(r[0] == 2 * 2 * (2 + 2 + 1) for r in res)  # groups x dtypes x layouts
    # the segments were unlinked right after every rank mapped them
    assert all(set(r[1]) <= before for r in res)


def _channel(rank, world, cross_host):
    if cross_host:
        os.environ["RAG_MM_HOST_ID"] = f"node{rank}"
    fwd = K.ShmChannel(0, 1, slot_bytes=4096, slots=2)  # activations 0 -> 1
    bwd = K.ShmChannel(1, 0, slot_bytes=4096, slots=2)  # gradients 1 -> 0
    assert fwd.uses_shm == (not cross_host), fwd.reason
    shapes = [(1,), (3, 5), (1000,), (40, 77)]  # 3 KB .. 12 KB: one to several slots
    if rank == 0:
        for i, s in enumerate(shapes):  # the sender may run ahead of the receiver
            fwd.send(torch.full(s, float(i)))
        fwd.send(torch.arange(24.0).reshape(4, 6).t())  # non-contiguous
        fwd.send(torch.arange(7, dtype=torch.bfloat16))
        got = [bwd.recv(torch.empty(s)) for s in shapes]
        return [t.sum().item() for t in got]
    got = [fwd.recv(torch.empty(s)) for s in shapes]
    for i, t in enumerate(got):
        assert torch.equal(t, torch.full(t.shape, float(i)))
    out = torch.empty(4, 6).t()  # receive into a non-contiguous view
    fwd.recv(out)
    assert torch.equal(out, torch.arange(24.0).reshape(4, 6).t())
    assert torch.equal(
        fwd.recv(torch.empty(7, dtype=torch.bfloat16)), torch.arange(7, dtype=torch.bfloat16)
    )
    for t in got:
        bwd.send(t * 2)
    return None


@pytest.mark.parametrize("cross_host", [False, True])
def test_channel_send_recv(cross_host):
    res = run_ranks(_channel, 2, cross_host, timeout_s=120)
    shapes = [(1,), (3, 5), (1000,), (40, 77)]
    expect = [2.0 * i * torch.zeros(s).numel() for i, s in enumerate(shapes)]
    assert res[0] == expect


def _rewind(rank, world, receiver_first):
    """Steps of 3 one-slot messages on a 5-slot ring, each side rewinding after its last message
    of the step (in either order): nothing is lost or reordered across the jump. (That the jump
    keeps the slots warm is a speed property: benchmarks/pipeline_cpu_*.md.)"""
    ch = K.ShmChannel(0, 1, slot_bytes=4096, slots=5)
    got = []
    for step in range(4):
        if rank == 0:
            for i in range(3):
                ch.send(torch.full((100,), float(10 * step + i)))
            if receiver_first:
                dist.barrier()  # the receiver has read and rewound
            ch.rewind()
            if not receiver_first:
                dist.barrier()
        else:
            if not receiver_first:
                dist.barrier()  # the sender has written and rewound before we read
            got += [ch.recv(torch.empty(100))[0].item() for _ in range(3)]
            ch.rewind()
            if receiver_first:
                dist.barrier()
    return got


@pytest.mark.parametrize("receiver_first", [False, True])
def test_channel_rewind_between_steps(receiver_first):
    got = run_ranks(_rewind, 2, receiver_first, timeout_s=120)[1]
    assert got == [float(10 * s + i) for s in range(4) for i in range(3)]
