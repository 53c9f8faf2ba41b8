"""Per-module statistics of a trace for the layout planner: FLOPs, parameter bytes (and the part
tensor parallel shards), activation bytes (and what block checkpointing keeps), summed over any
set of modules - the whole model or one pipeline stage."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from ..trace import TraceResult

BLOCK_CONTAINERS = ("ModuleList", "Sequential")  # a repeated block is a child of one of these
TP_TYPES = ("Linear", "Embedding", "Conv1D", "NonDynamicallyQuantizableLinear")  # weights TP shards
REPLICATED_ACT = ("Norm", "Dropout")  # type substrings whose saved activations every tp rank holds
# TP roles whose input, saved for backward, is whole on every tp rank
WHOLE_INPUT_ROLES = (
    "colwise",
    "lm_head",
)


@dataclass
class PartStats:
    """What a set of modules (the whole model, or one pipeline stage) costs per trace batch."""

    flops: float = 0.0  # forward+backward FLOPs
    param_bytes: float = 0.0  # parameters held (tied replicas included)
    tp_param_bytes: float = 0.0  # of which tensor parallel shards (TP_TYPES' weights)
    act: float = 0.0  # activations saved for backward
    act_rep: float = 0.0  # of which every tp rank holds in full (norms, dropout)
    ckpt_act: float = 0.0  # held with block checkpointing: outside whole blocks + block inputs
    ckpt_act_rep: float = 0.0  # of which replicated across tp (block inputs, norms, dropout)
    recompute_peak: float = 0.0  # largest whole block's activations (alive while it is recomputed)
    block_param: float = 0.0  # largest whole block's parameters (FSDP's gathered unit)
    block_tp_param: float = 0.0  # of which TP-sharded
    # parameters outside every whole block (FSDP's root unit: embeddings, head)
    outside_param: float = 0.0
    outside_tp_param: float = 0.0  # of which TP-sharded
    blocks: int = 0  # whole blocks (each costs TP all-reduces)
    block_out: float = 0.0  # output bytes summed over whole blocks (the TP all-reduce message)
    cut_in: float = 0.0  # bytes received per trace batch at the stage's first cut
    cut_out: float = 0.0  # bytes sent per trace batch at its last cut
    # output gradients of modules with parameters: what a deferred weight gradient keeps
    wgrad_keep: float = 0.0
    calls: int = 0  # module calls per forward (fixed per-call overhead follows them)
    tp_calls: int = 0  # of which calls of modules whose own parameters tensor parallel shards
    kv_param_bytes: float = 0.0  # replicated key/value weights (whole on each tp rank)
    kv_calls: int = 0  # calls of those modules (one gradient all-reduce each per microbatch)


class ModelStats:
    """Per-module quantities of a trace, summed over any set of modules in O(set size)."""

    def __init__(
        self,
        trace: TraceResult,
        samples: int,
        tp_sharded: set[str] | None = None,
        tp_whole_input: set[str] = frozenset(),
        tp_kv: set[str] = frozenset(),
    ):
        """``tp_sharded``: the canonical parameters tensor parallel shards (``tp_plan_facts``);
        None: the weights of ``TP_TYPES`` modules. ``tp_whole_input``: modules whose saved
        activations every tp rank holds whole (column-parallel layers keep their whole input).
        ``tp_kv``: the replicated key/value parameters (whole on every tp rank, their gradients
        all-reduced over the tp group in every backward)."""
        self.trace, self.samples = trace, samples
        self.tp_kv = tp_kv
        self.tp_whole_input = tp_whole_input
        mods = trace.modules
        self.blocks: dict[str, set[str]] = {}  # block name -> its subtree
        for name, node in mods.items():
            parent = mods[node.parent] if node.parent is not None else None
            if (
                parent is not None
                and parent.type in BLOCK_CONTAINERS
                and node.calls
                and sum(1 for c in parent.children if mods[c].calls) >= 2
            ):
                self.blocks[name] = self._subtree(name)
        self.block_of = {m: b for b, sub in self.blocks.items() for m in sub}
        self.tp_param = {
            p: (p in tp_sharded) if tp_sharded is not None else mods[o].type in TP_TYPES
            for p, o in trace.param_owner.items()
        }
        self.param_bytes = float(sum(b for b, _ in trace.param_sizes.values()))
        numel = sum(n for _, n in trace.param_sizes.values())
        # bytes per element of the trace's dtype
        self.elt = self.param_bytes / numel if numel else 4.0
        self.flops = float(mods[""].flops)
        if self.flops <= 0:
            raise ValueError(
                "the trace counted no FLOPs (torch's FlopCounterMode failed on an op); the "
                "planner needs them for compute time"
            )
        self.whole = self.part(list(mods), sorted({p for p in trace.param_owner}), self.flops)
        # the model's output (logits): the loss's input
        self.output_bytes = float(mods[""].out_bytes)

    def _subtree(self, name: str) -> set[str]:
        out, stack = set(), [name]
        while stack:
            m = stack.pop()
            out.add(m)
            stack.extend(self.trace.modules[m].children)
        return out

    def part(
        self,
        modules: Iterable[str],
        params: Iterable[str],
        flops: float,
        replicated: set[str] = frozenset(),
    ) -> PartStats:
        """Statistics of ``modules`` holding ``params``; ``replicated``: parameters tensor parallel
        leaves whole here (held by several pipeline stages)."""
        mods = self.trace.modules
        modules = set(modules)
        s = PartStats(flops=flops)
        sizes = self.trace.param_sizes
        params = list(params)
        tp_param = {p: self.tp_param.get(p, False) and p not in replicated for p in params}
        for p in params:
            s.param_bytes += sizes[p][0]
            s.tp_param_bytes += sizes[p][0] if tp_param[p] else 0
            s.kv_param_bytes += sizes[p][0] if p in self.tp_kv else 0
        whole = {b for b, sub in self.blocks.items() if b in modules and sub <= modules}
        for m in modules:
            node = mods[m]
            s.calls += node.calls
            sharded = any(
                tp_param.get(self.trace.param_alias.get(p, p), False) for p in node.params
            )
            if sharded:
                s.tp_calls += node.calls
            if any(self.trace.param_alias.get(p, p) in self.tp_kv for p in node.params):
                s.kv_calls += node.calls
            # whole on every tp rank: norms and dropout (no sequence parallel), the whole inputs of
            # column-parallel layers, and whatever runs outside the repeated blocks on modules
            # tensor parallel leaves whole (a head, the container's own code)
            outside = self.block_of.get(m) is None and not sharded
            rep = any(k in node.type for k in REPLICATED_ACT) or m in self.tp_whole_input or outside
            s.act += node.saved_bytes
            if node.params:  # its weight gradient needs the gradient of its output
                s.wgrad_keep += node.out_bytes
            s.act_rep += node.saved_bytes if rep else 0
            if (
                self.block_of.get(m) not in whole
            ):  # outside every whole block: kept under checkpointing
                s.ckpt_act += node.saved_bytes
                s.ckpt_act_rep += node.saved_bytes if rep else 0
        in_blocks: set[str] = set()
        for b in whole:
            sub = self.blocks[b]
            node = mods[b]
            b_in = node.out_bytes / max(node.calls, 1)  # a block's input is shaped like its output
            s.ckpt_act += b_in
            s.ckpt_act_rep += b_in
            s.recompute_peak = max(s.recompute_peak, float(sum(mods[m].saved_bytes for m in sub)))
            own = [p for m in sub for p in mods[m].params]
            in_blocks.update(own)
            pb = sum(sizes[p][0] for p in own)
            if pb > s.block_param:
                s.block_param = float(pb)
                s.block_tp_param = float(
                    sum(sizes[p][0] for p in own if tp_param.get(p, self.tp_param.get(p)))
                )
            s.blocks += 1
            s.block_out += node.out_bytes
        for p in params:
            if p not in in_blocks:
                s.outside_param += sizes[p][0]
                s.outside_tp_param += sizes[p][0] if tp_param[p] else 0
        return s


def tp_plan_facts(
    model, trace: TraceResult, tp: int = 2, kv: set[str] | None = None
) -> tuple[set[str], set[str]]:
    """What ``parallel.tp`` does to ``model`` (its plan read off ``trace``'s dataflow): (the
    canonical names of the parameters it shards, the modules whose saved input stays whole on
    every tp rank). Sharded: column-parallel weights and biases, row-parallel weights (their biases
    are added once, whole), vocabulary-parallel embeddings and LM heads, and the linear layers'
    matrices under a module rule. Tied parameters, norms, position embeddings stay whole. Whole
    input: column-parallel layers and the LM head (each rank multiplies the whole input by its
    shard of the columns). ``kv``: filled with the replicated key/value parameters (fewer
    key/value heads than ``tp``: whole on every rank)."""
    from ..tp.plan import discover_plan

    plan = discover_plan(model, tp, trace=trace, read_layouts=False)
    mods = dict(model.named_modules())

    def join(*parts: str) -> str:
        return ".".join(x for x in parts if x)

    out: set[str] = set()
    whole_input = {n for n, e in plan.entries.items() if e.role in WHOLE_INPUT_ROLES}
    for n, e in plan.entries.items():
        m = mods[n]
        if e.role in ("colwise", "vocab_embedding", "lm_head"):
            names = [join(n, k) for k, _ in m.named_parameters(recurse=False)]
        elif e.role == "rowwise":
            names = [join(n, "weight")]
        elif e.role == "kv_replicate":
            if kv is not None:
                own = (join(n, k) for k, _ in m.named_parameters(recurse=False))
                kv.update(trace.param_alias.get(p, p) for p in own)
            continue
        elif e.role.startswith(
            "rule:"
        ):  # a module rule shards its weight matrices (nn.MultiheadAttention:
            # the fused in_proj and out_proj), biases and norms stay whole
            names = [join(n, k) for k, p in m.named_parameters() if p.dim() >= 2]
        else:
            continue
        out.update(trace.param_alias.get(p, p) for p in names)
    return out, whole_input
