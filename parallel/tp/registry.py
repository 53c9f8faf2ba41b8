"""The registry of tensor-parallel rules: which module kinds get which sharded form.

Two kinds of entries, both open to users (SageMaker's ``smp.tp_register`` idea, on DTensor):

- **module rules** take a whole module of a kind (``nn.MultiheadAttention``, your attention
  class) and shard it themselves; the planner leaves that module's subtree alone::

      @register_tp_rule(MyAttention)            # a class, a class name, or a predicate
      def shard_my_attention(module, ctx):
          ctx.colwise(module.qkv, blocks=3)      # fused q|k|v: each rank keeps its heads of each
          ctx.rowwise(module.out)
          ctx.divide_attr(module, "n_heads")

- **linear kinds** teach the planner a new linear-like layer (weight layout + how to compute it),
  so column/row pairs built from it are discovered like ``nn.Linear`` pairs
  (``register_linear_kind``). HF's ``Conv1D`` (weight stored (in, out)) is registered this way.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

log = logging.getLogger("parallel.tp")


@dataclass
class LinearKind:
    """How a linear-like layer stores its weight and computes ``y = x W + b``."""

    out_dim: int  # weight dimension indexed by output features (0 for nn.Linear, 1 for HF Conv1D)
    compute: Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]

    def in_features(self, m: nn.Module) -> int:
        return m.weight.shape[1 - self.out_dim]

    def out_features(self, m: nn.Module) -> int:
        return m.weight.shape[self.out_dim]


def _conv1d(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    y = x.reshape(-1, x.shape[-1]) @ w  # (N, out)
    if b is not None:
        y = y + b
    return y.view(*x.shape[:-1], -1)


_LINEAR_KINDS: list[tuple[Callable[[nn.Module], bool], LinearKind]] = []
_MODULE_RULES: list[tuple[Callable[[nn.Module], bool], Callable, str]] = []


def _predicate(kind) -> Callable[[nn.Module], bool]:
    if isinstance(kind, type):
        return lambda m: isinstance(m, kind)
    if isinstance(kind, str):
        return lambda m: type(m).__name__ == kind
    if callable(kind):
        return kind
    raise TypeError(f"a rule's kind must be a class, a class name or a predicate (got {kind!r})")


def register_linear_kind(kind, out_dim: int, compute: Callable) -> None:
    """Teach the planner a linear-like module kind (matched by class, class name or predicate)."""
    _LINEAR_KINDS.insert(0, (_predicate(kind), LinearKind(out_dim, compute)))


def linear_kind(m: nn.Module) -> LinearKind | None:
    w = getattr(m, "weight", None)
    if not isinstance(w, torch.Tensor) or w.dim() != 2:
        return None
    for pred, kind in _LINEAR_KINDS:
        if pred(m):
            return kind
    return None


def register_tp_rule(kind, fn: Callable | None = None, *, name: str | None = None):
    """Register ``fn(module, ctx)`` as the sharded form of modules of ``kind``. Later
    registrations win over earlier ones (users override the built-ins). Usable as a decorator."""

    def deco(f):
        _MODULE_RULES.insert(0, (_predicate(kind), f, name or getattr(f, "__name__", str(kind))))
        return f

    return deco(fn) if fn is not None else deco


def unregister_tp_rule(fn: Callable) -> None:
    _MODULE_RULES[:] = [r for r in _MODULE_RULES if r[1] is not fn]


def module_rule(m: nn.Module) -> tuple[Callable, str] | None:
    for pred, fn, name in _MODULE_RULES:
        if pred(m):
            return fn, name
    return None


register_linear_kind(nn.Linear, 0, F.linear)
# transformers' Conv1D (GPT-2 family): weight (in, out), y = x @ W + b
register_linear_kind(lambda m: type(m).__name__ == "Conv1D" and hasattr(m, "nf"), 1, _conv1d)
