"""Memory savers: activation checkpointing (every block, or every n-th), activation offloading
to host memory (saved-tensor hooks), and meta-device (delayed) initialisation.

Both activation savers patch the block's ``forward`` on the instance, not wrap the module, so
parameter names (and checkpoint keys) stay exactly those of the unmodified model.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Callable, Iterator

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

log = logging.getLogger("parallel.memory")


def apply_activation_checkpointing(
    blocks: list[nn.Module], mode: str = "full", every: int = 1
) -> list[int]:
    """Recompute the forward of blocks in backward instead of keeping their activations: only
    each checkpointed block's inputs stay alive. ``full``: every block; ``every_n``: blocks n-1,
    2n-1, ... (every n-th, torchtitan's ``ac_freq``). Returns the indices checkpointed."""
    if mode == "none":
        return []
    if mode not in ("full", "every_n"):
        raise ValueError(f"activation_checkpointing must be none, full or every_n (got {mode!r})")
    n = 1 if mode == "full" else every
    chosen = [i for i in range(len(blocks)) if (i + 1) % n == 0]
    for i in chosen:
        b = blocks[i]
        inner = b.forward
        b.forward = functools.wraps(inner)(_checkpointed(inner))
        b._ac_inner_forward = inner
    log.info("activation checkpointing: %d of %d blocks (%s)", len(chosen), len(blocks), mode)
    return chosen


def checkpoint_candidates(model: nn.Module, blocks: list[nn.Module], skip=()) -> list[nn.Module]:
    """The blocks activation checkpointing may wrap: not a leaf module (a lone Linear keeps only
    its input either way, so recomputing it saves nothing), not under a name prefix in ``skip``
    (e.g. a vision tower whose activations are small next to the recompute it would cost)."""
    names = {id(m): n for n, m in model.named_modules()}
    prefixes = tuple(p.rstrip(".") for p in skip)
    keep = []
    for b in blocks:
        name = names.get(id(b), "")
        if not any(True for _ in b.children()):
            continue
        if any(name == p or name.startswith(p + ".") for p in prefixes):
            continue
        keep.append(b)
    return keep


def _checkpointed(inner: Callable) -> Callable:
    """``inner`` run under non-reentrant checkpointing. A plain function, not a partial: a compiled
    block traces through it and sees the ``checkpoint`` call (dynamo's activation-checkpoint op)."""

    def forward(*args, **kwargs):
        return checkpoint(inner, *args, use_reentrant=False, **kwargs)

    return forward


class SavedBytes(torch.autograd.graph.saved_tensors_hooks):
    """Count the bytes autograd keeps for backward inside the ``with`` block: distinct storages
    (a tensor saved twice counts once), parameters of ``model`` excluded. ``nbytes`` after."""

    def __init__(self, model: nn.Module):
        params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        seen: set[int] = set()
        self.nbytes = 0

        def pack(t: torch.Tensor):
            ptr = t.untyped_storage().data_ptr()
            if ptr not in params and ptr not in seen:
                seen.add(ptr)
                self.nbytes += t.untyped_storage().nbytes()
            return t

        super().__init__(pack, lambda t: t)

    def __enter__(self) -> SavedBytes:  # the base class returns None
        super().__enter__()
        return self


class OffloadActivations(torch.autograd.graph.saved_tensors_hooks):
    """Keep tensors saved for backward in host memory: packed to the CPU (pinned, async) during
    forward, brought back to their device when backward unpacks them. Tensors already on the CPU
    (and small ones, under ``min_bytes``) are kept as they are. ``stats`` counts what moved."""

    def __init__(self, min_bytes: int = 1024, pin_memory: bool | None = None):
        self.stats = {"packed": 0, "offloaded": 0, "offloaded_bytes": 0}
        pin = torch.cuda.is_available() if pin_memory is None else pin_memory

        def pack(t: torch.Tensor):
            self.stats["packed"] += 1
            nbytes = t.numel() * t.element_size()
            if t.device.type == "cpu" or nbytes < min_bytes:
                return t
            host = torch.empty(t.shape, dtype=t.dtype, layout=t.layout, pin_memory=pin)
            host.copy_(t, non_blocking=pin)
            self.stats["offloaded"] += 1
            self.stats["offloaded_bytes"] += nbytes
            return (t.device, host)

        def unpack(packed):
            if isinstance(packed, tuple):
                dev, host = packed
                return host.to(dev, non_blocking=pin)
            return packed

        super().__init__(pack, unpack)


def apply_activation_offload(blocks: list[nn.Module], **kw) -> OffloadActivations:
    """Run every block's forward under one ``OffloadActivations`` (returned, for its stats)."""
    hooks = OffloadActivations(**kw)
    for b in blocks:
        inner = b.forward

        @functools.wraps(inner)
        def forward(*args, __inner=inner, **kwargs):
            with hooks:
                return __inner(*args, **kwargs)

        b.forward = forward
    log.info("activation offload: %d blocks", len(blocks))
    return hooks


# ----------------------------------------------------------------------------- meta-device init


@contextlib.contextmanager
def meta_init(include_buffers: bool = False) -> Iterator[None]:
    """Build a model without allocating its parameters: every parameter registered inside the
    context lives on the meta device (shapes only). Buffers stay real unless ``include_buffers``
    (they are small and often computed in ``__init__``: rotary frequencies, position ids). Each
    parameter exists for an instant on the host before it is moved, so peak memory is one
    parameter, not the model. Shard (TP / FSDP) first, then ``materialize``."""
    orig = nn.Module.register_parameter

    def register(self, name, param):
        orig(self, name, param)
        if param is not None and param.device.type != "meta":
            self._parameters[name] = nn.Parameter(
                param.to("meta"), requires_grad=param.requires_grad
            )

    nn.Module.register_parameter = register
    try:
        if include_buffers:
            with torch.device("meta"):
                yield
        else:
            yield
    finally:
        nn.Module.register_parameter = orig


def materialize(
    model: nn.Module,
    device: str | torch.device = "cpu",
    init_fn: Callable[[nn.Module], None] | None = None,
) -> nn.Module:
    """Allocate the (now sharded) meta parameters on ``device``, only this rank's shards, then
    initialise them: ``init_fn(model)`` if given, else each module's ``reset_parameters()``.
    Real buffers are kept. Load weights afterwards with
    ``torch.distributed.checkpoint.state_dict.set_model_state_dict`` if you have them."""
    keep = {n: b.detach().clone() for n, b in model.named_buffers() if b.device.type != "meta"}
    model.to_empty(device=device)
    with torch.no_grad():
        for n, b in model.named_buffers():
            if n in keep:
                b.copy_(keep[n])
        if init_fn is not None:
            init_fn(model)
        else:
            uncovered = []
            for name, m in model.named_modules():
                own = list(m.named_parameters(recurse=False))
                if not own:
                    continue
                if hasattr(m, "reset_parameters"):
                    m.reset_parameters()
                # e.g. open_clip's class/positional embeddings set in __init__: to_empty left
                # garbage
                else:
                    uncovered += [f"{name}.{n}" if name else n for n, _ in own]
                    for _, p in own:
                        nn.init.normal_(p, std=0.02) if p.dim() >= 2 else nn.init.zeros_(p)
            if uncovered:
                log.warning(
                    "materialize: %d parameters have no reset_parameters() (%s%s): initialised "
                    "N(0, 0.02) / zeros; pass init_fn for the model's own initialisation",
                    len(uncovered),
                    ", ".join(uncovered[:4]),
                    "..." if len(uncovered) > 4 else "",
                )
    return model


def local_param_bytes(model: nn.Module) -> int:
    """Bytes of parameters this rank actually holds (local shards of DTensors)."""
    total = 0
    for p in model.parameters():
        t = p.to_local() if hasattr(p, "to_local") else p
        total += t.numel() * t.element_size()
    return total
