"""The graph path: stages cut out of an exported graph at the partition's cut points.

Where the model can be captured by ``torch.export`` (tensor inputs and outputs, no data-dependent
Python control flow), ``torch.distributed.pipelining.pipeline`` exports it and splits the graph
before the first module of every stage (``SplitPoint.BEGINNING``). Each stage is then a
``GraphModule`` with explicit inputs and outputs: no stage replays any other stage's code (the
eager path's duplicated container work disappears) and the tensors crossing a cut are exactly
the graph edges that cross it.

The root graph of the split says which stage produces every value and which stages consume it;
a value produced by stage j and used by stage t > j + 1 is relayed through the stages between,
as on the eager path, so only neighbours talk and the same ``Transport``, schedules and backward
(``EagerStage``'s) serve both paths. The graph is specialised to the example's shapes: training
microbatches must have the example microbatch's shapes.

``build_graph_plan`` raises ``GraphPathError`` with the reason when the model cannot take this
path (export rejects it, a stage would start inside a container's own code, parameters shared by
two stages); ``parallelize`` then falls back to the eager path and logs why.
"""

from __future__ import annotations

import inspect
import operator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import nn

from .eager import EagerStage, _MbState
from .p2p import Transport
from .tree import TensorSpec


class GraphPathError(RuntimeError):
    """The model or partition cannot be split as a graph (the eager path still can)."""


Key = tuple  # ("in", placeholder name) | ("v", stage, output index)


@dataclass
class GraphPlan:
    num_stages: int
    modules: list[nn.Module]  # the stage GraphModules (parameters are the model's own objects)
    inputs: list[list[Key]]  # per stage: its submodule's arguments, in order
    n_out: list[int]  # per stage: outputs of its submodule (1: a single value, not a tuple)
    tuple_out: list[bool]  # per stage: the submodule returns a tuple
    output: Any  # the graph's flat outputs as a tree of keys (a key, or a tuple of keys)
    # pytree spec of what the model returns: rebuilds a ModelOutput / dict from the flat outputs
    out_spec: Any
    placeholders: list[str]  # model input names of the root graph, in order
    arg_of: dict[str, str]  # placeholder -> forward() parameter it takes
    send: list[list[Key]] = field(default_factory=list)  # per stage: the bundle to stage s + 1

    def __post_init__(self) -> None:
        k = self.num_stages
        last_use: dict[Key, int] = {}
        for s in range(k):
            for key in self.inputs[s]:
                if key[0] == "v":
                    last_use[key] = max(last_use.get(key, -1), s)
        for key in _keys(self.output):
            if key[0] == "v":
                last_use[key] = k - 1
        self.send = [
            sorted(key for key, t in last_use.items() if key[1] <= s < t) for s in range(k)
        ]

    def describe(self) -> str:
        return "\n".join(
            f"graph stage {s}: {len(self.inputs[s])} inputs; sends {len(self.send[s])} tensors"
            for s in range(self.num_stages)
        )


def _keys(tree: Any) -> list[Key]:
    if isinstance(tree, tuple) and tree and isinstance(tree[0], str):
        return [tree]
    if isinstance(tree, list | tuple):
        return [k for t in tree for k in _keys(t)]
    return []


def split_spec(partition, num_stages: int) -> dict[str, Any]:
    """{module name: SplitPoint.BEGINNING} at the first unit of every stage after the first."""
    from torch.distributed.pipelining import SplitPoint

    spec: dict[str, Any] = {}
    for s in range(1, num_stages):
        first = next((u for u, st in zip(partition.units, partition.unit_stage) if st == s), None)
        if first is None:
            raise GraphPathError(f"stage {s} holds no unit")
        if first.kind != "module" or not first.module:
            raise GraphPathError(
                f"stage {s} starts with {first.name!r} ({first.kind}), not at a module call: "
                "a split point needs a module boundary"
            )
        spec[first.module] = SplitPoint.BEGINNING
    if any(s1 < s0 for s0, s1 in zip(partition.unit_stage, partition.unit_stage[1:])):
        raise GraphPathError("the partition is not contiguous in execution order")
    return spec


def build_graph_plan(
    model: nn.Module, partition, num_stages: int, args: tuple, kwargs: dict
) -> GraphPlan:
    """Export and split ``model`` on one microbatch; raises ``GraphPathError`` with the reason."""
    from torch.distributed.pipelining import pipeline

    spec = split_spec(partition, num_stages)
    if any(
        not isinstance(v, torch.Tensor) for v in list(args) + list(kwargs.values()) if v is not None
    ):
        raise GraphPathError("the graph path takes tensor inputs only")
    try:
        pipe = pipeline(model, mb_args=tuple(args), mb_kwargs=dict(kwargs) or None, split_spec=spec)
    except Exception as e:  # noqa: BLE001 - every export failure means: use the eager path
        msg = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise GraphPathError(
            f"torch.export / pipeline() rejected the model: {type(e).__name__}: {msg[:300]}"
        ) from e
    if pipe.num_stages != num_stages:
        raise GraphPathError(
            f"the split has {pipe.num_stages} stages, the partition {num_stages} "
            "(a split point inside code that export inlined or removed)"
        )
    root = pipe.split_gm.graph
    val: dict[Any, Key] = {}
    placeholders: list[str] = []
    inputs: list[list[Key]] = [[] for _ in range(num_stages)]
    tuple_out = [False] * num_stages
    n_out = [1] * num_stages
    stage_of_node: dict[Any, int] = {}
    output = None
    for node in root.nodes:
        if node.op == "placeholder":
            placeholders.append(node.target)
            val[node] = ("in", node.target)
        elif node.op == "call_module":
            s = int(str(node.target).rsplit("_", 1)[-1])
            stage_of_node[node] = s
            for a in node.args:
                if a not in val:
                    raise GraphPathError(
                        f"stage {s} takes an input the graph path cannot route: {a}"
                    )
                inputs[s].append(val[a])
            if node.kwargs:
                raise GraphPathError(f"stage {s} takes keyword inputs")
            val[node] = ("v", s, 0)
        elif node.op == "call_function" and node.target is operator.getitem:
            src, idx = node.args
            s = stage_of_node[src]
            tuple_out[s] = True
            n_out[s] = max(n_out[s], idx + 1)
            val[node] = ("v", s, idx)
        elif node.op == "output":
            out = node.args[0]
            output = tuple(val[a] for a in out) if isinstance(out, tuple | list) else val[out]
            if isinstance(out, tuple | list) and len(out) == 1:
                output = output[0]
        else:
            raise GraphPathError(
                f"unexpected node in the split root graph: {node.op} {node.target}"
            )
    arg_of = _match_placeholders(model, root, placeholders, args, kwargs)
    out_spec = _output_spec(model, args, kwargs, len(_keys(output)))
    mods = [pipe.get_stage_module(s) for s in range(num_stages)]
    owner: dict[int, int] = {}
    for s, m in enumerate(mods):
        for p in m.parameters():
            if owner.setdefault(id(p), s) != s:
                raise GraphPathError(
                    "a parameter is used by two stages (tied weights): the eager path "
                    "places and synchronises shared parameters"
                )
    names = dict(model.named_parameters())
    for s, m in enumerate(mods):
        for n, p in m.named_parameters():
            if names.get(n) is not p:
                raise GraphPathError(f"stage {s}'s parameter {n!r} is not the model's own object")
    return GraphPlan(
        num_stages, mods, inputs, n_out, tuple_out, output, out_spec, placeholders, arg_of
    )


def _output_spec(model: nn.Module, args: tuple, kwargs: dict, n_flat: int) -> Any:
    """The pytree spec of the model's output, so the last stage returns what the model returns (a
    Hugging Face ``ModelOutput``, a dict, nested tuples), not the flat tensors ``torch.export``
    leaves at the end of the split graph (``pipeline()`` drops the exported program's output spec).
    Export flattens outputs with the same pytree, so the leaves come in the same order. One forward
    on the example, without grad; buffers (batch-norm statistics) are put back afterwards."""
    saved = [(b, b.detach().clone()) for b in model.buffers()]
    try:
        with torch.no_grad():
            out = model(*args, **kwargs)
    finally:
        with torch.no_grad():
            for b, v in saved:
                b.copy_(v)
    leaves, spec = pytree.tree_flatten(out)
    if len(leaves) != n_flat or not all(isinstance(t, torch.Tensor) for t in leaves):
        kinds = sorted({type(t).__name__ for t in leaves})
        raise GraphPathError(
            f"the model returns {len(leaves)} leaves ({', '.join(kinds)}) but the split graph "
            f"{n_flat} tensors: its output structure cannot be rebuilt"
        )
    return spec


def bind_inputs(signature: inspect.Signature, args: tuple, kwargs: dict) -> dict[str, Any]:
    """The model's inputs by ``forward`` parameter name (``signature``: of ``model.forward``)."""
    return dict(signature.bind(*args, **kwargs).arguments)


def _match_placeholders(model, root, placeholders, args, kwargs) -> dict[str, str]:
    """Placeholder -> ``forward`` parameter. Export names placeholders after the parameters but
    renames some (``nn.Sequential``'s ``input`` becomes ``input_1``): match by name, else by
    position among the tensor arguments, and check every match against the traced shape."""
    named = bind_inputs(inspect.signature(model.forward), args, kwargs)
    tensors = [n for n, v in named.items() if isinstance(v, torch.Tensor)]
    vals = {n.target: n.meta.get("val") for n in root.nodes if n.op == "placeholder"}
    out = {}
    for i, p in enumerate(placeholders):
        name = p if p in named else (tensors[i] if len(placeholders) == len(tensors) else None)
        v, want = named.get(name), vals.get(p)
        if not isinstance(v, torch.Tensor) or (
            want is not None and tuple(v.shape) != tuple(want.shape)
        ):
            raise GraphPathError(
                f"cannot match the exported input {p!r} to an argument of forward()"
            )
        out[p] = name
    return out


class GraphStage(EagerStage):
    """One stage of the graph path: runs its GraphModule on the received and the model inputs;
    sends, receives and backward are ``EagerStage``'s."""

    def __init__(
        self,
        index: int,
        gplan: GraphPlan,
        model: nn.Module,
        transport: Transport,
        params: list[torch.Tensor],
        device: torch.device,
    ):
        super().__init__(index, gplan, None, transport, params, device)
        self.gplan = gplan
        self.model = model
        self.module = gplan.modules[index]
        self.signature = inspect.signature(model.forward)  # once: binding is per microbatch

    def forward(self, mb: int, args: tuple, kwargs: dict, grad: bool = True) -> Any:
        g, s = self.gplan, self.index
        env: dict[Key, torch.Tensor] = {}
        recv_list: list[torch.Tensor] = []
        if s > 0:
            order = g.send[s - 1]
            _, tensors = self.transport.recv_fwd(s - 1, s, mb, lambda meta: meta)
            for key, t in zip(order, tensors):
                leaf = t.detach()
                if grad and leaf.is_floating_point():
                    leaf.requires_grad_(True)
                env[key] = leaf
                recv_list.append(leaf)
        named = bind_inputs(self.signature, args, kwargs)
        for name in g.placeholders:
            env[("in", name)] = named.get(g.arg_of[name])
        with torch.set_grad_enabled(grad):
            out = self.module(*[env[k] for k in g.inputs[s]])
        outs = list(out) if g.tuple_out[s] else [out]
        for i, t in enumerate(outs):
            env[("v", s, i)] = t
        sent: list[torch.Tensor] = []
        if not self.is_last:
            tensors_out = [env[k] for k in g.send[s]]
            meta = [TensorSpec(tuple(t.shape), t.dtype, t.requires_grad) for t in tensors_out]
            self.transport.send_fwd(s, s + 1, mb, meta, tensors_out)
            sent = [t for t in tensors_out if t.requires_grad]
            result = None
        else:
            result = pytree.tree_unflatten([env[k] for k in _keys(g.output)], g.out_spec)
        if grad:
            self.state[mb] = _MbState(recv_list, sent)
        return result
