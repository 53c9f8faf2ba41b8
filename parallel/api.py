"""``parallelize``: the one call that turns a single-device model into a parallel one.

    pmodel = parallel.parallelize(model, parallel.ParallelConfig(pp=2, microbatches=8), example_inputs)
    loss = pmodel.train_step(inputs, target=target, loss_fn=fn)   # fwd + bwd, mean loss on every rank
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
   gradients averaged over the data-parallel ranks after every step.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from .config import ParallelConfig
from .cpu_affinity import bind_cores
from .fsdp import StepSync
from .host_malloc import steady_malloc
from .mesh import Layout, layout_of
from .partition import Partition, auto_partition, baseline_partition
from .pipeline.eager import EagerStage, Plan, Replayer, build_plan
from .pipeline.graph import GraphPathError, GraphPlan, GraphStage, build_graph_plan
from .pipeline.lanes import open_lanes
from .pipeline.p2p import PipelineError, Transport
from .pipeline.schedule import Action, forward_only, pipeline_order, stage_rank, stages_per_rank
from .spmd import Sharded, StagePart, discover_tp_plan, parallelize_spmd, stage_plan
from .timeline import Event
from .tp.verify import capture_inputs

log = logging.getLogger(__name__)

COST_SCHEDULE = {"gpipe": "gpipe", "1f1b": "1f1b", "eager_1f1b": "eager_1f1b", "interleaved_1f1b": "interleaved",
                 "looped_bfs": "interleaved", "zero_bubble": "interleaved", "zbv": "zbv", "dualpipev": "zbv"}
BASELINES = ("uniform", "parameters", "time")


# ----------------------------------------------------------------------------- inputs


def split_microbatches(inputs: Any, m: int) -> list[Any]:
    """Split dim 0 of every tensor in a tuple / list / dict (nested) into m chunks; everything
    else is repeated."""
    def split(x: Any) -> list[Any]:
        if isinstance(x, torch.Tensor) and x.dim() > 0:
            parts = list(torch.tensor_split(x, m, dim=0))
            return parts
        if isinstance(x, Mapping):
            cols = {k: split(v) for k, v in x.items()}
            return [type(x)({k: cols[k][i] for k in x}) if type(x) is not dict else {k: cols[k][i] for k in x}
                    for i in range(m)]
        if isinstance(x, list | tuple):
            cols = [split(v) for v in x]
            return [type(x)(c[i] for c in cols) if isinstance(x, list | tuple) else None for i in range(m)]
        return [x] * m

    if inputs is None:
        return [None] * m
    return split(inputs)


def _as_call(inputs: Any) -> tuple[tuple, dict]:
    if isinstance(inputs, Mapping):
        return (), dict(inputs)
    if isinstance(inputs, list | tuple):
        return tuple(inputs), {}
    return (inputs,), {}


def _default_loss(out: Any, target: Any) -> torch.Tensor:
    if isinstance(out, torch.Tensor) and out.dim() == 0:
        return out
    loss = getattr(out, "loss", None) if not isinstance(out, Mapping) else out.get("loss")
    if isinstance(loss, torch.Tensor):
        return loss
    raise ValueError("train_step needs loss_fn(model_output, target) unless the model returns a loss")


# ----------------------------------------------------------------------------- partition


def make_partition(model: nn.Module, cfg: ParallelConfig, example_inputs: Any, num_stages: int, v: int,
                   trace_loss_fn: Callable | None = None) -> Partition:
    """Rank 0 traces and partitions; every rank receives the same Partition.

    The trace runs on one microbatch, not the whole example batch: unit costs are per microbatch
    in the cost model, and they are not linear in the batch (the reader's copy head works on
    (tokens, vocabulary) tensors that stay in cache at a microbatch of 8 and not at 32: traced on
    the batch it looked 1.3x too expensive next to the blocks and drew the cut after lm_head,
    ~10 MB per microbatch across it, BENCHMARKS.md Pipeline)."""
    obj: list[Any] = [None]
    rank = dist.get_rank() if dist.is_initialized() else 0
    if _batch(example_inputs) >= cfg.microbatches > 1:
        example_inputs = split_microbatches(example_inputs, cfg.microbatches)[0]
    if rank == 0:
        sched = COST_SCHEDULE[cfg.schedule]
        kw = dict(schedule=sched, microbatches=cfg.microbatches, stages_per_rank=v)
        if cfg.partition == "auto":
            part = auto_partition(model, example_inputs, num_stages, cfg.objective, cfg.memory_cap_bytes,
                                  loss_fn=trace_loss_fn, **kw)
        elif cfg.partition in BASELINES:
            from .cost import CostConfig
            from .trace import trace_model

            trace = trace_model(model, example_inputs, loss_fn=trace_loss_fn)
            part = baseline_partition(trace, num_stages, cfg.partition,
                                      CostConfig(schedule=sched, microbatches=cfg.microbatches, stages_per_rank=v))
        elif os.path.exists(cfg.partition):
            part = Partition.load(cfg.partition)
        else:
            raise ValueError(f"partition must be auto, {', '.join(BASELINES)} or a JSON file (got {cfg.partition!r})")
        obj[0] = part.to_dict()
        for p in model.parameters():  # tracing ran backward passes
            p.grad = None
    if dist.is_initialized():
        dist.broadcast_object_list(obj, src=0)
    part = Partition.from_dict(obj[0])
    if part.num_stages != num_stages:
        raise ValueError(f"the partition has {part.num_stages} stages, the config needs {num_stages}")
    return part


# ----------------------------------------------------------------------------- the wrapper


class ParallelModel(nn.Module):
    """This rank's part of a parallelized model, with ``train_step`` over the pipeline."""

    def __init__(self, model: nn.Module, cfg: ParallelConfig, layout: Layout, partition: Partition | None,
                 plan: Plan | None, stages: dict[int, EagerStage], order: list[Action] | None,
                 transport: Transport | None, held: set[int], replicated: list[str], local_stages: list[int]):
        super().__init__()
        self.module = model
        self.cfg = cfg
        self.layout = layout
        self.partition = partition
        self.plan = plan
        self.stages = stages
        self.order = order
        self.transport = transport
        self._held = held
        self._named_held = [(n, p) for n, p in model.named_parameters(remove_duplicate=False) if id(p) in held]
        self._replicated = replicated  # canonical names held by more than one pipeline rank
        self.local_stages = local_stages
        self.events: list[Event] = []  # timeline of the last step
        self.record_timeline = True  # train_step records ``events`` (off: they stay empty)
        self.sharded = Sharded()  # what parallelize_spmd applied to this rank's part
        self.step_sync: StepSync | None = None  # FSDP units driven once per step (microbatches)
        self._fsdp_ids: set[int] = set()  # parameters whose gradients FSDP reduces
        # averages the flat gradient of what FSDP does not reduce over the data-parallel ranks
        # (``cfg.grad_reduce``: the process group, or the shared-memory / int8 reducers)
        self.grad_mean_: Callable[[torch.Tensor, int], torch.Tensor] | None = None
        self.loss_group = None  # shared-memory collectives for the step loss (_loss_group), or gloo
        # further input structures (``parallelize(structures=...)``): name -> this rank's stages,
        # each replaying the model on its own plan (``plans[name]``)
        self.structures: dict[str, dict[int, EagerStage]] = {}
        self.structure_names: set[str] = set()
        self.plans: dict[str, Plan] = {}

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
    def named_parameters(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
                         ) -> Iterator[tuple[str, nn.Parameter]]:
        """This rank's parameters (FSDP's sharded ones, also while a unit is gathered)."""
        seen: set[int] = set()
        for name, p in self._named_held:
            if id(p) in seen and remove_duplicate:
                continue
            seen.add(id(p))
            yield prefix + name, p

    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]:
        for _, p in self.named_parameters():
            yield p

    def _local_keys(self) -> set[str]:
        keys = {name for name, _ in self._named_held}
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

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The whole model's state, gathered over the pipeline (a collective; every rank gets it)."""
        mine = {k: v.detach().cpu() for k, v in self.state_dict().items()}
        if not dist.is_initialized() or self.layout.pp_size == 1:
            return mine
        parts: list[Any] = [None] * self.layout.pp_size
        dist.all_gather_object(parts, mine, group=self.layout.pp_group)
        out: dict[str, torch.Tensor] = {}
        for p in parts:
            out.update(p)
        return out

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = False, assign: bool = False):  # type: ignore[override]
        """Load the entries this rank holds (a full or a per-rank state dict both work)."""
        keys = self._local_keys()
        return self.module.load_state_dict({k: v for k, v in state_dict.items() if k in keys}, strict=False)

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
    def train_step(self, inputs: Any, target: Any = None, loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
                   weight_fn: Callable[[Any, Any], float] | None = None, structure: str | None = None
                   ) -> torch.Tensor:
        """Forward and backward of one batch over the pipeline; returns the mean loss (every rank).

        ``inputs``: tuple of positional or dict of keyword arguments; dim 0 of every tensor is
        split into ``cfg.microbatches``. ``loss_fn(output, target_microbatch)`` (default: the
        output's ``loss``). The step loss is ``sum_i w_i loss_i / sum_i w_i`` with ``w_i =
        weight_fn(inputs_i, target_i)`` (default 1: the mean of microbatch means); gradients are
        those of that loss. A per-token mean loss gives the full-batch mean when ``w_i`` is the
        microbatch's token count. Gradients accumulate into ``.grad`` (call ``zero_grad``).
        ``structure``: inputs are shaped like that extra example of ``parallelize`` (its plan).

        Mixed precision: call it inside ``torch.autocast(...)`` as one wraps a forward. The
        forwards and ``loss_fn`` run under the caller's autocast, the backwards with autocast off,
        as autocast's documentation asks of a backward pass."""
        m = self.cfg.microbatches
        stages = self._stages_for(structure)
        loss_fn = loss_fn or _default_loss
        mbs = split_microbatches(inputs, m)
        tgts = split_microbatches(target, m)
        w = [float(weight_fn(mbs[i], tgts[i])) if weight_fn is not None else 1.0 for i in range(m)]
        total_w = sum(w)
        if total_w <= 0:
            raise ValueError("microbatch weights sum to zero")
        self.events = []
        losses: dict[int, torch.Tensor] = {}
        rec = self.events.append if self.record_timeline else None
        rank = self.layout.rank
        no_cast = _autocast_off(self._device().type)
        if self.step_sync is not None:  # FSDP: gather once, reduce-scatter once, per step
            self.step_sync.begin()
            if stages:  # the split backward's weight step works on what autograd sees
                unsharded = self.step_sync.unsharded_params()
                params = [unsharded.get(id(p), p) for p in self._trainable]
                for st in self.all_stages():
                    st.params = params
        if not stages:  # no pipeline: gradient accumulation over the microbatches
            for i in range(m):
                t0 = time.perf_counter()
                args, kwargs = _as_call(mbs[i])
                loss = loss_fn(self.module(*args, **kwargs), tgts[i])
                with no_cast():
                    (loss * (w[i] / total_w)).backward()
                losses[i] = loss.detach()
                if rec:
                    rec(Event(rank, "B", 0, i, t0, time.perf_counter()))
        else:
            self.transport.wait_s = 0.0
            with _gc_paused(self.cfg.gc_pause):
                self._run_schedule(stages, mbs, tgts, w, total_w, loss_fn, losses, rec, rank, no_cast)
            self.transport.flush()
        t0 = time.perf_counter()
        if self.step_sync is not None:
            self.step_sync.finish()
        self._sync_grads()
        if self.is_last_stage:
            # four ops, not 3m: on a CPU rank each costs microseconds on the step's critical path
            lw = torch.tensor(w, dtype=torch.float32, device=losses[0].device)
            step_loss = torch.dot(torch.stack([losses[i] for i in range(m)]).float().reshape(m), lw) / total_w
        else:
            step_loss = torch.zeros((), dtype=torch.float32)
        step_loss = self._share_loss(step_loss)
        if rec:
            rec(Event(rank, "sync", -1, -1, t0, time.perf_counter()))
        return step_loss

    def _run_schedule(self, stages, mbs, tgts, w, total_w, loss_fn, losses, rec, rank, no_cast) -> None:
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
            if rec:  # receives happen at the start of an action: the event is the compute after them
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
            raise KeyError(f"no input structure {structure!r}: parallelize(..., structures=...) named "
                           f"{sorted(self.structure_names)}")
        return self.structures.get(structure, self.stages)  # no pipeline: the model runs as it is

    def all_stages(self) -> Iterator[Any]:
        """Every stage object of this rank, over all input structures (stage hooks update them)."""
        yield from self.stages.values()
        for stages in self.structures.values():
            yield from stages.values()

    def from_last_stage(self, obj: Any) -> Any:
        """``obj`` as the rank holding the pipeline's last stage has it, on every rank of this
        pipeline (a collective over the pipeline group; picklable objects)."""
        if not self.stages or not dist.is_initialized():
            return obj
        last = self.layout.pp_ranks[stage_rank(self.partition.num_stages - 1, self.layout.pp_size, self.cfg.schedule)]
        box = [obj]
        dist.broadcast_object_list(box, src=last, group=self.layout.pp_group)
        return box[0]

    def _share_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """Every rank gets the mean over data-parallel replicas of the last stage's loss."""
        if not dist.is_initialized() or dist.get_world_size() == 1:
            return loss.detach()
        t = loss.detach().float().reshape(1).to(self._device()).clone()
        if self.partition is None or self.partition.num_stages == 1 or not self.stages:
            dist.all_reduce(t)  # every rank is a last stage
            return (t / dist.get_world_size())[0]
        if self.loss_group is not None:
            self.loss_group.all_reduce_(t)
        else:
            dist.all_reduce(t)  # one last stage per pipeline: sum over its dp x tp ranks
        return (t / (self.layout.dp_size * self.layout.tp_size))[0]

    def _device(self) -> torch.device:
        dev = self.__dict__.get("_device_cache")
        if dev is None:  # parameters do not move after parallelize; finding the first held one walks them all
            p = next(self.parameters(), None)
            dev = self.__dict__["_device_cache"] = p.device if p is not None else torch.device("cpu")
        return dev

    @torch.no_grad()
    def _sync_grads(self) -> None:
        if not dist.is_initialized():
            return
        # 1. parameters replicated over pipeline ranks (tied embeddings, container-owned
        #    parameters): sum their gradients over the pipeline, as Megatron does for tied embeddings
        if self._replicated and self.layout.pp_size > 1:
            params = dict(self.module.named_parameters(remove_duplicate=False))
            flat = []
            for n in self._replicated:
                p = params[n]
                mine = id(p) in self._held
                flat.append(_local(p.grad).reshape(-1) if mine and p.grad is not None else
                            torch.zeros(self._numel[n], dtype=p.dtype, device=self._device()))
            buf = torch.cat(flat)
            dist.all_reduce(buf, group=self.layout.pp_group)
            off = 0
            for n in self._replicated:
                p, k = params[n], self._numel[n]
                if id(p) in self._held:
                    p.grad = buf[off:off + k].view_as(p).clone()
                off += k
        # 2. data parallel: average what FSDP does not reduce (everything without FSDP; under a
        #    pipeline with FSDP, the container-owned and tied parameters) over the ranks holding
        #    the same part; a TP shard is averaged as its local tensor (same shard on each)
        if self.layout.dp_size > 1:
            ps = [p for p in self.parameters() if p.requires_grad and id(p) not in self._fsdp_ids]
            for p in ps:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
            if ps:
                local = [_local(p.grad) for p in ps]
                buf = torch.cat([g.reshape(-1) for g in local])
                self.grad_mean_(buf, 0)
                off = 0
                for g in local:
                    g.copy_(buf[off:off + g.numel()].view_as(g))
                    off += g.numel()

    # --- evaluation
    @torch.no_grad()
    def predict(self, inputs: Any, output_fn: Callable[[Any, Any], Any] | None = None,
                extra: Any = None, structure: str | None = None) -> list[Any]:
        """Forward-only over the pipeline: ``output_fn(output, extra_microbatch)`` on the last stage
        for each microbatch (default: the output itself); the list of results (picklable) is
        broadcast to every rank of the pipeline. ``structure``: as in ``train_step``."""
        m = self.cfg.microbatches
        stages = self._stages_for(structure)
        mbs = split_microbatches(inputs, m)
        ext = split_microbatches(extra, m)
        fn = output_fn or (lambda out, _: out)
        if not stages:
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
        return self.from_last_stage(res)


# ----------------------------------------------------------------------------- parallelize


def _loss_group(cfg: ParallelConfig, device: torch.device, timeout_s: float):
    """Shared-memory collectives for the end-of-step loss where the shared-memory gate allows them (CPU
    tensors, every rank on this host), else None (the process group). After a pipelined step
    gloo's threads have gone idle and its all-reduce of one number took ~0.7 ms here
    (BENCHMARKS.md, Pipeline); the shared-memory one ~80 us. A collective: every rank learns every
    rank's answer, so all take the same path."""
    if cfg.p2p == "gloo" or not dist.is_initialized() or dist.get_world_size() == 1:
        return None
    from parallel.comm_hooks import hosts_of, should_use_shm
    from parallel.kernels import comm

    hosts = hosts_of()  # collective on every rank before any rank-local answer
    ok, _ = should_use_shm(torch.empty(0, device=device), hosts=hosts, op="pipeline loss all_reduce")
    ok = ok and os.environ.get("RAG_MM_PIPELINE_P2P") != "gloo"
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


def parallelize(model: nn.Module, cfg: ParallelConfig, example_inputs: Any, *,
                trace_loss_fn: Callable[[Any], torch.Tensor] | None = None,
                timeout_s: float = 300.0, partition: Partition | None = None,
                structures: Mapping[str, Any] | None = None) -> ParallelModel:
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
        pm = ParallelModel(model, cfg, layout, None, None, {}, None, None, set(), [], [0])
        pm.structure_names = set(structures)
        # 4. TP -> AC -> compile -> FSDP on the whole model
        _shard(pm, example_inputs, None)
        _broadcast_dp(pm)
        return pm
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
            extra_plans[name] = build_plan(replayer, heads, k, *_as_call(_microbatch_of(ex, cfg.microbatches)))
            log.info("input structure %r: %d module calls (the example: %d)", name, len(extra_plans[name].names),
                     len(plan.names))
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
    # a TP plan is read off the whole model's dataflow: found before the split, applied to each
    # rank's part below
    tp_plan = discover_tp_plan(model, cfg, example_inputs) if cfg.tp > 1 else None
    # each TP unit's inputs in the whole model's example forward: the plan checks itself on them
    captured = capture_inputs(model, tp_plan, example_inputs) if tp_plan is not None else None
    for p in model.parameters():
        if id(p) not in held:
            p.data = torch.empty(0, dtype=p.dtype, device=p.device)  # another rank's: free it
    device = next((p.device for p in model.parameters() if id(p) in held), torch.device("cpu"))
    stage_ranks = [layout.pp_ranks[stage_rank(s, cfg.pp, cfg.schedule)] for s in range(k)]
    transport = Transport(stage_ranks, timeout_s, device)
    # the I/W split (split_backward.py) is tested on plain and FSDP stages; TP's DTensors and the
    # saved-tensor hooks of checkpointing / offload keep the whole backward
    split_drain = cfg.split_drain and cfg.tp == 1 and cfg.activation_checkpointing == "none" \
        and not cfg.activation_offload
    if cfg.split_drain and not split_drain:
        log.info("split_drain off: the last backward stays whole under tp / activation checkpointing / offload")
    orders = pipeline_order(cfg.schedule, cfg.pp, v, cfg.microbatches, split_drain)
    transport.lanes, how = open_lanes(orders, cfg.microbatches, stage_ranks, layout.rank, timeout_s, cfg.p2p)
    log.info("pipeline p2p on rank %d: %s", layout.rank, how)
    loss_group = _loss_group(cfg, device, timeout_s)
    local_params = [p for p in model.parameters() if id(p) in held]
    if gplan is not None:
        plan = gplan
        stages = {s: GraphStage(s, gplan, model, transport, local_params, device) for s in local}
    else:
        stages = {s: EagerStage(s, plan, replayer, transport, local_params, device) for s in local}
    order = orders[layout.pp_rank]
    pm = ParallelModel(model, cfg, layout, partition, plan, stages, order, transport, held, replicated, local)
    pm.structure_names = set(structures)
    pm.plans = extra_plans
    pm.structures = {name: {s: EagerStage(s, p, replayer, transport, local_params, device) for s in local}
                     for name, p in extra_plans.items()}
    pm._numel = numel
    pm.loss_group = loss_group
    # 4. TP -> AC -> compile -> FSDP on this rank's part
    if tp_plan is not None:
        tp_plan, notes = stage_plan(tp_plan, ranks_of, layout.pp_rank)
        for msg in notes:
            log.info("tp under pp: %s", msg)
    # modules whose forward is container code (the root, ancestors of stage units): it runs on
    # every stage and stops where the stage's work ends
    container = {""} | {n for n, _ in model.named_modules() if n and any(h.startswith(n + ".") for h in heads)}
    if replayer is not None:  # the replay intercepts whatever forwards sharding leaves
        replayer.unwrap()
    params = dict(model.named_parameters(remove_duplicate=False))
    _shard(pm, example_inputs, StagePart(held, container, {id(params[n]) for n in replicated}), tp_plan, captured)
    if replayer is not None:
        replayer.rewrap()
    # 5. consistent start: replicated parameters from their first holder, replicas from dp rank 0
    _broadcast_replicated(pm)
    _broadcast_dp(pm)
    log.info("pipeline rank %d: stages %s, %d parameters\n%s", layout.pp_rank, local,
             sum(p.numel() for p in pm.parameters()), plan.describe())
    return pm


def _shard(pm: ParallelModel, example_inputs: Any, part: StagePart | None, tp_plan: Any = None,
           captured: Any = None) -> None:
    """Step 4 of ``parallelize`` on this rank's part, then the bookkeeping that follows it: TP and
    FSDP replace parameters by DTensors, so the rank's parameter set and its stages' lists are
    rebuilt, and FSDP units that run several microbatches per step are driven by ``StepSync``."""
    cfg, model = pm.cfg, pm.module
    names = [n for n, p in model.named_parameters(remove_duplicate=False) if part is None or id(p) in part.held]
    mesh = pm.layout.mesh
    if mesh is not None:
        pm.sharded = parallelize_spmd(model, cfg, mesh, example_inputs, plan=tp_plan, part=part, captured=captured)
    elif cfg.activation_checkpointing != "none" or cfg.activation_offload:  # one process: savers only
        from .memory import apply_activation_checkpointing, apply_activation_offload
        from .spmd import find_blocks

        blocks = find_blocks(model)
        apply_activation_checkpointing(blocks, cfg.activation_checkpointing, cfg.ac_every)
        if cfg.activation_offload:
            apply_activation_offload(blocks)
    new = dict(model.named_parameters(remove_duplicate=False))
    pm._held = {id(new[n]) for n in names}
    pm._named_held = [(n, new[n]) for n in names]
    local = list({id(p): p for n in names if (p := new[n]).requires_grad}.values())
    for st in pm.all_stages():
        st.params = local
    pm._trainable = local  # (while FSDP holds a unit gathered, the module shows its unsharded parameters)
    units = pm.sharded.fsdp_units
    pm._fsdp_ids = {id(p) for u in units for p in u.parameters()}
    if units and (part is not None or cfg.microbatches > 1):
        pm.step_sync = StepSync(units)


def _graph_plan(model: nn.Module, cfg: ParallelConfig, partition: Partition, k: int, args: tuple,
                kwargs: dict, structures: list[str]) -> tuple[GraphPlan | None, str]:
    """The gate between the two stage paths: (graph plan or None, the line that says which and why)."""
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
            return gplan, "graph path (torch.export split at the partition's cuts)\n" + gplan.describe()
        except GraphPathError as e:
            why = str(e)
    if cfg.stage_path == "graph":
        raise GraphPathError(f"stage_path='graph' but the model cannot take the graph path: {why}")
    return None, f"eager path (graph path not taken: {why})"


def _microbatch_of(example: Any, m: int) -> Any:
    """The first microbatch of an example batch (the whole example when it has fewer than m rows):
    plans are made on what one stage call will see."""
    return split_microbatches(example, m)[0] if _batch(example) >= m else example


def _batch(inputs: Any) -> int:
    args, kwargs = _as_call(inputs)
    for x in list(args) + list(kwargs.values()):
        if isinstance(x, torch.Tensor) and x.dim() > 0:
            return int(x.shape[0])
    return 0


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


def _broadcast_replicated(pm: ParallelModel) -> None:
    if not dist.is_initialized() or not pm._replicated:
        return
    params = dict(pm.module.named_parameters(remove_duplicate=False))
    held_stages = _held_stages(pm.module, pm.partition, pm.partition.num_stages)
    flat = []
    for n in pm._replicated:
        first = min(stage_rank(s, pm.layout.pp_size, pm.cfg.schedule) for s in held_stages[n])
        p = params[n]
        flat.append(p.detach().reshape(-1).clone() if first == pm.layout.pp_rank else
                    torch.zeros(pm._numel[n], dtype=p.dtype, device=pm._device()))
    buf = torch.cat(flat)
    dist.all_reduce(buf, group=pm.layout.pp_group)
    off = 0
    for n in pm._replicated:
        p, k = params[n], pm._numel[n]
        if id(p) in pm._held:
            with torch.no_grad():
                p.copy_(buf[off:off + k].view_as(p))
        off += k


@torch.no_grad()
def _broadcast_dp(pm: ParallelModel) -> None:
    """What FSDP does not shard starts equal on every data-parallel rank: dp rank 0's copy; and
    the reducer that averages its gradients there."""
    if not dist.is_initialized() or pm.layout.dp_size == 1:
        return
    from .comm_hooks import make_grad_reducer

    pm.grad_mean_ = make_grad_reducer(pm.cfg.grad_reduce, pm.layout.dp_group)
    src = dist.get_global_rank(pm.layout.dp_group, 0)
    for p in pm.parameters():
        if id(p) not in pm._fsdp_ids:
            dist.broadcast(_local(p.data), src=src, group=pm.layout.dp_group)


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (the same part on every data-parallel or pipeline peer), else ``t``."""
    return t.to_local() if isinstance(t, DTensor) else t


__all__ = ["ParallelConfig", "ParallelModel", "parallelize", "split_microbatches", "PipelineError"]
