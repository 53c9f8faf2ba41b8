"""Run a function on N gloo ranks in spawned processes and collect what each returns.

Real process groups (``init_process_group("gloo")`` over TCP on localhost), one process per
rank, the way torchrun starts them. A rank that raises fails the test with its traceback; one that
dies without raising (a signal) fails it with how it died, named before its peers' errors.
"""

from __future__ import annotations

import os
import pickle
import signal
import socket
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(
    rank: int, world: int, port: int, fn: Callable, args: tuple, queue, timeout_s: float, env: dict
):
    # the environment of the test that started the ranks, not of the server they were forked from
    os.environ.clear()
    os.environ.update(env)
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world),
    )
    torch.set_num_threads(1)
    try:
        dist.init_process_group(
            "gloo", rank=rank, world_size=world, timeout=timedelta(seconds=timeout_s)
        )
        out = fn(rank, world, *args)
        # pickled here, by value: a tensor put on a torch.multiprocessing queue travels as a shared
        # file descriptor that this process must still be alive to hand over, and a rank that
        # exits first leaves the parent with "connection reset by peer"
        queue.put((rank, "ok", pickle.dumps(out)))
    except BaseException:  # report everything, including assertion errors, to the parent
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _context():
    """Ranks forked from a server process that has imported torch (and open_clip) once.

    The forkserver is a clean process: it imported these modules and nothing else ran in it (no
    threads, no process group, no test), so a rank forked from it is as fresh as a spawned one
    without paying the imports a spawned interpreter pays, seconds per rank on a small machine.
    It is started by the first multi-rank test and serves every later one.
    """
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed", "open_clip", __name__])
    return ctx


def run_ranks(fn: Callable, world: int, *args: Any, timeout_s: float = 120.0) -> list[Any]:
    """Run ``fn(rank, world, *args)`` on ``world`` gloo ranks; return the per-rank results.

    ``fn`` must be importable (a module-level function) and its return value picklable.
    """
    ctx = _context()
    queue = ctx.Queue()
    port = free_port()
    env = dict(os.environ)
    procs = [
        ctx.Process(target=_entry, args=(r, world, port, fn, args, queue, timeout_s, env))
        for r in range(world)
    ]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    errors: dict[int, str] = {}
    # Drain the queue before joining: a child blocks in put() until a large payload is read.
    import queue as _q
    import time

    deadline = time.monotonic() + timeout_s + 60
    while len(results) + len(errors) < world and time.monotonic() < deadline:
        try:
            rank, status, payload = queue.get(timeout=1.0)
        except _q.Empty:
            if all(not p.is_alive() for p in procs) and queue.empty():
                break
            continue
        if status == "ok":
            results[rank] = pickle.loads(payload)
        else:
            errors[rank] = f"rank {rank}:\n{payload}"
    overdue = set()
    for r, p in enumerate(procs):
        p.join(10)
        if p.is_alive():
            overdue.add(r)
            p.kill()
            p.join(10)
    # A rank that died without a word (a signal: a crash in native code, the OOM killer) comes
    # first: its peers' errors ("Connection closed by peer") follow from it.
    silent = [
        _death(r, None if r in overdue else procs[r].exitcode)
        for r in range(world)
        if r not in results and r not in errors
    ]
    if silent or errors:
        raise AssertionError("\n".join(silent + [errors[r] for r in sorted(errors)]))
    return [results[r] for r in range(world)]


def _death(rank: int, code: int | None) -> str:
    """How a rank that reported nothing ended, from its exit code (-N: killed by signal N; None:
    still running at the deadline, killed by run_ranks)."""
    if code is None:
        how = "still running at the deadline, killed"
    elif code < 0:
        how = f"killed by {signal.Signals(-code).name}"
    else:
        how = f"exited with code {code}"
    return f"rank {rank}: {how}, without reporting a result or an error"
