"""Loading a checkpoint must not run code from it.

torch.distributed.checkpoint (DCP) reads tensors with ``torch.load(weights_only=True)``, but it
reads two things with full pickle: the ``.metadata`` file (``pickle.load``) and every non-tensor
entry of the state dict (``torch.load(weights_only=False)`` in ``DefaultLoadPlanner.load_bytes``:
optimizer hyper-parameters and the like). A crafted checkpoint could run code through either.

- ``check_metadata``: unpickles ``.metadata`` with an allow-list first -- DCP's own dataclasses
  and enums, ``torch.Size``, dtypes, layouts, paths -- and refuses anything else.
- ``WeightsOnlyLoadPlanner``: loads non-tensor entries with ``weights_only=True`` (plain Python
  data only) before handing them to DCP.

The manifest checksums (``checkpoint.verify``) catch damage; these catch a checkpoint that was
written to be malicious, checksums and all.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import importlib
import io
import pickle
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint import DefaultLoadPlanner

PATH_CLASSES = ("PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath", "Path")


class UnsafeCheckpointError(RuntimeError):
    """A checkpoint file refers to something that loading must not construct or call."""


def _allowed(module: str, name: str):
    if "." in name:  # protocol 4 dotted names walk attributes (e.g. "os.system"): never needed here
        return None
    if module.startswith("torch.distributed.checkpoint"):
        obj = getattr(importlib.import_module(module), name, None)
        if isinstance(obj, type) and (dataclasses.is_dataclass(obj) or issubclass(obj, enum.Enum)):
            return obj
        return None
    if module == "torch":
        obj = getattr(torch, name, None)
        if obj is torch.Size or isinstance(obj, (torch.dtype, torch.layout, torch.memory_format)):
            return obj
        return None
    if (module, name) == ("torch.serialization", "_get_layout"):  # layout by its name string
        return torch.serialization._get_layout
    if module == "pathlib" and name in PATH_CLASSES:
        return getattr(importlib.import_module("pathlib"), name)
    if module == "collections" and name == "OrderedDict":
        return importlib.import_module("collections").OrderedDict
    return None


class _RestrictedUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        obj = _allowed(module, name)
        if obj is None:
            raise UnsafeCheckpointError(
                f"refusing to load {module}.{name} from checkpoint metadata"
            )
        return obj


def check_metadata(ckpt: Path) -> None:
    """Raise UnsafeCheckpointError unless DCP's ``.metadata`` holds only DCP's plain records."""
    path = Path(ckpt) / ".metadata"
    if not path.is_file():
        raise UnsafeCheckpointError(f"{path}: missing")
    with open(path, "rb") as f:
        try:
            _RestrictedUnpickler(f).load()
        except UnsafeCheckpointError:
            raise
        except Exception as exc:
            raise UnsafeCheckpointError(f"{path}: unreadable: {exc}") from exc


class WeightsOnlyLoadPlanner(DefaultLoadPlanner):
    """DCP's default planner, with non-tensor entries loaded as plain data
    (``weights_only=True``)."""

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        try:
            obj = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as exc:
            raise UnsafeCheckpointError(
                f"checkpoint entry {read_item.dest_index.fqn}: {exc}"
            ) from exc
        # DCP's own load_bytes unpickles without restriction: give it bytes we wrote ourselves
        clean = io.BytesIO()
        torch.save(obj, clean)
        clean.seek(0)
        super().load_bytes(read_item, clean)


@contextlib.contextmanager
def one_process_quiet():
    """DCP's save and load warn at every call made without a process group ("torch.distributed
    is disabled, unavailable or uninitialized, assuming the intent is to save in a single
    process"), even when called with ``no_dist=True`` (torch 2.14). One process is what rag_mm
    means then, so the note is filtered here, around DCP's calls only, and only then."""
    with warnings.catch_warnings():
        if not dist.is_initialized():
            warnings.filterwarnings(
                "ignore",
                message=r"torch\.distributed is (disabled|unavailable)",
                category=UserWarning,
            )
        yield


def load(state: dict, ckpt: Path) -> None:
    """``dcp.load`` into ``state`` in place, with both guards; a refusal raises
    UnsafeCheckpointError."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    check_metadata(ckpt)
    try:
        with one_process_quiet():  # (one process: DCP's note that it assumes so, filtered)
            dcp.load(
                state,
                checkpoint_id=str(ckpt),
                planner=WeightsOnlyLoadPlanner(),
                no_dist=not dist.is_initialized(),
            )
    except CheckpointException as exc:  # DCP wraps each rank's failure: surface ours as itself
        for failure in getattr(exc, "failures", {}).values():
            if isinstance(failure, UnsafeCheckpointError):
                raise failure from exc
            if "UnsafeCheckpointError" in str(failure):
                raise UnsafeCheckpointError(f"{ckpt}: {failure}") from exc
        raise
