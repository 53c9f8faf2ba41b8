"""Estimating one layout's memory and step time, and enumerating every layout of a cluster (the
cost model is described in ``parallel/planner/__init__.py``)."""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Sequence
from typing import Any

from ..balance import InfeasiblePartition
from ..cluster import Cluster
from ..config import CHOICES, ParallelConfig
from ..cost import CostConfig, inflight, rank_of_stage
from ..partition import baseline_partition, partition_trace
from ..pipeline.schedule import DRAIN_DEPTH
from ..trace import TraceResult
from .report import Estimate, GiB
from .stats import ModelStats, PartStats

SCHEDULES = ("1f1b", "interleaved_1f1b", "zero_bubble", "zbv")  # parallel.config names, enumerated
# parallel.config schedule -> (cost.py schedule for in-flight counts, stages per rank); as
# api.COST_SCHEDULE and pipeline.schedule.stages_per_rank resolve them with the default v
SCHEDULE_COST = {
    "gpipe": ("gpipe", 1),
    "1f1b": ("1f1b", 1),
    "interleaved_1f1b": ("interleaved", 2),
    "zero_bubble": ("interleaved", 1),
    "zbv": ("zbv", 2),
}
MICROBATCH_FACTORS = (1, 2, 4, 8)  # microbatches tried under a pipeline: pp x these
ACCUMULATION = (1, 2, 4, 8, 16, 32)  # gradient-accumulation steps tried without a pipeline
# up to this many modules the stages come from the partitioner's full search; above it from the
# min-max balance of the layer list (balance.balanced_bounds), ~100x faster at 1000 modules (64
# stages: 0.03 s against 10 s) and within a few percent on block-structured models. The planner
# needs each stage's load, not the final cut: the runtime partitions again with the full search.
FULL_SEARCH_MODULES = 300
DDP_BUCKET_BYTES = 25 * 2**20  # DDP's default bucket: the smallest gradient message left at the end
RECOMPUTE = 4.0 / 3.0  # checkpointing runs each block's forward twice: (1 + 1 + 2) / (1 + 2)
# tensors of the output's size alive when backward starts: the output, a cross-entropy's saved
# log-probabilities, and the two gradients its backward makes (of the log-probabilities, of the
# output)
LOSS_WORKING_SET = 4.0
# host bytes Adam streams per fp32-parameter byte: read p, g, m, v; write p, m, v
HOST_ADAM_BYTES = 7.0


def bubble_slots(schedule: str, p: int, v: int) -> float:
    """Idle microbatch slots of a step on the busiest rank (GPipe / 1F1B: p - 1, the bubble
    fraction (p - 1)/(m + p - 1); interleaved: / v (Narayanan et al. 2021); ZB-H1: a third
    of 1F1B's; ZB-V: none when forward, input- and weight-backward take equal time (Qi et al.
    2023))."""
    if p <= 1:
        return 0.0
    if schedule in ("gpipe", "1f1b", "eager_1f1b"):
        return float(p - 1)
    if schedule in ("interleaved_1f1b", "looped_bfs"):
        return (p - 1) / v
    if schedule == "zero_bubble":
        return (p - 1) / (3.0 * v)
    return 0.0  # zbv, dualpipev


class Planner:
    def __init__(
        self,
        trace: TraceResult,
        samples: int,
        cluster: Cluster,
        global_batch: int,
        tp_divisor: int | None,
        partition: str,
        overhead_s: float = 0.0,
        tp_sharded: set[str] | None = None,
        tp_whole_input: set[str] = frozenset(),
        base: ParallelConfig | None = None,
        by_tp: dict[int, tuple[set[str], set[str], set[str]]] | None = None,
    ):
        """``by_tp``: per tp degree, what tensor parallel shards there (``tp_plan_facts``: the
        sharded parameters, the modules with whole inputs, the replicated key/value parameters);
        a degree not in it uses ``tp_sharded`` / ``tp_whole_input``."""
        self.base = base or ParallelConfig()  # each candidate's fields the planner does not choose
        self.stats = ModelStats(trace, samples, tp_sharded, tp_whole_input)
        self.samples, self.by_tp = samples, by_tp or {}
        self._stats: dict[int, ModelStats] = {}
        # fixed seconds per microbatch forward+backward of the whole model
        self.overhead_s = overhead_s
        self.trace, self.cluster, self.global_batch = trace, cluster, global_batch
        # stages balance FLOPs (the cost of the target devices), not the trace's CPU timings
        self.flops_trace = dataclasses.replace(trace, timed=False)
        if partition == "auto":
            partition = "search" if len(trace.modules) <= FULL_SEARCH_MODULES else "layers"
        if partition not in ("search", "layers"):
            raise ValueError(f"partition must be auto, search or layers (got {partition!r})")
        self.partition = partition
        self.tp_divisor = tp_divisor
        # (stages, tp) -> per-stage stats, or why there is no such split
        self._parts: dict[tuple[int, int], list[PartStats] | str] = {}
        self._splits: dict[int, Any] = {}  # stage count -> the partitioner's split (or why none)

    def stats_at(self, tp: int) -> ModelStats:
        """The model's statistics with what tensor parallel shards at degree ``tp``."""
        if tp not in self.by_tp:
            return self.stats
        if tp not in self._stats:
            sharded, whole_input, kv = self.by_tp[tp]
            self._stats[tp] = ModelStats(self.trace, self.samples, sharded, whole_input, kv)
        return self._stats[tp]

    # --- pipeline stages from the partitioner, one solve per stage count
    def stages(self, k: int, tp: int = 0) -> list[PartStats] | str:
        """Per-stage statistics of the ``k``-stage split with what tp shards at degree ``tp``
        (0: ``self.stats``), or why there is no such split."""
        key = (k, tp if tp in self.by_tp else 0)
        if key in self._parts:
            return self._parts[key]
        st = self.stats_at(tp)
        if k == 1:
            self._parts[key] = [st.whole]
            return self._parts[key]
        split = self._split(k)
        if isinstance(split, str):
            self._parts[key] = split
            return split
        part, mods, held, several, flops_per_s = split
        out = []
        for s, rep in enumerate(part.stages):
            # replayed container code included
            ps = st.part(mods[s], held[s], rep.compute_time * flops_per_s, several)
            ps.param_bytes = float(rep.param_bytes)
            ps.cut_in, ps.cut_out = float(rep.comm_in), float(rep.comm_out)
            out.append(ps)
        self._parts[key] = out
        return out

    def _split(self, k: int):
        """The partitioner's ``k``-stage split (modules and parameters per stage), or why none."""
        if k in self._splits:
            return self._splits[k]
        c = self.cluster
        # the time objective: the split balances FLOPs (+ sends at the cuts) whatever the schedule
        cfg = CostConfig(
            schedule="interleaved",
            microbatches=1,
            stages_per_rank=1,
            flops_per_s=c.flops_per_s("bf16"),
            bandwidth=c.inter_bandwidth / c.devices_per_node,
        )
        try:
            if self.partition == "search":
                part = partition_trace(self.flops_trace, k, "speed", cost_config=cfg)
            else:
                part = baseline_partition(self.flops_trace, k, "time", cfg)
                if any(rep.num_units == 0 for rep in part.stages):
                    raise InfeasiblePartition(f"the layer list has fewer than {k} layers")
        except InfeasiblePartition as e:
            self._splits[k] = f"no {k}-stage partition: {e}"
            return self._splits[k]
        mods: list[set[str]] = [set() for _ in range(k)]
        for u, s in zip(part.units, part.unit_stage):
            mods[s].update(u.modules)
        held: list[list[str]] = [[] for _ in range(k)]
        for p, stages in part.param_stages.items():
            if self.trace.param_alias.get(p, p) == p:
                for s in stages:
                    held[s].append(p)
        # a parameter on several stages (tied embeddings) is replicated there: TP leaves it whole
        several = {p for p, n in Counter(p for h in held for p in set(h)).items() if n > 1}
        self._splits[k] = (part, mods, held, several, cfg.flops_per_s)
        return self._splits[k]

    # --- one layout
    def estimate(
        self,
        pp: int,
        tp: int,
        dp_replicate: int,
        dp_shard: int,
        microbatches: int = 1,
        schedule: str = "1f1b",
        activation_checkpointing: bool = False,
        precision: str = "bf16",
        cpu_offload: bool = False,
        stages_per_rank: int | None = None,
        **_: Any,
    ) -> Estimate:
        """Model one layout. ``microbatches``: the pipeline's (pp > 1) or, without a pipeline, the
        gradient-accumulation steps; ``precision``: the compute dtype (bf16: autocast)."""
        c, st = self.cluster, self.stats_at(tp)
        if pp == 1:
            schedule = "-"  # microbatches are gradient-accumulation steps
        cost_sched, v = SCHEDULE_COST.get(schedule, ("1f1b", 1))
        v = (stages_per_rank or v) if pp > 1 else 1
        b = self.base
        config = dataclasses.replace(
            b,
            pp=pp,
            dp_replicate=dp_replicate,
            dp_shard=dp_shard,
            tp=tp,
            microbatches=microbatches if pp > 1 else 1,
            schedule=schedule if pp > 1 else b.schedule,
            stages_per_rank=v,
            activation_checkpointing=(
                b.activation_checkpointing if b.activation_checkpointing != "none" else "full"
            )
            if activation_checkpointing
            else "none",
            cpu_offload=cpu_offload,
        )
        lay = Estimate(config, precision, grad_accum=microbatches if pp == 1 else 1)
        dp = dp_replicate * dp_shard
        world = pp * dp * tp
        why = lay.reasons
        # the runtime's own rules: degrees x world, schedule, offload
        why += config.problems(c.world)
        if precision not in CHOICES["mixed_precision"]:
            why.append(f"precision must be one of {CHOICES['mixed_precision']} (got {precision!r})")
        if self.global_batch % (dp * microbatches):
            why.append(
                f"global batch {self.global_batch} does not split into {dp} replicas x "
                f"{microbatches} microbatches"
            )
        if self.tp_divisor and self.tp_divisor % tp:
            why.append(f"tp={tp} does not divide the {self.tp_divisor} attention heads")
        if tp > 1 and not st.blocks:
            why.append(
                "tp > 1 needs repeated blocks (children of a ModuleList / Sequential) to shard"
            )
        if activation_checkpointing and not st.blocks:
            why.append("checkpointing needs repeated blocks to checkpoint")
        if pp > 1 and st.blocks and pp * v > len(st.blocks):
            why.append(f"{pp * v} pipeline stages > {len(st.blocks)} blocks")
        if cpu_offload and c.host_bandwidth <= 0:
            why.append(f"no CPU offload on {c.name}: the devices are the host")
        if pp > 1 and schedule not in SCHEDULE_COST:
            why.append(f"the planner has no cost model of schedule {schedule!r}")
        if why:
            return lay
        parts = self.stages(pp * v, tp)
        if isinstance(parts, str):
            why.append(parts)
            return lay
        lay.microbatch_size = self.global_batch // (dp * microbatches)
        scale = lay.microbatch_size / st.samples  # trace batch -> one microbatch
        bf16 = precision == "bf16"
        cdt = 2.0 / st.elt if bf16 else 1.0  # compute-dtype bytes per trace-dtype byte
        rate = c.flops_per_s("bf16" if bf16 else "fp32")
        ccfg = CostConfig(schedule=cost_sched, microbatches=microbatches, stages_per_rank=v)
        ranks = [rank_of_stage(s, pp, ccfg) for s in range(len(parts))]
        infl = [inflight(s, pp, ccfg) for s in range(len(parts))]
        pp_stride = world // pp
        # the runtime's split drain (ParallelConfig.split_drain, on by default): GPipe / 1F1B ranks
        # after the first run their last DRAIN_DEPTH backwards as input gradients first, weight
        # gradients at the end of the step; off under tp and checkpointing (parallel/api.py)
        split_drain = (
            pp > 1 and cost_sched in ("gpipe", "1f1b") and tp == 1 and not activation_checkpointing
        )

        def local(total: float, tp_part: float) -> float:  # bytes on one tp rank
            return total - tp_part + tp_part / tp

        best_mem, mem_parts, slots = -1.0, {}, []
        for r in range(pp):
            mine = [s for s in range(len(parts)) if ranks[s] == r]
            P = sum(local(parts[s].param_bytes, parts[s].tp_param_bytes) for s in mine)
            blockP = max(local(parts[s].block_param, parts[s].block_tp_param) for s in mine)
            rootP = sum(local(parts[s].outside_param, parts[s].outside_tp_param) for s in mine)
            act = 0.0
            for s in mine:
                ps = parts[s]
                a, a_rep = (
                    (ps.ckpt_act, ps.ckpt_act_rep)
                    if activation_checkpointing
                    else (ps.act, ps.act_rep)
                )
                act += local(a, a - a_rep) * infl[s]  # all but the replicated part split over tp
            if activation_checkpointing:
                act += max(parts[s].recompute_peak for s in mine) / tp
            if (
                r > 0 and split_drain
            ):  # the drain's deferred weight gradients keep their output gradients
                act += min(DRAIN_DEPTH, microbatches) * sum(parts[s].wgrad_keep for s in mine)
            if (
                pp > 1
            ):  # the hand-over buffers: a received activation, the gradient packed to send it
                # back, the activation packed to send on (whole on every tp rank)
                act += sum(2.0 * parts[s].cut_in + parts[s].cut_out for s in mine)
            if (
                r == ranks[-1]
            ):  # the loss over the output, whole on every tp rank, at the start of backward
                act += LOSS_WORKING_SET * st.output_bytes
            act *= scale * cdt
            m = {
                "params": P / dp_shard,
                "grads": P / dp_shard,
                "optimizer": 2.0 * P / dp_shard,
                "gathered": 0.0,
                "activations": act,
            }
            # FSDP reduce-scatters once per optimizer step: accumulated gradients stay unsharded
            accumulating = dp_shard > 1 and (pp > 1 or microbatches > 1)
            if pp > 1 and dp_shard > 1:  # the stage stays gathered, gradients accumulate unsharded
                m["gathered"], m["grads"] = P * cdt, P
            elif dp_shard > 1 or cpu_offload:
                # the running and the prefetched block, and the root unit (everything outside the
                # blocks: fsdp.apply_fsdp keeps it gathered from its forward to its backward)
                m["gathered"] = (2.0 * blockP + rootP) * cdt
                if (
                    accumulating
                ):  # accumulation steps without a pipeline: unsharded until the last one
                    m["grads"] = P
            elif bf16:
                m["gathered"] = P * cdt  # autocast's bf16 weight casts, saved for backward
            # Gradients are allocated as backward frees activations. When the activations peak (the
            # start of a backward) they are still unallocated unless an earlier microbatch's
            # backward made them: gradient accumulation, or a pipeline rank with more microbatches
            # than in flight.
            grads_early = microbatches > 1 if pp == 1 else microbatches > max(infl[s] for s in mine)
            host = 0.0
            if (
                cpu_offload
            ):  # the sharded state on the host; gradients accumulating unsharded stay on the device
                host = m["params"] + P / dp_shard + m["optimizer"]
                m["params"] = m["optimizer"] = 0.0
                m["grads"] = m["grads"] if accumulating else 0.0
            total = sum(m.values()) - (0.0 if grads_early else min(m["grads"], m["activations"]))
            lay.memory_by_rank.append(total)
            lay.memory_kinds_by_rank.append(m)
            if total > best_mem:
                best_mem, mem_parts, host_peak = total, m, host
            # per microbatch on this rank
            redo = RECOMPUTE if activation_checkpointing else 1.0
            fl = sum(parts[s].flops for s in mine) * scale / tp * redo
            # the fixed per-call overhead: the stage's share of the model's module calls, on every
            # tp rank whole (each runs every operator of its shard), on the rank's share of the
            # device as its FLOPs are (host work slows as ranks time-share the cores)
            oh = (
                self.overhead_s
                / c.rank_share
                * sum(parts[s].calls for s in mine)
                / max(st.whole.calls, 1)
                * redo
            )
            nb = sum(parts[s].blocks for s in mine)
            units = nb + 1  # FSDP units: each whole block, and the root (everything else)
            # the runtime's own host work: DTensor dispatch on every sharded call, FSDP's hooks per
            # unit
            if tp > 1:
                oh += c.tp_call_s * sum(parts[s].tp_calls for s in mine) * redo
            fsdp_host = c.fsdp_unit_s * units if dp_shard > 1 or cpu_offload else 0.0
            if pp == 1:  # resharded after every forward: each microbatch gathers and reduces anew
                oh, fsdp_host = oh + fsdp_host, 0.0
            # (under a pipeline the stage stays gathered for the step: its units' work happens once)
            t_c = fl / rate + oh
            t_tp = 0.0
            if tp > 1 and nb:
                msg = sum(parts[s].block_out for s in mine) / nb * scale * cdt
                t_tp = nb * (6 if activation_checkpointing else 4) * c.all_reduce(msg, tp, 1)
            kv_calls = sum(parts[s].kv_calls for s in mine)
            if tp > 1 and kv_calls:  # replicated key/value weights: a gradient all-reduce per call
                kv_bytes = sum(parts[s].kv_param_bytes for s in mine)
                t_tp += kv_calls * c.all_reduce(kv_bytes / kv_calls, tp, 1)
            t_pp = 0.0
            if pp > 1:
                t_pp = sum(
                    c.send(parts[s].cut_out * scale * cdt, pp_stride)
                    + c.send(parts[s].cut_in * scale * cdt, pp_stride)
                    for s in mine
                )
            slots.append((t_c + t_tp + t_pp, t_c, t_tp, t_pp, P, blockP, units, fsdp_host))
        lay.memory_bytes_per_device = best_mem
        lay.memory = mem_parts
        usable = c.device_memory_bytes * c.usable_fraction
        if best_mem > usable:
            why.append(
                f"memory: {best_mem / GiB:.1f} GiB > {usable / GiB:.1f} GiB usable per device ("
                + ", ".join(f"{k} {v / GiB:.1f}" for k, v in mem_parts.items() if v)
                + ")"
            )
        if cpu_offload and host_peak * c.devices_per_node > c.host_memory_bytes * c.usable_fraction:
            why.append(
                f"host memory: {host_peak * c.devices_per_node / GiB:.0f} GiB of offloaded state "
                f"per node > {c.host_memory_bytes * c.usable_fraction / GiB:.0f} GiB usable"
            )
        # --- time
        slot, t_c, t_tp, t_pp, P, blockP, units, fsdp_host = max(slots)
        m = microbatches
        bub = bubble_slots(schedule, pp, v) * slot
        # data parallel: gradients in the trace's dtype, parameters gathered in the compute dtype.
        # Gradients are reduced once per optimizer step, on the last accumulation step (the
        # runtime's ``train_step(sync=...)``: DDP's no_sync, FSDP2's
        # set_requires_gradient_sync(False)). FSDP without a pipeline gathers again in every
        # accumulation step's forward and backward; under a pipeline the stage stays gathered.
        sh, rp = dp_shard, dp_replicate
        # accumulation steps whose compute hides the gathers
        rounds = m if pp == 1 and sh > 1 else 1
        if sh > 1:
            # one collective per FSDP unit: each pays the latency, together they move P
            grad = units * c.reduce_scatter(P / units, sh, tp) + c.all_reduce(P / sh, rp, tp * sh)
            last = c.reduce_scatter(blockP, sh, tp) + c.all_reduce(blockP / sh, rp, tp * sh)
        else:
            grad = c.all_reduce(P, rp, tp)
            last = c.all_reduce(min(P, max(DDP_BUCKET_BYTES, blockP)), rp, tp)
        ag = first = 0.0
        if sh > 1:
            # forward and backward of every step; a pipeline's once
            gathers = 2 * m if pp == 1 else 1
            ag = gathers * units * c.all_gather(P * cdt / units, sh, tp)
            first = c.all_gather(blockP * cdt, sh, tp)
        # compute the traffic hides behind: the microbatches it overlaps
        window = t_c * rounds * c.comm_overlap
        dp_t = max(last + first, grad + ag - window) if dp > 1 else 0.0
        off = 0.0
        if cpu_offload:
            shard = P / sh
            off = 3.0 * shard / c.host_bandwidth + HOST_ADAM_BYTES * shard / (
                c.host_memory_bandwidth / c.devices_per_node
            )
        lay.breakdown = {
            "compute": m * t_c + fsdp_host,
            "bubble": bub,
            "tp_comm": m * t_tp,
            "pp_comm": m * t_pp,
            "dp_comm": dp_t,
            "offload": off,
        }
        lay.step_time_s = m * slot + fsdp_host + bub + dp_t + off
        peak = c.peak_flops["bf16" if bf16 else "fp32"]
        lay.mfu = st.flops / st.samples * self.global_batch / (lay.step_time_s * c.world * peak)
        lay.fits = not why
        if lay.fits:
            top = max(lay.breakdown, key=lambda k: lay.breakdown[k])
            why.append(f"{top} {lay.breakdown[top] / lay.step_time_s:.0%} of the step")
            if pp > 1:
                why.append(f"bubble {bub / lay.step_time_s:.0%}")
            _, _, crosses = c.group_link(tp, 1)
            if tp > 1 and crosses:
                why.append("TP all-reduces cross nodes")
        return lay

    # --- every layout
    def enumerate(
        self,
        schedules: Sequence[str],
        precisions: Sequence[str],
        checkpointing: Sequence[bool],
        offload: Sequence[bool],
        tp_across_nodes: bool,
    ) -> list[Estimate]:
        c = self.cluster
        out = []
        for pp, dpr, dps, tp in _factorisations(c.world):
            if tp > c.devices_per_node and not tp_across_nodes:
                continue
            if tp_across_nodes is False and c.devices_per_node % tp:
                continue
            if pp == 1:
                combos = [("-", a) for a in ACCUMULATION]
            else:
                combos = [(s, pp * f) for s in schedules for f in MICROBATCH_FACTORS]
            for sched, m in combos:
                for prec in precisions:
                    for ac in checkpointing:
                        for off in offload:
                            if off and pp > 1:
                                continue
                            out.append(self.estimate(pp, tp, dpr, dps, m, sched, ac, prec, off))
        return out


def _factorisations(world: int) -> list[tuple[int, int, int, int]]:
    divs = [d for d in range(1, world + 1) if world % d == 0]
    out = []
    for pp in divs:
        for tp in divs:
            if world % (pp * tp):
                continue
            rest = world // (pp * tp)
            for dps in divs:
                if rest % dps == 0:
                    out.append((pp, rest // dps, dps, tp))
    return out
