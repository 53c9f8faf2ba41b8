"""One DeviceMesh for every kind of parallelism, built from ``ParallelConfig``.

Dimensions, outermost first: ``pp``, ``dp_replicate``, ``dp_shard``, ``tp`` (torchtitan's
order): tensor-parallel ranks are adjacent (they talk every layer, so they should share a node),
pipeline ranks are farthest apart (they exchange one activation per microbatch). Every dimension
is present even at size 1, so code can always slice ``mesh["tp"]``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from parallel.config import ParallelConfig

DIMS = ("pp", "dp_replicate", "dp_shard", "tp")


def default_device_type() -> str:
    """``cuda`` when this process has a GPU and the process group can use it, else ``cpu`` (gloo)."""
    if torch.cuda.is_available() and dist.is_initialized() and dist.get_backend() != "gloo":
        return "cuda"
    return "cpu"


def build_mesh(cfg: ParallelConfig, world_size: int | None = None, device_type: str | None = None) -> DeviceMesh:
    """The 4-D mesh (pp, dp_replicate, dp_shard, tp) for ``cfg``; validates the layout first, so a
    layout that does not fit the world fails here, before any model code runs."""
    world_size = world_size if world_size is not None else dist.get_world_size()
    cfg.validate(world_size)
    shape = tuple(getattr(cfg, d) for d in DIMS)
    return init_device_mesh(device_type or default_device_type(), shape, mesh_dim_names=DIMS)


def dp_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The data-parallel part: 2-D (dp_replicate, dp_shard) for HSDP, 1-D dp_shard otherwise."""
    if mesh["dp_replicate"].size() > 1:
        return mesh["dp_replicate", "dp_shard"]
    return mesh["dp_shard"]


def tp_mesh(mesh: DeviceMesh) -> DeviceMesh:
    return mesh["tp"]
