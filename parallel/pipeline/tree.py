"""Flatten whatever a module returns into (spec, tensors) and rebuild it on another rank.

A module output may be a tensor, a tuple/list, a dict, a Hugging Face ``ModelOutput`` (an ordered
dict that is also a dataclass), a plain dataclass, ``None``, a Python scalar or an opaque object
(``DynamicCache``). The spec is a small picklable tree: containers keep their type, tensors become
``TensorSpec`` (shape, dtype, requires_grad), picklable scalars travel by value, and opaque objects
become ``OPAQUE`` (rebuilt as ``None``: state objects such as caches are not activations).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, NamedTuple

import torch

OPAQUE = "<opaque>"
_SCALARS = (type(None), bool, int, float, str, torch.dtype, torch.device, torch.Size)


class TensorSpec(NamedTuple):
    shape: tuple[int, ...]
    dtype: torch.dtype
    requires_grad: bool


def flatten(obj: Any, depth: int = 0) -> tuple[Any, list[torch.Tensor]]:
    """(spec, tensors in depth-first order)."""
    leaves: list[torch.Tensor] = []
    spec = _flat(obj, leaves, depth)
    return spec, leaves


def _flat(obj: Any, leaves: list, depth: int) -> Any:
    if isinstance(obj, torch.Tensor):
        leaves.append(obj)
        return TensorSpec(tuple(obj.shape), obj.dtype, obj.requires_grad)
    if depth > 8:
        return OPAQUE
    if isinstance(obj, _SCALARS):
        return ("v", obj)
    if isinstance(obj, Mapping):  # dict, OrderedDict, ModelOutput
        return ("d", type(obj), [(k, _flat(v, leaves, depth + 1)) for k, v in obj.items()])
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # namedtuple
        return ("n", type(obj), [_flat(v, leaves, depth + 1) for v in obj])
    if isinstance(obj, list | tuple):
        return (
            "l" if isinstance(obj, list) else "t",
            None,
            [_flat(v, leaves, depth + 1) for v in obj],
        )
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        fields = [f.name for f in dataclasses.fields(obj)]
        return ("c", type(obj), [(k, _flat(getattr(obj, k), leaves, depth + 1)) for k in fields])
    return OPAQUE


def unflatten(spec: Any, leaves: list[torch.Tensor]) -> Any:
    it = iter(leaves)
    return _build(spec, it)


def _build(spec: Any, it) -> Any:
    if isinstance(spec, TensorSpec):
        return next(it)
    if spec == OPAQUE:
        return None
    kind, typ, body = spec[0], spec[1] if len(spec) > 2 else None, spec[-1]
    if kind == "v":
        return body
    if kind == "d":
        items = {k: _build(v, it) for k, v in body}
        try:
            return typ(**items) if typ is not dict and _is_model_output(typ) else typ(items)
        except Exception:  # noqa: BLE001 - an exotic mapping type: a plain dict carries the values
            return dict(items)
    if kind == "n":
        return typ(*[_build(v, it) for v in body])
    if kind in ("l", "t"):
        vals = [_build(v, it) for v in body]
        return vals if kind == "l" else tuple(vals)
    if kind == "c":
        vals = {k: _build(v, it) for k, v in body}
        init = {f.name for f in dataclasses.fields(typ) if f.init}
        obj = typ(**{k: v for k, v in vals.items() if k in init})
        for k, v in vals.items():
            if k not in init:
                object.__setattr__(obj, k, v)
        return obj
    raise ValueError(f"bad spec {spec!r}")


def _is_model_output(typ: type) -> bool:
    return dataclasses.is_dataclass(typ)


def tensor_specs(spec: Any) -> list[TensorSpec]:
    """The TensorSpecs of a spec in leaf order."""
    out: list[TensorSpec] = []

    def walk(s: Any) -> None:
        if isinstance(s, TensorSpec):
            out.append(s)
        elif isinstance(s, tuple) and len(s) == 3 and s[0] in ("d", "c"):
            for _, v in s[2]:
                walk(v)
        elif isinstance(s, tuple) and len(s) == 3 and s[0] in ("n", "l", "t"):
            for v in s[2]:
                walk(v)

    walk(spec)
    return out


def placeholder(
    ts: TensorSpec,
    device: torch.device,
    batch: int | None = None,
    template_batch: int | None = None,
) -> torch.Tensor:
    """A tensor of the right shape whose values must never be used: NaN for floats (so a wrong
    "not needed" decision shows up as a NaN loss instead of a silently wrong one), 0 otherwise."""
    shape = list(ts.shape)
    if batch is not None and template_batch is not None and shape and shape[0] == template_batch:
        shape[0] = batch
    if ts.dtype.is_floating_point or ts.dtype.is_complex:
        return torch.full(shape, float("nan"), dtype=ts.dtype, device=device)
    return torch.zeros(shape, dtype=ts.dtype, device=device)
