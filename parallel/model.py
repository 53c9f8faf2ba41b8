"""``ParallelModel``: what ``parallelize`` returns. This rank's part of the model (its pipeline
stages, sharded by TP / FSDP where configured) and the step that drives it: microbatches through
the pipeline schedule, the loss shared by every rank, gradients averaged over the data-parallel
ranks for what FSDP does not shard (once per optimizer step under gradient accumulation), the
global-norm clipper, and forward-only prediction. Built by ``parallel.api`` from the frozen
``Parts`` it made; nothing outside sets its attributes.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from .collectives import flat_collective
from .config import ParallelConfig
from .fsdp import StepSync, clip_grad_norm_
from .inputs import _as_call, _default_loss, split_microbatches
from .mesh import Layout
from .partition import Partition
from .pipeline.eager import EagerStage, Plan
from .pipeline.p2p import Transport
from .pipeline.schedule import Action, forward_only, stage_rank
from .spmd import Sharded
from .timeline import Event

if TYPE_CHECKING:  # the reducers load the shared-memory extension: imported where used
    from .comm_hooks import CommStats

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Parts:
    """What ``parallelize`` made of the model on this rank, handed whole to ``ParallelModel``
    (which sets nothing from outside after it is built). Mappings are built once and not changed."""

    module: nn.Module  # the model: this rank's parameters (other stages' freed), sharded in place
    cfg: ParallelConfig  # the layout and step settings it was parallelized with
    layout: Layout  # this rank's place in the mesh and its process groups
    device: torch.device  # where this rank's parameters live (they do not move after parallelize)
    # this rank's parameters by name (a tied one under each name)
    named_held: tuple[tuple[str, nn.Parameter], ...]
    trainable: tuple[nn.Parameter, ...]  # the distinct held parameters that take gradients
    # what parallelize_spmd applied (TP plan, FSDP units)
    sharded: Sharded = field(default_factory=Sharded)
    fsdp_ids: frozenset[int] = frozenset()  # ids of the parameters whose gradients FSDP reduces
    step_sync: StepSync | None = None  # FSDP units driven once per call (microbatches, pipeline)
    # averages a flat gradient of what FSDP does not reduce over the data-parallel ranks, in place
    # (``cfg.grad_reduce``: the process group, or the shared-memory / int8 reducers); None: dp == 1
    grad_reducer: Callable[[torch.Tensor, int], torch.Tensor] | None = None
    partition: Partition | None = None  # the pipeline's stage assignment (None: pp == 1)
    plan: Plan | None = None  # the replay plan of the example's input structure (pp > 1)
    # this rank's stages (empty: pp == 1)
    stages: Mapping[int, EagerStage] = field(default_factory=dict)
    order: tuple[Action, ...] | None = None  # this rank's schedule actions, in order
    transport: Transport | None = None  # the pipeline's point-to-point sends and receives
    local_stages: tuple[int, ...] = (0,)  # the stage indices this rank runs
    replicated: tuple[
        str, ...
    ] = ()  # canonical names held by more than one pipeline rank (tied weights)
    # their sizes (a rank not holding one sends zeros)
    replicated_numel: Mapping[str, int] = field(default_factory=dict)
    # shared-memory collectives for the step loss (``_loss_group``), or None: gloo
    loss_group: Any = None
    # further input structures (``parallelize(structures=...)``): name -> this rank's stages, each
    # replaying the model on its own plan (``plans[name]``); names without a pipeline map to nothing
    structures: Mapping[str, Mapping[int, EagerStage]] = field(default_factory=dict)
    structure_names: frozenset[str] = frozenset()
    plans: Mapping[str, Plan] = field(default_factory=dict)


class ParallelModel(nn.Module):
    """This rank's part of a parallelized model, with ``train_step`` over the pipeline."""

    def __init__(self, parts: Parts):
        super().__init__()
        self.module = parts.module
        self.cfg = parts.cfg
        self.layout = parts.layout
        self.partition = parts.partition
        self.plan = parts.plan
        self.stages = parts.stages
        self.order = parts.order
        self.transport = parts.transport
        self.local_stages = parts.local_stages
        self.sharded = parts.sharded
        self.step_sync = parts.step_sync
        self.structures = parts.structures
        self.structure_names = parts.structure_names
        self.plans = parts.plans
        self._parts = parts
        self._held = {id(p) for _, p in parts.named_held}
        self.events: list[Event] = []  # timeline of the last step
        self._record = True  # train_step records ``events`` (``set_record_timeline``)

    # --- identity
    @property
    def dp_rank(self) -> int:
        return self.layout.dp_rank

    @property
    def dp_size(self) -> int:
        return self.layout.dp_size

    @property
    def pp_rank(self) -> int:
        return self.layout.pp_rank

    @property
    def is_last_stage(self) -> bool:
        return self.partition is None or (self.partition.num_stages - 1) in self.local_stages

    # --- parameters by original names
    def named_parameters(
        self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
    ) -> Iterator[tuple[str, nn.Parameter]]:
        """This rank's parameters (FSDP's sharded ones, also while a unit is gathered)."""
        seen: set[int] = set()
        for name, p in self._parts.named_held:
            if id(p) in seen and remove_duplicate:
                continue
            seen.add(id(p))
            yield prefix + name, p

    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]:
        for _, p in self.named_parameters():
            yield p

    def _local_keys(self) -> set[str]:
        keys = {name for name, _ in self._parts.named_held}
        mods = self.partition.module_stages if self.partition is not None else None
        for name, _ in self.module.named_buffers(remove_duplicate=False):
            owner = name.rsplit(".", 1)[0] if "." in name else ""
            st = mods.get(owner) if mods is not None else None
            if st is None or set(st) & set(self.local_stages):
                keys.add(name)
        return keys

    def state_dict(self, *args, **kwargs) -> dict[str, torch.Tensor]:  # type: ignore[override]
        """This rank's parameters and buffers under their original names."""
        keys = self._local_keys()
        return {k: v for k, v in self.module.state_dict(keep_vars=False).items() if k in keys}

    def load_state_dict(
        self, state_dict: Mapping[str, Any], strict: bool = False, assign: bool = False
    ):  # type: ignore[override]
        """Load the entries this rank holds (a full or a per-rank state dict both work)."""
        keys = self._local_keys()
        return self.module.load_state_dict(
            {k: v for k, v in state_dict.items() if k in keys}, strict=False
        )

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.parameters():
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()

    def forward(self, *args, **kwargs):
        if self.partition is not None and self.partition.num_stages > 1:
            raise RuntimeError("a pipelined model runs through train_step / predict, not __call__")
        return self.module(*args, **kwargs)

    # --- training
    def train_step(
        self,
        inputs: Any,
        target: Any = None,
        loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
        weight_fn: Callable[[Any, Any], float | torch.Tensor] | None = None,
        structure: str | None = None,
        sync: bool = True,
        weight_total: float | torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Forward and backward of one batch over the pipeline; returns the mean loss (every rank).

        ``inputs``: tuple of positional or dict of keyword arguments; dim 0 of every tensor is
        split into ``cfg.microbatches``. ``loss_fn(output, target_microbatch)`` (default: the
        output's ``loss``). The step loss is ``sum_i w_i loss_i / sum_i w_i`` with ``w_i =
        weight_fn(inputs_i, target_i)`` (default 1: the mean of microbatch means), a number or a
        tensor (on an accelerator a tensor stays there: no host sync; a zero sum is then not
        caught); gradients are those of that loss. A per-token mean loss gives the full-batch
        mean when ``w_i`` is the microbatch's token count. Gradients accumulate into ``.grad`` (call
        ``zero_grad``). ``structure``: inputs are shaped like that extra example of ``parallelize``
        (its plan).

        ``weight_total``: the sum of the weights over the whole optimizer step (every
        data-parallel replica's batch, every accumulated call), which the caller counts before
        the step (an all-reduce of its count, as torchtitan counts its global tokens). The step
        loss is then ``sum w_i loss_i / weight_total`` over all of them, and this call's
        gradients and returned loss are its share of it: the shares of an optimizer step's
        calls sum to the global mean. None: the mean of this call's batch, replicas averaged as
        equals (DDP's convention; with unequal weights not the global mean).

        ``sync``: whether this call ends an optimizer step's gradient accumulation. Only then are
        gradients synchronised, once, over everything accumulated since the last synced call:
        the data-parallel average, FSDP's reduce-scatter and the pipeline's sum of tied
        parameters. Earlier calls (``sync=False``) only accumulate locally, as DDP's ``no_sync``,
        nanoGPT's ``require_backward_grad_sync`` and FSDP2's ``set_requires_gradient_sync(False)``
        do: one reduce per bucket per optimizer step, not one per accumulation micro-step.

        Mixed precision: call it inside ``torch.autocast(...)`` as one wraps a forward. The
        forwards and ``loss_fn`` run under the caller's autocast, the backwards with autocast off,
        as autocast's documentation asks of a backward pass."""
        m = self.cfg.microbatches
        stages = self._stages_for(structure)
        loss_fn = loss_fn or _default_loss
        mbs = split_microbatches(inputs, m)
        tgts = split_microbatches(target, m)
        # a weight_fn may answer with an accelerator's tensor: kept there (reading it is a host
        # sync)
        w = [
            _weight(weight_fn(mbs[i], tgts[i])) if weight_fn is not None else 1.0 for i in range(m)
        ]
        total_w = sum(w)
        if not isinstance(total_w, torch.Tensor) and total_w <= 0:
            raise ValueError("microbatch weights sum to zero")
        if weight_total is not None:
            # the gradient sync averages over the dp replicas: each weighs in dp times its share
            total_w = _weight(weight_total) / self.layout.dp_size
        self.events = []
        losses: dict[int, torch.Tensor] = {}
        rec = self.events.append if self._record else None
        graphs = self._cuda_graphs()  # a new step: the last one's outputs may be overwritten
        rank = self.layout.rank
        no_cast = _autocast_off(self._device().type)
        if self.step_sync is not None:  # FSDP: gather once, reduce-scatter once (if sync), per call
            self.step_sync.begin()
            if stages:  # the split backward's weight step works on what autograd sees
                unsharded = self.step_sync.unsharded_params()
                params = [unsharded.get(id(p), p) for p in self._parts.trainable]
                for st in self.all_stages():
                    st.params = params
        elif (
            self.sharded.fsdp_units
        ):  # FSDP's own hooks run the step: they reduce-scatter only if sync
            for u in self.sharded.fsdp_units:
                u.set_requires_gradient_sync(sync, recurse=False)
        if not stages:  # no pipeline: gradient accumulation over the microbatches
            for i in range(m):
                t0 = time.perf_counter()
                args, kwargs = _as_call(mbs[i])
                loss = loss_fn(self.module(*args, **kwargs), tgts[i])
                with no_cast():
                    (loss * (w[i] / total_w)).backward()
                # a CUDA graph's output is overwritten by the next microbatch's replay: copied
                losses[i] = loss.detach().clone() if graphs else loss.detach()
                if rec:
                    rec(Event(rank, "B", 0, i, t0, time.perf_counter()))
        else:
            self.transport.wait_s = 0.0
            with _gc_paused(self.cfg.gc_pause):
                self._run_schedule(
                    stages, mbs, tgts, w, total_w, loss_fn, losses, rec, rank, no_cast
                )
            self.transport.flush()
        t0 = time.perf_counter()
        if self.step_sync is not None:
            self.step_sync.finish(reduce=sync)
        if sync:
            self._sync_grads()
        if (
            self.is_last_stage
            and losses[0].device.type == "cpu"
            and not isinstance(total_w, torch.Tensor)
        ):
            # four ops, not 3m: on a CPU rank each costs microseconds on the step's critical path
            lw = torch.tensor(w, dtype=torch.float32, device=losses[0].device)
            step_loss = (
                torch.dot(torch.stack([losses[i] for i in range(m)]).float().reshape(m), lw)
                / total_w
            )
        elif self.is_last_stage:  # an accelerator: no host tensor of weights to copy in every step
            step_loss = sum(losses[i].float().reshape(()) * (w[i] / total_w) for i in range(m))
        else:
            step_loss = torch.zeros((), dtype=torch.float32, device=self._device())
        step_loss = self._share_loss(step_loss)
        if rec:
            rec(Event(rank, "sync", -1, -1, t0, time.perf_counter()))
        return step_loss

    def _run_schedule(
        self, stages, mbs, tgts, w, total_w, loss_fn, losses, rec, rank, no_cast
    ) -> None:
        """This rank's actions of the schedule, in order (receives happen inside them); the
        backwards under ``no_cast`` (``_autocast_off``)."""
        for a in self.order:
            st = stages[a.stage]
            t0 = time.perf_counter()
            w0 = self.transport.wait_s
            if a.kind == "F":
                args, kwargs = _as_call(mbs[a.mb])
                out = st.forward(a.mb, args, kwargs)
                if st.is_last:
                    loss = loss_fn(out, tgts[a.mb])
                    st.set_loss(a.mb, loss * (w[a.mb] / total_w))
                    losses[a.mb] = loss.detach()
            else:
                with no_cast():
                    if a.kind == "B":
                        st.backward(a.mb)
                    elif a.kind == "I":
                        st.backward_input(a.mb)
                    elif a.kind == "W":
                        st.backward_weight(a.mb)
            if (
                rec
            ):  # receives happen at the start of an action: the event is the compute after them
                waited = self.transport.wait_s - w0
                if waited > 0:
                    rec(Event(rank, "wait", a.stage, a.mb, t0, t0 + waited))
                rec(Event(rank, a.kind, a.stage, a.mb, t0 + waited, time.perf_counter()))

    def _stages_for(self, structure: str | None) -> dict:
        """This rank's stages for inputs shaped like the example named ``structure`` (None: the
        ``example_inputs`` of ``parallelize``)."""
        if structure is None:
            return self.stages
        if structure not in self.structure_names:
            raise KeyError(
                f"no input structure {structure!r}: parallelize(..., structures=...) named "
                f"{sorted(self.structure_names)}"
            )
        return self.structures.get(structure, self.stages)  # no pipeline: the model runs as it is

    def all_stages(self) -> Iterator[Any]:
        """Every stage object of this rank, over all input structures (stage hooks update them)."""
        yield from self.stages.values()
        for stages in self.structures.values():
            yield from stages.values()

    def _cuda_graphs(self) -> bool:
        """Whether the model replays CUDA graphs (``compile_mode=reduce-overhead``); if so, tells
        them a new step begins: the graphs' outputs of the last one may now be overwritten."""
        if self.cfg.compile and self.cfg.compile_mode == "reduce-overhead":
            torch.compiler.cudagraph_mark_step_begin()
            return True
        return False

    def _last_rank(self) -> int:
        """The global rank holding this pipeline's last stage."""
        return self.layout.pp_ranks[
            stage_rank(self.partition.num_stages - 1, self.layout.pp_size, self.cfg.schedule)
        ]

    def from_last_stage(self, obj: Any) -> Any:
        """``obj`` as the rank holding the pipeline's last stage has it, on every rank of this
        pipeline (a collective over the pipeline group; picklable objects, through the host: a
        tensor of known shape goes by ``last_stage_tensor_`` instead)."""
        if not self.stages or not dist.is_initialized():
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=self._last_rank(), group=self.layout.pp_group)
        return box[0]

    def last_stage_tensor_(self, t: torch.Tensor) -> torch.Tensor:
        """In place and returned: ``t``, of one shape and dtype on every rank of this pipeline,
        takes the values the last stage's rank holds: one broadcast on the tensor's device,
        nothing read back to the host (a collective over the pipeline group)."""
        if self.stages and dist.is_initialized():
            dist.broadcast(t, src=self._last_rank(), group=self.layout.pp_group)
        return t

    def _share_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """Every rank gets the mean over data-parallel replicas of the last stage's loss."""
        if not dist.is_initialized() or dist.get_world_size() == 1:
            return loss.detach()
        t = loss.detach().float().reshape(1).to(self._device()).clone()
        if self.partition is None or self.partition.num_stages == 1 or not self.stages:
            dist.all_reduce(t)  # every rank is a last stage
            return (t / dist.get_world_size())[0]
        if self._parts.loss_group is not None:
            self._parts.loss_group.all_reduce_(t)
        else:
            dist.all_reduce(t)  # one last stage per pipeline: sum over its dp x tp ranks
        return (t / (self.layout.dp_size * self.layout.tp_size))[0]

    def _device(self) -> torch.device:
        return self._parts.device

    @torch.no_grad()
    def _sync_grads(self) -> None:
        if not dist.is_initialized():
            return
        parts = self._parts
        # 1. parameters replicated over pipeline ranks (tied embeddings, container-owned
        #    parameters): sum their gradients over the pipeline, as Megatron does for tied
        #    embeddings
        if parts.replicated and self.layout.pp_size > 1:
            params = dict(self.module.named_parameters(remove_duplicate=False))
            flat = []
            for n in parts.replicated:
                p = params[n]
                mine = id(p) in self._held
                flat.append(
                    _local(p.grad).reshape(-1)
                    if mine and p.grad is not None
                    else torch.zeros(
                        parts.replicated_numel[n], dtype=p.dtype, device=self._device()
                    )
                )
            summed = flat_collective(
                flat, lambda buf: dist.all_reduce(buf, group=self.layout.pp_group), write_back=False
            )
            for n, g in zip(parts.replicated, summed, strict=True):
                p = params[n]
                if id(p) in self._held:
                    p.grad = g.view_as(p).clone()
        # 2. data parallel: average what FSDP does not reduce (everything without FSDP; under a
        #    pipeline with FSDP, the container-owned and tied parameters) over the ranks holding
        #    the same part; a TP shard is averaged as its local tensor (same shard on each)
        if parts.grad_reducer is not None:
            ps = [p for p in self.parameters() if p.requires_grad and id(p) not in parts.fsdp_ids]
            for p in ps:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
            flat_collective([_local(p.grad) for p in ps], lambda buf: parts.grad_reducer(buf, 0))

    @property
    def grad_reduce_stats(self) -> CommStats | None:
        """Bytes and calls of the data-parallel gradient reduction between hosts, where a
        hierarchical reducer runs it (``cfg.grad_reduce``); None for the process group or dp ==
        1."""
        state = getattr(self._parts.grad_reducer, "state", None)
        return state.stats if state is not None else None

    def set_record_timeline(self, on: bool) -> None:
        """Whether the following ``train_step`` calls record their per-action ``events``."""
        self._record = on

    def clip_grad_norm_(self, max_norm: float, also: Iterable[nn.Parameter] = ()) -> torch.Tensor:
        """Clip the gradients of the whole model (every pipeline rank's part, each TP / FSDP shard
        once) and of ``also`` (parameters outside the model, whole and equal on every rank of the
        pipeline) to a global 2-norm of ``max_norm``; returns that norm (before clipping), the
        same on every rank. A tied parameter held by several pipeline ranks counts once."""
        copies: dict[int, int] = {}
        if self.partition is not None:
            stage_rank = self.partition.stage_rank
            params = dict(self.module.named_parameters(remove_duplicate=False))
            for n in self._parts.replicated:
                copies[id(params[n])] = len(
                    {stage_rank[s] for s in self.partition.param_stages.get(n, [0])}
                )
        also = list(also)
        pp = self.layout.pp_size if dist.is_initialized() else 1
        copies.update({id(q): pp for q in also})  # every pipeline rank holds them alike
        return clip_grad_norm_(
            [*self.parameters(), *also],
            max_norm,
            group=self.layout.pp_group if pp > 1 else None,
            copies=copies,
        )

    # --- evaluation
    @torch.no_grad()
    def predict(
        self,
        inputs: Any,
        output_fn: Callable[[Any, Any], Any] | None = None,
        extra: Any = None,
        structure: str | None = None,
        to_all: bool = True,
    ) -> list[Any]:
        """Forward-only over the pipeline: ``output_fn(output, extra_microbatch)`` on the last stage
        for each microbatch (default: the output itself); the list of results (picklable) is
        broadcast to every rank of the pipeline (``to_all=False``: not; the other ranks' entries
        are None). ``structure``: as in ``train_step``."""
        m = self.cfg.microbatches
        stages = self._stages_for(structure)
        mbs = split_microbatches(inputs, m)
        ext = split_microbatches(extra, m)
        fn = output_fn or (lambda out, _: out)
        if not stages:
            self._cuda_graphs()
            res = []
            for i in range(m):
                args, kwargs = _as_call(mbs[i])
                res.append(fn(self.module(*args, **kwargs), ext[i]))
            return res
        res: list[Any] = [None] * m
        if self.step_sync is not None:  # gathered now, whichever module's code reads them
            self.step_sync.unsharded_params()
        for a in forward_only(self.local_stages, m):
            st = stages[a.stage]
            args, kwargs = _as_call(mbs[a.mb])
            out = st.forward(a.mb, args, kwargs, grad=False)
            if st.is_last:
                res[a.mb] = fn(out, ext[a.mb])
        self.transport.flush()
        if self.step_sync is not None:  # units stay gathered after a forward under a pipeline
            self.step_sync.reshard()
        return self.from_last_stage(res) if to_all else res


def _loss_group(cfg: ParallelConfig, device: torch.device, timeout_s: float):
    """Shared-memory collectives for the end-of-step loss where the shared-memory gate allows them
    (CPU tensors, every rank on one host), else None (the process group). After a pipelined step
    gloo's threads have gone idle, and waking them costs its all-reduce of one number several times
    what the shared-memory one takes (benchmarks/pipeline_cpu_*.md). A collective: every rank learns
    every rank's answer, so all take the same path."""
    if cfg.p2p == "gloo" or not dist.is_initialized() or dist.get_world_size() == 1:
        return None
    from parallel.comm_hooks import hosts_of, should_use_shm
    from parallel.kernels import comm

    hosts = hosts_of()  # collective on every rank before any rank-local answer
    ok, _ = should_use_shm(
        torch.empty(0, device=device), hosts=hosts, op="pipeline loss all_reduce"
    )
    oks: list = [None] * dist.get_world_size()
    dist.all_gather_object(oks, ok)
    return comm.ShmGroup(timeout_s=timeout_s) if all(oks) else None


def _autocast_off(device_type: str) -> Callable[[], Any]:
    """A context factory for the backwards: autocast off when the caller enabled it (the forwards
    keep it), else a no-op (no context object per microbatch in fp32)."""
    if torch.is_autocast_enabled(device_type):
        return lambda: torch.autocast(device_type, enabled=False)
    return contextlib.nullcontext


@contextlib.contextmanager
def _gc_paused(on: bool):
    """Automatic garbage collection off for the block (see ``ParallelConfig.gc_pause``)."""
    was = gc.isenabled()
    if on:
        gc.disable()
    try:
        yield
    finally:
        if on and was:
            gc.enable()


def _weight(w) -> float | torch.Tensor:
    """A microbatch weight: a number or a host tensor as a float, an accelerator's tensor as it
    is."""
    return w.detach() if isinstance(w, torch.Tensor) and w.device.type != "cpu" else float(w)


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (the same part on every data-parallel or pipeline peer), else
    ``t``."""
    return t.to_local() if isinstance(t, DTensor) else t
