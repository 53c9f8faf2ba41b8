"""The tensor-parallel self-check: a plan is applied only where it reproduces the model.

Discovery reads a plan off one forward's dataflow. A layout it misreads (a fused projection, a
head count kept in an attribute it does not know) shards a module into something that runs but
computes another function. Before the model is sharded, each *unit* of the plan runs twice on the
inputs it received in one forward of the example: as it is (replicated), and as a deep copy with
the unit's part of the plan applied (sharded). A unit is

- the owner of a column -> row pair (the smallest module holding the sources and the sink; the
  plan divides the head counts in its subtree): its output is whole again after the row sum;
- a module under a module rule, a vocabulary-parallel embedding, a vocabulary-parallel LM head.

Outputs, input gradients and parameter gradients (for a fixed random cotangent) are compared in
fp32 (TF32 off), each relative to its scale. The largest relative error is all-reduced (max) over
the tp group, so every rank takes the same decision. A unit over the tolerance keeps its
replicated form: its plan entries become ``replicate``, with one log line naming it, the error and
the layout. Units are checked innermost first, each together with the units inside it that
passed, so a unit's check covers exactly what will be applied inside it. The check shards with
plain TP collectives; sequence parallel changes the collectives, not the layouts, and a layer list
holding a rejected unit leaves sequence parallel off.

Whole model (pp == 1): ``apply_tp`` captures, checks and applies. A pipeline rank's part: capture
on the whole model before the split (``capture_inputs``), then ``verify_and_apply`` on the part
with its stage plan. The example inputs must be the same on the tp ranks (as every TP batch).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import inspect
import math
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from parallel.tp.plan import LEFT_REPLICATED, TPEntry, TPPlan, apply_plan, discover_plan
from parallel.trace import TraceResult

UNIT_ROLES = ("vocab_embedding", "lm_head")  # entries that are units of their own (besides rule:*)
# entries of a column -> row pair: decided together, as one unit (the pair's owner)
PAIR_ROLES = ("colwise", "rowwise", "kv_replicate", "head_local")


@dataclass
class CapturedInputs:
    """(args, kwargs) of each unit's first call in one forward of the example on the unsharded
    model (eval mode, KV caches off: ``_kv_cache_off``), detached and deep-copied."""

    calls: dict[str, tuple[tuple, dict]] = field(default_factory=dict)
    # per call, for each tensor of (args, kwargs) in ``_map`` order: whether it required grad in
    # the model (hidden states do; rotary cos / sin built from buffers do not, and a sharded
    # unit's gradient for them is a per-rank partial sum nothing consumes)
    needs_grad: dict[str, list[bool]] = field(default_factory=dict)
    skipped: str = ""  # why nothing could be captured (then the plan is applied unchecked, logged)
    # per unit, the indexes (``_tensors`` order) of its outputs that a module called later takes
    # as input: T5's attention returns its position bias, and the next block adds it to its own
    # scores, so that output's head count must match the next block's, not only the first output
    consumed: dict[str, set[int]] = field(default_factory=dict)


def plan_units(plan: TPPlan) -> dict[str, list[str]]:
    """Unit module name -> the plan entries it decides; innermost units first, then module order."""
    units: dict[str, list[str]] = {}
    for n, e in plan.entries.items():
        if e.role in PAIR_ROLES and e.group in plan.owners:
            units.setdefault(plan.owners[e.group], []).append(n)
        elif e.role.startswith("rule:") or e.role in UNIT_ROLES:
            units.setdefault(n, []).append(n)
    first = {u: i for i, u in enumerate(units)}
    depth = {u: (u.count(".") + 1 if u else 0) for u in units}
    return {u: units[u] for u in sorted(units, key=lambda u: (-depth[u], first[u]))}


@contextlib.contextmanager
def _kv_cache_off(model: nn.Module):
    """``config.use_cache`` off on every module that has one (Hugging Face models), restored after.

    With a KV cache, each attention layer receives the cache object holding the earlier layers'
    keys and values: non-leaf tensors ``copy.deepcopy`` refuses, so those layers' inputs could
    not be captured and their units stayed replicated (LLaVA: 3 of 4 language layers), and a
    replayed call would read all heads' keys from it. The ``use_cache=False`` argument alone does
    not reach a composite model's language model when the outer forward takes it only through
    ``**kwargs`` (``LlavaForConditionalGeneration``); each sub-model reads its own config."""
    configs = {}  # id -> config: sub-models may share one
    for m in model.modules():
        c = getattr(m, "config", None)
        if getattr(c, "use_cache", None) is True:
            configs[id(c)] = c
    for c in configs.values():
        c.use_cache = False
    try:
        yield
    finally:
        for c in configs.values():
            c.use_cache = True


def _call(model: nn.Module, example_inputs: Any) -> Any:
    args = example_inputs if isinstance(example_inputs, tuple | list) else ()
    kwargs = dict(example_inputs) if isinstance(example_inputs, dict) else {}
    if not isinstance(example_inputs, tuple | list | dict):
        args = (example_inputs,)
    try:
        if "use_cache" in inspect.signature(model.forward).parameters and "use_cache" not in kwargs:
            kwargs["use_cache"] = False  # a KV cache would grow with every rerun of a captured call
    except (TypeError, ValueError):
        pass
    with _kv_cache_off(model):
        return model(*args, **kwargs)


def capture_inputs(model: nn.Module, plan: TPPlan, example_inputs: Any) -> CapturedInputs:
    """One forward of ``example_inputs`` on the unsharded ``model``, keeping each unit's inputs.
    On the pipeline path call it on the whole model before the split, with the whole plan."""
    if example_inputs is None:
        return CapturedInputs(skipped="no example inputs")
    if any(p.is_meta for p in model.parameters()):
        return CapturedInputs(skipped="parameters on the meta device")
    units = plan_units(plan)
    mods = dict(model.named_modules())
    cap = CapturedInputs()

    def pre(name: str):
        def hook(mod, args, kwargs):
            if name in cap.calls:
                return
            flags: list[bool] = []

            def detach(t: torch.Tensor) -> torch.Tensor:
                flags.append(t.requires_grad)
                return t.detach().clone()  # a view's own elements, not its whole storage

            try:
                cap.calls[name] = copy.deepcopy(_map((tuple(args), dict(kwargs)), detach))
            except (
                Exception
            ) as e:  # an input object that cannot be copied: the unit fails its check
                cap.calls[name] = ((), {"__not_copied__": f"{type(e).__name__}: {e}"})
            cap.needs_grad[name] = flags

        return hook

    produced: dict[
        int, tuple[str, int, torch.Tensor]
    ] = {}  # id -> (unit, output index, tensor kept alive)

    def post(name: str):
        def hook(mod, args, out):
            if name not in cap.consumed:  # first call only, as the inputs
                cap.consumed[name] = set()
                for i, t in enumerate(_tensors(out)):
                    produced.setdefault(id(t), (name, i, t))

        return hook

    def consumer(mod, args, kwargs):
        for t in _tensors((args, kwargs)):
            hit = produced.get(id(t))
            if hit is not None and hit[2] is t:
                cap.consumed[hit[0]].add(hit[1])

    handles = [
        mods[u].register_forward_pre_hook(pre(u), with_kwargs=True) for u in units if u in mods
    ]
    handles += [mods[u].register_forward_hook(post(u)) for u in units if u in mods]
    handles += [m.register_forward_pre_hook(consumer, with_kwargs=True) for m in model.modules()]
    modes = [(m, m.training) for m in model.modules()]
    model.eval()  # dropout off: the ranks see the same activations
    try:
        with torch.enable_grad():  # so the hooks see which inputs carry gradients
            _call(model, example_inputs)
    finally:
        for h in handles:
            h.remove()
        for m, t in modes:
            m.training = t
    return cap


def _map(obj: Any, fn, memo: dict[int, torch.Tensor] | None = None) -> Any:
    """``fn`` once on every distinct tensor inside tuples, lists and dicts (other objects pass
    through); a tensor passed twice stays one tensor (``nn.MultiheadAttention`` checks
    ``query is key``)."""
    memo = {} if memo is None else memo
    if isinstance(obj, torch.Tensor):
        if id(obj) not in memo:
            memo[id(obj)] = fn(obj)
        return memo[id(obj)]
    if isinstance(obj, tuple | list):
        items = [_map(o, fn, memo) for o in obj]
        return type(obj)(*items) if hasattr(obj, "_fields") else type(obj)(items)
    if isinstance(obj, dict):
        return {k: _map(v, fn, memo) for k, v in obj.items()}
    return obj


def _tensors(out: Any) -> list[torch.Tensor]:
    """The tensors of a module output (tensor, tuple, dict / ModelOutput, dataclass), in order."""
    if isinstance(out, DTensor):
        return [out.full_tensor()]
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, tuple | list):
        return [t for o in out for t in _tensors(o)]
    if isinstance(out, dict):
        return [t for o in out.values() for t in _tensors(o)]
    if dataclasses.is_dataclass(out) and not isinstance(out, type):
        return [t for f in dataclasses.fields(out) for t in _tensors(getattr(out, f.name))]
    return []


def _forward(
    mod: nn.Module, call: tuple[tuple, dict], needs_grad: list[bool]
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """``mod``'s output tensors on a fresh copy of a captured call (floating inputs in fp32; those
    that carried gradients in the model require grad), in eval mode; and those inputs."""
    args, kwargs = copy.deepcopy(call)
    if "__not_copied__" in kwargs:
        raise RuntimeError(f"the captured inputs could not be copied ({kwargs['__not_copied__']})")
    ins: list[torch.Tensor] = []
    flags = iter(needs_grad)

    def leaf(t: torch.Tensor) -> torch.Tensor:
        grad = next(flags, False)
        if t.is_floating_point():
            t = t.float()
            if grad:
                t.requires_grad_(True)
                ins.append(t)
        return t

    args, kwargs = _map((args, kwargs), leaf)
    modes = [(m, m.training) for m in mod.modules()]
    mod.eval()
    try:
        with torch.enable_grad():
            out = mod(*args, **kwargs)
    finally:
        for m, t in modes:
            m.training = t
    return _tensors(out), ins


def _grads(
    outs: list[torch.Tensor], idx: list[int], wrt: list[torch.Tensor]
) -> list[torch.Tensor | None] | None:
    """Gradients of sum_i <outs[i], c_i> (c_i: fixed random, the same on every run) w.r.t.
    ``wrt``."""
    loss = None
    for i in idx:
        o = outs[i]
        if o.requires_grad and o.is_floating_point():
            c = torch.randn(
                o.shape, generator=torch.Generator().manual_seed(i), dtype=torch.float32
            ).to(o.device)
            loss = (o.float() * c).sum() if loss is None else loss + (o.float() * c).sum()
    if loss is None or not wrt:
        return None
    return list(torch.autograd.grad(loss, wrt, allow_unused=True))


def _full(t: torch.Tensor | None) -> torch.Tensor | None:
    return t.full_tensor() if isinstance(t, DTensor) else t


def _worst(
    pairs: list[tuple[str, torch.Tensor | None, torch.Tensor | None]], floor: float
) -> tuple[float, str]:
    """Largest max|x - x_ref| / max(max|x_ref|, floor * the largest max|x_ref| of the list)."""
    top = max(
        (float(r.abs().max()) for _, _, r in pairs if r is not None and r.numel()), default=0.0
    )
    err, what = 0.0, ""
    for name, x, r in pairs:
        if x is None and r is None:
            continue
        x = torch.zeros_like(r) if x is None else x.float()
        r = torch.zeros_like(x) if r is None else r.float()
        if x.shape != r.shape:
            return math.inf, f"{name}: shape {tuple(x.shape)}, replicated {tuple(r.shape)}"
        d = float((x - r).abs().max()) if r.numel() else 0.0
        scale = max(float(r.abs().max()) if r.numel() else 0.0, floor * top)
        e = d / scale if scale > 0 else (0.0 if d == 0 else math.inf)
        if e > err or e != e:
            err, what = (e if e == e else math.inf), name
    return err, what


def _sub_plan(
    plan: TPPlan, unit: str, unit_of: dict[str, str], live: set[str]
) -> tuple[TPPlan, bool]:
    """The entries of ``live`` units inside ``unit``, renamed for a host module holding a copy of
    ``unit`` as child ``u`` (the root: the copy itself, names unchanged). Returns (plan, hosted)."""

    def inside(n: str) -> bool:
        return not unit or n == unit or n.startswith(unit + ".")

    def rel(n: str) -> str:
        return n if not unit else ("u" if n == unit else "u." + n[len(unit) + 1 :])

    sub = TPPlan()
    for n, e in plan.entries.items():
        if unit_of.get(n) in live and inside(n):
            sub.entries[rel(n)] = e
    groups = {e.group for e in sub.entries.values() if e.group >= 0}
    sub.owners = {g: rel(o) for g, o in plan.owners.items() if g in groups}
    return sub, bool(unit)


def _check_unit(
    model: nn.Module,
    unit: str,
    plan: TPPlan,
    unit_of: dict[str, str],
    live: set[str],
    mesh: DeviceMesh,
    captured: CapturedInputs,
) -> tuple[float, str]:
    """Largest relative error of the sharded copy of ``unit`` against ``unit`` itself, and where."""
    if unit not in captured.calls:
        return math.inf, "not called in the example's forward"
    call, needs_grad = captured.calls[unit], captured.needs_grad.get(unit, [])
    mod = model.get_submodule(unit) if unit else model
    fp32 = all(p.dtype == torch.float32 for p in mod.parameters())
    ref = mod if fp32 else copy.deepcopy(mod).float()
    y_ref, x_ref = _forward(ref, call, needs_grad)
    trial = copy.deepcopy(mod).float()
    sub, hosted = _sub_plan(plan, unit, unit_of, live)
    host = trial
    if hosted:
        host = nn.Module()
        host.add_module("u", trial)
    apply_plan(host, sub, mesh, quiet=True)
    y, x = _forward(trial, call, needs_grad)
    # only the outputs' structure decides what runs next (values may differ between the ranks of
    # a broken layout; the collectives of the backward below must line up on every rank)
    if len(y) != len(y_ref) or not y or y[0].shape != y_ref[0].shape:
        return (
            math.inf,
            f"outputs {[tuple(t.shape) for t in y]}, replicated {[tuple(t.shape) for t in y_ref]}",
        )
    # the first output must agree in shape, and so must every output a later module takes in;
    # the others (per-head attention weights nothing reads) may stay sharded
    for i in sorted(captured.consumed.get(unit, ())):
        if i < len(y) and y[i].shape != y_ref[i].shape:
            return math.inf, (
                f"output {i}, which a later module takes in, has shape {tuple(y[i].shape)}, "
                f"replicated {tuple(y_ref[i].shape)}"
            )
    idx = [i for i in range(len(y)) if y[i].shape == y_ref[i].shape]
    err, what = _worst(
        [
            (f"output {i}", y[i].detach(), y_ref[i].detach())
            for i in idx
            if y[i].is_floating_point() or y_ref[i].is_floating_point()
        ],
        0.0,
    )
    for i in idx:
        if not (y[i].is_floating_point() or y_ref[i].is_floating_point()) and not torch.equal(
            y[i], y_ref[i]
        ):
            err, what = math.inf, f"output {i}"
    p_ref = [(n, p) for n, p in ref.named_parameters() if p.requires_grad]
    p_trial = dict(trial.named_parameters())
    if any(n not in p_trial for n, _ in p_ref):
        return math.inf, "parameter names changed"
    g_ref = _grads(y_ref, idx, [p for _, p in p_ref] + x_ref)
    if g_ref is None:
        return err, f"{what}: {err:.1e}" if what else ""
    g = _grads(y, idx, [p_trial[n] for n, _ in p_ref] + x)
    if g is None:
        return math.inf, "sharded output does not require grad"
    g = [_full(t) for t in g]  # same parameters, same order on every rank: the gathers line up
    k = len(p_ref)
    # gradients relative to their own scale, floored at 1% of the largest (a key bias's gradient
    # is zero in exact arithmetic: its rounding noise is not an error)
    ep, wp = _worst([(f"gradient of {n}", g[i], g_ref[i]) for i, (n, _) in enumerate(p_ref)], 1e-2)
    ex, wx = _worst(
        [(f"input gradient {i}", g[k + i], g_ref[k + i]) for i in range(len(x_ref))], 1e-2
    )
    found = [(e, w) for e, w in ((err, what), (ep, wp), (ex, wx)) if w]
    return max(err, ep, ex), "; ".join(f"{w}: {e:.1e}" for e, w in found)


def _device(mesh: DeviceMesh) -> torch.device:
    if mesh.device_type == "cpu":
        return torch.device("cpu")
    return torch.device(mesh.device_type, getattr(torch, mesh.device_type).current_device())


@contextlib.contextmanager
def _exact_fp32():
    """fp32 matmuls and convolutions in full precision (no TF32) while the check runs."""
    prev = torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32
    torch.set_float32_matmul_precision("highest")
    torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(prev[0])
        torch.backends.cudnn.allow_tf32 = prev[1]


def _same_inputs(captured: CapturedInputs, mesh: DeviceMesh) -> bool:
    """Whether every tp rank captured the same inputs (one all-reduce of a fingerprint)."""
    s = torch.zeros(2, dtype=torch.float64)
    for call in captured.calls.values():
        for t in _tensors(list(call)):
            if not t.is_meta:  # masks hold -inf: counted as -1
                v = float(
                    torch.nan_to_num(t.detach().double(), nan=0.0, posinf=1.0, neginf=-1.0).sum()
                )
                s += torch.tensor([v, -v], dtype=torch.float64)
    s = s.to(_device(mesh))
    m = s.clone()
    dist.all_reduce(m, op=dist.ReduceOp.MAX, group=mesh.get_group())
    return bool(torch.equal(m, s)) and float(m[0]) == -float(m[1])


def _layout(plan: TPPlan, names: list[str]) -> str:
    return ", ".join(
        f"{n} {plan.entries[n].role}"
        + (f" blocks={plan.entries[n].blocks}" if plan.entries[n].blocks > 1 else "")
        for n in names
    )


def verify_plan(
    model: nn.Module,
    plan: TPPlan,
    mesh: DeviceMesh,
    captured: CapturedInputs,
    *,
    rtol: float = 1e-4,
) -> TPPlan:
    """A copy of ``plan`` whose units that do not reproduce ``model`` (relative error > ``rtol``
    on the max over the tp ranks) are replicated; ``model`` is left unchanged. Collective over
    ``mesh``'s group: every tp rank calls it with the same plan."""
    plan = copy.deepcopy(plan)
    units = plan_units(plan)
    if not units:
        return plan
    if captured.skipped:
        plan.log.append(f"self-check skipped ({captured.skipped}): plan applied unchecked")
        return plan
    if not _same_inputs(captured, mesh):
        raise ValueError(
            "tp self-check: the example inputs differ across the tensor-parallel ranks; "
            "tp ranks must be given the same batch"
        )
    unit_of = {n: u for u, names in units.items() for n in names}
    group, dev = mesh.get_group(), _device(mesh)
    live: set[str] = set()
    rejected: list[str] = []
    worst = 0.0
    with _exact_fp32():
        for u, names in units.items():
            try:
                err, what = _check_unit(model, u, plan, unit_of, live | {u}, mesh, captured)
            except Exception as e:  # a sharded form that does not even run: replicated
                err, what = math.inf, f"{type(e).__name__}: {str(e)[:200]}"
            t = torch.tensor([err if err == err else math.inf], dtype=torch.float64, device=dev)
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
            if float(t) <= rtol:
                live.add(u)
                worst = max(worst, float(t))
                continue
            rejected.append(u)
            layout = _layout(plan, names)
            where = (
                what if err > rtol or err != err else "this rank agrees; another tp rank does not"
            )
            plan.log.append(
                f"self-check: {u or type(model).__name__} {LEFT_REPLICATED}: max relative error "
                f"{float(t):.2e} > {rtol:g} ({where}); layout was {layout}"
            )
            for n in names:
                e = plan.entries[n]
                plan.entries[n] = TPEntry(
                    "replicate", reason=f"self-check failed ({e.role}, blocks={e.blocks})"
                )
                plan.owners.pop(e.group, None)
    _drop_regions(plan, rejected)
    plan.log.append(
        f"self-check: {len(live)} of {len(units)} units sharded (largest relative error "
        f"{worst:.1e}, tolerance {rtol:g})"
    )
    return plan


def _drop_regions(plan: TPPlan, rejected: list[str]) -> None:
    """Sequence parallel off for each layer list holding a rejected unit (its replicated module
    would see a sequence shard)."""
    for first, last in list(plan.regions):
        prefix = first.rpartition(".")[0] + "."
        if any(u.startswith(prefix) for u in rejected):
            plan.regions.remove((first, last))
            for n in [
                n
                for n, e in plan.entries.items()
                if e.role == "sequence_local" and n.startswith(prefix)
            ]:
                del plan.entries[n]
            plan.log.append(
                f"sequence parallel off over {first} .. {last}: a unit inside failed the self-check"
            )


def verify_and_apply(
    model: nn.Module,
    plan: TPPlan,
    mesh: DeviceMesh,
    captured: CapturedInputs,
    *,
    rtol: float = 1e-4,
    sequence_parallel: bool = False,
    loss_parallel: bool = False,
    seq_dim: int = 1,
) -> TPPlan:
    """Check ``plan`` unit by unit on ``captured`` (``capture_inputs``), then shard ``model`` in
    place with the units that agree. Returns the plan as applied; its ``log`` names every unit
    left replicated and why. ``model`` may be a pipeline rank's part (other ranks' parameters
    freed) with its stage plan: only the plan's units are run."""
    checked = verify_plan(model, plan, mesh, captured, rtol=rtol)
    ctx = apply_plan(
        model,
        checked,
        mesh,
        sequence_parallel=sequence_parallel,
        loss_parallel=loss_parallel,
        seq_dim=seq_dim,
    )
    checked.log = ctx.log
    return checked


def apply_tp(
    model: nn.Module,
    mesh: DeviceMesh,
    example_inputs: Any = None,
    *,
    trace: TraceResult | None = None,
    plan: TPPlan | None = None,
    sequence_parallel: bool = False,
    loss_parallel: bool = False,
    loss_fn=None,
    seq_dim: int = 1,
    verify: bool = True,
    rtol: float = 1e-4,
) -> TPPlan:
    """Discover (unless given) and apply a TP plan on the 1-D tp ``mesh``. Returns the plan as
    applied; its ``log`` says what was sharded, what was left replicated and why. ``verify``: run
    the self-check first (``verify_and_apply``: each unit of the plan, sharded, must reproduce its
    replicated output and gradients on the example within ``rtol``, or it stays replicated)."""
    if mesh.size() == 1:
        return plan or TPPlan()
    if plan is None:
        plan = discover_plan(
            model,
            mesh.size(),
            trace,
            example_inputs,
            sequence_parallel=sequence_parallel,
            loss_fn=loss_fn,
        )
    if verify:
        return verify_and_apply(
            model,
            plan,
            mesh,
            capture_inputs(model, plan, example_inputs),
            rtol=rtol,
            sequence_parallel=sequence_parallel,
            loss_parallel=loss_parallel,
            seq_dim=seq_dim,
        )
    ctx = apply_plan(
        model,
        plan,
        mesh,
        sequence_parallel=sequence_parallel,
        loss_parallel=loss_parallel,
        seq_dim=seq_dim,
    )
    plan.log = ctx.log
    return plan


def sharded_share(model: nn.Module) -> tuple[float, list[str]]:
    """How much of a model tensor parallel shards: the share (by element count) of the 2-D weights
    outside embeddings held as DTensors with a non-replicated placement, and the names of the 2-D
    weights left whole (replicated by the self-check or by no rule)."""
    from torch.distributed.tensor import Replicate

    emb = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    total, sharded, whole = 0, 0, []
    for n, p in model.named_parameters():
        if p.dim() != 2 or id(p) in emb:
            continue
        total += p.numel()
        if isinstance(p, DTensor) and any(not isinstance(pl, Replicate) for pl in p.placements):
            sharded += p.numel()
        else:
            whole.append(n)
    return sharded / total, whole
