"""One DeviceMesh for every kind of parallelism, built once from ``ParallelConfig``.

Dimensions, outermost first: ``pp``, ``dp_replicate``, ``dp_shard``, ``tp`` (torchtitan's
order): tensor-parallel ranks are adjacent (they talk every layer, so they should share a node),
pipeline ranks are farthest apart (they exchange one activation per microbatch). Every dimension
is present even at size 1, so code can always slice ``mesh["tp"]``. Global rank
``r = ((pp_i * R + rep_i) * S + shard_i) * T + tp_i`` for degrees (P, R, S, T).

``Layout`` is where this rank sits on that mesh, with the process groups the runtime uses that a
1-D mesh slice does not give directly: the pipeline (``mesh["pp"]``) and the data-parallel ranks
(``dp_replicate`` x ``dp_shard`` flattened: the ranks holding the same part of the model).
"""

from __future__ import annotations

import inspect
import itertools
import logging
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from parallel.config import DEGREES, ParallelConfig

log = logging.getLogger(__name__)

DIMS = DEGREES


def default_device_type() -> str:
    """``cuda`` when this process has a GPU and the process group can use it, else ``cpu``
    (gloo)."""
    if torch.cuda.is_available() and dist.is_initialized() and dist.get_backend() != "gloo":
        return "cuda"
    return "cpu"


def _timeout_override(device_type: str, timeout_s: float | None) -> dict | None:
    """``init_device_mesh``'s ``backend_override`` giving every dimension's process group the run's
    collective timeout: without it each sub-group gets torch's default (30 min), so a dead peer
    on the pipeline or tensor-parallel group would hang the job that long. None where it cannot
    be said (no timeout asked, or a torch whose ``init_device_mesh`` lacks the argument)."""
    if not timeout_s or "backend_override" not in inspect.signature(init_device_mesh).parameters:
        if timeout_s:
            log.warning(
                "this torch's init_device_mesh takes no backend_override: mesh sub-groups keep "
                "torch's default collective timeout"
            )
        return None
    nccl = device_type == "cuda" and "nccl" in dist.get_backend()
    opts = dist.ProcessGroupNCCL.Options() if nccl else dist.ProcessGroupGloo._Options()
    opts._timeout = timedelta(seconds=timeout_s)
    return {d: ("nccl" if nccl else "gloo", opts) for d in DIMS}


def build_mesh(
    cfg: ParallelConfig,
    world_size: int | None = None,
    device_type: str | None = None,
    timeout_s: float | None = None,
) -> DeviceMesh:
    """The 4-D mesh (pp, dp_replicate, dp_shard, tp) for ``cfg``; validates the layout first, so a
    layout that does not fit the world fails here, before any model code runs. ``timeout_s``: the
    collective timeout of every dimension's group (None: torch's default)."""
    cfg.validate(world_size if world_size is not None else dist.get_world_size())
    return _init_mesh(cfg, device_type, timeout_s)


def _init_mesh(cfg: ParallelConfig, device_type: str | None, timeout_s: float | None) -> DeviceMesh:
    """``init_device_mesh`` over a validated ``cfg``."""
    shape = tuple(getattr(cfg, d) for d in DIMS)
    device_type = device_type or default_device_type()
    override = _timeout_override(device_type, timeout_s)
    if override is None:
        return init_device_mesh(device_type, shape, mesh_dim_names=DIMS)
    return init_device_mesh(device_type, shape, mesh_dim_names=DIMS, backend_override=override)


def dp_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The data-parallel part: 2-D (dp_replicate, dp_shard) for HSDP, 1-D dp_shard otherwise."""
    if mesh["dp_replicate"].size() > 1:
        return mesh["dp_replicate", "dp_shard"]
    return mesh["dp_shard"]


@dataclass
class Layout:
    """Where this rank sits on the (pp, dp_replicate, dp_shard, tp) mesh."""

    rank: int  # global rank
    pp_rank: int  # index along the pipeline
    pp_size: int
    # index among the data-parallel ranks (dp_replicate x dp_shard): which share of the data
    dp_rank: int
    dp_size: int
    tp_rank: int  # index among the tensor-parallel ranks (they read the same data)
    tp_size: int
    pp_ranks: list[int]  # global ranks of this rank's pipeline, by pipeline index
    pp_group: Any  # process group of this pipeline (None: pp == 1)
    dp_group: (
        Any  # process group of the data-parallel ranks holding this rank's part (None: dp == 1)
    )
    mesh: DeviceMesh | None  # the 4-D mesh (None in a single process without a process group)


def layout_of(
    cfg: ParallelConfig, device_type: str | None = None, timeout_s: float | None = None
) -> Layout:
    """Build the mesh once (a collective: every rank calls it) and this rank's place on it. Without
    a process group (one process), a layout of size 1 everywhere and no mesh. ``timeout_s``: how
    long a collective on any of the mesh's groups waits for a dead peer (None: torch's default)."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    cfg.validate(world)
    if not dist.is_initialized():
        return Layout(0, 0, 1, 0, 1, 0, 1, [0], None, None, None)
    rank = dist.get_rank()
    mesh = _init_mesh(cfg, device_type, timeout_s)
    P, R, S, T = (getattr(cfg, d) for d in DIMS)
    coord = dict(zip(DIMS, mesh.get_coordinate()))
    dp_i = coord["dp_replicate"] * S + coord["dp_shard"]

    def rank_at(p: int, d: int, t: int) -> int:  # d: flattened (dp_replicate, dp_shard) index
        return (p * R * S + d) * T + t

    pp_ranks = [rank_at(p, dp_i, coord["tp"]) for p in range(P)]
    pp_group = mesh.get_group("pp") if P > 1 else None
    dp_group = None
    if R * S == world:  # every rank holds the same part: the default group, with its own timeout
        dp_group = dist.group.WORLD
    elif R * S > 1:  # every rank creates every group, in the same order (new_group is collective)
        timeout = timedelta(seconds=timeout_s) if timeout_s else None
        for p, t in itertools.product(range(P), range(T)):
            g = dist.new_group([rank_at(p, d, t) for d in range(R * S)], timeout=timeout)
            if (p, t) == (coord["pp"], coord["tp"]):
                dp_group = g
    return Layout(
        rank, coord["pp"], P, dp_i, R * S, coord["tp"], T, pp_ranks, pp_group, dp_group, mesh
    )
