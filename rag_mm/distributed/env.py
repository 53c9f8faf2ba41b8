"""Process-group set-up from torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_*)."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)


@dataclass
class DistEnv:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def world_size_from_env() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def init_distributed(device: str = "auto", backend: str = "auto", timeout_s: int = 600) -> DistEnv:
    """Join the process group torchrun describes (or run alone); pick the device and backend."""
    world = world_size_from_env()
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    use_cuda = torch.cuda.is_available() if device == "auto" else device == "cuda"
    if use_cuda:
        torch.cuda.set_device(local_rank)
        dev = torch.device("cuda", local_rank)
    else:
        dev = torch.device("cpu")
    # alone, a process group is joined only when asked for by name under torchrun (one process
    # on NCCL: the GPU checks train the demo through NCCL's set-up and collectives)
    asked = backend != "auto" and "MASTER_ADDR" in os.environ
    if (world > 1 or asked) and not dist.is_initialized():
        be = ("nccl" if use_cuda else "gloo") if backend == "auto" else backend
        # Under NCCL, host tensors (stop flags, counts, object broadcasts) go through a gloo
        # backend of the same group: NCCL alone refuses a CPU tensor.
        pg_backend = "cpu:gloo,cuda:nccl" if be == "nccl" else be
        dist.init_process_group(
            pg_backend,
            timeout=timedelta(seconds=timeout_s),
            device_id=dev if be == "nccl" else None,
            **_restart_safe_store(rank, world, timeout_s),
        )
        log.info("rank %d/%d joined the %s process group (device %s)", rank, world, be, dev)
    return DistEnv(rank, world, local_rank, dev)


def _restart_safe_store(rank: int, world: int, timeout_s: int) -> dict:
    """Under torchrun, a store namespace of our own per restart of the worker group.

    torchrun's agent keeps one TCP store across ``--max-restarts``; on torch 2.14 a restarted
    group's gloo rendezvous reads the dead group's addresses from it and hangs or fails
    ("connectFullMesh failed ... Connection refused"). A prefix per restart keeps them apart.
    """
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return {}
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        is_master=False,
        timeout=timedelta(seconds=timeout_s),
    )
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return {
        "store": dist.PrefixStore(f"rag_mm/attempt_{attempt}", store),
        "rank": rank,
        "world_size": world,
    }


def all_reduce_sum(t: torch.Tensor) -> torch.Tensor:
    if dist.is_initialized():
        dist.all_reduce(t)
    return t


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def broadcast_object(obj):
    if not dist.is_initialized():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def cleanup() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
