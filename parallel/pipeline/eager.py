"""The eager pipeline path: every rank replays the model's Python, running only its own modules.

Why replay: a partition cuts the module tree between *units* (parameter-holding modules in
execution order), but the code between them - a container's own ``forward`` (GPT-2's mask and
cache set-up, the reader's token packing, a ``for block in self.h`` loop) - is ordinary Python
that no tracer has to understand. So every stage runs the root ``forward`` itself, and each
top-level call of a unit module is intercepted (SageMaker's library does the same with its
"module server"):

- a call of a module placed on this stage runs for real;
- a call of a module placed on an earlier stage returns that call's output *as received*: the
  previous stage sends, per microbatch, the structure of every earlier call's output (tuples,
  dicts, ``ModelOutput``...) and the tensors this or a later stage actually needs; the others
  are rebuilt as NaN placeholders of the right shape, so container code that only looks at
  shapes, dtypes or devices (mask creation) still works, and a wrong "not needed" decision shows
  up as a NaN instead of a silently wrong number;
- a non-last stage stops (``_StageDone``) at the first top-level call after its last own one;
  calls of later stages that precede that point in program order (a tied embedding called again by a
  decoder) get placeholders shaped like the traced example;
- container code therefore runs on every stage up to that stage's last call: it is duplicated
  work, small next to the blocks for the models we know (charged to every stage, not balanced).

Which tensors a stage needs is found once at set-up, per stage and without communication: the
stage is replayed on the example with every foreign call output turned into a fresh leaf that
requires grad; the leaves that receive a gradient from the stage's own outputs (or the model
output, on the last stage) are needed. Integer tensors are always sent (no gradient to follow).
A leaf of a *later* stage that receives a gradient means the partition is not a pipeline
(a stage would wait for a later one): that raises at set-up.

Tensors cross one cut at a time (stage s sends to s + 1 what s + 1 and everything after it
needs, relaying older tensors), so only neighbours talk, as in every pipeline schedule; the
gradient of a relayed tensor flows back through the same stages and is summed on the way.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from .p2p import Transport
from .split_backward import WeightWork
from .split_backward import backward_input as split_input
from .split_backward import backward_weight as split_weight
from .tree import TensorSpec, flatten, placeholder, tensor_specs, unflatten

log = logging.getLogger(__name__)

_CACHE_ENTRIES = 256  # per-structure caches of a stage (specs, placeholders): cleared when full


class _StageDone(BaseException):
    """Raised after a non-last stage's last own call (a BaseException: model code that catches
    ``Exception`` must not swallow it)."""


class PipelinePlanError(RuntimeError):
    """The model or the partition cannot run as an eager pipeline."""


# ----------------------------------------------------------------------------- interception


class _Ctx:
    """State of one replay of the model's forward on one stage."""

    def __init__(
        self,
        stage: int,
        names: list[str] | None,
        call_stage: list[int] | None,
        stub: Callable[[int], Any] | None,
        last_call: int | None,
    ):
        self.stage = stage  # -1: record mode (every call real)
        self.names = names
        self.call_stage = call_stage
        self.stub = stub
        # raise _StageDone at the first call after this index (None: run to the end)
        self.last_call = last_call
        self.idx = 0
        self.depth = 0
        # per real call: its output flattened (spec, tensors) when the call returns, before the
        # caller's code can change it: Qwen2-VL replaces ``pooler_output`` of its vision tower's
        # ModelOutput with a tuple of per-image splits, and a later stage, handed the changed
        # structure, split the tuple again ("'tuple' object has no attribute 'split'")
        self.outputs: dict[int, tuple[Any, list[torch.Tensor]]] = {}
        self.seen: list[str] = []

    def call(self, name: str, orig: Callable, args: tuple, kwargs: dict) -> Any:
        idx = self.idx
        if self.last_call is not None and idx > self.last_call:
            # the stage's work is done: stop at the next top-level call, not inside the last one,
            # so the module hooks around that call (FSDP's post-forward) still run
            raise _StageDone
        self.idx += 1
        if self.names is not None:
            if idx >= len(self.names) or self.names[idx] != name:
                want = self.names[idx] if idx < len(self.names) else "<end of the traced sequence>"
                raise PipelinePlanError(
                    f"module call #{idx} is {name!r} but the traced example called {want!r}: the "
                    "eager pipeline needs the same sequence of top-level module calls in every "
                    "microbatch (pass example inputs with the same structure as the training "
                    "batches)"
                )
        else:
            self.seen.append(name)
        real = self.stage < 0 or self.call_stage[idx] == self.stage
        if not real:
            return self.stub(idx)
        self.depth += 1
        try:
            out = orig(*args, **kwargs)
        finally:
            self.depth -= 1
        self.outputs[idx] = flatten(out)
        return out


class Replayer:
    """Wraps ``forward`` of every unit-head module (instance attribute) so an active context can
    intercept top-level calls; with no context the model runs exactly as before."""

    def __init__(self, model: nn.Module, heads: set[str]):
        self.model = model
        self.ctx: _Ctx | None = None
        self.heads = heads
        self.wrapped: dict[str, nn.Module] = {}
        self.rewrap()

    def unwrap(self) -> None:
        """The modules' own forwards back (before sharding replaces or wraps them)."""
        for mod in self.wrapped.values():
            mod.__dict__.pop("forward", None)
        self.wrapped = {}

    def rewrap(self) -> None:
        """Intercept whatever forward each unit-head module has now."""
        for name, mod in self.model.named_modules():  # canonical name per module object
            if name in self.heads and name != "" and name not in self.wrapped:
                self._wrap(mod, name)

    def _wrap(self, mod: nn.Module, name: str) -> None:
        orig = mod.forward
        self.wrapped[name] = mod

        def forward(*args, **kwargs):
            ctx = self.ctx
            if ctx is None or ctx.depth:
                return orig(*args, **kwargs)
            return ctx.call(name, orig, args, kwargs)

        mod.forward = forward

    def run(self, ctx: _Ctx, args: tuple, kwargs: dict) -> tuple[Any, bool]:
        """(model output or None, finished) for one replay."""
        self.ctx = ctx
        try:
            return self.model(*args, **kwargs), True
        except _StageDone:
            return None, False
        finally:
            self.ctx = None


# ----------------------------------------------------------------------------- the plan


@dataclass
class Plan:
    """What every stage runs and sends, derived once from the example (identical on all ranks)."""

    num_stages: int
    names: list[str]  # module name of each top-level unit call, in program order
    call_stage: list[int]  # stage of each call
    last_call: list[int]  # per stage: index of its last call (-1: none)
    templates: list[Any]  # per call: output spec on the example (placeholders for later stages)
    template_batch: int | None  # dim 0 of the example microbatch
    need: list[set[tuple[int, int]]]  # per stage: (call, leaf) of earlier stages it needs
    send: list[list[tuple[int, int]]] = field(default_factory=list)  # per stage: bundle to s + 1

    def __post_init__(self) -> None:
        k = self.num_stages
        self.send = []
        for s in range(k):
            want = set()
            for t in range(s + 1, k):
                want |= {(i, j) for (i, j) in self.need[t] if self.call_stage[i] <= s}
            self.send.append(sorted(want))

    def describe(self) -> str:
        lines = []
        for s in range(self.num_stages):
            calls = [self.names[i] for i in range(len(self.names)) if self.call_stage[i] == s]
            lines.append(
                f"stage {s}: {len(calls)} calls; sends {len(self.send[s])} tensors to stage {s + 1}"
                if s + 1 < self.num_stages
                else f"stage {s}: {len(calls)} calls (last)"
            )
        return "\n".join(lines)


def _batch_of(args: tuple, kwargs: Mapping) -> int | None:
    for v in list(args) + list(kwargs.values()):
        if isinstance(v, torch.Tensor) and v.dim() > 0:
            return int(v.shape[0])
    return None


def build_plan(
    replayer: Replayer, head_stage: dict[str, int], num_stages: int, args: tuple, kwargs: dict
) -> Plan:
    """Record the call sequence on the example and find each stage's needs (see module doc)."""
    with torch.enable_grad():
        ref = _Ctx(-1, None, None, None, None)
        replayer.run(ref, args, kwargs)
    names = ref.seen
    missing = sorted({n for n in names if n not in head_stage})
    if missing:
        raise PipelinePlanError(f"modules {missing} are not placed on any stage")
    call_stage = [head_stage[n] for n in names]
    # a module without parameters or buffers (T5's dropout, called after the embedding and again
    # after the final norm) holds no state: a repeated call runs where the program is at that
    # point (the stage of the call before it), not back on the stage of its first call
    seen: set[str] = set()
    for i, n in enumerate(names):
        if n in seen and i > 0 and _stateless(replayer.model.get_submodule(n)):
            call_stage[i] = call_stage[i - 1]
        seen.add(n)
    last_call = [
        max((i for i, s in enumerate(call_stage) if s == st), default=-1)
        for st in range(num_stages)
    ]
    specs, leaves = [], []
    for i in range(len(names)):
        sp, lv = ref.outputs[i]
        specs.append(sp)
        leaves.append([t.detach() for t in lv])
    del ref
    need: list[set[tuple[int, int]]] = []
    for st in range(num_stages):
        need.append(
            _probe(
                replayer, st, num_stages, names, call_stage, last_call, specs, leaves, args, kwargs
            )
        )
    return Plan(num_stages, names, call_stage, last_call, specs, _batch_of(args, kwargs), need)


def _stateless(mod: nn.Module) -> bool:
    return next(mod.parameters(), None) is None and next(mod.buffers(), None) is None


def _probe(
    replayer, st, k, names, call_stage, last_call, specs, leaves, args, kwargs
) -> set[tuple[int, int]]:
    is_last = st == k - 1
    if last_call[st] < 0 and not is_last:
        return set()
    made: dict[tuple[int, int], torch.Tensor] = {}

    def stub(i: int) -> Any:
        out = []
        for j, t in enumerate(leaves[i]):
            x = t.detach()
            if x.is_floating_point():
                x = x.clone().requires_grad_(True)
            made[(i, j)] = x
            out.append(x)
        return unflatten(specs[i], out)

    ctx = _Ctx(st, names, call_stage, stub, None if is_last else last_call[st])
    with torch.enable_grad():
        out, _ = replayer.run(ctx, args, kwargs)
        roots = [t for _, lv in ctx.outputs.values() for t in lv]
        if is_last:
            roots += flatten(out)[1]
        roots = [t for t in roots if t.is_floating_point() and t.requires_grad]
        keys = [key for key, x in made.items() if x.requires_grad]
        grads = []
        if roots and keys:
            obj = sum(t.float().sum() for t in roots)
            grads = torch.autograd.grad(obj, [made[key] for key in keys], allow_unused=True)
    got = {key for key, g in zip(keys, grads) if g is not None}
    later = sorted({names[i] for (i, _) in got if call_stage[i] > st})
    if later:
        raise PipelinePlanError(
            f"stage {st} depends on the outputs of {later}, placed on later stages: this "
            "placement is not a pipeline; use another partition (e.g. shared='colocate' or manual "
            "split points)"
        )
    need = {key for key in got if call_stage[key[0]] < st}
    need |= {
        key for key, x in made.items() if not x.is_floating_point() and call_stage[key[0]] < st
    }
    return need


# ----------------------------------------------------------------------------- a stage


@dataclass
class _MbState:
    recv: list[torch.Tensor]  # received leaves in bundle order
    sent: list[torch.Tensor]  # sent tensors that require grad (roots of the backward)
    loss: torch.Tensor | None = None  # scaled loss (last stage)
    grads: list[torch.Tensor] | None = None  # gradients of ``sent`` (kept between I and W)
    weight_work: WeightWork | None = None  # what W does after I (split_backward.py)


class EagerStage:
    """One pipeline stage of the eager path: forward / backward (full, or input then weight) of
    one microbatch, with its receives and sends."""

    def __init__(
        self,
        index: int,
        plan: Plan,
        replayer: Replayer,
        transport: Transport,
        params: list[torch.Tensor],
        device: torch.device,
    ):
        self.index = index
        self.plan = plan
        self.replayer = replayer
        self.transport = transport
        self.params = [p for p in params if p.requires_grad]
        self.device = device
        self.is_first = index == 0
        self.is_last = index == plan.num_stages - 1
        self.state: dict[int, _MbState] = {}
        self._spec_cache: dict[int, tuple[dict, dict[int, list[TensorSpec]]]] = {}
        self._ph_cache: dict[tuple, torch.Tensor] = {}

    # --- forward
    def forward(self, mb: int, args: tuple, kwargs: dict, grad: bool = True) -> Any:
        plan, s = self.plan, self.index
        meta: dict[int, Any] = {}
        recv_leaves: dict[tuple[int, int], torch.Tensor] = {}
        recv_list: list[torch.Tensor] = []
        if s > 0:
            order = plan.send[s - 1]
            meta, tensors = self.transport.recv_fwd(
                s - 1, s, mb, lambda m: self._recv_specs(m, order)
            )
            for key, t, sp in zip(order, tensors, self._recv_specs(meta, order)):
                # a fresh receive buffer (or a same-rank hand-over, detached by the sender)
                leaf = t
                if grad and sp.requires_grad and leaf.is_floating_point():
                    leaf.requires_grad_(True)
                recv_leaves[key] = leaf
                recv_list.append(leaf)
        batch = _batch_of(args, kwargs)

        def stub(i: int) -> Any:
            if plan.call_stage[i] < s:
                sp = meta[i]
                lv = [
                    recv_leaves[(i, j)] if (i, j) in recv_leaves else self._placeholder(ts)
                    for j, ts in enumerate(self._call_specs(meta, i))
                ]
            else:  # a later stage's call before our last one: shaped like the example
                sp = plan.templates[i]
                lv = [self._placeholder(ts, batch) for ts in tensor_specs(sp)]
            return unflatten(sp, lv)

        ctx = _Ctx(
            s, plan.names, plan.call_stage, stub, None if self.is_last else plan.last_call[s]
        )
        out = None
        if self.is_last or plan.last_call[s] >= 0:
            with torch.set_grad_enabled(grad):
                out, _ = self.replayer.run(ctx, args, kwargs)
        sent: list[torch.Tensor] = []
        if not self.is_last:
            own = ctx.outputs
            meta_out = dict(meta)
            meta_out.update({i: sp for i, (sp, _) in own.items()})
            tensors_out = [
                own[i][1][j] if plan.call_stage[i] == s else recv_leaves[(i, j)]
                for (i, j) in plan.send[s]
            ]
            self.transport.send_fwd(s, s + 1, mb, meta_out, tensors_out)
            sent = [t for t in tensors_out if t.requires_grad]
        if grad:
            self.state[mb] = _MbState(recv_list, sent)
        return out

    # Per-microbatch costs are paid m times per step on every stage, so what only depends on the
    # received structure is computed once per structure. A received ``meta`` is the object the
    # transport keeps per metadata id, so its identity names the structure.
    def _call_specs(self, meta: dict, i: int) -> list[TensorSpec]:
        got = self._spec_cache.get(id(meta))
        if got is None or got[0] is not meta:
            if len(self._spec_cache) >= _CACHE_ENTRIES:
                self._spec_cache.clear()
            got = self._spec_cache[id(meta)] = (meta, {})
        per = got[1]
        if i not in per:
            per[i] = tensor_specs(meta[i])
        return per[i]

    def _recv_specs(self, meta: dict, order: list[tuple[int, int]]) -> list[TensorSpec]:
        return [self._call_specs(meta, i)[j] for (i, j) in order]

    def _placeholder(self, ts: TensorSpec, batch: int | None = None) -> torch.Tensor:
        """One NaN (or zero) tensor per shape, reused by every microbatch: placeholders are
        never read (the plan sends whatever a stage needs), only looked at."""
        shape = ts.shape
        if (
            batch is not None
            and self.plan.template_batch is not None
            and shape
            and shape[0] == self.plan.template_batch
        ):
            shape = (batch, *shape[1:])
        key = (shape, ts.dtype)
        t = self._ph_cache.get(key)
        if t is None:
            if len(self._ph_cache) >= _CACHE_ENTRIES:  # variable shapes (the reader): stay bounded
                self._ph_cache.clear()
            t = self._ph_cache[key] = placeholder(TensorSpec(shape, ts.dtype, False), self.device)
        return t

    def set_loss(self, mb: int, scaled_loss: torch.Tensor) -> None:
        self.state[mb].loss = scaled_loss

    # --- backward
    def _roots(self, mb: int) -> tuple[list[torch.Tensor], list[torch.Tensor | None]]:
        st = self.state[mb]
        if st.grads is None:
            specs = [TensorSpec(tuple(t.shape), t.dtype, True) for t in st.sent]
            st.grads = (
                self.transport.recv_bwd(self.index + 1, self.index, mb, specs)
                if not self.is_last
                else []
            )
        roots: list[torch.Tensor] = list(st.sent)
        grads: list[torch.Tensor | None] = list(st.grads)
        if st.loss is not None:
            roots.append(st.loss)
            grads.append(None)
        return roots, grads

    def _send_input_grads(self, mb: int, grads: list[torch.Tensor | None] | None = None) -> None:
        st = self.state[mb]
        if self.is_first:
            return
        leaves = [x for x in st.recv if x.requires_grad]
        if grads is None:
            grads = [x.grad for x in leaves]
        out = [g if g is not None else torch.zeros_like(x) for x, g in zip(leaves, grads)]
        self.transport.send_bwd(self.index, self.index - 1, mb, out)

    def backward(self, mb: int) -> None:
        """Full backward of one microbatch (inputs and weights)."""
        roots, grads = self._roots(mb)
        if roots:
            torch.autograd.backward(roots, grads)
        self._send_input_grads(mb)
        del self.state[mb]

    def backward_input(self, mb: int) -> None:
        """Zero-bubble "I": gradients of the received tensors only, sent at once. The graph is
        kept, with the gradients where the weights meet the input path, for the weight step
        (split_backward.py: W then computes each dW once and no dX again)."""
        roots, grads = self._roots(mb)
        st = self.state[mb]
        leaves = [x for x in st.recv if x.requires_grad]
        if roots and leaves:
            gin, st.weight_work = split_input(roots, grads, leaves, self.params)
            self._send_input_grads(mb, gin)
        else:  # nothing to send (the first stage): W runs the whole backward
            self._send_input_grads(mb, [None] * len(leaves))

    def backward_weight(self, mb: int) -> None:
        """Zero-bubble "W": parameter gradients, accumulated into ``.grad``."""
        st = self.state[mb]
        if st.weight_work is not None:
            split_weight(st.weight_work)
        else:
            roots, grads = self._roots(mb)
            params = [p for p in self.params if p.requires_grad]
            if roots and params:
                torch.autograd.backward(roots, grads, inputs=params)
        del self.state[mb]
