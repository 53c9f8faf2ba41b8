"""Eager, hook-based tracer: one forward+backward per pass on example inputs, recording per module
the execution order, call count, parameter/buffer bytes, activation bytes, forward/backward time
(median over repeated passes), FLOPs, which parameters are shared, and the dataflow between
module calls.

No graph capture: the model runs as ordinary Python (control flow, ``DynamicCache`` outputs and
keyword-only inputs all work), so it traces anything that runs eagerly. SageMaker's library does
the same in its first step; we additionally record backward time and
the dataflow the pipeline and tensor-parallel code need.

How each quantity is measured:

- forward time: a clock read in forward pre/post hooks, minus the time spent inside the
  tracer's own hooks during the call (so a parent's time does not include its children's hooks);
- the clock: on a CPU running one intra-op thread, the thread's CPU time (``thread_time``), so a
  module that happens to be descheduled by another process is not charged the wait (where ranks
  or other jobs share the cores, one such outlier can decide a whole partition); with several
  threads or on a GPU,
  wall time (``perf_counter``, after a device sync);
- backward time: each autograd node created during a module call is *claimed* by the innermost
  module whose forward post-hook reaches it (walking back from the outputs, stopping at the call's
  inputs and at nodes already claimed), and timed by node pre/post hooks during backward;
- activation bytes: tensors autograd saves for backward (``saved_tensors_hooks``), deduplicated
  by storage and excluding parameters, attributed to the innermost running module; this is the
  memory a microbatch in flight holds. Output bytes are recorded too;
- dataflow: every tensor a call consumes is looked up by storage: produced by an earlier call,
  computed by a parent's own code from earlier calls' outputs (found by walking the autograd
  graph to claimed nodes), or external (model input / constant).
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

EXTERNAL = -1  # producer id of a tensor that no module call produced (model input, constant)


# ----------------------------------------------------------------------------- data structures


@dataclass
class ModuleNode:
    """One ``nn.Module`` in the tree, with what tracing measured (all per training step)."""

    name: str  # fully-qualified name as in ``model.named_modules()``; "" is the root
    type: str  # class name, for tables and for TP rules that match module kinds
    parent: str | None  # parent's name; None for the root
    children: list[str] = field(default_factory=list)  # direct children, in registration order
    calls: int = 0  # forward calls in one pass; >1 means reused (loop, shared module)
    first_seq: int = -1  # event counter at its first forward call; -1: never called
    last_seq: int = -1  # event counter when its last call returned (nesting/interleaving check)
    param_bytes: int = 0  # bytes of parameters registered directly on it, each tensor counted once
    param_numel: int = 0  # number of such parameter elements (DeepSpeed's 'parameters' balance)
    buffer_bytes: int = 0  # bytes of its own buffers (persistent or not): they live on its stage
    out_bytes: int = 0  # bytes of tensors in its outputs, summed over calls
    saved_bytes: int = 0  # activation bytes saved for backward while it was innermost (exclusive)
    fwd_time: float = 0.0  # inclusive forward seconds over all its calls, median over passes
    bwd_time: float = 0.0  # exclusive backward seconds of the autograd nodes it created, median
    flops: float = 0.0  # inclusive forward+backward FLOPs (torch FlopCounterMode)
    params: list[str] = field(default_factory=list)  # canonical names of its own parameters


@dataclass
class TensorFlow:
    """One distinct tensor (storage) consumed by a module call: who made it, who used it."""

    producer: int  # call id of the module call that output it; EXTERNAL if none did
    via: list[int]  # for tensors computed by a parent's own code: the calls it was derived from
    nbytes: int  # bytes of the tensor (what a pipeline cut would send)
    shape: list[int]  # shape at first use, for readability and for allocating receive buffers
    dtype: str  # dtype at first use
    consumers: list[int] = field(default_factory=list)  # call ids that took it as an input


@dataclass
class ModuleCall:
    """One forward call of a module, in execution order (index in ``TraceResult.calls``)."""

    module: str  # module name
    seq: int  # event counter at the call's start (orders calls and parameter uses)
    end_seq: int  # event counter at the call's end
    inputs: list[int]  # indices into ``TraceResult.tensors`` of the tensors it consumed
    out_bytes: int  # bytes of its output tensors


@dataclass
class SharedGroup:
    """Modules tied by a common parameter (e.g. GPT-2's token embedding and LM head)."""

    params: list[str]  # every name the parameter(s) go by, canonical first
    modules: list[str]  # every module that registers or uses one of them
    nbytes: int  # bytes of the shared parameters (counted once)


@dataclass
class TraceResult:
    """Everything the cost model, partitioner, pipeline and TP planner need from one trace."""

    root_type: str  # class name of the traced model
    device: str  # device the trace ran on ("meta": shapes only, no timings)
    passes: int  # timed forward+backward passes whose median gives the times
    timed: bool  # False on the meta device: use ``flops`` as compute cost
    modules: dict[str, ModuleNode]  # all modules by name, root "" first, in registration order
    calls: list[ModuleCall]  # every module call in execution order
    tensors: list[TensorFlow]  # every distinct tensor that crossed a module boundary
    shared: list[SharedGroup]  # parameter-sharing groups (tied weights)
    param_alias: dict[str, str]  # every parameter name (duplicates included) -> canonical name
    param_owner: dict[str, str]  # canonical parameter name -> module that registers it
    param_first_use: dict[str, int]  # canonical parameter name -> event counter at first use
    param_sizes: dict[str, list[int]]  # canonical parameter name -> [bytes, numel]
    total_fwd_time: float  # median seconds of a whole forward (root call)
    total_bwd_time: float  # median seconds of a whole backward

    def node(self, name: str) -> ModuleNode:
        return self.modules[name]

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> TraceResult:
        d = dict(d)
        d["modules"] = {k: ModuleNode(**v) for k, v in d["modules"].items()}
        d["calls"] = [ModuleCall(**c) for c in d["calls"]]
        d["tensors"] = [TensorFlow(**t) for t in d["tensors"]]
        d["shared"] = [SharedGroup(**s) for s in d["shared"]]
        return cls(**d)

    def save(self, path: str) -> None:
        with open(path, "w") as f:
            json.dump(self.to_dict(), f)

    @classmethod
    def load(cls, path: str) -> TraceResult:
        with open(path) as f:
            return cls.from_dict(json.load(f))

    def edges(self) -> list[tuple[str, str, int]]:
        """Module-level dataflow ``(producer, consumer, bytes)`` between module calls, with tensors
        computed in a parent's own code attributed to the calls they were derived from. The TP
        planner reads "which linear feeds which" from this."""
        out = []
        for t in self.tensors:
            srcs = [t.producer] if t.producer != EXTERNAL else t.via
            for s in srcs:
                for c in t.consumers:
                    out.append((self.calls[s].module, self.calls[c].module, t.nbytes))
        return out


# ----------------------------------------------------------------------------- helpers


def _tensors(obj: Any, depth: int = 0) -> list[torch.Tensor]:
    """Tensors inside nested tuples/lists/dicts/dataclasses (``ModelOutput`` is a dict). Opaque
    objects (``DynamicCache``) are skipped: they are state, not activations flowing onward."""
    if depth > 6:
        return []
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, Mapping):
        return [t for v in obj.values() for t in _tensors(v, depth + 1)]
    if isinstance(obj, list | tuple):
        return [t for v in obj for t in _tensors(v, depth + 1)]
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return [
            t
            for f in dataclasses.fields(obj)
            for t in _tensors(getattr(obj, f.name, None), depth + 1)
        ]
    return []


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _storage_key(t: torch.Tensor) -> int:
    """Identity of a tensor's memory, so views and re-returned tensors map to one record. Meta
    tensors have no memory: use the object id (the tracer keeps them alive while tracing)."""
    try:
        ptr = t.untyped_storage().data_ptr()
    except Exception:  # noqa: BLE001 - tensor subclasses without storage
        ptr = 0
    return ptr if ptr else -id(t)


def default_loss(output: Any) -> torch.Tensor:
    """A scalar that depends on every floating-point output that requires grad."""
    ts = [t for t in _tensors(output) if t.is_floating_point() and t.requires_grad]
    if not ts:
        raise ValueError("tracing needs an output tensor that requires grad for the backward pass")
    return sum(t.float().mean() for t in ts)


_clock = time.perf_counter  # set by trace_model for its timed passes (see the module doc)


def _now() -> float:
    return _clock()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class _ParamUse(TorchFunctionMode):
    """Records the event counter at which each parameter is first used by any torch function, so a
    parent's own parameters (ViT's ``cls_token``, open_clip's ``text_projection``) can be placed in
    execution order among its children, and users of a parameter that do not register it
    (``F.linear(x, self.embed.weight)``) are found."""

    def __init__(self, tracer: _Tracer):
        super().__init__()
        self.tracer = tracer

    # metadata reads (``w.dtype``, ``w.shape``, ``w.size()``) are not uses of the values
    _METADATA = frozenset(
        {
            "__get__",
            "size",
            "dim",
            "numel",
            "stride",
            "is_floating_point",
            "element_size",
            "data_ptr",
            "is_contiguous",
            "get_device",
            "__len__",
        }
    )

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        tr = self.tracer
        if getattr(func, "__name__", "") in self._METADATA:
            return func(*args, **kwargs)
        for a in list(args) + list(kwargs.values()):
            if isinstance(a, nn.Parameter):
                name = tr.param_name.get(id(a))
                if name is not None:
                    tr.first_use.setdefault(name, tr.seq)
                    if tr.stack:
                        tr.param_users.setdefault(name, set()).add(tr.stack[-1])
        return func(*args, **kwargs)


# ----------------------------------------------------------------------------- the tracer


class _Tracer:
    def __init__(self, model: nn.Module):
        self.model = model
        self.names = {id(m): n for n, m in model.named_modules(remove_duplicate=False)}
        # remove_duplicate=True gives each module object one canonical name
        self.canon_mod = {id(m): n for n, m in model.named_modules()}
        self.param_name = {id(p): n for n, p in model.named_parameters()}
        self.param_ptrs = {_storage_key(p) for p in model.parameters()}
        self.reset()

    def reset(self) -> None:
        self.seq = 0  # event counter: increments at every call start and end
        self.stack: list[str] = []  # names of modules currently running, innermost last
        self.call_stack: list[int] = []
        self.overhead = 0.0  # seconds spent inside our hooks (subtracted from call times)
        self.calls: list[ModuleCall] = []
        self.call_start: list[float] = []
        self.call_overhead0: list[float] = []
        self.call_in_nodes: list[set] = []
        self.fwd: dict[str, float] = {}
        self.bwd: dict[str, float] = {}
        self.calls_of: dict[str, int] = {}
        self.first_seq: dict[str, int] = {}
        self.last_seq: dict[str, int] = {}
        self.out_bytes: dict[str, int] = {}
        self.saved: dict[str, int] = {}
        self.saved_keys: set[int] = set()
        self.claimed: dict[Any, int] = {}  # autograd node -> call id that created it
        self.producer: dict[int, int] = {}  # storage key -> tensor record index
        self.tensors: list[TensorFlow] = []
        self.keep: list[Any] = []  # strong refs: storages/ids must not be reused while tracing
        self.first_use: dict[str, int] = {}
        self.param_users: dict[str, set[str]] = {}
        self.glue_memo: dict[Any, frozenset[int]] = {}
        self.node_t0: dict[Any, float] = {}
        self.timing = False
        self.device = torch.device("cpu")

    # --- forward hooks
    def pre(self, mod: nn.Module, args: tuple, kwargs: dict) -> None:
        _sync(self.device)
        t0 = _now()
        name = self.canon_mod[id(mod)]
        cid = len(self.calls)
        inputs = _tensors(args) + _tensors(kwargs)
        in_idx: list[int] = []
        in_nodes = set()
        for t in inputs:
            if t.grad_fn is not None:
                in_nodes.add(t.grad_fn)
            if not self.timing:
                rec = self._record_input(t)
                if rec not in in_idx:
                    in_idx.append(rec)
                    self.tensors[rec].consumers.append(cid)
        self.calls.append(ModuleCall(name, self.seq, -1, in_idx, 0))
        self.seq += 1
        self.first_seq.setdefault(name, self.calls[-1].seq)
        self.stack.append(name)
        self.call_stack.append(cid)
        self.call_in_nodes.append(in_nodes)
        self.call_overhead0.append(self.overhead)
        t1 = _now()
        self.overhead += t1 - t0
        self.call_start.append(t1)

    def post(self, mod: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        _sync(self.device)
        t0 = _now()
        cid = self.call_stack.pop()
        name = self.stack.pop()
        elapsed = t0 - self.call_start[cid] - (self.overhead - self.call_overhead0[cid])
        self.fwd[name] = self.fwd.get(name, 0.0) + max(elapsed, 0.0)
        self.calls_of[name] = self.calls_of.get(name, 0) + 1
        call = self.calls[cid]
        call.end_seq = self.seq
        self.last_seq[name] = self.seq
        self.seq += 1
        outs = _tensors(output)
        call.out_bytes = sum(_nbytes(t) for t in outs)
        self.out_bytes[name] = self.out_bytes.get(name, 0) + call.out_bytes
        self._claim(cid, outs)
        if not self.timing:
            for t in outs:
                key = _storage_key(t)
                rec = self.producer.get(key)
                # innermost producer wins; a later, non-nested call re-returning it takes over
                if (
                    rec is None
                    or self.tensors[rec].producer == EXTERNAL
                    or self.calls[self.tensors[rec].producer].seq < call.seq
                ):
                    self.producer[key] = len(self.tensors)
                    self.tensors.append(
                        TensorFlow(cid, [], _nbytes(t), list(t.shape), str(t.dtype))
                    )
                    self.keep.append(t)
        self.overhead += _now() - t0

    def _record_input(self, t: torch.Tensor) -> int:
        key = _storage_key(t)
        rec = self.producer.get(key)
        if rec is not None:
            return rec
        via = sorted(self._glue_sources(t.grad_fn)) if t.grad_fn is not None else []
        self.producer[key] = len(self.tensors)
        self.tensors.append(TensorFlow(EXTERNAL, via, _nbytes(t), list(t.shape), str(t.dtype)))
        self.keep.append(t)
        return self.producer[key]

    def _glue_sources(self, node: Any) -> frozenset[int]:
        """Calls whose outputs a tensor computed by un-hooked code was derived from."""
        if node is None:
            return frozenset()
        if node in self.claimed:
            return frozenset([self.claimed[node]])
        if node in self.glue_memo:
            return self.glue_memo[node]
        out: set[int] = set()
        stack, seen = [node], {node}
        while stack:
            n = stack.pop()
            for nxt, _ in n.next_functions:
                if nxt is None or nxt in seen:
                    continue
                seen.add(nxt)
                if nxt in self.claimed:
                    out.add(self.claimed[nxt])
                elif nxt in self.glue_memo:
                    out |= self.glue_memo[nxt]
                else:
                    stack.append(nxt)
        self.glue_memo[node] = frozenset(out)
        return self.glue_memo[node]

    def _claim(self, cid: int, outs: list[torch.Tensor]) -> None:
        """Attribute the autograd nodes this call created (reachable from its outputs without
        crossing its inputs or already-claimed nodes) to this call; hook them when timing."""
        stop = self.call_in_nodes[cid]
        stack = [t.grad_fn for t in outs if t.grad_fn is not None]
        name = self.calls[cid].module
        while stack:
            n = stack.pop()
            if n in self.claimed or n in stop:
                continue
            self.claimed[n] = cid
            if self.timing:
                n.register_prehook(self._node_pre)
                n.register_hook(self._make_node_post(name))
            for nxt, _ in n.next_functions:
                if nxt is not None and nxt not in self.claimed and nxt not in stop:
                    if type(nxt).__name__ != "AccumulateGrad":
                        stack.append(nxt)

    # --- backward node hooks
    def _node_pre(self, grad_outputs):
        _sync(self.device)
        self._bwd_t0 = _now()

    def _make_node_post(self, name: str) -> Callable:
        def post(grad_inputs, grad_outputs):
            _sync(self.device)
            self.bwd[name] = self.bwd.get(name, 0.0) + _now() - self._bwd_t0

        return post

    # --- saved activations
    def pack(self, t: torch.Tensor) -> torch.Tensor:
        key = _storage_key(t)
        if key not in self.saved_keys and key not in self.param_ptrs and self.stack:
            self.saved_keys.add(key)
            self.keep.append(t)
            self.saved[self.stack[-1]] = self.saved.get(self.stack[-1], 0) + _nbytes(t)
        return t


def _run(
    model: nn.Module, inputs: tuple | dict, loss_fn: Callable[[Any], torch.Tensor]
) -> tuple[float, float]:
    t0 = _now()
    out = model(**inputs) if isinstance(inputs, Mapping) else model(*inputs)
    loss = loss_fn(out)
    t1 = _now()
    loss.backward()
    t2 = _now()
    return t1 - t0, t2 - t1


def trace_model(
    model: nn.Module,
    example_inputs: tuple | list | dict,
    *,
    passes: int = 3,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    count_flops: bool = True,
) -> TraceResult:
    """Trace ``model`` on ``example_inputs`` (a tuple of positional args or a dict of keyword args,
    already on the model's device) with one untimed structure/dataflow pass plus ``passes`` timed
    forward+backward passes (median per module). On the meta device nothing is timed and FLOPs
    stand in for compute. Gradients accumulated by tracing are cleared afterwards."""
    if not isinstance(example_inputs, Mapping):
        example_inputs = (
            tuple(example_inputs) if isinstance(example_inputs, list | tuple) else (example_inputs,)
        )
    loss_fn = loss_fn or default_loss
    tr = _Tracer(model)
    p0 = next(iter(model.parameters()), None)
    device = p0.device if p0 is not None else torch.device("cpu")
    tr.device = device
    timed = device.type != "meta"
    global _clock
    _clock = (
        time.thread_time
        if device.type == "cpu" and torch.get_num_threads() == 1
        else time.perf_counter
    )
    handles = []
    for m in model.modules():
        handles.append(m.register_forward_pre_hook(tr.pre, with_kwargs=True))
        handles.append(m.register_forward_hook(tr.post, with_kwargs=True))
    grads_before = {id(p): p.grad for p in model.parameters()}
    try:
        with torch.enable_grad():
            # pass 0: structure, dataflow, saved activations, parameter uses (not timed)
            with _ParamUse(tr), torch.autograd.graph.saved_tensors_hooks(tr.pack, lambda t: t):
                _run(model, example_inputs, loss_fn)
            struct = tr
            for h in handles:  # the FLOP and timed passes must not add to the structure pass
                h.remove()
            handles.clear()
            flops: dict[str, float] = {}
            if count_flops:
                flops = _count_flops(model, example_inputs, loss_fn)
            fwd_runs: list[dict[str, float]] = []
            bwd_runs: list[dict[str, float]] = []
            totals: list[tuple[float, float]] = []
            for _ in range(passes if timed else 0):
                t = _Tracer.__new__(_Tracer)
                t.__dict__.update(
                    {
                        k: struct.__dict__[k]
                        for k in ("model", "names", "canon_mod", "param_name", "param_ptrs")
                    }
                )
                t.reset()
                t.timing = True
                t.device = device
                _swap_hooks(handles, model, t)
                totals.append(_run(model, example_inputs, loss_fn))
                fwd_runs.append(t.fwd)
                bwd_runs.append(t.bwd)
                del t
    finally:
        _clock = time.perf_counter
        for h in handles:
            h.remove()
        for p in model.parameters():
            p.grad = grads_before.get(id(p))
    return _build_result(model, struct, fwd_runs, bwd_runs, totals, flops, device, timed, passes)


def _swap_hooks(handles: list, model: nn.Module, tr: _Tracer) -> None:
    for h in handles:
        h.remove()
    handles.clear()
    for m in model.modules():
        handles.append(m.register_forward_pre_hook(tr.pre, with_kwargs=True))
        handles.append(m.register_forward_hook(tr.post, with_kwargs=True))


# backward / forward FLOPs of a layer: a gradient for its input and one for its weight
BACKWARD_FLOPS = 2.0


def _count_flops(model: nn.Module, inputs: tuple | dict, loss_fn: Callable) -> dict[str, float]:
    """Inclusive forward+backward FLOPs per module name (torch's FlopCounterMode keys modules as
    ``RootClass.fqn``; we strip the root prefix). Empty if counting fails (exotic ops).

    Only the forward is counted, and backward is taken as ``BACKWARD_FLOPS`` x forward: the
    counter charges backward FLOPs to every module its tracker still holds open, so a decoder's
    later layers' backward lands on earlier attention modules (layer 3's attention showed 7x its
    layer's share on a Llama), while forward attribution is exact."""
    from torch.utils.flop_counter import FlopCounterMode

    try:
        with FlopCounterMode(display=False) as fc:  # grad enabled: its module tracker needs it
            out = model(**inputs) if isinstance(inputs, Mapping) else model(*inputs)
            loss_fn(out)
    except Exception:  # noqa: BLE001 - FLOPs are an optional extra, never fatal
        return {}
    root = type(model).__name__
    out = {}
    for k, v in fc.get_flop_counts().items():
        if k == "Global":
            continue
        name = "" if k == root else k[len(root) + 1 :] if k.startswith(root + ".") else None
        if name is not None:
            out[name] = (1.0 + BACKWARD_FLOPS) * float(sum(v.values()))
    return out


def _median(runs: list[dict[str, float]], name: str) -> float:
    return statistics.median(r.get(name, 0.0) for r in runs) if runs else 0.0


def _build_result(
    model, tr: _Tracer, fwd_runs, bwd_runs, totals, flops, device, timed, passes
) -> TraceResult:
    modules: dict[str, ModuleNode] = {}
    for name, mod in model.named_modules():
        parent = None if name == "" else (name.rsplit(".", 1)[0] if "." in name else "")
        node = ModuleNode(name=name, type=type(mod).__name__, parent=parent)
        node.calls = tr.calls_of.get(name, 0)
        node.first_seq = tr.first_seq.get(name, -1)
        node.last_seq = tr.last_seq.get(name, -1)
        node.out_bytes = tr.out_bytes.get(name, 0)
        node.saved_bytes = tr.saved.get(name, 0)
        node.fwd_time = _median(fwd_runs, name)
        node.bwd_time = _median(bwd_runs, name)
        node.flops = flops.get(name, 0.0)
        node.buffer_bytes = sum(_nbytes(b) for b in mod.buffers(recurse=False))
        modules[name] = node
    for name, node in modules.items():
        if node.parent is not None and node.parent in modules:
            modules[node.parent].children.append(name)
    # parameters: canonical name = first name in named_parameters(); owner = its module
    alias: dict[str, str] = {}
    owner: dict[str, str] = {}
    registrants: dict[str, set[str]] = {}
    canon_by_id = tr.param_name
    for mname, mod in model.named_modules(remove_duplicate=False):
        cm = tr.canon_mod[id(mod)]
        for pname, p in mod._parameters.items():
            if p is None:
                continue
            full = f"{mname}.{pname}" if mname else pname
            canon = canon_by_id[id(p)]
            alias[full] = canon
            registrants.setdefault(canon, set()).add(cm)
            if canon == full:
                owner[canon] = cm
    for canon, m in owner.items():
        p = model.get_parameter(canon)
        modules[m].param_bytes += _nbytes(p)
        modules[m].param_numel += p.numel()
        modules[m].params.append(canon)
    # backward nodes are claimed by the innermost module; sum up the tree to make it inclusive
    for name in reversed(list(modules)):
        node = modules[name]
        if node.parent is not None:
            modules[node.parent].bwd_time += node.bwd_time
    shared = _shared_groups(model, alias, owner, registrants, tr.param_users)
    return TraceResult(
        root_type=type(model).__name__,
        device=str(device),
        passes=passes if timed else 0,
        timed=timed,
        modules=modules,
        calls=tr.calls,
        tensors=tr.tensors,
        shared=shared,
        param_alias=alias,
        param_owner=owner,
        param_first_use=dict(tr.first_use),
        param_sizes={n: [_nbytes(p), p.numel()] for n, p in model.named_parameters()},
        total_fwd_time=statistics.median(t[0] for t in totals) if totals else 0.0,
        total_bwd_time=statistics.median(t[1] for t in totals) if totals else 0.0,
    )


def _shared_groups(model, alias, owner, registrants, users) -> list[SharedGroup]:
    """Connected components of the module<->parameter graph (SageMaker's rule) restricted to
    components with more than one module: registering a parameter and using
    it in a forward (outside the registrant's subtree) both count."""
    links: dict[str, set[str]] = {}
    for canon, regs in registrants.items():
        mods = set(regs)
        o = owner[canon]
        for u in users.get(canon, ()):
            # the owner's subtree and its ancestors (nn.MultiheadAttention reading out_proj.weight)
            # hold or contain the parameter already: not sharing
            if not (u == o or u.startswith(o + ".") or o == "" or u == "" or o.startswith(u + ".")):
                mods.add(u)
        if len(mods) > 1:
            links[canon] = mods
    # union-find over parameters that share a module
    groups: list[tuple[set[str], set[str]]] = []
    for canon, mods in links.items():
        merged = ({canon}, set(mods))
        rest = []
        for g in groups:
            if g[1] & merged[1]:
                merged[0].update(g[0])
                merged[1].update(g[1])
            else:
                rest.append(g)
        groups = rest + [merged]
    out = []
    for params, mods in groups:
        names = sorted(params)
        all_names = names + sorted(a for a, c in alias.items() if c in params and a not in params)
        nbytes = sum(_nbytes(model.get_parameter(p)) for p in names)
        out.append(SharedGroup(all_names, sorted(mods), nbytes))
    return out
