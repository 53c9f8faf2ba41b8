"""Automatic (and manual) pipeline partitioning of an arbitrary ``nn.Module``.

``auto_partition`` traces the model (``trace.py``), cuts the module tree into units
(``units.py``), and places contiguous runs of units on stages with the exact min-max dynamic
program (``balance.py``) under the cost model (``cost.py``). Where the tree is too coarse to
balance (a transformer block dominating a stage, a unit over the memory cap) it descends into
that module and solves again.

Shared parameters (tied embedding / LM head): a contiguous linear pipeline cannot co-locate the
first and the last layer, so the default policy ``shared="replicate"`` keeps a copy on every stage
that uses the parameter and marks the group ``grad_sync`` - the runtime broadcasts it at start and
all-reduces its gradient over those stages each step (as Megatron and DeepSpeed do for tied
embeddings). Where all users land on one rank (one stage, or the first
and last stage of a V-shaped schedule) the group is reported ``colocated`` and needs no sync.
``shared="colocate"`` instead forbids every cut between the users (SageMaker's rule).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from torch import nn

from .balance import InfeasiblePartition, balanced_bounds, minmax_partition, uniform_bounds
from .cost import CostConfig, StageCosts
from .trace import TraceResult, trace_model
from .units import Unit, UnitBuilder, cut_bytes, layer_units

# memory weight per objective (see README of cost.py)
OBJECTIVE_WEIGHT = {
    "speed": 0.0,
    "memory": 0.8,
}
REFINE_FRACTION = 8  # descend into a unit above 1/8 of the ideal stage time: fine enough to balance
REFINE_SLACK = 0.02  # stop descending once the largest stage is within 2% of the ideal
REFINE_ROUNDS = 32  # bound on descend-and-resolve rounds after the first cut
COMM_TOLERANCE = 0.01  # accept a 1% worse bottleneck for fewer bytes across the cuts


@dataclass
class StageReport:
    """What one stage costs, per microbatch (time) and at peak (memory)."""

    stage: int  # stage index in pipeline order
    rank: int  # pipeline rank that runs it
    first: str  # name of its first unit
    last: str  # name of its last unit
    num_units: int  # units placed on it
    time: float  # forward+backward seconds including send/receive at its cuts
    compute_time: float  # forward+backward seconds of its units alone
    param_bytes: int  # bytes of the parameters it holds (replicas of shared ones included)
    act_bytes: int  # activation bytes saved per microbatch
    memory: float  # params x (1+grad+opt) + buffers + activations x in-flight microbatches
    comm_in: int  # bytes received per microbatch forward (the same again as gradients backward)
    comm_out: int  # bytes sent per microbatch forward
    cost: float  # the objective the partitioner balanced


@dataclass
class SharedPlacement:
    """Where a group of tied parameters lives and whether its gradient must be synchronised."""

    params: list[str]  # every name of the shared parameter(s)
    modules: list[str]  # modules that register or use them
    stages: list[int]  # stages holding a copy
    policy: str  # "colocated" (one rank holds every user) or "replicated"
    grad_sync: bool  # True: all-reduce the gradient over ``stages`` (and broadcast at start)


@dataclass
class Partition:
    """The placement of every module and parameter on pipeline stages, with its costs."""

    method: str  # "auto", "manual", or a baseline: "uniform" | "parameters" | "time"
    num_stages: int  # pipeline stages (ranks x stages_per_rank)
    objective: str  # "speed" | "memory"
    cost_config: CostConfig  # the cost model it was balanced under
    timed: bool  # costs from measured time (True) or FLOPs (meta-device trace)
    units: list[Unit]  # the unit sequence in execution order
    unit_stage: list[int]  # stage of each unit (non-decreasing unless a manual override says so)
    cut_bytes: list[int]  # bytes crossing the cut before unit j, per microbatch (n + 1 entries)
    stage_rank: list[int]  # rank of each stage
    module_stages: dict[str, list[int]]  # module name -> stages it runs on (>1: a split container)
    param_stages: dict[str, list[int]]  # parameter name (every alias) -> stages holding it
    shared: list[SharedPlacement]  # tied-parameter groups and how they are kept consistent
    stages: list[StageReport]  # per-stage costs

    # --- queries
    def stage_of(self, name: str) -> int:
        """Stage of a module or parameter held by exactly one stage."""
        st = self.module_stages.get(name, self.param_stages.get(name))
        if st is None:
            raise KeyError(f"no module or parameter named {name!r}")
        if len(st) != 1:
            raise ValueError(f"{name!r} spans stages {st}")
        return st[0]

    @property
    def bounds(self) -> list[int]:
        """Unit index where each stage starts, plus n (contiguous partitions only)."""
        b = [0]
        for j in range(1, len(self.unit_stage)):
            if self.unit_stage[j] != self.unit_stage[j - 1]:
                b.append(j)
        return b + [len(self.unit_stage)]

    @property
    def max_time(self) -> float:
        return max(s.time for s in self.stages)

    @property
    def max_memory(self) -> float:
        """Peak memory of the fullest rank (several stages per rank add up)."""
        per_rank: dict[int, float] = {}
        for s in self.stages:
            per_rank[s.rank] = per_rank.get(s.rank, 0.0) + s.memory
        return max(per_rank.values())

    # --- output
    def table(self) -> str:
        head = (
            f"{'stage':>5} {'rank':>4} {'units':>5} {'first unit':<28} {'last unit':<28} "
            f"{'time ms':>8} {'params MB':>9} {'act MB':>7} {'mem MB':>8} {'in KB':>8} "
            f"{'out KB':>8} {'cost':>6}"
        )
        lines = [
            f"Partition ({self.method}, objective={self.objective}, "
            f"schedule={self.cost_config.schedule}, {self.num_stages} stages, {len(self.units)} "
            "units)",
            head,
            "-" * len(head),
        ]
        for s in self.stages:
            lines.append(
                f"{s.stage:>5} {s.rank:>4} {s.num_units:>5} {_short(s.first):<28} "
                f"{_short(s.last):<28} {s.time * 1e3:>8.3f} {s.param_bytes / 2**20:>9.2f} "
                f"{s.act_bytes / 2**20:>7.2f} {s.memory / 2**20:>8.2f} {s.comm_in / 1024:>8.1f} "
                f"{s.comm_out / 1024:>8.1f} {s.cost:>6.3f}"
            )
        for g in self.shared:
            sync = "gradients all-reduced over stages" if g.grad_sync else "no sync needed"
            lines.append(
                f"shared {g.params} used by {g.modules}: {g.policy} on stages {g.stages} ({sync})"
            )
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Partition:
        d = dict(d)
        d["cost_config"] = CostConfig(**d["cost_config"])
        d["units"] = [Unit(**u) for u in d["units"]]
        d["shared"] = [SharedPlacement(**g) for g in d["shared"]]
        d["stages"] = [StageReport(**s) for s in d["stages"]]
        return cls(**d)

    def save(self, path: str) -> None:
        with open(path, "w") as f:
            json.dump(self.to_dict(), f, indent=1)

    @classmethod
    def load(cls, path: str) -> Partition:
        with open(path) as f:
            return cls.from_dict(json.load(f))


def _short(name: str, width: int = 28) -> str:
    name = name or "<root>"
    return name if len(name) <= width else "…" + name[-(width - 1) :]


# ----------------------------------------------------------------------------- building blocks


def _unit_time(u: Unit, cfg: CostConfig, timed: bool) -> float:
    return u.time if timed else u.flops / cfg.flops_per_s


def _with_replicas(units: list[Unit], trace: TraceResult, policy: str) -> list[Unit]:
    """Under the replicate policy a unit that uses a shared parameter it does not hold carries a
    copy: count its bytes there too (an upper bound when two users share a stage)."""
    if policy != "replicate" or not trace.shared:
        return units
    out = []
    for u in units:
        extra = 0
        mods = set(u.modules) | {u.module}
        for g in trace.shared:
            canon = [p for p in g.params if trace.param_alias.get(p) == p]
            if mods & set(g.modules) and not set(canon) & set(u.params):
                extra += g.nbytes
        out.append(dataclasses.replace(u, param_bytes=u.param_bytes + extra) if extra else u)
    return out


def _positions_of(units: list[Unit], modules: Sequence[str]) -> list[int]:
    ms = set(modules)
    return [i for i, u in enumerate(units) if ms & set(u.modules)]


def _forbidden_cuts(units: list[Unit], trace: TraceResult, policy: str) -> set[int]:
    if policy != "colocate":
        return set()
    bad: set[int] = set()
    for g in trace.shared:
        pos = _positions_of(units, g.modules)
        if pos:
            bad.update(range(min(pos) + 1, max(pos) + 1))
    return bad


def _costs(
    units: list[Unit], trace: TraceResult, cfg: CostConfig, k: int, policy: str
) -> StageCosts:
    adj = _with_replicas(units, trace, policy)
    return StageCosts(adj, cut_bytes(units, trace), cfg, trace.timed, k)


def _largest_module_error(
    units: list[Unit], costs: StageCosts, cap: float, k: int
) -> InfeasiblePartition:
    i = max(range(len(units)), key=lambda j: costs.unit_memory(j))
    u = units[i]
    cfg = costs.cfg
    need = costs.unit_memory(i)
    total = sum(costs.unit_memory(j) for j in range(len(units)))
    return InfeasiblePartition(
        f"memory cap of {cap / 2**20:.1f} MiB per stage is infeasible for {k} stages: the largest "
        f"module {u.name or '<root>'!r} ({u.kind}) alone needs {need / 2**20:.1f} MiB (params "
        f"{u.param_bytes / 2**20:.1f} MiB x (1 + {cfg.grad_factor:g} grad + "
        f"{cfg.optimizer_factor:g} optimizer) + activations {u.act_bytes / 2**20:.1f} MiB x "
        f"{costs.inflight.max():g} microbatches in flight); the whole model needs "
        f"{total / 2**20:.1f} MiB. Raise the cap, add stages, or shard parameters."
    )


def _refine(
    trace: TraceResult, k: int, cfg: CostConfig, policy: str
) -> tuple[list[Unit], StageCosts, list[int]]:
    """Descend the tree until the units can be balanced, then solve exactly."""
    b = UnitBuilder(trace)
    units = b.root()
    timed = trace.timed
    total = _unit_time(units[0], cfg, timed)
    target = total / k
    cap = cfg.memory_cap
    state = 1.0 + cfg.grad_factor + cfg.optimizer_factor
    worst_inflight = float(cfg.microbatches)  # upper bound of any schedule's in-flight count

    def too_big(u: Unit) -> bool:
        if _unit_time(u, cfg, timed) > target / REFINE_FRACTION:
            return True
        return (
            cap is not None
            and u.param_bytes * state + u.buffer_bytes + u.act_bytes * worst_inflight > cap
        )

    # phase A: one sweep down the tree (each unit expanded at most once)
    changed = True
    while changed:
        changed = False
        out: list[Unit] = []
        for u in units:
            if u.kind == "module" and u.expandable and too_big(u):
                out.extend(b.expand(u))
                changed = True
            else:
                out.append(u)
        units = out
    while sum(u.kind == "module" for u in units) < k:  # every stage needs a module call to run
        cand = [i for i, u in enumerate(units) if u.kind == "module" and u.expandable]
        if not cand:
            raise InfeasiblePartition(
                f"the model has only {sum(u.kind == 'module' for u in units)} placeable modules "
                f"({[u.name for u in units if u.kind == 'module']}); cannot give each of {k} "
                "stages one (use fewer stages)"
            )
        i = max(cand, key=lambda j: _unit_time(units[j], cfg, timed))
        units[i : i + 1] = b.expand(units[i])

    def settle(
        units: list[Unit], bounds: list[int], best: float, tol: float
    ) -> tuple[list[Unit], list[int], float]:
        """Merge back what lies on one stage (``_coarsen``: the other stages no longer replay its
        own code) and solve again on the merged units, until nothing merges."""
        while True:
            merged, _ = _coarsen(b, units, _stage_of_units(bounds))
            if len(merged) == len(units):
                return units, bounds, best
            units = merged
            bounds, best = minmax_partition(
                _costs(units, trace, cfg, k, policy),
                k,
                cap,
                _forbidden_cuts(units, trace, policy),
                tolerance=tol,
            )

    # phase B: solve; descend into the bottleneck (or an over-cap unit) while that helps. A finer
    # cut is not always better: the expanded container's own code is replayed on every later
    # stage that does not hold it whole (cost.py), so each candidate is scored after merging back
    # what its solution leaves on one stage, and the best settled sequence seen is kept.
    best_units: list[Unit] | None = None
    best_cost = float("inf")
    for _ in range(REFINE_ROUNDS):
        costs = _costs(units, trace, cfg, k, policy)
        forbidden = _forbidden_cuts(units, trace, policy)
        try:
            bounds, best = minmax_partition(costs, k, cap, forbidden, tolerance=0.0)
        except InfeasiblePartition:
            cand = [i for i, u in enumerate(units) if u.kind == "module" and u.expandable]
            if not cand:
                if forbidden:
                    raise InfeasiblePartition(
                        "shared parameters with shared='colocate' force units "
                        f"{sorted(forbidden)[0] - 1}..{sorted(forbidden)[-1]} onto one stage; "
                        "use shared='replicate' or fewer stages"
                    ) from None
                raise _largest_module_error(units, costs, cap or 0.0, k) from None
            i = max(cand, key=lambda j: costs.unit_memory(j))
            units[i : i + 1] = b.expand(units[i])
            continue
        settled, _, settled_best = settle(list(units), bounds, best, 0.0)
        if settled_best < best_cost * (1 - 1e-9):
            best_units, best_cost = settled, settled_best
        # ideal: the units spread evenly, each stage also replaying all container code
        replay = costs.PS[-1] * (k - 1) / costs.total_time
        ideal = (
            (1 - cfg.memory_weight) * (1 + replay)
            + cfg.memory_weight
            * (costs.PM[-1] + costs.PA[-1] * costs.inflight.mean())
            / costs.total_mem
        ) / k
        if best <= (1 + REFINE_SLACK) * ideal:
            break
        s = max(range(k), key=lambda t: costs.cost(t, bounds[t], bounds[t + 1], cap))
        lo, hi = max(bounds[s] - 1, 0), min(bounds[s + 1] + 1, len(units))
        cand = [i for i in range(lo, hi) if units[i].kind == "module" and units[i].expandable]
        if not cand:
            break
        i = max(cand, key=lambda j: _unit_time(units[j], cfg, timed))
        units[i : i + 1] = b.expand(units[i])
    # the hand-written layer list (what the baselines cut) is also a candidate: it exposes less
    # container code than a deep descent, so it may balance better
    layers = layer_units(b)
    if sum(u.kind == "module" for u in layers) >= k:
        lc = _costs(layers, trace, cfg, k, policy)
        try:
            _, lbest = minmax_partition(
                lc, k, cap, _forbidden_cuts(layers, trace, policy), tolerance=0.0
            )
            if lbest < best_cost * (1 - 1e-9):
                best_units, best_cost = layers, lbest
        except InfeasiblePartition:
            pass
    if best_units is not None:
        units = best_units
    costs = _costs(units, trace, cfg, k, policy)
    bounds, best = minmax_partition(
        costs, k, cap, _forbidden_cuts(units, trace, policy), tolerance=COMM_TOLERANCE
    )
    units, bounds, _ = settle(units, bounds, best, COMM_TOLERANCE)
    return units, _costs(units, trace, cfg, k, policy), bounds


def _stage_of_units(bounds: Sequence[int]) -> list[int]:
    out = []
    for s in range(len(bounds) - 1):
        out.extend([s] * (bounds[s + 1] - bounds[s]))
    return out


def _coarsen(
    b: UnitBuilder, units: list[Unit], unit_stage: list[int]
) -> tuple[list[Unit], list[int]]:
    """Merge back each expanded module whose units all sit, in one run, on one stage (the search
    expands modules to balance the stages, and most expansions end up wholly on one side of every
    cut). Placement is unchanged; what changes is the replay: the other stages intercept the whole
    module as one call instead of running its own code (a block's attention, say) on stand-ins.
    Only modules whose whole subtree runs inside their one call merge (a child the wrapper calls
    first stays a unit of its own). Deepest modules first, so merges cascade up in one pass."""
    mods = b.mods

    def depth(name: str) -> int:
        return name.count(".") + 1 if name else 0

    expanded = sorted(
        {u.module for u in units if u.kind == "self" and u.module}, key=depth, reverse=True
    )
    for name in expanded:
        top = mods[name]
        if top.calls != 1:
            continue
        sub = set(b.subtree(name))
        if any(
            mods[m].calls and (mods[m].first_seq < top.first_seq or mods[m].last_seq > top.last_seq)
            for m in sub
        ):
            continue
        idx = [j for j, v in enumerate(units) if v.module in sub]
        lo, hi = idx[0], idx[-1]
        if hi - lo + 1 != len(idx) or len(set(unit_stage[lo : hi + 1])) != 1:
            continue
        units = units[:lo] + [b.module_unit(name)] + units[hi + 1 :]
        unit_stage = unit_stage[:lo] + [unit_stage[lo]] + unit_stage[hi + 1 :]
    return units, unit_stage


def _assemble(
    method: str,
    trace: TraceResult,
    units: list[Unit],
    unit_stage: list[int],
    costs: StageCosts,
    k: int,
    cfg: CostConfig,
    objective: str,
    policy: str,
) -> Partition:
    from .cost import rank_of_stage

    units = costs.units  # replica-adjusted: what the balancer saw
    n = len(units)
    ranks = [rank_of_stage(s, costs.num_ranks, cfg) for s in range(k)]
    mods = trace.modules
    module_stages: dict[str, set[int]] = {m: set() for m in mods}
    param_stages: dict[str, set[int]] = {}
    for u, s in zip(units, unit_stage):
        for m in u.modules:
            module_stages[m].add(s)
        a = mods[u.module].parent if u.kind == "module" else u.module
        while a is not None:  # containers split across stages run on each of them
            module_stages[a].add(s)
            a = mods[a].parent
        for p in u.params:
            param_stages.setdefault(p, set()).add(s)
    # shared parameters: a copy on every stage with a user
    shared = []
    for g in trace.shared:
        st = sorted({s for m in g.modules for s in module_stages.get(m, ())})
        for p in g.params:
            param_stages.setdefault(trace.param_alias.get(p, p), set()).update(st)
        one_rank = len({ranks[s] for s in st}) <= 1
        shared.append(
            SharedPlacement(
                list(g.params),
                list(g.modules),
                st,
                "colocated" if one_rank else "replicated",
                not one_rank,
            )
        )
    for alias, canon in trace.param_alias.items():
        param_stages[alias] = param_stages.get(canon, set())
    # exact per-stage report
    state = 1.0 + cfg.grad_factor + cfg.optimizer_factor
    comm_in, comm_out = [0] * k, [0] * k
    for j in range(1, n):
        if unit_stage[j] != unit_stage[j - 1]:
            comm_out[unit_stage[j - 1]] += costs.cut[j]
            comm_in[unit_stage[j]] += costs.cut[j]
    reports = []
    for s in range(k):
        idx = [i for i in range(n) if unit_stage[i] == s]
        held = {p for p, st in param_stages.items() if s in st and trace.param_alias.get(p, p) == p}
        pbytes = sum(trace.param_sizes[p][0] for p in held)
        buf = sum(units[i].buffer_bytes for i in idx)
        act = sum(units[i].act_bytes for i in idx)
        # own units, plus the container code the stage replays up to its last unit (cost.py)
        ctime = sum(float(costs.unit_time[i]) for i in idx if units[i].kind != "self")
        ctime += float(costs.PS[idx[-1] + 1]) if idx else 0.0
        time = ctime + 2.0 * (comm_in[s] + comm_out[s]) / cfg.bandwidth
        mem = pbytes * state + buf + act * float(costs.inflight[s])
        w = cfg.memory_weight
        cost = (1 - w) * time / costs.total_time + w * mem / costs.total_mem if idx else 0.0
        reports.append(
            StageReport(
                s,
                ranks[s],
                units[idx[0]].name if idx else "",
                units[idx[-1]].name if idx else "",
                len(idx),
                time,
                ctime,
                pbytes,
                act,
                mem,
                int(comm_in[s]),
                int(comm_out[s]),
                cost,
            )
        )
    return Partition(
        method=method,
        num_stages=k,
        objective=objective,
        cost_config=cfg,
        timed=trace.timed,
        units=units,
        unit_stage=list(unit_stage),
        cut_bytes=[int(c) for c in costs.cut],
        stage_rank=ranks,
        module_stages={m: sorted(v) for m, v in module_stages.items()},
        param_stages={p: sorted(v) for p, v in param_stages.items()},
        shared=shared,
        stages=reports,
    )


def _make_config(
    num_stages: int,
    objective: str,
    memory_cap_bytes: float | None,
    cost_config: CostConfig | None,
    memory_weight: float | None,
    schedule: str | None,
    microbatches: int | None,
    stages_per_rank: int | None,
) -> CostConfig:
    if objective not in OBJECTIVE_WEIGHT:
        raise ValueError(f"objective must be one of {sorted(OBJECTIVE_WEIGHT)}, got {objective!r}")
    cfg = cost_config or CostConfig()
    upd: dict[str, Any] = {
        "memory_weight": OBJECTIVE_WEIGHT[objective] if memory_weight is None else memory_weight
    }
    if memory_cap_bytes is not None:
        upd["memory_cap"] = float(memory_cap_bytes)
    if schedule is not None:
        upd["schedule"] = schedule
        if stages_per_rank is None and schedule == "zbv":
            upd["stages_per_rank"] = 2
    if microbatches is not None:
        upd["microbatches"] = microbatches
    if stages_per_rank is not None:
        upd["stages_per_rank"] = stages_per_rank
    cfg = dataclasses.replace(cfg, **upd)
    if num_stages % cfg.stages_per_rank:
        raise ValueError(
            f"{num_stages} stages do not divide into {cfg.stages_per_rank} stages per rank"
        )
    return cfg


# ----------------------------------------------------------------------------- public API


def partition_trace(
    trace: TraceResult,
    num_stages: int,
    objective: str = "speed",
    memory_cap_bytes: float | None = None,
    *,
    shared: str = "replicate",
    manual: Sequence[str] | Sequence[Sequence[str]] | None = None,
    cost_config: CostConfig | None = None,
    memory_weight: float | None = None,
    schedule: str | None = None,
    microbatches: int | None = None,
    stages_per_rank: int | None = None,
) -> Partition:
    """Partition an already-traced model (what ``auto_partition`` does after tracing).

    ``manual`` overrides the search: a list of ``num_stages - 1`` module names where a new stage
    begins (like torch pipelining's ``SplitPoint.BEGINNING``), or ``num_stages`` lists of module
    names per stage (units outside every list follow the unit before them). A manual partition
    keeps every unit its names ask for; the search's merges back what it expanded on one stage
    (``_coarsen``)."""
    if shared not in ("replicate", "colocate"):
        raise ValueError("shared must be 'replicate' or 'colocate'")
    cfg = _make_config(
        num_stages,
        objective,
        memory_cap_bytes,
        cost_config,
        memory_weight,
        schedule,
        microbatches,
        stages_per_rank,
    )
    if manual is not None:
        return _manual(trace, num_stages, cfg, objective, shared, manual)

    def solve(c: CostConfig) -> Partition:
        units, costs, bounds = _refine(trace, num_stages, c, shared)
        return _assemble(
            "auto", trace, units, _stage_of_units(bounds), costs, num_stages, cfg, objective, shared
        )

    part = solve(cfg)
    if cfg.memory_cap is not None and cfg.stages_per_rank > 1 and part.max_memory > cfg.memory_cap:
        # several stages share a rank: solve again with the cap split between them
        part = solve(dataclasses.replace(cfg, memory_cap=cfg.memory_cap / cfg.stages_per_rank))
        if part.max_memory > cfg.memory_cap:
            raise InfeasiblePartition(
                f"no placement keeps every rank under {cfg.memory_cap / 2**20:.1f} MiB"
            )
    return part


def auto_partition(
    model: nn.Module,
    example_inputs: tuple | list | dict,
    num_stages: int,
    objective: str = "speed",
    memory_cap_bytes: float | None = None,
    *,
    trace: TraceResult | None = None,
    passes: int = 3,
    loss_fn: Callable[[Any], Any] | None = None,
    **kwargs: Any,
) -> Partition:
    """Trace ``model`` on ``example_inputs`` (a tuple of positional arguments or a dict of keyword
    arguments, on the device to trace on: CPU, the target GPU, or meta for shapes only) and
    partition it into ``num_stages`` pipeline stages. ``objective`` is "speed" (balance time under
    the cap) or "memory" (memory weight 0.8, as SageMaker's library). Extra keyword arguments go
    to ``partition_trace`` (shared, manual, schedule, microbatches, stages_per_rank,
    memory_weight, cost_config)."""
    if trace is None:
        trace = trace_model(model, example_inputs, passes=passes, loss_fn=loss_fn)
    return partition_trace(trace, num_stages, objective, memory_cap_bytes, **kwargs)


def _manual(
    trace: TraceResult,
    k: int,
    cfg: CostConfig,
    objective: str,
    policy: str,
    manual: Sequence[str] | Sequence[Sequence[str]],
) -> Partition:
    b = UnitBuilder(trace)
    per_stage = not isinstance(manual[0], str) if len(manual) else False
    names = [m for group in manual for m in group] if per_stage else list(manual)
    for m in names:
        if m not in trace.modules:
            raise KeyError(f"manual partition names unknown module {m!r}")
    units = b.root()

    def split_needed(u: Unit) -> bool:  # a named module must be a unit of its own (or inside one)
        return (
            u.kind == "module"
            and u.expandable
            and any(m != u.name and (u.name == "" or m.startswith(u.name + ".")) for m in names)
        )

    while any(split_needed(u) for u in units):
        units = [x for u in units for x in (b.expand(u) if split_needed(u) else [u])]
    where = {m: i for i, u in enumerate(units) for m in u.modules}
    if per_stage:
        if len(manual) != k:
            raise ValueError(f"manual partition has {len(manual)} stage lists for {k} stages")
        unit_stage: list[int | None] = [None] * len(units)
        for s, group in enumerate(manual):
            for m in group:
                for i, u in enumerate(units):
                    if m in u.modules or u.module == m or u.module.startswith(m + "."):
                        unit_stage[i] = s
        prev = 0
        for i, s in enumerate(unit_stage):
            prev = s if s is not None else prev
            unit_stage[i] = prev
        stages = [int(s) for s in unit_stage]
    else:
        if len(manual) != k - 1:
            raise ValueError(f"{len(manual)} split points make {len(manual) + 1} stages, not {k}")
        starts = [where[m] for m in manual]
        if starts != sorted(set(starts)) or (starts and starts[0] == 0):
            raise ValueError(
                f"split points must be distinct and in execution order: {list(manual)}"
            )
        stages = _stage_of_units([0, *starts, len(units)])
    costs = _costs(units, trace, cfg, k, policy)
    return _assemble("manual", trace, units, stages, costs, k, cfg, objective, policy)


def baseline_partition(
    trace: TraceResult,
    num_stages: int,
    method: str,
    cost_config: CostConfig | None = None,
    units: list[Unit] | None = None,
) -> Partition:
    """The partitions users of other libraries get, over the hand-written list of layers
    (``layer_units``): "uniform" (DeepSpeed: equal layer count), "parameters" (DeepSpeed:
    balanced parameter count) and "time" (torchgpipe ``balance_by_time``: balanced measured
    time). Costed with the same model as ``auto`` for comparison."""
    cfg = cost_config or CostConfig()
    units = units if units is not None else layer_units(UnitBuilder(trace))
    n = len(units)
    if method == "uniform":
        bounds = uniform_bounds(n, num_stages)
    elif method == "parameters":
        bounds = balanced_bounds([u.param_numel for u in units], num_stages)
    elif method == "time":
        bounds = balanced_bounds([_unit_time(u, cfg, trace.timed) for u in units], num_stages)
    else:
        raise ValueError(f"unknown baseline {method!r}")
    costs = _costs(units, trace, cfg, num_stages, "replicate")
    return _assemble(
        method, trace, units, _stage_of_units(bounds), costs, num_stages, cfg, "speed", "replicate"
    )


__all__ = [
    "Partition",
    "StageReport",
    "SharedPlacement",
    "auto_partition",
    "partition_trace",
    "baseline_partition",
    "InfeasiblePartition",
]
