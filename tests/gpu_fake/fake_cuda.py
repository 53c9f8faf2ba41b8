"""Fake CUDA on any machine: modules built on ``torch.device("cuda")`` under a ``FakeTensorMode``
(metadata only, no memory, no driver), and an audit of every op a step runs on them.

``HostAudit`` is a ``TorchDispatchMode`` stacked above the fake mode, so it sees each op with its
fake CUDA inputs before the fake mode runs it, and records:

* host syncs: an op tagged ``data_dependent_output`` on a CUDA tensor (``.item()``, ``float()``,
  ``int()``, ``bool()``, ``.tolist()`` reach ``aten._local_scalar_dense``; ``torch.equal``), an
  op tagged ``dynamic_output_shape`` (``nonzero``, boolean-mask indexing, ``unique``: the output's
  size is read back from the device), a copy from CUDA to the host (``.cpu()``), and a blocking
  copy from the host to CUDA (``torch.tensor(list, device="cuda")``, ``.to("cuda")`` without
  ``non_blocking``: CUDA's copy waits for the stream);
* CPU tensors: every op output on the CPU (a factory call without ``device=``, a Python number
  turned into a tensor). A CUDA kernel takes a Python number as a scalar argument; a CPU tensor is
  created, and copied, on every step.

Each finding names the innermost frame of the project's code that issued the op. A fake tensor
holds no data, so a sync cannot return the real value: ``HostAudit(substitute=True)`` counts it
and answers with a stand-in (1 for integers, 1.0 for floats, False for a bool, a one-row
``nonzero``) so the step runs on and every sync of it is counted; a sync it cannot stand in for
is recorded and raised. With ``substitute=False`` the first sync raises, as the fake mode does.

What torch does not allow here: a backward through the autograd engine (eager ``.backward()``,
``torch.autograd.grad``, and so ``make_fx`` and AOTAutograd, which trace through the engine) asks
CUDA for the device's primary context (``GraphTask::stash_current_streams``), which fails with
no driver. ``engine_backward_error`` runs that probe, so a test can tell when a newer torch
lifts it.
"""

from __future__ import annotations

import contextlib
import traceback
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

REPO = Path(__file__).resolve().parents[2]
# whose code is audited
PROJECT = tuple(str(REPO / d) + "/" for d in ("rag_mm", "retriever", "parallel"))
aten = torch.ops.aten
_COPIES = {
    aten._to_copy.default,
    aten.copy_.default,
    aten._copy_from.default,
    aten._copy_from_and_resize.default,
}


@dataclass
class Finding:
    kind: str  # "sync" or "cpu_tensor"
    op: str  # the aten op (and what it did, for copies)
    where: str  # innermost project frame: "rag_mm/model/layout.py:123 in assemble"

    def __str__(self) -> str:
        return f"{self.kind}: {self.op} at {self.where}"


@dataclass
class HostAudit(TorchDispatchMode):
    """Records host syncs and CPU tensors of the ops run inside it (see the module doc)."""

    substitute: bool = True  # answer a sync with a stand-in value and go on (else raise it)
    syncs: list[Finding] = field(default_factory=list)
    cpu_tensors: list[Finding] = field(default_factory=list)

    def __post_init__(self) -> None:
        super().__init__()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        ins = [a for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)]
        on_cuda = any(a.device.type == "cuda" for a in ins)
        if torch.Tag.data_dependent_output in func.tags:
            if (
                not on_cuda
            ):  # a host tensor's value (copied back by a counted sync): no data here either
                return self._stand_in(func, args, kwargs)
            return self._sync(func, args, kwargs, str(func))
        if (
            on_cuda
            and torch.Tag.dynamic_output_shape in func.tags
            and _data_dependent_shape(func, args)
        ):
            return self._sync(func, args, kwargs, f"{func} (output size read back)")
        out = func(*args, **kwargs)
        outs = [o for o in tree_flatten(out)[0] if isinstance(o, torch.Tensor)]
        if func in _COPIES and ins and outs:
            src, dst = ins[-1 if func is aten.copy_.default else 0].device.type, outs[0].device.type
            if src == "cuda" and dst == "cpu":
                self.syncs.append(Finding("sync", f"{func} cuda -> cpu", _where()))
            elif src == "cpu" and dst == "cuda" and not kwargs.get("non_blocking", False):
                self.syncs.append(Finding("sync", f"{func} cpu -> cuda, blocking", _where()))
        if any(o.device.type == "cpu" for o in outs):
            self.cpu_tensors.append(Finding("cpu_tensor", str(func), _where()))
        return out

    def _sync(self, func, args, kwargs, what: str):
        self.syncs.append(Finding("sync", what, _where()))
        return self._stand_in(func, args, kwargs)

    def _stand_in(self, func, args, kwargs):
        if not self.substitute:
            return func(*args, **kwargs)  # the fake mode raises it
        x = args[0]
        if func is aten._local_scalar_dense.default:
            return False if x.dtype == torch.bool else (1.0 if x.dtype.is_floating_point else 1)
        if func is aten.equal.default:
            return True
        if func is aten.nonzero.default:
            return torch.zeros(min(1, x.numel()), x.dim(), dtype=torch.long, device=x.device)
        return func(*args, **kwargs)  # no stand-in: recorded, then raised by the fake mode

    def report(self) -> str:
        """Every finding, one a line, counted by place (for assertion messages)."""
        counts: dict[str, int] = {}
        for f in self.syncs + self.cpu_tensors:
            counts[str(f)] = counts.get(str(f), 0) + 1
        return "\n".join(f"{n} x {line}" for line, n in counts.items()) or "none"


def _data_dependent_shape(func, args) -> bool:
    """Whether this call's output size depends on the data: indexing takes the tag for its boolean
    masks, and integer indices give a size known from the shapes."""
    if func in (
        aten.index.Tensor,
        aten.index_put.default,
        aten.index_put_.default,
        aten._index_put_impl_.default,
    ):
        return any(i is not None and i.dtype in (torch.bool, torch.uint8) for i in args[1])
    return True


def _where() -> str:
    """The innermost frame of the project's own code on the stack (the op's issuer)."""
    stack = traceback.extract_stack()
    for fr in reversed(stack):
        if fr.filename.startswith(PROJECT):
            return f"{Path(fr.filename).relative_to(REPO)}:{fr.lineno} in {fr.name}"
    # torch's own: skipped
    caller = [fr for fr in stack if fr.filename != __file__ and "/torch/" not in fr.filename]
    fr = caller[-1] if caller else stack[-1]
    return f"{fr.filename.rsplit('/', 1)[-1]}:{fr.lineno} in {fr.name} (outside the project)"


@contextlib.contextmanager
def fake_cuda(mode: FakeTensorMode | None = None) -> Iterator[FakeTensorMode]:
    """A fake mode (``mode``, or a new one) in which CUDA tensors exist without a GPU; every tensor
    must be fake (a real tensor mixed in raises). Build modules inside ``with torch.device("cuda")``
    (or materialize a meta-device module there), but run the step outside it: a factory call
    without ``device=`` must land on the CPU to be caught."""
    mode = mode or FakeTensorMode(allow_non_fake_inputs=False)
    with mode:
        yield mode


@contextlib.contextmanager
def audited(substitute: bool = True) -> Iterator[HostAudit]:
    """``HostAudit`` over the block (inside ``fake_cuda``)."""
    audit = HostAudit(substitute=substitute)
    with audit:
        yield audit


def engine_backward_error() -> str | None:
    """Why a backward through the autograd engine fails on fake CUDA tensors here (None: it
    runs)."""
    with fake_cuda():
        w = torch.ones(2, device="cuda", requires_grad=True)
        try:
            (w * 2).sum().backward()
        except RuntimeError as exc:
            return str(exc).splitlines()[0]
    return None
