"""Layout planner: which (pp, tp, dp_replicate, dp_shard, microbatches, schedule, activation
checkpointing, bf16, CPU offload) to run on a cluster, and whether the model fits at all.

``plan_layout(model_or_trace, example_inputs, cluster, global_batch=...)`` traces the model once
(``trace.py``: on the CPU, or on the meta device where FLOPs stand in for time), enumerates every
factorisation of the world into ``pp x dp_replicate x dp_shard x tp`` (mesh order outermost first,
as ``mesh.py`` builds it; tp inside a node) with every schedule, microbatch count and option, and
estimates each layout's memory per device and step time. Each candidate is an ``Estimate``: the
runtime's ``ParallelConfig`` that runs it (checked by the config's own ``problems``, as
``parallelize`` checks it), the compute dtype and accumulation steps it assumes, and its costs;
a caller turns the config into its own launch line. Pipeline stages come from the
partitioner (``partition.py`` / ``cost.py``, min-max balanced on the trace's FLOPs), cached per
stage count: with the time objective the split does not depend on the schedule.

Cost model, per device (``b`` = samples per microbatch, everything else per trace sample x b):

- memory = params + grads + Adam (m, v) in the trace's dtype, each divided by ``dp_shard`` and the
  tensor-parallel part (what ``parallel.tp`` shards at that degree; replicated key/value weights,
  where the key/value heads are fewer than tp, stay whole) by ``tp``; under FSDP the gathered
  working
  parameters (two blocks: the running one and the prefetched one, plus the root unit, i.e. every
  parameter outside the blocks, which ``fsdp.apply_fsdp`` keeps gathered from forward through
  backward; under a pipeline the whole stage stays gathered with unsharded gradients, as the
  runtime keeps it for the step); a bf16 working
  copy of the parameters without FSDP (autocast saves its casts for backward); activations per
  microbatch x the schedule's in-flight count (``cost.inflight``), divided by ``tp`` except those of
  norms and dropout (replicated without sequence parallel), the whole inputs that
  column-parallel layers and the LM head save, and those of modules outside the repeated blocks
  that tensor parallel leaves whole; with checkpointing only each block's
  input stays per microbatch, plus one block's activations while it is recomputed; on the rank
  holding the model's output, a loss over it at the start of backward (4 output-sized tensors:
  the output, a cross-entropy's saved log-probabilities and the two gradients its backward
  makes); on pipeline ranks after the first under the split drain, the output gradients that
  the deferred weight gradients of its last 2 microbatches keep; under a pipeline, the hand-over
  buffers (a received activation, the gradient packed to send back, the activation packed to
  send on); with CPU offload params, grads
  and Adam state live on the host (they must fit there); FSDP's gradients stay unsharded
  while they accumulate (a pipeline's microbatches, or accumulation steps: they are
  reduce-scattered once per optimizer step). Gradients are allocated as backward
  frees activations, so the two count together only where an earlier microbatch's backward made
  the gradients before the activations peak (gradient accumulation, or a pipeline rank with more
  microbatches than it holds in flight); otherwise the larger of the two.
- time = (m + bubble) x slot + exposed data-parallel communication + offload traffic (m: pipeline
  microbatches, or gradient-accumulation steps without a pipeline), with
  slot = the slowest pipeline rank's compute + TP all-reduces + pipeline sends per microbatch:
  compute = FLOPs / tp / (peak x efficiency x the rank's share of the device) + a fixed per-call
  overhead by the stage's share of module calls (not divided by tp; slowed by the rank's share
  of the device as the FLOPs are), x 4/3 with checkpointing,
  + the runtime's own host work (``Cluster.tp_call_s`` per call of a TP-sharded module,
  ``Cluster.fsdp_unit_s`` per FSDP unit, once a step under a pipeline, whose stages stay
  gathered; measured on CPU ranks, 0 on accelerators);
  TP: 4 all-reduces per block and microbatch (2 forward, 2 backward; 6 with recompute) of the
  block's output, and one of each replicated key/value weight's gradient per call; pipeline:
  one activation forward and one gradient backward per stage boundary;
  bubble slots: (p - 1) for 1F1B, (p - 1)/v interleaved, (p - 1)/3 zero-bubble with one stage
  per rank (ZB-H1: the deferred weight gradients fill two thirds of it), 0 for ZB-V.
- data-parallel traffic (gradient all-reduce, or reduce-scatter then all-reduce over replicas;
  FSDP's parameter all-gathers, one collective per FSDP unit: each block and the root) overlaps
  compute (``Cluster.comm_overlap`` of it): the whole step's forward and backward at pp = 1,
  one microbatch's under a pipeline (the first's forward for the gathers, the last's backward for
  the reduction: earlier microbatches only accumulate); the last bucket (one block's gradients, at
  least DDP's 25 MiB) and the first block's gather are always exposed.
- CPU offload: parameters copied to the device twice per step (forward, backward), gradients back
  once, and Adam on the host streaming 28 bytes per fp32 parameter; nothing of it overlapped.

Not modelled: sequence / context parallelism, ZeRO-1/2 (only FSDP's full sharding), the pipeline's
tied-embedding gradient all-reduce, and the optimizer step on the device (memory-bound, small).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from ..cluster import Cluster
from ..config import ParallelConfig
from ..trace import EXTERNAL, TraceResult, trace_model
from .estimate import SCHEDULE_COST, SCHEDULES, Planner, bubble_slots
from .report import Estimate, Plan
from .stats import TP_TYPES, ModelStats, tp_plan_facts

log = logging.getLogger(__name__)


def _samples(example_inputs: Any, trace: TraceResult) -> int:
    def first(obj: Any) -> torch.Tensor | None:
        if isinstance(obj, torch.Tensor):
            return obj if obj.dim() else None
        vals = (
            obj.values()
            if isinstance(obj, Mapping)
            else obj
            if isinstance(obj, list | tuple)
            else ()
        )
        for v in vals:
            t = first(v)
            if t is not None:
                return t
        return None

    t = first(example_inputs) if example_inputs is not None else None
    if t is not None:
        return int(t.shape[0])
    ext = [x for x in trace.tensors if x.producer == EXTERNAL and not x.via and x.shape]
    if ext:
        return int(ext[0].shape[0])
    raise ValueError("cannot tell how many samples the trace ran on: pass trace_samples=")


def plan_layout(
    model_or_trace: nn.Module | TraceResult,
    example_inputs: Any,
    cluster: Cluster | str,
    *,
    global_batch: int,
    trace_samples: int | None = None,
    tp_divisor: int | None = None,
    schedules: Sequence[str] = SCHEDULES,
    precisions: Sequence[str] = ("bf16", "fp32"),
    checkpointing: Sequence[bool] = (False, True),
    offload: Sequence[bool] = (False, True),
    tp_across_nodes: bool = False,
    passes: int = 1,
    partition: str = "auto",
    overhead_s: float = 0.0,
    trace: TraceResult | None = None,
    base: ParallelConfig | None = None,
) -> Plan:
    """Rank every layout of ``model_or_trace`` on ``cluster`` (a ``Cluster`` or a preset name)
    for ``global_batch`` samples per step.

    ``example_inputs``: one batch (tuple / dict) the model is traced on, on the CPU or the meta
    device; its first dimension is the sample count (or give ``trace_samples``), and sample
    shapes (sequence length) are the training ones. A ``TraceResult`` is used as it is.
    ``tp_divisor``: tp must divide it (attention heads; read from ``model.config`` when it has
    ``num_attention_heads``). ``partition``: how pipeline stages are balanced: "search" (the
    partitioner's full search), "layers" (min-max over the layer list), "auto" (search up to
    FULL_SEARCH_MODULES modules). ``overhead_s``: fixed seconds of one forward + backward of the
    whole model that do not grow with the batch (``cluster.measure_model``; 0 on GPU presets),
    charged per microbatch by each stage's share of the module calls. ``trace``: the model's trace
    when it was already taken. The result's ``estimate(...)`` models any other layout; each
    candidate's ``config`` is the ``ParallelConfig`` that runs it: ``base`` (default: the
    runtime's defaults) with the degrees and options the planner chose, so the fields it does not
    choose (grad_reduce, p2p, partition, ...) are the caller's and are checked with the layout."""
    t0 = time.perf_counter()
    if isinstance(cluster, str):
        cluster = Cluster.preset(cluster)
    tp_sharded, tp_whole_input, by_tp = None, frozenset(), {}
    if isinstance(model_or_trace, TraceResult):
        trace = model_or_trace
    else:
        trace = trace or trace_model(model_or_trace, example_inputs, passes=passes)
        if tp_divisor is None:
            tp_divisor = getattr(
                getattr(model_or_trace, "config", None), "num_attention_heads", None
            )
        # what tensor parallel will shard, from its own plan (else: Linear / Embedding weights)
        try:
            smallest = next(
                (d for d in range(2, (tp_divisor or 2) + 1) if (tp_divisor or 2) % d == 0), 2
            )
            tp_sharded, tp_whole_input = tp_plan_facts(model_or_trace, trace, smallest)
            # what tp shards depends on the degree where key/value heads are fewer than the ranks
            top = cluster.world if tp_across_nodes else cluster.devices_per_node
            for tp in range(2, top + 1):
                if cluster.world % tp == 0 and (not tp_divisor or tp_divisor % tp == 0):
                    kv: set[str] = set()
                    by_tp[tp] = (*tp_plan_facts(model_or_trace, trace, tp, kv), kv)
        except ValueError as e:
            log.info(
                "planner: no TP plan for the model (%s); Linear and Embedding weights count as "
                "sharded",
                e,
            )
    samples = trace_samples or _samples(example_inputs, trace)
    planner = Planner(
        trace,
        samples,
        cluster,
        global_batch,
        tp_divisor,
        partition,
        overhead_s,
        tp_sharded,
        tp_whole_input,
        base,
        by_tp,
    )
    layouts = planner.enumerate(schedules, precisions, checkpointing, offload, tp_across_nodes)
    layouts.sort(
        key=lambda lay: (
            not lay.fits,
            lay.step_time_s if lay.fits else lay.memory_bytes_per_device or math.inf,
        )
    )
    numel = sum(n for _, n in trace.param_sizes.values())
    return Plan(
        cluster,
        int(numel),
        planner.stats.param_bytes,
        global_batch,
        layouts,
        planner,
        time.perf_counter() - t0,
    )


__all__ = [
    "Cluster",
    "Estimate",
    "ModelStats",
    "Plan",
    "SCHEDULE_COST",
    "SCHEDULES",
    "TP_TYPES",
    "bubble_slots",
    "plan_layout",
]
