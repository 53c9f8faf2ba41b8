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


def discover_tp_plan(model: nn.Module, cfg: ParallelConfig, example_inputs: Any) -> TPPlan:
    """The TP plan of the whole model (``parallel.parallelize`` calls it before the pipeline
    split: pairs are read off the dataflow of the full forward)."""
    from parallel.tp import discover_plan

    if cfg.sequence_parallel and cfg.pp > 1:
        raise NotImplementedError("sequence_parallel with pp > 1: activations would cross the pipeline cuts "
                                  "sharded over the sequence; use sequence_parallel=False under pp")
    return discover_plan(model, cfg.tp, example_inputs=example_inputs)


def _stage_plan(plan: TPPlan, rank_of: dict[str, set[int]], me: int) -> tuple[TPPlan, list[str]]:
    """The part of the whole-model ``plan`` that this pipeline rank applies: entries whose modules
    are held by this rank alone. A pair whose column and row halves sit on different pipeline
    ranks (or on several) is left replicated, so every tensor crossing a cut is a plain,
    replicated tensor. Returns the stage plan and notes on what was dropped."""
    def only_mine(mod: str) -> bool:
        holders = {r for n, rs in rank_of.items() if n == mod or n.startswith(mod + ".") for r in rs}
        return holders == {me}

    out, notes = TPPlan(log=list(plan.log)), []
    for gid, (srcs, sink) in plan.pairs().items():
        mods = srcs + [sink]
        holders = [only_mine(m) for m in mods]
        if all(holders):
            for m in mods:
                out.entries[m] = plan.entries[m]
            out.owners[gid] = plan.owners[gid]
        elif any(holders):
            notes.append(f"pair {srcs} -> {sink} is cut by the pipeline: left replicated")
    for n, e in plan.entries.items():
        if e.group < 0 and e.role != "replicate" and only_mine(n):
            out.entries[n] = e
    return out, notes


def _pipeline_stage_hook(pm, cfg: ParallelConfig) -> str | None:
    """TP -> AC -> FSDP on this pipeline rank's part, on the stage's (dp_replicate, dp_shard, tp)
    sub-mesh. The eager runtime keeps replaying the whole model's Python, so the replayer's call
    interception is re-installed over the forwards TP replaces, and the rank's parameter list is
    refreshed (TP / FSDP swap parameters for DTensors)."""
    from parallel.api import _held_stages
    from parallel.mesh import build_mesh
    from parallel.pipeline.schedule import stage_rank
    from parallel.tp.plan import apply_plan

    if cfg.cpu_offload or cfg.mixed_precision != "fp32" or cfg.dp_shard > 1 or (cfg.tp > 1 and cfg.dp_replicate > 1):
        raise NotImplementedError("pp > 1 composes with tp (3-D: pp x tp), dp_replicate (without tp) and "
                                  "activation checkpointing / offload; FSDP options under pp (dp_shard, "
                                  "cpu_offload, mixed_precision) and tp x dp_replicate under pp are not wired "
                                  "into the pipeline runtime yet")
    model = pm.module
    named = list(model.named_parameters(remove_duplicate=False))
    held_names = {n for n, p in named if id(p) in pm._held}
    # 1. tensor parallel with the whole-model plan, restricted to this rank's modules, on this
    #    rank's slice of the (pp, dp_replicate, dp_shard, tp) mesh
    if cfg.tp > 1:
        mesh = build_mesh(cfg)
        k = pm.partition.num_stages
        rank_of = {n: {stage_rank(s, cfg.pp, cfg.schedule) for s in st}
                   for n, st in _held_stages(model, pm.partition, k).items()}
        plan, notes = _stage_plan(pm.tp_plan, rank_of, pm.pp_rank)
        for msg in notes:
            log.info("tp under pp: %s", msg)
        replayer = next(iter(pm.stages.values())).replayer
        mods = dict(model.named_modules())
        wrapped = [n for n in replayer.heads if n and "forward" in mods[n].__dict__]
        for n in wrapped:  # the class forward back, so TP's forwards replace the real one ...
            del mods[n].__dict__["forward"]
        apply_plan(model, plan, mesh["tp"])
        for n in wrapped:  # ... and the interception wraps whatever forward the module has now
            replayer._wrap(mods[n], n)
    # 2. activation checkpointing / offload of the blocks this rank holds
    held = [b for b in find_blocks(model) if all(p.numel() for p in b.parameters())]
    apply_activation_checkpointing(held, cfg.activation_checkpointing, cfg.ac_every)
    if cfg.activation_offload:
        apply_activation_offload(held)
    # (3. FSDP2 over the stage's dp_shard ranks would go here: rejected above for now)
    new = dict(model.named_parameters(remove_duplicate=False))
    pm._held = {id(new[n]) for n in held_names}
    local = [new[n] for n in held_names if new[n].requires_grad]
    for st in pm.all_stages():
        st.params = list({id(p): p for p in local}.values())
    # tp ranks hold shards (TP reduces inside the layers): no data-parallel averaging over them
    return "reduces_grads" if cfg.tp > 1 else None


def _stage_hook(pm, cfg: ParallelConfig, groups) -> str | None:
    """``parallel.api`` stage hook: TP -> AC -> FSDP on the model ``parallelize`` prepared."""
    wanted = (cfg.tp > 1 or cfg.dp_shard > 1 or cfg.activation_checkpointing != "none" or cfg.activation_offload
              or cfg.cpu_offload or cfg.mixed_precision != "fp32")
    if not wanted:
        return None
    if cfg.pp > 1:
        return _pipeline_stage_hook(pm, cfg)
    from parallel.mesh import build_mesh

    mesh = build_mesh(cfg)
    parallelize_spmd(pm.module, cfg, mesh, getattr(pm, "example_inputs", None))
    return "reduces_grads" if dp_mesh(mesh).size() > 1 or cfg.tp > 1 else None


try:  # register with the pipeline API when it is present
    from parallel.api import register_stage_hook

    register_stage_hook("tensor_parallel", _stage_hook)
except ImportError:  # pragma: no cover
    pass
