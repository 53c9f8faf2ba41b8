"""Find a tensor-parallel plan for an arbitrary model from the dataflow seen while tracing.

A column->row pair is read off the traced module graph, not off names: linear A is a column
source of linear B when A's output reaches B passing only through parameter-free modules
(activations, dropout) and the parent's own code (reshape, attention, rotary, products), and no
other linear on the way. B is row-parallel when every linear that reaches it reaches only B.
With one source whose width is k times B's input (GPT-2's c_attn: q|k|v, 3 x hidden) the source
is taken as k fused blocks and sharded per block; on a real (not meta) example the blocks are then
read off the dataflow (``parallel.tp.layout``: GPT-NeoX's per-head [q_h k_h v_h] is one block).
Head counts on the pair's owner are divided by tp.

Fewer key/value heads than tp ranks (multi-query attention, small grouped-query): the query
source and the output projection are sharded by heads, k and v stay whole on every rank
(``kv_replicate``) and each rank computes the key/value heads its query heads read
(``parallel.tp.layout``); their gradients are summed over the tp group. A norm applied per head
to a source's output (Gemma 3's and Qwen3's q_norm / k_norm: 1-D weights over the last dimension
of a >= 4-D tensor) does not cut the dataflow; its weight stays whole and its gradient is summed
(``head_local``). One log line per attention kind says what was replicated and why.

Left replicated, and logged: modules that share a parameter (tied embeddings / LM heads; SMP
makes the same choice), linears without a partner (other than the LM head), anything whose width
does not divide, fused layouts no DTensor placement holds (a grouped-query q|k|v). ``apply_tp``
(``parallel.tp.verify``, which imports this module) then checks the plan unit by unit before
sharding and keeps replicated whatever does not reproduce the model.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from parallel.tp.layout import read_pair_blocks
from parallel.tp.registry import linear_kind, log, module_rule
from parallel.tp.rules import (
    HEAD_ATTRS,
    KV_GROUP_ATTRS,
    KV_HEAD_ATTRS,
    SIZE_ATTRS,
    TPContext,
    _with_sp,
)
from parallel.trace import TraceResult

# marks a plan log line about a unit that discovery or the self-check meant to shard and left
# whole (a width tp does not divide, a fused layout no placement holds, a failed self-check)
LEFT_REPLICATED = "left replicated"


@dataclass
class TPEntry:
    # colwise | rowwise | kv_replicate | head_local | vocab_embedding | lm_head | rule:<name> |
    # sequence_local | replicate
    role: str
    blocks: int = 1  # fused equal blocks of a colwise weight
    group: int = -1  # pair id (colwise sources and their rowwise sink share it)
    reason: str = ""  # why (for replicate) or what (for the log)
    rows: list[list[int]] | None = None  # kv_replicate: the output features each tp rank computes

    @property
    def factor(self) -> int:
        """kv_replicate: how many tp ranks compute each output feature (1 for other roles)."""
        if not self.rows:
            return 1
        return len(self.rows) * len(self.rows[0]) // len({f for r in self.rows for f in r})


@dataclass
class TPPlan:
    entries: dict[str, TPEntry] = field(default_factory=dict)
    owners: dict[int, str] = field(default_factory=dict)  # pair id -> module owning its head counts
    regions: list[tuple[str, str]] = field(default_factory=list)  # SP: (first block, last block)
    log: list[str] = field(default_factory=list)
    # head counts / sizes to divide; None: those of ``entries``' pairs
    # (``head_divisions``: (module, attribute, divisor; 0 for tp)). A pipeline rank's stage plan
    # lists other ranks' pairs too: their owners' code is replayed there on stand-ins shaped like
    # the sharded outputs
    divide: list[tuple[str, str, int]] | None = None

    def pairs(self) -> dict[int, tuple[list[str], str]]:
        """pair id -> (its other members: sources sharded, sources replicated and per-head norms,
        in module order; its row-parallel sink)."""
        out: dict[int, tuple[list[str], str]] = {}
        for name, e in self.entries.items():
            if e.group >= 0:
                srcs, sink = out.get(e.group, ([], ""))
                if e.role != "rowwise":
                    srcs.append(name)
                else:
                    sink = name
                out[e.group] = (srcs, sink)
        return out

    def table(self) -> str:
        rows = [f"{'module':50s} {'role':18s} note"]
        for n, e in self.entries.items():
            note = e.reason or (f"blocks={e.blocks}" if e.blocks > 1 else "")
            rows.append(f"{n:50s} {e.role:18s} {note}")
        return "\n".join(rows)


def _has_params(m: nn.Module) -> bool:
    return next(m.parameters(), None) is not None


def tied_modules(model: nn.Module) -> dict[str, str]:
    """Module name -> tied parameter description, for every module that shares a parameter."""
    by_id: dict[int, list[str]] = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(p), []).append(n)
    out = {}
    for names in by_id.values():
        if len(names) > 1:
            for n in names:
                out[n.rpartition(".")[0]] = " = ".join(names)
    return out


def _lca(names: list[str]) -> str:
    parts = [n.split(".") for n in names]
    common = []
    for level in zip(*parts):
        if all(p == level[0] for p in level):
            common.append(level[0])
        else:
            break
    return ".".join(common)


def find_block_lists(model: nn.Module) -> list[tuple[str, list[str]]]:
    """(ModuleList name, [block names]) for every list of >= 2 modules of one class: the layers."""
    out = []
    for name, m in model.named_modules():
        if isinstance(m, nn.ModuleList | nn.Sequential) and len(m) >= 2:
            kids = list(m.named_children())
            if len({type(c) for _, c in kids}) == 1 and _has_params(kids[0][1]):
                out.append((name, [f"{name}.{k}" if name else k for k, _ in kids]))
    # keep the outermost lists only (a block's own Sequential MLP is not a layer list)
    return [(n, b) for n, b in out if not any(n != o and n.startswith(o + ".") for o, _ in out)]


def _per_head(mod: nn.Module, args: tuple, out: Any) -> bool:
    """``mod`` is a norm applied per head: 1-D parameters as long as the last dimension of its
    (>= 4-D: heads split off) input, and an output of the input's shape."""
    x = next((a for a in args if isinstance(a, torch.Tensor)), None)
    ps = list(mod.parameters(recurse=False))
    return (
        x is not None
        and isinstance(out, torch.Tensor)
        and x.dim() >= 4
        and out.shape == x.shape
        and bool(ps)
        and all(p.dim() == 1 and p.numel() == x.shape[-1] for p in ps)
    )


def linear_dataflow(
    model: nn.Module,
    example_inputs: Any,
    linears: set[str],
    keep: dict[str, list[Any]] | None = None,
    head_norms: dict[str, set[str]] | None = None,
) -> dict[str, set[str]]:
    """Run one forward (under autograd, on any device incl. meta) and return, for each linear-like
    module, the linears whose outputs reach its input through parameter-free computation only:
    the autograd graph is walked back from each linear's input and stops at the output of any
    module that holds parameters (a linear: a source; a norm, an embedding: a barrier).
    ``keep``: filled with ``name -> [input, output]`` of each linear's first call (their graph
    stays alive while the caller holds them; ``parallel.tp.layout`` reads fused layouts off it).
    A norm applied per head (``_per_head``) is walked through, not a barrier; ``head_norms``:
    filled with each such norm's name -> the linears reaching its input."""
    mods = dict(model.named_modules())
    barrier: dict[Any, str] = {}  # grad_fn of a parameterised module's output -> module name
    inputs: dict[str, list[Any]] = {}
    norm_inputs: dict[str, list[Any]] = {}
    handles = []

    def pre(name):
        def hook(mod, args, kwargs):
            ts = [
                a
                for a in list(args) + list(kwargs.values())
                if isinstance(a, torch.Tensor) and a.grad_fn is not None
            ]
            inputs.setdefault(name, []).extend(t.grad_fn for t in ts)
            if keep is not None and name not in keep and ts:
                keep[name] = [ts[0], None]

        return hook

    def post(name):
        def hook(mod, args, kwargs, out):
            outs = (
                [out]
                if isinstance(out, torch.Tensor)
                else [
                    o
                    for o in (out if isinstance(out, tuple | list) else ())
                    if isinstance(o, torch.Tensor)
                ]
            )
            if name not in linears and _per_head(mod, args, out):
                norm_inputs.setdefault(name, []).extend(
                    a.grad_fn for a in args if isinstance(a, torch.Tensor) and a.grad_fn is not None
                )
                return
            for o in outs:
                if o.grad_fn is not None:
                    barrier.setdefault(o.grad_fn, name)
            if (
                keep is not None
                and name in linears
                and isinstance(out, torch.Tensor)
                and out.grad_fn is not None
            ):
                keep.setdefault(name, [None, None])
                if keep[name][1] is None:
                    keep[name][1] = out

        return hook

    for n, m in mods.items():
        if any(True for _ in m.parameters(recurse=False)) or n in linears:
            if n in linears:
                handles.append(m.register_forward_pre_hook(pre(n), with_kwargs=True))
            handles.append(m.register_forward_hook(post(n), with_kwargs=True))
    try:
        with torch.enable_grad():
            if isinstance(example_inputs, dict):
                model(**example_inputs)
            else:
                model(
                    *(
                        example_inputs
                        if isinstance(example_inputs, tuple | list)
                        else (example_inputs,)
                    )
                )
    finally:
        for h in handles:
            h.remove()
    memo: dict[Any, frozenset[str]] = {}

    def sources(node) -> frozenset[str]:
        if node in barrier:
            return frozenset([barrier[node]])
        if node in memo:
            return memo[node]
        out: set[str] = set()
        stack, seen = [node], {node}
        while stack:
            nd = stack.pop()
            for nxt, _ in nd.next_functions:
                if nxt is None or nxt in seen:
                    continue
                seen.add(nxt)
                if nxt in barrier:
                    out.add(barrier[nxt])
                elif nxt in memo:
                    out |= memo[nxt]
                else:
                    stack.append(nxt)
        memo[node] = frozenset(out)
        return memo[node]

    if head_norms is not None:
        for n, gs in norm_inputs.items():
            head_norms[n] = {s for g in gs for s in sources(g) if s in linears}
    return {
        b: {s for g in gs for s in sources(g) if s in linears and s != b}
        for b, gs in inputs.items()
    }


def _head_norm_by_name(mods: dict, name: str) -> bool:
    """A stored trace's stand-in for ``_per_head``: 1-D parameters as long as the parent's
    ``head_dim`` attribute."""
    hd = getattr(mods.get(name.rpartition(".")[0]), "head_dim", None)
    ps = list(mods[name].parameters(recurse=False))
    return isinstance(hd, int) and bool(ps) and all(p.dim() == 1 and p.numel() == hd for p in ps)


def _edges_dataflow(
    trace: TraceResult, mods: dict, linears: set[str], head_norms: dict[str, set[str]] | None = None
) -> dict[str, set[str]]:
    succ: dict[str, set[str]] = {}
    for a, b, _ in trace.edges():
        if a != b:
            succ.setdefault(a, set()).add(b)
    out: dict[str, set[str]] = {}
    for a in linears:
        seen, q = {a}, deque([a])
        while q:
            for nxt in succ.get(q.popleft(), ()):
                if nxt in seen:
                    continue
                seen.add(nxt)
                if nxt in linears:
                    out.setdefault(nxt, set()).add(a)
                elif nxt in mods and not _has_params(mods[nxt]):
                    q.append(nxt)
                elif nxt in mods and _head_norm_by_name(mods, nxt):
                    q.append(nxt)
                    if head_norms is not None:
                        head_norms.setdefault(nxt, set()).add(a)
    return out


def discover_plan(
    model: nn.Module,
    tp: int,
    trace: TraceResult | None = None,
    example_inputs: Any = None,
    *,
    sequence_parallel: bool = False,
    loss_fn=None,
    shard_embedding: bool = True,
    shard_lm_head: bool = True,
    read_layouts: bool = True,
) -> TPPlan:
    """The TP plan for ``model`` at degree ``tp`` (see module doc). Raises ValueError, before
    anything is changed, when tp does not divide a head count or a width the plan needs.
    ``read_layouts``: read each pair's fused layout off the example's gradients
    (``parallel.tp.layout``; needs real, not meta, tensors) instead of trusting the width rule."""
    if trace is None and example_inputs is None:
        raise ValueError(
            "tp plan discovery needs example inputs (or a TraceResult) to see the dataflow"
        )
    mods = dict(model.named_modules())
    plan = TPPlan()
    tied = tied_modules(model)
    for n, desc in tied.items():
        if n in mods and _has_params(mods[n]):
            plan.entries[n] = TPEntry(
                "replicate", reason=f"tied parameter ({desc}): left replicated"
            )

    claimed: list[str] = []  # subtrees owned by module rules
    for n, m in mods.items():
        if n in plan.entries or any(n.startswith(c + ".") for c in claimed):
            continue
        r = module_rule(m)
        if r is not None:
            plan.entries[n] = TPEntry(f"rule:{r[1]}")
            claimed.append(n)
            for attr in HEAD_ATTRS:  # fail before sharding anything
                v = getattr(m, attr, None)
                if isinstance(v, int) and not isinstance(v, bool) and v % tp:
                    raise ValueError(
                        f"tp={tp} does not divide the head count {n}.{attr}={v}; choose a tp that "
                        "divides it"
                    )

    def free(n: str) -> bool:
        return not any(n == c or n.startswith(c + ".") for c in claimed) and n not in plan.entries

    linears = {n for n, m in mods.items() if linear_kind(m) is not None and free(n)}
    keep: dict[str, list[Any]] | None = {} if read_layouts else None
    head_norms: dict[str, set[str]] = {}
    if example_inputs is not None:
        sources_of = linear_dataflow(model, example_inputs, linears, keep, head_norms)
    else:  # a stored trace only: its module-level edges (containers' own code is not resolved)
        sources_of = _edges_dataflow(trace, mods, linears, head_norms)
    R: dict[str, set[str]] = {a: set() for a in linears}
    for b, srcs in sources_of.items():
        for a in srcs:
            R[a].add(b)
    order = {n: i for i, n in enumerate(mods)}
    sources: dict[str, list[str]] = {}
    for a in sorted(R, key=lambda n: order[n]):
        for b in R[a]:
            sources.setdefault(b, []).append(a)
    used: set[str] = set()
    gid = 0
    for b, srcs in sorted(sources.items(), key=lambda kv: order.get(kv[0], 1 << 30)):
        if b in used or any(s in used for s in srcs) or any(R[s] != {b} for s in srcs):
            continue
        owner = _lca(srcs + [b])
        inside = [
            mn
            for mn in mods
            if (mn == owner or (owner and mn.startswith(owner + "."))) and free(mn)
        ]
        # validate head counts now, so a bad layout fails before anything is sharded (key/value
        # heads tp does not divide are replicated instead)
        for mn in inside:
            for attr in HEAD_ATTRS:
                v = getattr(mods[mn], attr, None)
                if attr in KV_HEAD_ATTRS or not isinstance(v, int) or isinstance(v, bool):
                    continue
                if v % tp:
                    raise ValueError(
                        f"tp={tp} does not divide the head count "
                        f"{mn or type(model).__name__}.{attr}={v}; "
                        f"choose a tp that divides it"
                    )
        kb = linear_kind(mods[b])
        width = kb.in_features(mods[b])
        blocks = {}
        rows = _kv_rows_by_width(mods, inside, srcs, width, tp)  # the width rule's guess
        ok = True
        for s in srcs:
            out = linear_kind(mods[s]).out_features(mods[s])
            k = out // width if len(srcs) == 1 and out % width == 0 and out > width else 1
            blocks[s] = 0 if s in rows else k
            if s not in rows and (out // k) % tp and not keep:
                ok = False
                plan.log.append(
                    f"{s} -> {b}: width {out} not divisible by tp={tp}; {LEFT_REPLICATED}"
                )
        if width % tp:
            ok = False
        if not ok:
            continue
        if keep:
            read, read_rows, why = read_pair_blocks(
                keep, mods, srcs, b, tp, {s: k or 1 for s, k in blocks.items()}
            )
            if read is not None and read_rows is not None:
                rows = read_rows
            elif read is not None:  # the example could not tell: the width rule's guess
                read = blocks
            if read is None:
                for n in srcs + [b]:
                    plan.entries[n] = TPEntry(
                        "replicate", reason=f"fused layout fits no DTensor placement: {why}"
                    )
                plan.log.append(
                    f"{srcs} -> {b}: fused layout fits no DTensor placement ({why}); "
                    f"{LEFT_REPLICATED}"
                )
                used.update(srcs + [b])
                continue
            for s in srcs:
                if read[s] != blocks[s] and read[s] and blocks[s]:
                    plan.log.append(
                        f"{s}: fused layout read from the dataflow: blocks={read[s]} "
                        f"(the width rule said {blocks[s]})"
                    )
            blocks = read
        for s in srcs:
            if s in rows:
                plan.entries[s] = TPEntry("kv_replicate", 0, gid, rows=rows[s])
            else:
                plan.entries[s] = TPEntry("colwise", blocks[s], gid)
        for n, reach in head_norms.items():  # per-head norms on this pair's sources, in its owner
            if n in inside and reach and reach <= set(srcs) and n not in plan.entries:
                plan.entries[n] = TPEntry("head_local", 1, gid)
        plan.entries[b] = TPEntry("rowwise", 1, gid)
        plan.owners[gid] = owner
        used.update(srcs + [b])
        gid += 1

    # the vocabulary: the width of a final linear (one feeding no other linear) or config.vocab_size
    vocab = {
        linear_kind(mods[n]).out_features(mods[n])
        for n in linears - used
        if not R.get(n)
        and linear_kind(mods[n]).out_features(mods[n]) > linear_kind(mods[n]).in_features(mods[n])
    }
    vocab &= {m.num_embeddings for m in mods.values() if isinstance(m, nn.Embedding)}
    if isinstance(getattr(getattr(model, "config", None), "vocab_size", None), int):
        vocab.add(model.config.vocab_size)
    for n in sorted(linears - used, key=lambda n: order[n]):
        m = mods[n]
        out = linear_kind(m).out_features(m)
        if shard_lm_head and out in vocab and out % tp == 0 and not R.get(n):
            plan.entries[n] = TPEntry(
                "lm_head", reason="vocab-sharded; output gathered (or DTensor with loss_parallel)"
            )
        else:
            plan.entries[n] = TPEntry("replicate", reason="no row-parallel partner in the dataflow")
    for n, m in mods.items():
        if isinstance(m, nn.Embedding) and free(n):
            if (
                shard_embedding
                and m.num_embeddings in vocab
                and m.num_embeddings % tp == 0
                and m.max_norm is None
            ):
                plan.entries[n] = TPEntry("vocab_embedding")
            else:
                plan.entries[n] = TPEntry("replicate", reason="small or indivisible embedding")

    if sequence_parallel:
        pair_mods = [
            n
            for n, e in plan.entries.items()
            if e.role in ("colwise", "rowwise") or e.role.startswith("rule:")
        ]
        for _, blocks in find_block_lists(model):
            inside = [blk for blk in blocks if any(p.startswith(blk + ".") for p in pair_mods)]
            if len(inside) != len(blocks):
                continue
            plan.regions.append((blocks[0], blocks[-1]))
            for blk in blocks:
                for mn, m in mods.items():
                    if (
                        mn.startswith(blk + ".")
                        and free(mn)
                        and any(True for _ in m.parameters(recurse=False))
                    ):
                        if not any(mn.startswith(c + ".") for c in pair_mods):
                            plan.entries[mn] = TPEntry("sequence_local")
        if not plan.regions:
            plan.log.append("sequence_parallel: no layer list with sharded pairs found; off")
    for n, e in plan.entries.items():
        if e.role == "replicate" and e.reason.startswith("tied"):
            log.info("tp: %s %s", n, e.reason)
    return plan


def _head_dim(mods: dict[str, nn.Module], names: list[str]) -> int | None:
    """The ``head_dim`` attribute of the first of ``names`` that has one."""
    for n in names:
        v = getattr(mods[n], "head_dim", None)
        if isinstance(v, int) and not isinstance(v, bool) and v > 0:
            return v
    return None


def _kv_rows_by_width(
    mods: dict[str, nn.Module], inside: list[str], srcs: list[str], width: int, tp: int
) -> dict[str, list[list[int]]]:
    """The width rule for key/value heads (meta tensors, stored traces): a source of a
    multi-source pair narrower than the sink's input holds ``out / head_dim`` key/value heads
    (``head_dim`` from the pair's owner); fewer than tp (tp a multiple of them): replicated, rank
    r computing head ``r // (tp / heads)``, the one its query heads read in the usual layout."""
    hd = _head_dim(mods, inside)
    out: dict[str, list[list[int]]] = {}
    if hd is None or len(srcs) < 2:
        return out
    for s in srcs:
        n = linear_kind(mods[s]).out_features(mods[s])
        kv = n // hd
        if n < width and n % hd == 0 and kv % tp and tp % kv == 0:
            per = tp // kv
            out[s] = [list(range((r // per) * hd, (r // per + 1) * hd)) for r in range(tp)]
    if len(out) == len(srcs):
        return {}
    return out


def _kv_notes(plan: TPPlan, mods: dict[str, nn.Module], tp: int) -> list[str]:
    """One log line per attention kind (owner class) whose key/value sources ``plan`` replicates
    (on a pipeline rank: those of its own stage)."""
    kinds: dict[str, list[Any]] = {}
    for gid, (srcs, _) in plan.pairs().items():
        kv = [s for s in srcs if plan.entries[s].role == "kv_replicate"]
        if not kv:
            continue
        owner = plan.owners[gid]
        kind = type(mods[owner]).__name__
        e = plan.entries[kv[0]]
        rec = kinds.setdefault(kind, [0, [s[len(owner) + 1 :] if owner else s for s in kv], e])
        rec[0] += 1
    notes = []
    for kind, (count, names, e) in kinds.items():
        groups = tp // e.factor
        notes.append(
            f"replicated K/V in {count} {kind} module(s): {', '.join(names)} whole on "
            f"every rank ({groups} key/value head group(s) for tp={tp}, each read by "
            f"{e.factor} ranks); each rank computes the {len(e.rows[0])} features its "
            f"query heads read, gradients summed over the tp group"
        )
    return notes


def _gather_point(plan: TPPlan, gid: int, srcs: list[str]) -> str | None:
    """Sequence parallel: the module whose input is gathered for pair ``gid`` (None: each source
    gathers its own). The pair's owner when nothing in it runs on a sequence shard (an attention
    module, which reads the sequence length off its input), else the sources' common parent."""
    owner = plan.owners.get(gid, "")
    inside = [
        n
        for n, e in plan.entries.items()
        if e.role == "sequence_local" and (n == owner or n.startswith(owner + "."))
    ]
    if owner and owner not in srcs and not inside:
        return owner
    top = _lca(srcs)
    return top if len(srcs) > 1 and top not in srcs else None


def head_divisions(
    model: nn.Module, plan: TPPlan, groups: set[int] | None = None, tp: int | None = None
) -> list[tuple[str, str, int]]:
    """(module, attribute, divisor) for what sharding ``plan``'s pairs (those in ``groups``;
    None: all) divides: by tp every head count (``HEAD_ATTRS``) in each pair owner's subtree and
    every size attribute (``SIZE_ATTRS``) equal to the width of one block of the pair's first
    sharded source. With replicated key/value sources, each computed by f ranks: key/value head
    counts by tp / f, query-per-key/value group sizes (``KV_GROUP_ATTRS``) by f (``tp``: the
    degree, read off the rows when None). Reads the sources' widths: needs the unsharded weights."""
    mods = dict(model.named_modules())
    pairs = plan.pairs()
    out: list[tuple[str, str, int]] = []
    done: set[tuple[int, str]] = set()  # a module under several names is divided once
    for gid, owner in plan.owners.items():
        if groups is not None and gid not in groups:
            continue
        srcs, _ = pairs[gid]
        first = next(s for s in srcs if plan.entries[s].role == "colwise")
        width = linear_kind(mods[first]).out_features(mods[first]) // plan.entries[first].blocks
        kv = [plan.entries[s] for s in srcs if plan.entries[s].role == "kv_replicate"]
        f = kv[0].factor if kv else 1
        deg = tp or (len(kv[0].rows) if kv else 0)
        for mn, m in mods.items():
            if not (mn == owner or (owner and mn.startswith(owner + "."))):
                continue
            if plan.entries.get(mn, TPEntry("")).role.startswith("rule:"):
                continue
            for attr in (*HEAD_ATTRS, *SIZE_ATTRS, *KV_GROUP_ATTRS):
                v = getattr(m, attr, None)
                if not isinstance(v, int) or isinstance(v, bool) or (id(m), attr) in done:
                    continue
                if attr in KV_GROUP_ATTRS:
                    if f > 1:
                        out.append((mn, attr, f))
                elif kv and attr in KV_HEAD_ATTRS:
                    out.append((mn, attr, deg // f))
                elif attr in HEAD_ATTRS or v == width:
                    out.append((mn, attr, 0))  # 0: the tp degree
                else:
                    continue
                done.add((id(m), attr))
    return out


def apply_plan(
    model: nn.Module,
    plan: TPPlan,
    mesh: DeviceMesh,
    *,
    sequence_parallel: bool = False,
    loss_parallel: bool = False,
    seq_dim: int = 1,
    quiet: bool = False,
) -> TPContext:
    """Shard ``model`` in place following ``plan``; returns the context (with its log). ``quiet``:
    keep the log in the context only (the self-check's trial copies)."""
    ctx = TPContext(
        mesh,
        sequence_parallel=sequence_parallel and bool(plan.regions),
        seq_dim=seq_dim,
        loss_parallel=loss_parallel,
        echo=not quiet,
    )
    for msg in plan.log:  # a unit the plan meant to shard and did not: one warning line, with why
        ctx.note(msg, logging.WARNING if LEFT_REPLICATED in msg else logging.INFO)
    mods = dict(model.named_modules())
    # head counts first (validated by discover_plan)
    divide = plan.divide if plan.divide is not None else head_divisions(model, plan, tp=ctx.size)
    for mn, attr, by in divide:
        ctx.divide_attr(mods[mn], attr, by or ctx.size)
    groups: dict[int, object] = {}
    ready: set[str] = set()  # SP: colwise sources whose input a parent gathers
    lists = [first.rpartition(".")[0] + "." for first, _ in plan.regions]
    plain = _with_sp(ctx, False)  # modules outside the sequence-parallel layer lists

    def ctx_of(n: str) -> TPContext:
        return ctx if ctx.sequence_parallel and any(n.startswith(p) for p in lists) else plain

    if ctx.sequence_parallel:
        for gid, (srcs, _) in plan.pairs().items():
            top = _gather_point(plan, gid, srcs)
            if top is not None and top in mods and ctx_of(top) is ctx:
                ctx.gather_input(mods[top])  # HF attention reads the sequence length off its input
                ready.update(srcs)
    for n, e in plan.entries.items():
        m, c = mods[n], ctx_of(n)
        if e.role == "colwise":
            owner = groups.setdefault(e.group, type("TPInput", (), {})())
            c.colwise(m, e.blocks, input_group=owner, input_ready=n in ready)
        elif e.role == "kv_replicate":
            owner = groups.setdefault(e.group, type("TPInput", (), {})())
            c.replicated_rows(m, e.rows[ctx.rank], input_group=owner, input_ready=n in ready)
        elif e.role == "head_local":
            c.partial_grad(m)
        elif e.role == "rowwise":
            c.rowwise(m)
        elif e.role == "vocab_embedding":
            plain.vocab_embedding(m)
        elif e.role == "lm_head":
            plain.colwise(m, gather_output=True)
        elif e.role == "sequence_local":
            if c.sequence_parallel:
                c.sequence_local(m)
        elif e.role.startswith("rule:"):
            fn, _ = module_rule(m)
            fn(m, c)
        if e.role != "replicate":
            ctx.note(f"{n}: {e.role}" + (f" (blocks={e.blocks})" if e.blocks > 1 else ""))
        else:
            ctx.note(f"{n}: replicated ({e.reason})")
    for msg in _kv_notes(plan, mods, ctx.size):  # what was replicated and why, once per kind
        ctx.note(msg)
    if ctx.sequence_parallel:
        for first, last in plan.regions:
            ctx.sequence_region(mods[first], mods[last])
            ctx.note(f"sequence parallel over {first} .. {last}")
    return ctx
