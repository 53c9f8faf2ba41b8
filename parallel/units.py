"""Cutting the traced module tree into a sequence of *units* in execution order.

A unit is what the partitioner places as a whole: a module with its subtree, one parameter that
a parent registers itself (ViT's ``cls_token``: it goes where it is first used), or a parent's own
code ("self": time and activations of the parent's forward outside its children, plus its buffers
and never-called children). Expanding a unit replaces it by its children's units and its own
parts, so every cut of the coarse sequence is still a cut of the finer one.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .trace import EXTERNAL, TraceResult

SELF = "<self>"  # suffix of a self unit's name: "<parent>.<self>"


@dataclass
class Unit:
    """One placeable piece of the model, with its measured costs (per microbatch = example
    batch)."""

    name: str  # module name, parameter name, or "<module>.<self>"
    kind: str  # "module" | "param" | "self"
    module: str  # the module it belongs to (the module itself for kind "module")
    seq: int  # execution-order key: event counter of first call / first use
    modules: list[str] = field(default_factory=list)  # modules wholly inside it (for placement)
    params: list[str] = field(default_factory=list)  # canonical parameter names it holds
    fwd_time: float = 0.0  # forward seconds
    bwd_time: float = 0.0  # backward seconds
    flops: float = 0.0  # forward+backward FLOPs
    param_bytes: int = 0  # bytes of the parameters it holds
    param_numel: int = 0  # elements of those parameters
    buffer_bytes: int = 0  # bytes of buffers of the modules inside it
    act_bytes: int = 0  # activation bytes saved for backward, per microbatch
    expandable: bool = False  # True if a finer cut exists (a module called once with children)

    @property
    def time(self) -> float:
        return self.fwd_time + self.bwd_time


class UnitBuilder:
    """Builds units from a trace and expands them on demand."""

    def __init__(self, trace: TraceResult):
        self.trace = trace
        self.mods = trace.modules
        self._incl: dict[str, dict[str, float]] = {}
        for name in reversed(list(self.mods)):  # children before parents
            self._inclusive(name)
        # the module whose code made each call: the innermost call enclosing it (None: the caller
        # of the root); calls are in start order and nest, so one sweep with a stack finds them
        self._caller: list[str | None] = []
        open_calls: list[int] = []
        for i, c in enumerate(trace.calls):
            while open_calls and trace.calls[open_calls[-1]].end_seq < c.seq:
                open_calls.pop()
            self._caller.append(trace.calls[open_calls[-1]].module if open_calls else None)
            open_calls.append(i)
        self._calls_of: dict[str, list[int]] = {}
        for i, c in enumerate(trace.calls):
            self._calls_of.setdefault(c.module, []).append(i)

    def _inclusive(self, name: str) -> dict[str, float]:
        """Subtree totals. A container never called itself (``ModuleList``) sums its children."""
        n = self.mods[name]
        kids = [self._incl[c] for c in n.children]
        s = {
            k: sum(d[k] for d in kids)
            for k in ("fwd", "bwd", "flops", "pbytes", "pnumel", "bbytes", "act")
        }
        out = {
            "fwd": n.fwd_time if n.calls else s["fwd"],
            "bwd": n.bwd_time if n.calls else s["bwd"],
            "flops": n.flops if n.calls else s["flops"],
            "pbytes": n.param_bytes + s["pbytes"],
            "pnumel": n.param_numel + s["pnumel"],
            "bbytes": n.buffer_bytes + s["bbytes"],
            "act": n.saved_bytes + s["act"],
        }
        self._incl[name] = out
        return out

    def subtree(self, name: str) -> list[str]:
        out, stack = [], [name]
        while stack:
            m = stack.pop()
            out.append(m)
            stack.extend(self.mods[m].children)
        return out

    def _called_children(self, name: str) -> list[str]:
        """Children that run, descending through never-called containers (ModuleList,
        ModuleDict)."""
        out = []
        for c in self.mods[name].children:
            n = self.mods[c]
            if n.calls:
                out.append(c)
            elif any(self.mods[d].calls for d in self.subtree(c)):
                out.extend(self._called_children(c))
        return out

    def module_unit(self, name: str) -> Unit:
        inc = self._incl[name]
        n = self.mods[name]
        sub = self.subtree(name)
        params = [p for m in sub for p in self.mods[m].params]
        return Unit(
            name=name,
            kind="module",
            module=name,
            seq=n.first_seq,
            modules=sub,
            params=params,
            fwd_time=inc["fwd"],
            bwd_time=inc["bwd"],
            flops=inc["flops"],
            param_bytes=int(inc["pbytes"]),
            param_numel=int(inc["pnumel"]),
            buffer_bytes=int(inc["bbytes"]),
            act_bytes=int(inc["act"]),
            expandable=self.is_expandable(name),
        )

    def is_expandable(self, name: str) -> bool:
        """A module can be split if it ran exactly once (a module run several times, e.g. in a
        loop, interleaves with others: kept whole) and each running child either nests inside
        that call or is called only outside it, by the code of a module that encloses this one
        (a language model's token embedding that a multimodal wrapper calls itself before the
        decoder): such a child is placed where its calls are, as a sibling of this module would
        be."""
        n = self.mods[name]
        if n.calls != 1:
            return False
        kids = self._called_children(name)
        ancestors, m = set(), n.parent
        while m is not None:
            ancestors.add(m)
            m = self.mods[m].parent

        def nested(c: str) -> bool:
            return self.mods[c].first_seq > n.first_seq and self.mods[c].last_seq < n.last_seq

        def called_from_outside(c: str) -> bool:
            return all(
                not n.first_seq <= self.trace.calls[i].seq <= n.last_seq
                and self._caller[i] in ancestors
                for i in self._calls_of.get(c, [])
            )

        return bool(kids) and all(nested(c) or called_from_outside(c) for c in kids)

    def root(self) -> list[Unit]:
        return [self.module_unit("")]

    def expand(self, unit: Unit) -> list[Unit]:
        """The finer units replacing ``unit`` (a module unit), in execution order."""
        assert unit.kind == "module" and unit.expandable, unit.name
        name = unit.name
        n = self.mods[name]
        kids = self._called_children(name)
        kid_units = [self.module_unit(c) for c in kids]
        inside = {m for u in kid_units for m in u.modules}
        # the module, idle containers, never-called children
        own = [m for m in self.subtree(name) if m not in inside]
        own_params = [p for m in own for p in self.mods[m].params]
        first_use = self.trace.param_first_use
        used = [p for p in own_params if p in first_use]
        unused = [p for p in own_params if p not in first_use]
        out = list(kid_units)
        for p in used:  # a parent's own parameter goes where it is first used
            b, k = self._param_size(p)
            out.append(
                Unit(
                    name=p,
                    kind="param",
                    module=self.trace.param_owner[p],
                    seq=first_use[p],
                    params=[p],
                    param_bytes=b,
                    param_numel=k,
                )
            )
        inc = self._incl[name]
        me = Unit(
            name=f"{name}.{SELF}" if name else SELF,
            kind="self",
            module=name,
            seq=n.first_seq,
            modules=own,
            params=unused,
        )
        me.fwd_time = max(inc["fwd"] - sum(u.fwd_time for u in kid_units), 0.0)
        me.bwd_time = max(inc["bwd"] - sum(u.bwd_time for u in kid_units), 0.0)
        me.flops = max(inc["flops"] - sum(u.flops for u in kid_units), 0.0)
        me.act_bytes = sum(self.mods[m].saved_bytes for m in own)
        me.buffer_bytes = sum(self.mods[m].buffer_bytes for m in own)
        for p in unused:
            b, k = self._param_size(p)
            me.param_bytes += b
            me.param_numel += k
        out.append(me)
        out.sort(key=lambda u: (u.seq, u.kind != "self"))
        return out

    def _param_size(self, p: str) -> tuple[int, int]:
        b, k = self.trace.param_sizes[p]
        return b, k


def layer_units(builder: UnitBuilder) -> list[Unit]:
    """The "list of layers" a DeepSpeed ``PipelineModule`` or torchgpipe ``nn.Sequential`` user
    writes by hand: expand every module that holds a ``ModuleList``/``Sequential`` of blocks
    somewhere below it, stop at the blocks. Used by the baselines."""
    mods = builder.mods

    def holds_list(name: str) -> bool:
        return any(
            mods[m].type in ("ModuleList", "Sequential") and m != name
            for m in builder.subtree(name)
        )

    units = builder.root()
    changed = True
    while changed:
        changed = False
        out = []
        for u in units:
            if (
                u.kind == "module"
                and u.expandable
                and holds_list(u.name)
                and mods[u.name].type not in ("ModuleList",)
            ):
                out.extend(builder.expand(u))
                changed = True
            else:
                out.append(u)
        units = out
    return units


def unit_positions(units: list[Unit], trace: TraceResult) -> dict[str, int]:
    """Module name -> index of the unit that holds it (modules wholly inside one unit)."""
    pos: dict[str, int] = {}
    for i, u in enumerate(units):
        for m in u.modules:
            pos[m] = i
    return pos


def cut_bytes(units: list[Unit], trace: TraceResult) -> list[int]:
    """Bytes of distinct tensors that cross each cut, per microbatch: entry j is the cut before
    unit j (entries 0 and n are 0). A tensor produced at unit p (for tensors computed by a
    parent's code: the latest unit it was derived from; model inputs: before unit 0) and last
    consumed at unit c crosses every cut j with p < j <= c."""
    n = len(units)
    pos = unit_positions(units, trace)
    # a container split across units produces its output at its last unit
    last_of: dict[str, int] = {}
    for i, u in enumerate(units):
        m = u.module
        while m is not None:
            last_of[m] = max(last_of.get(m, -1), i)
            m = trace.modules[m].parent
    diff = [0] * (n + 2)
    calls = trace.calls

    def where(cid: int) -> int:
        m = calls[cid].module
        return pos[m] if m in pos else last_of.get(m, -1)

    for t in trace.tensors:
        cons = [pos[calls[c].module] for c in t.consumers if calls[c].module in pos]
        if not cons:
            continue
        if t.producer != EXTERNAL:
            p = where(t.producer)
        elif t.via:
            p = max(where(c) for c in t.via)
        else:
            p = -1
        c = max(cons)
        lo = max(p + 1, 1)
        if c >= lo:
            diff[lo] += t.nbytes
            diff[c + 1] -= t.nbytes
    out, run = [0] * (n + 1), 0
    for j in range(n + 1):
        run += diff[j]
        out[j] = run if 0 < j < n else 0
    return out
