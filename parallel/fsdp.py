"""Sharded data parallel with FSDP2 (``fully_shard``): per-block units plus the root, HSDP when
the dp mesh is 2-D (replicate x shard), bf16 parameters with fp32 gradient reduction, optional
CPU offload of parameters, gradients and optimizer state (the optimizer then steps on the host).

Under a pipeline a rank holds only its stages' part, and the pipeline runs many microbatch
forwards and backwards per step, so the units are this rank's blocks and the other modules that
own its parameters, and one step is driven from outside (``StepSync``, as torch's own pipelining
stages do): parameters are gathered at the first forward and kept for the whole step,
gradients accumulate unsharded, and are reduce-scattered once after the last backward.

Composes with tensor parallel: parameters that are DTensors on the tp mesh get a 2-D layout
(dp shard x tp). A parameter whose TP layout is a strided fused block (q|k|v) is sharded by FSDP
on another dimension, so its ``full_tensor()`` keeps the single-device layout.
"""

from __future__ import annotations

import logging
import math

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
)
from torch.distributed.tensor import DTensor, Shard

log = logging.getLogger("parallel.fsdp")

# FSDP2's per-module state and parameter group are not public API; torch's pipelining stage
# (``perform_reduce_grad``) drives them the same way. ``_fsdp_param_group`` is the attribute on
# torch 2.11 and a compatibility property on 2.14 (one group per ``fully_shard`` call here).


def shard_unit(module: nn.Module, **kw) -> nn.Module:
    """``fully_shard(module, **kw)``, with the module's class still named as its own.

    FSDP2 swaps the module's class for a dynamic subclass ``FSDP<Name>`` (one per class, cached
    by torch) that adds ``unshard`` / ``reshard`` / ``set_*``. Model code that identifies a module
    by its class's name then stops recognising it: transformers keys its output-capture registry
    (``_can_record_outputs``) on ``str(type(model))``, so a vision tower made an FSDP unit and
    called with ``output_hidden_states=True`` returned ``hidden_states=None`` (LLaVA under pp x
    dp_shard). The swapped class takes the original's ``__module__``, ``__qualname__`` and
    ``__name__``: ``str(type(m))`` and ``type(m).__name__`` read as before, while FSDP's methods
    and ``isinstance(m, FSDPModule)`` still tell a unit apart. Code that compares classes by
    identity (``type(m) is X``) still sees the swap."""
    original = type(module)
    fully_shard(module, **kw)
    swapped = type(module)
    if swapped is not original:
        # torch creates the class once per original class; renaming it names every FSDP
        # instance of that class alike (torch itself finds the original by MRO position)
        swapped.__module__ = original.__module__
        swapped.__qualname__ = original.__qualname__
        swapped.__name__ = original.__name__
    return module


def mixed_precision_policy(mode: str) -> MixedPrecisionPolicy:
    """fp32: no casting. bf16: parameters and compute in bf16, gradients reduced in fp32 (the
    reduction is where bf16 rounding would accumulate across ranks)."""
    if mode == "bf16":
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    if mode == "fp32":
        return MixedPrecisionPolicy()
    raise ValueError(f"mixed_precision must be fp32 or bf16 (got {mode!r})")


def _placement_fn(p: nn.Parameter):
    """FSDP shards dim 0, except where TP already holds dim 0 as fused strided blocks."""
    if isinstance(p, DTensor):
        for pl in p.placements:
            if type(pl).__name__ == "_StridedShard" and p.dim() > 1:
                return Shard(1 if pl.dim == 0 else 0)
    return Shard(0)


def apply_fsdp(
    model: nn.Module,
    mesh: DeviceMesh,
    blocks: list[nn.Module] | None = None,
    *,
    mixed_precision: str = "fp32",
    cpu_offload: bool = False,
    reshard_after_forward: bool = True,
) -> nn.Module:
    """``fully_shard`` each block (layer) and then the root on ``mesh`` (1-D: FSDP, 2-D
    (replicate, shard): HSDP). Blocks are the communication units: one all-gather before each
    block's forward and backward, one reduce-scatter after its backward."""
    kw = dict(
        mesh=mesh,
        mp_policy=mixed_precision_policy(mixed_precision),
        offload_policy=CPUOffloadPolicy(pin_memory=torch.cuda.is_available())
        if cpu_offload
        else OffloadPolicy(),
        shard_placement_fn=_placement_fn,
    )
    for b in blocks or []:
        shard_unit(b, reshard_after_forward=reshard_after_forward, **kw)
    # the root's parameters (embeddings, final norm, head) are needed again right after forward
    shard_unit(model, reshard_after_forward=False, **kw)
    log.info(
        "fsdp: %d block units + root on mesh %s (mixed precision %s, cpu offload %s)",
        len(blocks or []),
        tuple(mesh.shape),
        mixed_precision,
        cpu_offload,
    )
    return model


@torch.no_grad()
def clip_grad_norm_(
    parameters,
    max_norm: float,
    norm_type: float = 2.0,
    *,
    group=None,
    copies: dict[int, int] | None = None,
) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` for a model spread over ranks; the one clipper of the
    runtime and the app. Each DTensor gradient's norm (a TP / FSDP shard) is reduced over its
    mesh; with ``group`` (a pipeline's ranks, each holding other parameters) the sum of the
    norms' ``norm_type``-th powers is all-reduced over it, and ``copies[id(p)]`` (default 1)
    divides the share of a parameter whose gradient that many ranks of ``group`` hold alike (a
    tied weight, a module held whole on every rank), so it counts once. Every rank then sees the
    norm of the whole model's gradient, and returns it (before clipping, a tensor on the
    gradients' device). No host sync: the clip coefficient stays a tensor; ``max_norm`` inf
    only measures."""
    params = [p for p in parameters if p.grad is not None]
    grads = [p.grad for p in params]
    if not grads and group is None:
        return torch.tensor(0.0)
    # a rank without gradients still joins the group's reduction, with nothing of its own
    dev = _local_tensor(grads[0]).device if grads else _collective_device(group)
    copies = copies or {}
    norms = [torch.zeros((), dtype=torch.float64, device=dev)]
    for p, g in zip(params, grads):
        n = torch.linalg.vector_norm(g, norm_type)
        n = (n.full_tensor() if isinstance(n, DTensor) else n).to(dev, torch.float64)
        norms.append(n if math.isinf(norm_type) else n.pow(norm_type) / copies.get(id(p), 1))
    stacked = torch.stack(norms)
    if math.isinf(norm_type):
        total = stacked.max()
        if group is not None:
            dist.all_reduce(total, op=dist.ReduceOp.MAX, group=group)
    else:
        total = stacked.sum()
        if group is not None:
            dist.all_reduce(total, group=group)
        total = total.pow(1.0 / norm_type)
    if not math.isinf(max_norm):
        coef = (max_norm / (total + 1e-6)).clamp(max=1.0)
        for g in grads:
            g.mul_(coef.to(g.device, g.dtype))
    return total.float()


def _local_tensor(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _collective_device(group) -> torch.device:
    """Where a tensor must be for ``group``'s collectives: the current GPU under NCCL, else the
    CPU."""
    if "nccl" in dist.get_backend(group):
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def fsdp_units(
    model: nn.Module, held: set[int], blocks: list[nn.Module], container: set[str]
) -> list[nn.Module]:
    """The FSDP units of one pipeline rank's part, innermost first: each held block, then the
    outermost modules around the rest of its parameters (an attention module with its output
    projection, whose weight the parent's own code reads, not the projection's forward). Left
    out, so they stay replicated over the data-parallel ranks (their gradients averaged like
    DDP's): parameters of the root or of a module in ``container`` (whose forward is container
    code, interrupted where the stage ends: FSDP's post-forward would not run), and parameters
    shared by several modules (a tied embedding: FSDP swaps a parameter only on the modules of
    its own unit, and a stage's tied head outside that unit would keep the unsharded original)."""
    owners: dict[int, int] = {}
    for m in model.modules():
        for p in m.parameters(recurse=False):
            owners[id(p)] = owners.get(id(p), 0) + 1
    ok = {i for i in held if owners.get(i, 0) == 1}

    def shardable(m: nn.Module, skip: set[int] = frozenset()) -> bool:
        ps = [p for p in m.parameters() if id(p) not in skip]
        return bool(ps) and all(id(p) in ok and p.numel() > 0 for p in ps)

    units = [b for b in blocks if shardable(b)]
    covered = {id(p) for b in units for p in b.parameters()}
    outer: list[str] = []
    for n, m in model.named_modules():  # pre-order: an outer module before its children
        if not n or n in container or any(n.startswith(o + ".") for o in outer):
            continue
        if shardable(m, covered):
            outer.append(n)
    mods = dict(model.named_modules())
    return units + [mods[n] for n in outer]


class StepSync:
    """One training step of FSDP units that run many forwards and backwards (microbatches): no
    reduce-scatter and no resharding until ``finish``, which reduce-scatters each unit's
    accumulated gradient once and reshards (or, for an earlier accumulation micro-step, leaves
    both to a later ``finish``). ``unsharded_params`` are what autograd sees during
    the step (the split backward's weight step needs them, not the sharded parameters)."""

    def __init__(self, units: list[nn.Module]):
        self.units = units

    def begin(self) -> None:
        for u in self.units:
            u.set_is_last_backward(False)
            u.set_reshard_after_backward(False, recurse=False)
            u.set_requires_gradient_sync(False, recurse=False)

    def unsharded_params(self) -> dict[int, torch.Tensor]:
        """id(sharded parameter) -> the unsharded parameter autograd sees (gathers every unit
        now)."""
        out = {}
        for u in self.units:
            u.unshard()
            group = fully_shard.state(u)._fsdp_param_group
            for fp in group.fsdp_params if group is not None else []:
                out[id(fp.sharded_param)] = fp.unsharded_param
        return out

    def reshard(self) -> None:
        """Free the gathered parameters (after forward-only use: evaluation leaves them
        gathered)."""
        for u in self.units:
            u.reshard()

    def finish(self, reduce: bool = True) -> None:
        """End of the call's backwards. ``reduce``: reduce-scatter the gradients accumulated so far
        and reshard; else (an earlier micro-step of gradient accumulation) they stay unsharded and
        accumulate into the next call's, the parameters stay gathered, and nothing is sent."""
        for u in self.units:
            u.set_is_last_backward(True)
            u.set_reshard_after_backward(reduce, recurse=False)
            u.set_requires_gradient_sync(reduce, recurse=False)
        roots = []
        for u in self.units:
            state = fully_shard.state(u)
            if state._fsdp_param_group is not None:
                state._fsdp_param_group.post_backward()
            if state._is_root:
                roots.append(state)
        for state in roots:  # waits for the reduce-scatters, back to idle
            state._root_post_backward_final_callback()
