"""The zero-bubble backward split: gradients of a stage's inputs now ("I"), of its weights later
("W").

The two halves must not repeat each other's work. Running ``autograd.grad(roots, inputs)`` and
later ``autograd.backward(roots, inputs=params)`` would walk the input chain twice (every layer's
dX again, to reach the earlier layers' weights), so W would cost almost a full backward. Instead,
as torch's pipelining does (``torch.distributed.pipelining._backward``, whose functions assume a
graph without parameters off the input path and detach the stage outputs, which our eager stages
cannot promise), the autograd graph is cut where weights meet the input path:

- an *intermediate* is a node on a path from the stage inputs to the roots that a parameter's
  gradient also flows through (``AddmmBackward0`` of a ``Linear``: the input path enters it and the
  weight's ``AccumulateGrad`` hangs below it);
- I runs ``autograd.grad(roots, inputs)`` and keeps the gradient flowing into every intermediate
  (the engine captures it for a GEMM node, asked for as a ``GradientEdge`` input; a Python pre-hook
  for other nodes); the engine computes only the outputs that lead to the inputs (each
  ``Linear``'s dX, not its dW);
- W starts the engine at those intermediates with the kept gradients (``GradientEdge``) and asks
  for the parameters only: each dW once, no dX. A linear layer's W skips the engine: its weight
  gradient is one GEMM from the kept gradient and the node's saved input, accumulated in place
  (``_linear_weight_grads``).

Parameters whose gradient never meets the input path, or also reaches a root around it (an
embedding of the raw microbatch on a later stage; everything on the first stage, whose inputs need
no gradient), W gets with one ordinary backward from the roots to those parameters. The graph is
kept between I and W (``retain_graph``) and freed when the caller drops the roots.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import torch
from torch.autograd.graph import GradientEdge, Node


def _node(t: torch.Tensor) -> Node | None:
    """grad_fn, or the AccumulateGrad node of a leaf (created lazily: reached through a view)."""
    if t.grad_fn is not None:
        return t.grad_fn
    if not t.requires_grad:
        return None
    return t.view_as(t).grad_fn.next_functions[0][0]


def _reverse_edges(roots: list[Node]) -> dict[Node, list[Node]]:
    """node -> the nodes that feed gradient into it (its consumers in the forward)."""
    rev: dict[Node, list[Node]] = {}
    seen = set(roots)
    q = deque(roots)
    while q:
        n = q.popleft()
        for nxt, _ in n.next_functions:
            if nxt is None:
                continue
            rev.setdefault(nxt, []).append(n)
            if nxt not in seen:
                seen.add(nxt)
                q.append(nxt)
    return rev


def _closure(
    starts: list[Node], rev: dict[Node, list[Node]], stop: set[Node] | frozenset = frozenset()
) -> tuple[set[Node], set[Node]]:
    """(nodes reachable from ``starts`` along reverse edges, stopping at ``stop``; stop nodes
    hit)."""
    out, hit = set(starts), set()
    q = deque(starts)
    while q:
        for up in rev.get(q.popleft(), ()):
            if up in out:
                continue
            if up in stop:
                hit.add(up)
                continue
            out.add(up)
            q.append(up)
    return out, hit


@dataclass
class WeightWork:
    """What W needs: the kept gradients at the intermediates, and the parameters they lead to."""

    groups: list[tuple[list[Node], list[torch.nn.Parameter]]]  # (intermediates, params)
    kept: dict[Node, tuple] = field(default_factory=dict)  # intermediate -> gradients into it
    orphans: list[torch.nn.Parameter] = field(default_factory=list)  # params off the input path
    roots: list[torch.Tensor] = field(default_factory=list)  # for the orphans only
    grads: list[torch.Tensor | None] = field(default_factory=list)


_ONE_OUTPUT = ("AddmmBackward0", "MmBackward0")  # GEMM nodes: one forward output


def backward_input(
    roots: list[torch.Tensor],
    grads: list[torch.Tensor | None],
    inputs: list[torch.Tensor],
    params: list[torch.nn.Parameter],
) -> tuple[list[torch.Tensor | None], WeightWork]:
    """Gradients of ``inputs`` (None where unused) and the work left for ``backward_weight``."""
    root_nodes = [n for n in map(_node, roots) if n is not None]
    root_set = set(root_nodes)
    rev = _reverse_edges(root_nodes)
    in_nodes = [n for n in map(_node, inputs) if n is not None and n in rev]
    on_path, _ = _closure(in_nodes, rev)
    # group parameters by the intermediates they reach; merge groups that share one
    owner: dict[Node, int] = {}
    groups: list[tuple[set[Node], list[torch.nn.Parameter]] | None] = []
    orphans = []
    for p in params:
        acc = _node(p)
        if acc not in rev:  # not used by this microbatch's graph
            continue
        reach, hit = _closure([acc], rev, on_path)
        if not hit or not reach.isdisjoint(root_set):  # (also) reaches a root off the input path
            orphans.append(p)
            continue
        mine = sorted({owner[n] for n in hit if n in owner})
        inter, ps = set(hit), [p]
        for g in mine:
            gi, gp = groups[g]
            inter |= gi
            ps += gp
            groups[g] = None
        groups.append((inter, ps))
        for n in inter:
            owner[n] = len(groups) - 1
    work = WeightWork([(list(g[0]), g[1]) for g in groups if g is not None], orphans=orphans)

    def keep(node):
        def hook(grad_outputs):
            work.kept[node] = grad_outputs

        return hook

    # the gradient into a GEMM node (one output: its grad_outputs is that one tensor) is captured
    # by the engine itself, as a GradientEdge input; other nodes (any number of outputs) by a
    # Python pre-hook, which the engine calls with all of them
    edges = [n for inter, _ in work.groups for n in inter if n.name() in _ONE_OUTPUT]
    handles = [
        n.register_prehook(keep(n))
        for inter, _ in work.groups
        for n in inter
        if n.name() not in _ONE_OUTPUT
    ]
    want = [x for x in inputs if x.requires_grad]
    try:
        got = (
            torch.autograd.grad(
                roots,
                want + [GradientEdge(n, 0) for n in edges],
                grads,
                retain_graph=True,
                allow_unused=True,
            )
            if want
            else ()
        )
    finally:
        for h in handles:
            h.remove()
    for n, g in zip(edges, got[len(want) :]):
        work.kept[n] = (g,)
    it = iter(got[: len(want)])
    if orphans:
        work.roots, work.grads = list(roots), list(grads)
    return [next(it) if x.requires_grad else None for x in inputs], work


def _accumulate(p: torch.Tensor, g: torch.Tensor | None) -> None:
    if g is None:
        return
    if p.grad is None:
        p.grad = g
    else:
        p.grad += g


def _replace_with(kept: tuple | None):
    def hook(_grad_outputs):
        return kept  # None: leave the incoming gradient as it is

    return hook


# W's nn.Linear fast path (below); off only to time the engine path against it
LINEAR_FAST_PATH = True


def _plain(t: torch.Tensor | None) -> bool:
    return t is None or type(t) in (torch.Tensor, torch.nn.Parameter)


def _linear_weight_grads(node: Node, kept: tuple | None, params: list[torch.nn.Parameter]) -> bool:
    """W's fast path for a linear layer: one GEMM node whose weight (and bias) are exactly the
    group's parameters - ``AddmmBackward0`` (``nn.Linear``; GPT-2's ``Conv1D``, its weight not
    transposed) or ``MmBackward0`` (a Linear without bias, as in Llama). ``weight.grad += G^T X``
    (or ``X^T G``) is one GEMM that accumulates in place, ``bias.grad += sum_rows(G)``. The engine
    path computes the same numbers with a GEMM, a separate add and an engine start per group, which
    made I + W cost 1.4x a fused backward on the CPU ranks measured (benchmarks/pipeline_cpu_*.md).
    Returns False, having done nothing, for any other graph: a cast of the weight
    (autocast), tensor subclasses (DTensor), gradient hooks on the parameters, alpha / beta != 1;
    the engine runs those."""
    if not kept or len(kept) != 1 or kept[0] is None:
        return False
    kind = node.name()
    if kind == "AddmmBackward0":
        if node._saved_alpha != 1 or node._saved_beta != 1:
            return False
        bias_acc, x, w_edge = node.next_functions[0][0], node._saved_mat1, node.next_functions[2][0]
    elif kind == "MmBackward0":
        bias_acc, x, w_edge = None, node._saved_self, node.next_functions[1][0]
    else:
        return False
    if (
        w_edge is not None and w_edge.name() == "TBackward0"
    ):  # nn.Linear: mat2 = weight.t(), (out, in)
        w_acc, transposed = w_edge.next_functions[0][0], True
    else:  # Conv1D: mat2 = weight, (in, out)
        w_acc, transposed = w_edge, False
    g = kept[0]  # (N, out): gradient of the GEMM's output; x (N, in): its saved input
    if not (_plain(g) and _plain(x)) or g.dim() != 2 or x.dim() != 2:
        return False
    where = {}
    for p in params:
        acc = _node(p)
        if acc is w_acc and p.shape == (
            (g.shape[1], x.shape[1]) if transposed else (x.shape[1], g.shape[1])
        ):
            where[id(p)] = "w"
        elif acc is bias_acc and bias_acc is not None:
            where[id(p)] = "b"
        else:
            return False
        if (
            not _plain(p)
            or not _plain(p.grad)
            or p._backward_hooks
            or p._post_accumulate_grad_hooks
        ):
            return False
    for p in params:
        if where[id(p)] == "w":
            a, b = (g.t(), x) if transposed else (x.t(), g)
            if p.grad is None:
                p.grad = torch.mm(a, b)
            else:
                p.grad.addmm_(a, b)
        else:
            _accumulate(p, g.sum_to_size(p.shape))
    return True


def backward_weight(work: WeightWork) -> None:
    """Parameter gradients from the kept intermediate gradients, accumulated into ``.grad``."""
    for inter, params in work.groups:
        if (
            LINEAR_FAST_PATH
            and len(inter) == 1
            and _linear_weight_grads(inter[0], work.kept.get(inter[0]), params)
        ):
            continue
        edges, outs = [], []
        for n in inter:
            for i, g in enumerate(work.kept.get(n, ())):
                if g is not None:
                    edges.append(GradientEdge(n, i))
                    outs.append(g)
        if not edges:
            continue
        handles = []
        if len(inter) > 1:  # one intermediate below another: replace what flows into it by what
            # was kept, or the upper one's gradient would be counted twice
            handles = [n.register_prehook(_replace_with(work.kept.get(n))) for n in inter]
        try:
            dws = torch.autograd.grad(edges, params, outs, retain_graph=True, allow_unused=True)
        finally:
            for h in handles:
                h.remove()
        for p, g in zip(params, dws):
            _accumulate(p, g)
    if work.orphans:
        dws = torch.autograd.grad(
            work.roots, work.orphans, work.grads, retain_graph=True, allow_unused=True
        )
        for p, g in zip(work.orphans, dws):
            _accumulate(p, g)
    work.kept.clear()
