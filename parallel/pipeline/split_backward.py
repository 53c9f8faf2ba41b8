"""The zero-bubble backward split: gradients of a stage's inputs now ("I"), of its weights later ("W").

The two halves must not repeat each other's work. Running ``autograd.grad(roots, inputs)`` and
later ``autograd.backward(roots, inputs=params)`` would walk the input chain twice (every layer's
dX again, to reach the earlier layers' weights), so W would cost almost a full backward. Instead,
as torch's pipelining does (``torch.distributed.pipelining._backward``, whose functions assume a
graph without parameters off the input path and detach the stage outputs, which our eager stages
cannot promise), the autograd graph is cut where weights meet the input path:

- an *intermediate* is a node on a path from the stage inputs to the roots that a parameter's
  gradient also flows through (``AddmmBackward0`` of a ``Linear``: the input path enters it and the
  weight's ``AccumulateGrad`` hangs below it);
- I runs ``autograd.grad(roots, inputs)`` with a pre-hook on every intermediate that keeps the
  gradient flowing into it; the engine computes only the outputs that lead to the inputs (each
  ``Linear``'s dX, not its dW);
- W starts the engine at those intermediates with the kept gradients (``GradientEdge``) and asks
  for the parameters only: each dW once, no dX.

Parameters whose gradient never meets the input path, or also reaches a root around it (an
embedding of the raw microbatch on a later stage; everything on the first stage, whose inputs need
no gradient), W gets with one ordinary backward from the roots to those parameters. The graph is kept
between I and W (``retain_graph``) and freed when the caller drops the roots.
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


def _closure(starts: list[Node], rev: dict[Node, list[Node]], stop: set[Node] | frozenset = frozenset()
             ) -> tuple[set[Node], set[Node]]:
    """(nodes reachable from ``starts`` along reverse edges, stopping at ``stop``; stop nodes hit)."""
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


def backward_input(roots: list[torch.Tensor], grads: list[torch.Tensor | None], inputs: list[torch.Tensor],
                   params: list[torch.nn.Parameter]) -> tuple[list[torch.Tensor | None], WeightWork]:
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

    handles = [n.register_prehook(keep(n)) for inter, _ in work.groups for n in inter]
    try:
        want = [x for x in inputs if x.requires_grad]
        got = torch.autograd.grad(roots, want, grads, retain_graph=True, allow_unused=True) if want else ()
    finally:
        for h in handles:
            h.remove()
    it = iter(got)
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


def backward_weight(work: WeightWork) -> None:
    """Parameter gradients from the kept intermediate gradients, accumulated into ``.grad``."""
    for inter, params in work.groups:
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
        dws = torch.autograd.grad(work.roots, work.orphans, work.grads, retain_graph=True, allow_unused=True)
        for p, g in zip(work.orphans, dws):
            _accumulate(p, g)
    work.kept.clear()
