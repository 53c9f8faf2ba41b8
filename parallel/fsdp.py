"""Sharded data parallel with FSDP2 (``fully_shard``): per-block units plus the root, HSDP when
the dp mesh is 2-D (replicate x shard), bf16 parameters with fp32 gradient reduction, optional
CPU offload of parameters, gradients and optimizer state (the optimizer then steps on the host).

Composes with tensor parallel: parameters that are DTensors on the tp mesh get a 2-D layout
(dp shard x tp). A parameter whose TP layout is a strided fused block (q|k|v) is sharded by FSDP
on another dimension, so its ``full_tensor()`` keeps the single-device layout.
"""

from __future__ import annotations

import logging

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
)
from torch.distributed.tensor import DTensor, Shard

log = logging.getLogger("parallel.fsdp")


def mixed_precision_policy(mode: str) -> MixedPrecisionPolicy:
    """fp32: no casting. bf16: parameters and compute in bf16, gradients reduced in fp32 (the
    reduction is where bf16 rounding would accumulate across ranks)."""
    if mode == "bf16":
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    if mode == "fp32":
        return MixedPrecisionPolicy()
    raise ValueError(f"mixed_precision must be fp32 or bf16 (got {mode!r})")


def _placement_fn(p: nn.Parameter):
    """FSDP shards dim 0, except where TP already holds dim 0 as fused strided blocks."""
    if isinstance(p, DTensor):
        for pl in p.placements:
            if type(pl).__name__ == "_StridedShard" and p.dim() > 1:
                return Shard(1 if pl.dim == 0 else 0)
    return Shard(0)


def apply_fsdp(model: nn.Module, mesh: DeviceMesh, blocks: list[nn.Module] | None = None, *,
               mixed_precision: str = "fp32", cpu_offload: bool = False,
               reshard_after_forward: bool = True) -> nn.Module:
    """``fully_shard`` each block (layer) and then the root on ``mesh`` (1-D: FSDP, 2-D
    (replicate, shard): HSDP). Blocks are the communication units: one all-gather before each
    block's forward and backward, one reduce-scatter after its backward."""
    kw = dict(mesh=mesh, mp_policy=mixed_precision_policy(mixed_precision),
              offload_policy=CPUOffloadPolicy(pin_memory=torch.cuda.is_available()) if cpu_offload else OffloadPolicy(),
              shard_placement_fn=_placement_fn)
    for b in blocks or []:
        fully_shard(b, reshard_after_forward=reshard_after_forward, **kw)
    # the root's parameters (embeddings, final norm, head) are needed again right after forward
    fully_shard(model, reshard_after_forward=False, **kw)
    log.info("fsdp: %d block units + root on mesh %s (mixed precision %s, cpu offload %s)",
             len(blocks or []), tuple(mesh.shape), mixed_precision, cpu_offload)
    return model


@torch.no_grad()
def clip_grad_norm_(parameters, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` for a mix of DTensor (TP / FSDP shards) and plain
    gradients: each DTensor's norm is reduced over its mesh, so every rank sees the norm of the
    whole model's gradient. Returns that total norm (a plain tensor)."""
    grads = [p.grad for p in parameters if p.grad is not None]
    if not grads:
        return torch.tensor(0.0)
    norms = []
    for g in grads:
        n = torch.linalg.vector_norm(g, norm_type)
        norms.append((n.full_tensor() if isinstance(n, DTensor) else n).float().cpu())
    total = torch.linalg.vector_norm(torch.stack(norms), norm_type)
    coef = (max_norm / (total + 1e-6)).clamp(max=1.0)
    for g in grads:
        g.mul_(coef.to(g.device))
    return total
