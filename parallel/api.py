"""``parallelize``: the one call that turns a single-device model into a parallel one.

    pmodel = parallel.parallelize(
        model, parallel.ParallelConfig(pp=2, microbatches=8), example_inputs
    )
    # fwd + bwd, mean loss on every rank
    loss = pmodel.train_step(inputs, target=target, loss_fn=fn)
    opt = torch.optim.AdamW(pmodel.parameters())                  # this rank's parameters
    opt.step(); pmodel.zero_grad()

Every rank builds the same model (same seed or checkpoint) and passes the same example; every rank
of one pipeline passes the same batch to ``train_step`` (data loaders shard by ``pmodel.dp_rank``
/ ``pmodel.dp_size``, not by the global rank).

The order of what ``parallelize`` does, and why (torchtitan's ``pipeline_llama`` followed by
``parallelize_llama`` per model part):

1. mesh: the 4-D (pp, dp_replicate, dp_shard, tp) DeviceMesh, built once (``mesh.layout_of``);
2. partition (pp > 1): traced and balanced on the *unsharded* model (rank 0 traces, every rank
   gets the same ``Partition``: timings differ between ranks, placements must not);
3. pipeline stages (pp > 1): the eager runtime's plan (which calls each stage runs, which tensors
   cross each cut) is derived on the full model, one per input structure (``structures``), and
   the TP plan is read off the full model's dataflow; then parameters of other stages are freed;
4. ``spmd.parallelize_spmd`` on this rank's part (the whole model when pp == 1): tensor parallel
   -> activation checkpointing -> compile -> FSDP2, on the non-pipeline dimensions of the mesh;
5. data parallel for what FSDP does not shard: parameters broadcast from dp rank 0 now,
   gradients averaged over the data-parallel ranks once per optimizer step
   (``train_step(sync=...)``).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .collectives import flat_collective
from .config import ParallelConfig
from .cpu_affinity import bind_cores
from .fsdp import StepSync
from .host_malloc import steady_malloc
from .inputs import _as_call, _batch, _microbatch_of, split_microbatches
from .mesh import layout_of
from .model import ParallelModel, Parts, _local, _loss_group
from .partition import Partition, auto_partition, baseline_partition
from .pipeline.eager import EagerStage, Plan, Replayer, build_plan
from .pipeline.graph import GraphPathError, GraphPlan, GraphStage, build_graph_plan
from .pipeline.lanes import open_lanes
from .pipeline.p2p import PipelineError, Transport
from .pipeline.schedule import pipeline_order, stage_rank, stages_per_rank
from .spmd import Sharded, StagePart, discover_tp_plan, parallelize_spmd, stage_plan
from .tp.verify import capture_inputs, verify_plan

log = logging.getLogger(__name__)

COST_SCHEDULE = {
    "gpipe": "gpipe",
    "1f1b": "1f1b",
    "eager_1f1b": "eager_1f1b",
    "interleaved_1f1b": "interleaved",
    "looped_bfs": "interleaved",
    "zero_bubble": "interleaved",
    "zbv": "zbv",
    "dualpipev": "zbv",
}
BASELINES = ("uniform", "parameters", "time")


def make_partition(
    model: nn.Module,
    cfg: ParallelConfig,
    example_inputs: Any,
    num_stages: int,
    v: int,
    trace_loss_fn: Callable | None = None,
) -> Partition:
    """Rank 0 traces and partitions; every rank receives the same Partition.

    The trace runs on one microbatch, not the whole example batch: unit costs are per microbatch
    in the cost model, and they are not linear in the batch (the reader's copy head works on
    (tokens, vocabulary) tensors that stay in cache at a microbatch of 8 and not at 32: traced on
    the batch it looked 1.3x too expensive next to the blocks and drew the cut after lm_head,
    ~10 MB per microbatch across it, benchmarks/pipeline_cpu_*.md)."""
    obj: list[Any] = [None]
    rank = dist.get_rank() if dist.is_initialized() else 0
    if _batch(example_inputs) >= cfg.microbatches > 1:
        example_inputs = split_microbatches(example_inputs, cfg.microbatches)[0]
    if rank == 0:
        sched = COST_SCHEDULE[cfg.schedule]
        kw = dict(schedule=sched, microbatches=cfg.microbatches, stages_per_rank=v)
        if cfg.partition == "auto":
            part = auto_partition(
                model,
                example_inputs,
                num_stages,
                cfg.objective,
                cfg.memory_cap_bytes,
                loss_fn=trace_loss_fn,
                **kw,
            )
        elif cfg.partition in BASELINES:
            from .cost import CostConfig
            from .trace import trace_model

            trace = trace_model(model, example_inputs, loss_fn=trace_loss_fn)
            part = baseline_partition(
                trace,
                num_stages,
                cfg.partition,
                CostConfig(schedule=sched, microbatches=cfg.microbatches, stages_per_rank=v),
            )
        elif os.path.exists(cfg.partition):
            part = Partition.load(cfg.partition)
        else:
            raise ValueError(
                f"partition must be auto, {', '.join(BASELINES)} or a JSON file (got "
                f"{cfg.partition!r})"
            )
        obj[0] = part.to_dict()
        for p in model.parameters():  # tracing ran backward passes
            p.grad = None
    if dist.is_initialized():
        dist.broadcast_object_list(obj, src=0)
    part = Partition.from_dict(obj[0])
    if part.num_stages != num_stages:
        raise ValueError(
            f"the partition has {part.num_stages} stages, the config needs {num_stages}"
        )
    return part


# ----------------------------------------------------------------------------- the wrapper


def parallelize(
    model: nn.Module,
    cfg: ParallelConfig,
    example_inputs: Any,
    *,
    trace_loss_fn: Callable[[Any], torch.Tensor] | None = None,
    timeout_s: float = 300.0,
    partition: Partition | None = None,
    structures: Mapping[str, Any] | None = None,
) -> ParallelModel:
    """Spread ``model`` over the ranks as ``cfg`` says (see the module doc for the order).

    ``example_inputs``: one batch (tuple of positional or dict of keyword arguments) shaped like
    the training batches; ``trace_loss_fn(output) -> scalar`` for tracing when the output is not
    a scalar or a dataclass with tensors (default: sum of means of the outputs). ``timeout_s``:
    how long a pipeline receive waits before raising ``PipelineError``.

    ``structures``: further example batches by name, for inputs that make the model run another
    sequence of module calls than ``example_inputs`` (another number of documents, an encoder
    skipped): each gets its own replay plan on the same partition, used by
    ``train_step(..., structure=name)`` / ``predict(..., structure=name)``. The partition is
    balanced on ``example_inputs`` only. Plans need the whole model, so they are made here, before
    the parameters of other ranks are freed; they take the eager path."""
    structures = dict(structures or {})
    bad = [n for n in structures if not isinstance(n, str) or not n]
    if bad:
        raise ValueError(f"structures must be named by non-empty strings (got {bad})")
    if cfg.steady_malloc:
        steady_malloc()
    if cfg.bind_cores:  # before the partition times the model, so it times it as it will run
        bind_cores(next((p.device for p in model.parameters()), torch.device("cpu")))
    # 1. mesh (validates the layout against the world first)
    layout = layout_of(cfg, timeout_s=timeout_s)
    v = stages_per_rank(cfg.schedule, cfg.stages_per_rank)
    k = cfg.pp * v
    if cfg.pp == 1:
        # 4. TP -> AC -> compile -> FSDP on the whole model
        shard = _shard(model, cfg, layout, example_inputs, None, [])
        parts = Parts(
            module=model,
            cfg=cfg,
            layout=layout,
            device=_device_of(shard.named_held),
            **shard.fields(),
            grad_reducer=_grad_reducer(cfg, layout),
            structure_names=frozenset(structures),
        )
        _broadcast_dp(parts)
        return ParallelModel(parts)
    # 2. partition
    if partition is None:
        partition = make_partition(model, cfg, example_inputs, k, v, trace_loss_fn)
    # 3. pipeline stages: plan on the full model, then free what other ranks hold; the graph
    #    path (export + split at the partition's cuts) where asked for and possible, else eager
    args, kwargs = _as_call(_microbatch_of(example_inputs, cfg.microbatches))
    gplan, path = _graph_plan(model, cfg, partition, k, args, kwargs, sorted(structures))
    log.info("pipeline stages: %s", path)
    extra_plans: dict[str, Plan] = {}
    replayer = None
    heads: dict[str, int] = {}
    for u, s in zip(partition.units, partition.unit_stage):
        if u.kind == "module":
            heads[u.module] = s
    if gplan is None:
        replayer = Replayer(model, set(heads))
        plan = build_plan(replayer, heads, k, args, kwargs)
        for name, ex in structures.items():
            extra_plans[name] = build_plan(
                replayer, heads, k, *_as_call(_microbatch_of(ex, cfg.microbatches))
            )
            log.info(
                "input structure %r: %d module calls (the example: %d)",
                name,
                len(extra_plans[name].names),
                len(plan.names),
            )
    for p in model.parameters():
        p.grad = None
    local = [s for s in range(k) if stage_rank(s, cfg.pp, cfg.schedule) == layout.pp_rank]
    held_stages = _held_stages(model, partition, k)
    held: set[int] = set()
    ranks_of: dict[str, set[int]] = {}
    for name, p in model.named_parameters():
        st = held_stages.get(name, set())
        ranks_of[name] = {stage_rank(s, cfg.pp, cfg.schedule) for s in st}
        if st & set(local):
            held.add(id(p))
    replicated = sorted(n for n, r in ranks_of.items() if len(r) > 1)
    if gplan is not None:  # a stage holds exactly the parameters its graph uses (none shared)
        held = {id(p) for s in local for p in gplan.modules[s].parameters()}
        replicated = []
    numel = {n: p.numel() for n, p in model.named_parameters()}
    # a TP plan is read off the whole model's dataflow and checks itself on the whole model (each
    # unit, sharded, against its replicated self on its inputs in the example's forward), before
    # the split: every pipeline rank then knows the same checked plan, and applies its part below
    tp_plan, tp_notes = None, []
    if cfg.tp > 1:
        tp_plan = discover_tp_plan(model, cfg, example_inputs)
        if replayer is not None:  # the check runs copies of units: with their own forwards
            replayer.unwrap()
        tp_plan = verify_plan(
            model, tp_plan, layout.mesh["tp"], capture_inputs(model, tp_plan, example_inputs)
        )
        if replayer is not None:
            replayer.rewrap()
        tp_plan, tp_notes = stage_plan(model, tp_plan, ranks_of, layout.pp_rank)
    for p in model.parameters():
        if id(p) not in held:
            p.data = torch.empty(0, dtype=p.dtype, device=p.device)  # another rank's: free it
    device = next((p.device for p in model.parameters() if id(p) in held), torch.device("cpu"))
    stage_ranks = [layout.pp_ranks[stage_rank(s, cfg.pp, cfg.schedule)] for s in range(k)]
    transport = Transport(stage_ranks, timeout_s, device)
    # the I/W split (split_backward.py) is tested on plain and FSDP stages; TP's DTensors and the
    # saved-tensor hooks of checkpointing / offload keep the whole backward
    split_drain = (
        cfg.split_drain
        and cfg.tp == 1
        and cfg.activation_checkpointing == "none"
        and not cfg.activation_offload
    )
    if cfg.split_drain and not split_drain:
        log.info(
            "split_drain off: the last backward stays whole under tp / activation checkpointing / "
            "offload"
        )
    orders = pipeline_order(cfg.schedule, cfg.pp, v, cfg.microbatches, split_drain)
    transport.lanes, how = open_lanes(
        orders, cfg.microbatches, stage_ranks, layout.rank, timeout_s, cfg.p2p
    )
    log.info("pipeline p2p on rank %d: %s", layout.rank, how)
    loss_group = _loss_group(cfg, device, timeout_s)
    local_params = [p for p in model.parameters() if id(p) in held]
    if gplan is not None:
        plan = gplan
        stages = {s: GraphStage(s, gplan, model, transport, local_params, device) for s in local}
    else:
        stages = {s: EagerStage(s, plan, replayer, transport, local_params, device) for s in local}
    extra_stages = {
        name: {s: EagerStage(s, p, replayer, transport, local_params, device) for s in local}
        for name, p in extra_plans.items()
    }
    # 4. TP -> AC -> compile -> FSDP on this rank's part
    for msg in tp_notes:
        log.info("tp under pp: %s", msg)
    # modules whose forward is container code (the root, ancestors of stage units): it runs on
    # every stage and stops where the stage's work ends
    container = {""} | {
        n for n, _ in model.named_modules() if n and any(h.startswith(n + ".") for h in heads)
    }
    if replayer is not None:  # the replay intercepts whatever forwards sharding leaves
        replayer.unwrap()
    params = dict(model.named_parameters(remove_duplicate=False))
    all_stages = [*stages.values(), *(st for by in extra_stages.values() for st in by.values())]
    shard = _shard(
        model,
        cfg,
        layout,
        example_inputs,
        StagePart(held, container, {id(params[n]) for n in replicated}),
        all_stages,
        tp_plan,
    )
    if replayer is not None:
        replayer.rewrap()
    parts = Parts(
        module=model,
        cfg=cfg,
        layout=layout,
        device=device,
        **shard.fields(),
        grad_reducer=_grad_reducer(cfg, layout),
        partition=partition,
        plan=plan,
        stages=stages,
        order=tuple(orders[layout.pp_rank]),
        transport=transport,
        local_stages=tuple(local),
        replicated=tuple(replicated),
        replicated_numel={n: numel[n] for n in replicated},
        loss_group=loss_group,
        structures=extra_stages,
        structure_names=frozenset(structures),
        plans=extra_plans,
    )
    # 5. consistent start: replicated parameters from their first holder, replicas from dp rank 0
    _broadcast_replicated(parts)
    _broadcast_dp(parts)
    log.info(
        "pipeline rank %d: stages %s, %d parameters\n%s",
        layout.pp_rank,
        local,
        sum(p.numel() for p in shard.trainable),
        plan.describe(),
    )
    return ParallelModel(parts)


@dataclass(frozen=True)
class _Sharding:
    """This rank's parameters after step 4 (TP and FSDP replace them by DTensors)."""

    sharded: Sharded  # what parallelize_spmd applied
    # this rank's parameters by name, after the swap
    named_held: tuple[tuple[str, nn.Parameter], ...]
    trainable: tuple[nn.Parameter, ...]  # the distinct ones that take gradients
    fsdp_ids: frozenset[int]  # those whose gradients FSDP reduces
    # FSDP units that run several microbatches per call, driven once per call
    step_sync: StepSync | None

    def fields(self) -> dict[str, Any]:
        """These, as ``Parts``' keyword arguments."""
        return {f.name: getattr(self, f.name) for f in fields(self)}


def _shard(
    model: nn.Module,
    cfg: ParallelConfig,
    layout,
    example_inputs: Any,
    part: StagePart | None,
    stages: list,
    tp_plan: Any = None,
) -> _Sharding:
    """Step 4 of ``parallelize`` on this rank's part, then the bookkeeping that follows it: TP and
    FSDP replace parameters by DTensors, so the rank's parameter set and its ``stages``' lists are
    rebuilt, and FSDP units that run several microbatches per step are driven by ``StepSync``."""
    names = [
        n
        for n, p in model.named_parameters(remove_duplicate=False)
        if part is None or id(p) in part.held
    ]
    sharded = Sharded()
    if layout.mesh is not None:
        sharded = parallelize_spmd(model, cfg, layout.mesh, example_inputs, plan=tp_plan, part=part)
    elif cfg.activation_checkpointing != "none" or cfg.activation_offload or cfg.compile:
        # one process: savers, then compile (the spmd order without TP and FSDP)
        from .compile import apply_compile, apply_compile_model
        from .memory import (
            apply_activation_checkpointing,
            apply_activation_offload,
            checkpoint_candidates,
        )
        from .spmd import find_blocks

        blocks = find_blocks(model)
        ac_blocks = checkpoint_candidates(model, blocks, cfg.ac_skip)
        apply_activation_checkpointing(ac_blocks, cfg.activation_checkpointing, cfg.ac_every)
        if cfg.activation_offload:
            apply_activation_offload(blocks)
        if cfg.compile and cfg.compile_scope == "model":
            apply_compile_model(model, cfg.compile_backend, cfg.compile_mode)
        elif cfg.compile:
            apply_compile(blocks, cfg.compile_backend)
    new = dict(model.named_parameters(remove_duplicate=False))
    # (while FSDP holds a unit gathered, the module shows its unsharded parameters)
    trainable = tuple({id(p): p for n in names if (p := new[n]).requires_grad}.values())
    for st in stages:
        st.params = list(trainable)
    units = sharded.fsdp_units
    step_sync = StepSync(units) if units and (part is not None or cfg.microbatches > 1) else None
    return _Sharding(
        sharded,
        tuple((n, new[n]) for n in names),
        trainable,
        frozenset(id(p) for u in units for p in u.parameters()),
        step_sync,
    )


def _device_of(named: tuple[tuple[str, nn.Parameter], ...]) -> torch.device:
    """Where this rank's parameters live (the first held one's device; CPU when it holds none)."""
    return next((p.device for _, p in named), torch.device("cpu"))


def _grad_reducer(cfg: ParallelConfig, layout) -> Callable | None:
    """The data-parallel gradient average of what FSDP does not shard (``cfg.grad_reduce``); None
    without data parallel. A collective: every rank builds it."""
    if not dist.is_initialized() or layout.dp_size == 1:
        return None
    from .comm_hooks import make_grad_reducer

    return make_grad_reducer(cfg.grad_reduce, layout.dp_group)


def _graph_plan(
    model: nn.Module,
    cfg: ParallelConfig,
    partition: Partition,
    k: int,
    args: tuple,
    kwargs: dict,
    structures: list[str],
) -> tuple[GraphPlan | None, str]:
    """The gate between the two stage paths: (graph plan or None, the line that says which and
    why)."""
    if cfg.stage_path == "eager":
        return None, "eager path (stage_path='eager')"
    why = ""
    if structures:  # an exported graph is one input structure; the replay plans one per structure
        why = f"further input structures {structures} replay on the eager path, one plan each"
    elif cfg.tp > 1 or cfg.dp_shard > 1:
        why = "tensor parallel and FSDP under pp shard the eager path's modules"
    else:
        try:
            gplan = build_graph_plan(model, partition, k, args, kwargs)
            return (
                gplan,
                "graph path (torch.export split at the partition's cuts)\n" + gplan.describe(),
            )
        except GraphPathError as e:
            why = str(e)
    if cfg.stage_path == "graph":
        raise GraphPathError(f"stage_path='graph' but the model cannot take the graph path: {why}")
    return None, f"eager path (graph path not taken: {why})"


def _held_stages(model: nn.Module, part: Partition, k: int) -> dict[str, set[int]]:
    """Stages holding each canonical parameter: where the partition put it (shared ones on every
    stage that uses them), and parameters of container code (run by every stage) everywhere."""
    in_units = {m for u in part.units if u.kind == "module" for m in u.modules}
    out: dict[str, set[int]] = {}
    for name, _ in model.named_parameters():
        owner = name.rsplit(".", 1)[0] if "." in name else ""
        st = set(part.param_stages.get(name, []))
        if owner not in in_units:
            st = set(range(k))  # container-owned: the container's code runs on every stage
        out[name] = st
    return out


def _broadcast_replicated(parts: Parts) -> None:
    """Parameters held by several pipeline ranks start as their first holder's."""
    if not dist.is_initialized() or not parts.replicated:
        return
    model, layout = parts.module, parts.layout
    params = dict(model.named_parameters(remove_duplicate=False))
    held = {id(p) for _, p in parts.named_held}
    held_stages = _held_stages(model, parts.partition, parts.partition.num_stages)
    flat = []
    for n in parts.replicated:
        first = min(stage_rank(s, layout.pp_size, parts.cfg.schedule) for s in held_stages[n])
        p = params[n]
        flat.append(
            p.detach().reshape(-1)
            if first == layout.pp_rank
            else torch.zeros(parts.replicated_numel[n], dtype=p.dtype, device=parts.device)
        )
    summed = flat_collective(
        flat, lambda buf: dist.all_reduce(buf, group=layout.pp_group), write_back=False
    )
    for n, value in zip(parts.replicated, summed, strict=True):
        p = params[n]
        if id(p) in held:
            with torch.no_grad():
                p.copy_(value.view_as(p))


@torch.no_grad()
def _broadcast_dp(parts: Parts) -> None:
    """What FSDP does not shard starts equal on every data-parallel rank: dp rank 0's copy."""
    if not dist.is_initialized() or parts.layout.dp_size == 1:
        return
    group = parts.layout.dp_group
    src = dist.get_global_rank(group, 0)
    seen: set[int] = set()
    for _, p in parts.named_held:
        if id(p) not in parts.fsdp_ids and id(p) not in seen:
            seen.add(id(p))
            dist.broadcast(_local(p.data), src=src, group=group)


__all__ = ["ParallelConfig", "ParallelModel", "parallelize", "split_microbatches", "PipelineError"]
