"""Bind each CPU rank of a host to its own share of the cores (``ParallelConfig.bind_cores``).

Why: with every rank free to run on every core, the scheduler may move a rank to another core
(a rank waiting on a shared-memory ring yields and naps, and may wake elsewhere), leaving its
weights and activations in the old core's caches. This is what ``numactl --physcpubind`` or
``taskset`` at launch do, and what DeepSpeed's ``--bind_cores_to_rank`` does; doing it here means
a launch line does not have to know. What it gains depends on the host: the pipeline
benchmark's ``+bind`` rows measure it (figures: benchmarks/pipeline_cpu_*.md).

Opt-in (off by default): binding is only right when this job owns the cores it was started on.
Two jobs started side by side on one machine would each bind their local rank 0 to the same
first core and leave the others idle. So it is applied only when

- the model is on the CPU (GPU ranks are bound by the launcher's NUMA policy, not here),
- every rank of this host was started with the same set of allowed cores (a launcher or user
  that bound them already is left alone),
- that set has at least one core per local rank.

Local rank ``i`` of ``n`` gets the ``i``-th contiguous slice of ``len(cores) // n`` cores; every
thread of the process is bound (as ``taskset -p`` would), and torch's intra-op threads are capped
at the slice size so a rank does not oversubscribe its own cores.
"""

from __future__ import annotations

import logging
import os

import torch
import torch.distributed as dist

log = logging.getLogger("parallel.cpu_affinity")


def plan_binding(
    rank: int, hosts: list[str], allowed: list[tuple[int, ...]]
) -> tuple[tuple[int, ...] | None, str]:
    """The cores rank ``rank`` should be bound to, or None and why not. ``hosts[r]`` and
    ``allowed[r]`` (sorted cores) are every rank's host id and allowed cores."""
    local = [r for r in range(len(hosts)) if hosts[r] == hosts[rank]]
    if len(local) == 1:
        return None, "one rank on this host"
    if any(allowed[r] != allowed[rank] for r in local):
        return (
            None,
            "the ranks of this host were started with different allowed cores (already bound)",
        )
    cores = allowed[rank]
    if len(cores) < len(local):
        return None, f"{len(local)} ranks on this host share {len(cores)} cores"
    k = len(cores) // len(local)
    i = local.index(rank)
    return cores[i * k : (i + 1) * k], f"local rank {i} of {len(local)}"


def _set_all_threads(cores: tuple[int, ...]) -> None:
    try:
        tids = [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        tids = [0]
    for tid in tids:
        try:
            os.sched_setaffinity(tid, cores)
        except OSError:  # a thread that ended meanwhile
            pass


def bind_cores(device: torch.device) -> str:
    """Collective over the default group (every rank calls it); returns what was done (logged)."""
    if device.type != "cpu":
        done = f"left as is (model on {device.type})"
    elif (
        not hasattr(os, "sched_setaffinity")
        or not dist.is_initialized()
        or dist.get_world_size() == 1
    ):
        done = "left as is (no affinity API or a single process)"
    else:
        from .comm_hooks import hosts_of

        hosts = hosts_of()
        allowed: list = [None] * dist.get_world_size()
        dist.all_gather_object(allowed, tuple(sorted(os.sched_getaffinity(0))))
        cores, why = plan_binding(dist.get_rank(), hosts, allowed)
        if cores is None:
            done = f"left as is ({why})"
        else:
            _set_all_threads(cores)
            if torch.get_num_threads() > len(cores):
                torch.set_num_threads(len(cores))
            done = (
                f"bound to cores {list(cores)} ({why}), {torch.get_num_threads()} intra-op threads"
            )
    log.info("rank %s cpu affinity: %s", dist.get_rank() if dist.is_initialized() else 0, done)
    return done
