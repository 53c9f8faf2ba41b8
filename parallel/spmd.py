"""``parallelize_spmd``: tensor parallel, activation checkpointing / offload and FSDP2 applied to
one module over the non-pipeline dimensions of the mesh, in torchtitan's order.

``parallel.parallelize`` calls it for the whole model when pp == 1, and the pipeline code calls
it for each stage module.
"""

from __future__ import annotations

import logging
from typing import Any

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from parallel.config import ParallelConfig
from parallel.fsdp import apply_fsdp
from parallel.memory import apply_activation_checkpointing, apply_activation_offload
from parallel.mesh import dp_mesh
from parallel.tp.plan import TPPlan, apply_tp, find_block_lists

log = logging.getLogger("parallel.spmd")


def find_blocks(model: nn.Module) -> list[nn.Module]:
    """The repeated layers (children of the outermost lists of >= 2 same-class modules)."""
    mods = dict(model.named_modules())
    return [mods[b] for _, blocks in find_block_lists(model) for b in blocks]


def parallelize_spmd(model: nn.Module, cfg: ParallelConfig, mesh: DeviceMesh, example_inputs: Any = None, *,
                     plan: TPPlan | None = None, blocks: list[nn.Module] | None = None,
                     loss_parallel: bool = False, seq_dim: int = 1) -> TPPlan | None:
    """Apply ``cfg``'s tp / activation savers / dp_replicate x dp_shard to ``model`` in place.
    ``mesh``: the 4-D mesh of ``parallel.mesh.build_mesh`` (or any mesh with dims named tp,
    dp_replicate, dp_shard). ``example_inputs`` (on the model's device, or meta for a meta model)
    let the TP planner see the dataflow; not needed when ``plan`` is given or tp == 1.
    Returns the TP plan (None when tp == 1)."""
    blocks = find_blocks(model) if blocks is None else blocks
    tp_plan = None
    # 1. tensor parallel first: it changes the modules' forwards and turns parameters into DTensors
    #    on the tp mesh, which the later steps must see
    if mesh["tp"].size() > 1:
        tp_plan = apply_tp(model, mesh["tp"], example_inputs, plan=plan, sequence_parallel=cfg.sequence_parallel,
                           loss_parallel=loss_parallel, seq_dim=seq_dim)
    # 2. activation checkpointing / offload inside each block's forward, so FSDP's hooks stay
    #    outside: the recomputation runs while FSDP holds the block's gathered parameters
    apply_activation_checkpointing(blocks, cfg.activation_checkpointing, cfg.ac_every)
    if cfg.activation_offload:
        apply_activation_offload(blocks)
    # (3. torch.compile would go here, per block)
    # 4. FSDP2 last: it shards whatever parameters (plain or TP DTensors) the steps above left
    dp = dp_mesh(mesh)
    if dp.size() > 1 or cfg.cpu_offload or cfg.mixed_precision != "fp32":
        apply_fsdp(model, dp, blocks, mixed_precision=cfg.mixed_precision, cpu_offload=cfg.cpu_offload)
    return tp_plan


def _stage_hook(pm, cfg: ParallelConfig, groups) -> str | None:
    """``parallel.api`` stage hook: TP -> AC -> FSDP on the model ``parallelize`` prepared."""
    wanted = (cfg.tp > 1 or cfg.dp_shard > 1 or cfg.activation_checkpointing != "none" or cfg.activation_offload
              or cfg.cpu_offload or cfg.mixed_precision != "fp32")
    if not wanted:
        return None
    if cfg.pp > 1:
        if cfg.tp > 1 or cfg.dp_shard > 1 or cfg.cpu_offload or cfg.mixed_precision != "fp32":
            raise NotImplementedError("pp > 1 combined with tp / dp_shard / FSDP options is not supported yet "
                                      "(issue 6: the 3-D layout is not wired into the pipeline runtime)")
        held = [b for b in find_blocks(pm.module) if all(p.numel() for p in b.parameters())]
        apply_activation_checkpointing(held, cfg.activation_checkpointing, cfg.ac_every)
        if cfg.activation_offload:
            apply_activation_offload(held)
        return None
    from parallel.mesh import build_mesh

    mesh = build_mesh(cfg)
    parallelize_spmd(pm.module, cfg, mesh, getattr(pm, "example_inputs", None))
    return "reduces_grads" if dp_mesh(mesh).size() > 1 or cfg.tp > 1 else None


try:  # register with the pipeline API when it is present
    from parallel.api import register_stage_hook

    register_stage_hook("tensor_parallel", _stage_hook)
except ImportError:  # pragma: no cover
    pass
