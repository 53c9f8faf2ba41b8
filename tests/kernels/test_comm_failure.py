"""A rank that dies (or stays away) during a shared-memory collective makes its peers raise a
clear error within a bounded time, and no segment is left in /dev/shm."""

import os
import queue as _q
import signal
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from parallel.kernels import comm as K
from tests.distributed import free_port, run_ranks

pytestmark = [pytest.mark.multirank, pytest.mark.usefixtures("comm_built")]


def _shm_entries():
    return {e for e in os.listdir("/dev/shm") if e.startswith("rmm_")}


def _looping_rank(rank, world, port, q):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=60))
    g = K.ShmGroup(timeout_s=120)  # the deadline is far: only the liveness check can end it
    q.put((rank, "ready", g.name))
    x = torch.ones(4 << 20)  # 16 MB: each all-reduce takes milliseconds, so a kill lands inside one
    t0 = time.monotonic()
    try:
        while True:
            g.all_reduce_(x)
            x.fill_(1.0)
    except RuntimeError as e:
        q.put((rank, "error", (str(e), time.monotonic() - t0)))
    q.close()
    q.join_thread()  # flush the queue's feeder thread before the hard exit
    os._exit(0)  # skip process-group teardown with a dead peer


@pytest.mark.parametrize("world", [3])
def test_killed_rank_fails_peers_and_leaves_no_segment(world):
    before = _shm_entries()
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_looping_rank, args=(r, world, port, q)) for r in range(world)]
    for p in procs:
        p.start()
    try:
        ready = {}
        deadline = time.monotonic() + 120
        while len(ready) < world and time.monotonic() < deadline:
            rank, status, payload = q.get(timeout=120)
            assert status == "ready", payload
            ready[rank] = payload
        assert len(ready) == world
        name = ready[0]
        time.sleep(1.0)  # let them loop
        victim = world - 1
        os.kill(procs[victim].pid, signal.SIGKILL)
        errors = {}
        deadline = time.monotonic() + 60  # bounded: liveness is checked every ~2 ms
        while len(errors) < world - 1 and time.monotonic() < deadline:
            try:
                rank, status, payload = q.get(timeout=1.0)
            except _q.Empty:
                continue
            errors[rank] = payload[0]
        assert sorted(errors) == list(range(world - 1)), f"survivors did not fail: {errors}"
        for _r, msg in errors.items():
            # the detecting rank names the dead one; the others may report the abort instead
            assert f"local rank {victim}" in msg and "all_reduce" in msg, msg
            assert "died" in msg or "aborted" in msg, msg
        assert any("died" in m for m in errors.values())
        for p in procs:
            p.join(30)
        assert name.lstrip("/") not in os.listdir("/dev/shm")
        assert _shm_entries() <= before, f"leaked: {_shm_entries() - before}"
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()


def _absent_peer(rank, world):
    g = K.ShmGroup(timeout_s=1.0)
    if rank == 0:
        with pytest.raises(RuntimeError, match="timed out after 1 s waiting for local rank 1"):
            g.all_reduce_(torch.ones(10))
        dist.barrier()  # now let rank 1 try: rank 0 has marked the group aborted
        return "timeout"
    dist.barrier()
    with pytest.raises(
        RuntimeError, match="local rank 0 aborted the group because local rank 1 timed out"
    ):
        g.all_reduce_(torch.ones(10))
    return "aborted"


def test_absent_peer_times_out_and_aborts_group():
    assert run_ranks(_absent_peer, 2, timeout_s=60) == ["timeout", "aborted"]
