"""``parallelize_spmd``: the one function that shards a rank's part of the model over the
non-pipeline dimensions of the mesh, in torchtitan's order (``parallelize_llama``):
tensor parallel -> activation checkpointing / offload -> compile -> FSDP2.

``parallel.parallelize`` calls it for every layout: on the whole model when pp == 1, and on each
pipeline rank's part (the model with other ranks' parameters freed) when pp > 1.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field
from typing import Any

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from parallel.compile import apply_compile, apply_compile_model
from parallel.config import ParallelConfig
from parallel.fsdp import apply_fsdp, fsdp_units, mixed_precision_policy
from parallel.memory import (
    apply_activation_checkpointing,
    apply_activation_offload,
    checkpoint_candidates,
)
from parallel.mesh import dp_mesh
from parallel.tp.plan import TPPlan, apply_plan, find_block_lists, head_divisions
from parallel.tp.verify import apply_tp

log = logging.getLogger("parallel.spmd")


@dataclass
class Sharded:
    """What ``parallelize_spmd`` did to a model part."""

    tp_plan: TPPlan | None = None  # the TP plan applied (None: tp == 1)
    fsdp_units: list[nn.Module] = field(default_factory=list)  # FSDP modules, innermost first
    # the whole model is one FSDP root (pp == 1): its own hooks run the step
    fsdp_root: bool = False


@dataclass
class StagePart:
    """A pipeline rank's part of the whole model (pp > 1)."""

    held: set[int]  # ids of the parameters this rank holds (others are freed, numel 0)
    container: set[str]  # modules whose forward is container code (strict ancestors of stage units)
    # ids of parameters held by several pipeline ranks (their gradients are summed over the
    # pipeline on the whole tensor): FSDP leaves them whole
    replicated: set[int] = field(default_factory=set)


def find_blocks(model: nn.Module) -> list[nn.Module]:
    """The repeated layers (children of the outermost lists of >= 2 same-class modules)."""
    mods = dict(model.named_modules())
    return [mods[b] for _, blocks in find_block_lists(model) for b in blocks]


def parallelize_spmd(
    model: nn.Module,
    cfg: ParallelConfig,
    mesh: DeviceMesh,
    example_inputs: Any = None,
    *,
    plan: TPPlan | None = None,
    blocks: list[nn.Module] | None = None,
    loss_parallel: bool = False,
    seq_dim: int = 1,
    part: StagePart | None = None,
) -> Sharded:
    """Apply ``cfg``'s tp / activation savers / compile / dp_replicate x dp_shard to ``model`` in
    place.

    ``mesh``: the 4-D mesh of ``parallel.mesh.build_mesh`` (or any mesh with dims named tp,
    dp_replicate, dp_shard). ``example_inputs`` (on the model's device, or meta for a meta model)
    let the TP planner see the dataflow; not needed when ``plan`` is given or tp == 1. ``part``:
    this pipeline rank's part (pp > 1); ``plan`` is then the whole model's checked TP plan
    restricted to the part (``stage_plan``), and FSDP shards the part's units only."""
    blocks = find_blocks(model) if blocks is None else blocks
    if part is not None:  # a pipeline rank: only the blocks it holds
        blocks = [
            b for b in blocks if all(id(p) in part.held and p.numel() for p in b.parameters())
        ]
        held_names = _names_of(model, part.held), _names_of(model, part.replicated)
    out = Sharded()
    # 1. tensor parallel first: it changes the modules' forwards and turns parameters into DTensors
    #    on the tp mesh, which the later steps must see
    if mesh["tp"].size() > 1:
        if part is None:
            out.tp_plan = apply_tp(
                model,
                mesh["tp"],
                example_inputs,
                plan=plan,
                sequence_parallel=cfg.sequence_parallel,
                loss_parallel=loss_parallel,
                seq_dim=seq_dim,
            )
        else:  # read off and checked on the whole model before the split (``stage_plan``)
            ctx = apply_plan(
                model, plan, mesh["tp"], sequence_parallel=cfg.sequence_parallel, seq_dim=seq_dim
            )
            out.tp_plan = dataclasses.replace(plan, log=ctx.log)
            # TP put new (DTensor) parameter objects in place of the ones ``part`` names by id:
            # without this, FSDP took every TP-sharded module for another rank's and left it
            # whole on each data-parallel rank
            part = dataclasses.replace(
                part, held=_ids_of(model, held_names[0]), replicated=_ids_of(model, held_names[1])
            )
    # 2. activation checkpointing / offload inside each block's forward, so FSDP's hooks stay
    #    outside: the recomputation runs while FSDP holds the block's gathered parameters
    ac_blocks = checkpoint_candidates(model, blocks, cfg.ac_skip)
    apply_activation_checkpointing(ac_blocks, cfg.activation_checkpointing, cfg.ac_every)
    if cfg.activation_offload:
        apply_activation_offload(blocks)
    # 3. torch.compile per block, around the checkpointed forward and inside FSDP's hooks; or the
    #    whole model as one graph (plain data parallel only: ParallelConfig.problems)
    if cfg.compile and cfg.compile_scope == "model":
        apply_compile_model(model, cfg.compile_backend, cfg.compile_mode)
    elif cfg.compile:
        apply_compile(blocks, cfg.compile_backend)
    # 4. FSDP2 last: it shards whatever parameters (plain or TP DTensors) the steps above left
    dp = dp_mesh(mesh)
    if (
        part is None
    ):  # replicas alone (dp_shard == 1) are plain data parallel: ParallelModel averages
        if cfg.dp_shard > 1 or cfg.cpu_offload or cfg.mixed_precision != "fp32":
            apply_fsdp(
                model, dp, blocks, mixed_precision=cfg.mixed_precision, cpu_offload=cfg.cpu_offload
            )
            out.fsdp_units, out.fsdp_root = [*blocks, model], True
    elif cfg.dp_shard > 1:
        out.fsdp_units = _shard_part(model, dp, blocks, part, cfg)
    return out


def _shard_part(
    model: nn.Module, dp: DeviceMesh, blocks: list[nn.Module], part: StagePart, cfg: ParallelConfig
) -> list[nn.Module]:
    """FSDP2 on a pipeline rank's units (``fsdp.fsdp_units``). ``reshard_after_forward=False``: a
    unit's parameters stay gathered between its microbatch forwards and backwards, so the step
    gathers each once instead of twice per microbatch (torchtitan turns it off under PP too); the
    pipeline's ``StepSync`` reduce-scatters once per step."""
    from parallel.fsdp import _placement_fn, shard_unit

    units = fsdp_units(model, part.held - part.replicated, blocks, part.container)
    covered = {id(p) for u in units for p in u.parameters()}
    left = sum(p.numel() for p in model.parameters() if id(p) in part.held and id(p) not in covered)
    for u in units:
        shard_unit(
            u,
            mesh=dp,
            reshard_after_forward=False,
            shard_placement_fn=_placement_fn,
            mp_policy=mixed_precision_policy(cfg.mixed_precision),
        )
    log.info(
        "fsdp under pp: %d units on mesh %s; %d parameters left replicated over the data-parallel "
        "ranks (container-owned, tied or held by several stages)",
        len(units),
        tuple(dp.shape),
        left,
    )
    return units


def _names_of(model: nn.Module, ids: set[int]) -> set[str]:
    """The names (every alias) of the parameters whose ids are in ``ids``."""
    return {n for n, p in model.named_parameters(remove_duplicate=False) if id(p) in ids}


def _ids_of(model: nn.Module, names: set[str]) -> set[int]:
    """The ids of the parameters now registered under ``names``."""
    return {id(p) for n, p in model.named_parameters(remove_duplicate=False) if n in names}


def discover_tp_plan(model: nn.Module, cfg: ParallelConfig, example_inputs: Any) -> TPPlan:
    """The TP plan of the whole model (``parallel.parallelize`` calls it before the pipeline
    split: pairs are read off the dataflow of the full forward)."""
    from parallel.tp import discover_plan

    return discover_plan(
        model, cfg.tp, example_inputs=example_inputs, sequence_parallel=cfg.sequence_parallel
    )


def stage_plan(
    model: nn.Module, plan: TPPlan, rank_of: dict[str, set[int]], me: int
) -> tuple[TPPlan, list[str]]:
    """The part of the whole-model ``plan`` that this pipeline rank applies: entries whose modules
    are held by this rank alone. A pair whose column and row halves sit on different pipeline
    ranks (or on several) is left replicated, so every tensor crossing a cut is a plain,
    replicated tensor. Returns the stage plan and notes on what was dropped.

    The head counts of every pair that some rank shards are divided on every rank: a block cut by
    the pipeline runs its attention's own code on each stage up to the cut, and on the stages
    that do not hold the projections it reads stand-ins shaped like their sharded outputs. Needs
    ``model``'s unsharded weights (call it before other ranks' parameters are freed)."""

    def holders(mod: str) -> set[int]:
        return {r for n, rs in rank_of.items() if n == mod or n.startswith(mod + ".") for r in rs}

    def only_mine(mod: str) -> bool:
        return holders(mod) == {me}

    out, notes = TPPlan(log=list(plan.log)), []
    sharded: set[int] = set()  # pairs that one rank holds whole (and shards)
    for gid, (srcs, sink) in plan.pairs().items():
        mods = srcs + [sink]
        who = [holders(m) for m in mods]
        if len(who[0]) == 1 and all(h == who[0] for h in who):
            sharded.add(gid)
        if all(h == {me} for h in who):
            for m in mods:
                out.entries[m] = plan.entries[m]
            out.owners[gid] = plan.owners[gid]
        elif any(h == {me} for h in who):
            notes.append(f"pair {srcs} -> {sink} is cut by the pipeline: left replicated")
    out.divide = head_divisions(model, plan, sharded)
    for n, e in plan.entries.items():
        if e.group < 0 and e.role != "replicate" and only_mine(n):
            out.entries[n] = e
    # sequence parallel: each run of consecutive blocks this rank holds whole is a region of its
    # own (split at its first block's input, gathered after its last), so every tensor crossing a
    # pipeline cut is whole over the sequence; an interleaved schedule gives a rank several runs
    for first, last in plan.regions:
        prefix, _, i0 = first.rpartition(".")
        run: list[int] = []
        for i in range(int(i0), int(last.rpartition(".")[2]) + 1):
            if only_mine(f"{prefix}.{i}"):
                run.append(i)
                continue
            if run:
                out.regions.append((f"{prefix}.{run[0]}", f"{prefix}.{run[-1]}"))
            run = []
        if run:
            out.regions.append((f"{prefix}.{run[0]}", f"{prefix}.{run[-1]}"))
    return out, notes
