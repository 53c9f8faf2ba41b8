"""Checks of the config keys that hold a path, run before any work.

Each check asks the same questions of its path: does it exist, is it the right kind (file,
directory, checkpoint directory, state dict, index file), can this process read (or write) it,
and does it parse. Each returns its problems as messages naming the key; ``check_paths`` raises
them all in one ``ConfigError``. Torch and the checkpoint module are imported only when a key
that needs them is set.
"""

from __future__ import annotations

import json
import os
import pickle
import tempfile
import warnings
import zipfile
from collections.abc import Mapping
from pathlib import Path

from rag_mm.config import ConfigError, TrainConfig, data_splits, shard_problems

# what rag_mm.components.checkpoint.save writes
CHECKPOINT_FILES = (
    "manifest.json",
    ".metadata",
    "trainer_state.json",
)


def short_error(exc: BaseException) -> str:
    """An exception as one short line: its type and the first line of its message."""
    first = (str(exc).strip().splitlines() or [""])[0]
    first = first if len(first) <= 160 else first[:157] + "..."
    return f"{type(exc).__name__}: {first}" if first else type(exc).__name__


def file_problem(key: str, path: str | os.PathLike) -> str | None:
    """Why ``path`` is not an existing, readable regular file (None when it is)."""
    p = Path(path)
    if not p.exists():
        return f"{key}: {path} does not exist"
    if p.is_dir():
        return f"{key}: {path} is a directory, expected a file"
    if not p.is_file():
        return f"{key}: {path} is not a regular file"
    if not os.access(p, os.R_OK):
        return f"{key}: {path} is not readable (permissions)"
    return None


def dir_problem(key: str, path: str | os.PathLike) -> str | None:
    """Why ``path`` is not an existing directory whose entries can be listed and read."""
    p = Path(path)
    if not p.exists():
        return f"{key}: {path} does not exist"
    if not p.is_dir():
        return f"{key}: {path} is a file, expected a directory"
    if not os.access(p, os.R_OK | os.X_OK):
        return f"{key}: directory {path} is not readable (permissions)"
    return None


def writable_dir_problem(key: str, path: str | os.PathLike) -> str | None:
    """Why a directory this process writes into cannot be used or created at ``path``. Permission
    bits do not tell everything (root ignores them; /proc, read-only mounts and full disks refuse
    anyway), so the directory is then created (the run would create it) and a file written and
    removed in it."""
    p = Path(path)
    if p.exists():
        if not p.is_dir():
            return f"{key}: {path} is a file, expected a directory"
        if not os.access(p, os.W_OK | os.X_OK):
            return f"{key}: directory {path} is not writable (permissions)"
    else:
        parent = p.absolute().parent
        while (
            not parent.exists()
        ):  # the nearest existing ancestor decides whether it can be created
            parent = parent.parent
        if not parent.is_dir():
            return f"{key}: {path} cannot be created: {parent} is a file"
        if not os.access(parent, os.W_OK | os.X_OK):
            return f"{key}: {path} cannot be created: {parent} is not writable (permissions)"
    try:
        p.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=p):
            pass
    except OSError as e:
        return f"{key}: {path} cannot be created or written ({e.strerror or e})"
    return None


def run_dir_problems(key: str, path: str) -> list[str]:
    """``run_dir``: a directory this process can write (or create), and its ``checkpoints`` too."""
    why = writable_dir_problem(key, path)
    if why:
        return [why]
    ckpts = Path(path) / "checkpoints"
    if ckpts.exists():
        why = writable_dir_problem(key, ckpts)
        if why:
            return [why.replace(f"{key}: ", f"{key}: its checkpoints directory ", 1)]
    return []


def checkpoint_dir_problems(key: str, path: str | os.PathLike) -> list[str]:
    """A complete, unaltered checkpoint directory as ``rag_mm.components.checkpoint.save`` writes
    it: its manifest, DCP's ``.metadata`` and the trainer state present, every file the manifest
    lists with the size and SHA-256 it records."""
    why = dir_problem(key, path)
    if why:
        return [why]
    p = Path(path)
    absent = [name for name in CHECKPOINT_FILES if not (p / name).is_file()]
    if absent:
        hint = ""
        if (p / "checkpoints").is_dir():
            hint = (
                f" (it is a run directory: pass one of {p / 'checkpoints'}/step_*, or "
                f"resume=auto with run_dir={p})"
            )
        elif any(c.name.startswith("step_") for c in p.iterdir()):
            hint = " (it holds checkpoints: pass one of its step_* directories)"
        elif not any(p.iterdir()):
            hint = " (the directory is empty)"
        return [f"{key}: {path} is not a rag_mm checkpoint: no {', '.join(absent)}{hint}"]
    try:
        files = json.loads((p / "manifest.json").read_text())["files"]
        ok = isinstance(files, dict) and all(
            isinstance(m, dict) and {"bytes", "sha256"} <= set(m) for m in files.values()
        )
    except (OSError, ValueError, KeyError, TypeError) as exc:  # ValueError: bad JSON or not UTF-8
        return [f"{key}: unreadable manifest in checkpoint {path} ({short_error(exc)})"]
    if not ok:
        return [
            f"{key}: the manifest of checkpoint {path} is not a file list with sizes and checksums"
        ]
    from rag_mm.components.checkpoint import verify

    try:
        why = verify(p)
    except OSError as exc:
        return [f"{key}: cannot read checkpoint {path} ({short_error(exc)})"]
    return [f"{key}: checkpoint {path} is damaged: {why}"] if why else []


def resume_problems(key: str, value: str) -> list[str]:
    """``resume``: auto | never | the path of one checkpoint directory."""
    if value in ("auto", "never"):
        return []
    return checkpoint_dir_problems(key, value)


def state_dict_problems(key: str, path: str | None) -> list[str]:
    """A file ``torch.load(weights_only=True)`` reads as a state dict of tensors (or a dict whose
    ``state_dict`` entry is one), as the vision tower and the dual encoder load it. Zip-format
    files are memory-mapped: their tensors are not read."""
    if not path:
        return []
    why = file_problem(key, path)
    if why:
        return [why]
    import torch

    try:
        with (
            warnings.catch_warnings()
        ):  # e.g. the pickle-protocol note on files written by other tools
            warnings.simplefilter("ignore")
            state = torch.load(
                path, map_location="cpu", weights_only=True, mmap=zipfile.is_zipfile(path)
            )
    except MemoryError:
        raise
    except pickle.UnpicklingError:  # its message is a page on weights_only; what it means is short
        return [
            f"{key}: {path} is not a PyTorch state dict (no weights-only pickle: code, objects or "
            "foreign bytes)"
        ]
    except (
        Exception
    ) as exc:  # the unpickler fails on foreign bytes with KeyError, EOFError, RuntimeError, ...
        return [f"{key}: {path} is not a PyTorch state dict ({short_error(exc)})"]
    if isinstance(state, Mapping) and isinstance(state.get("state_dict"), Mapping):
        state = state["state_dict"]
    if not isinstance(state, Mapping) or not any(
        isinstance(v, torch.Tensor) for v in state.values()
    ):
        return [
            f"{key}: {path} holds a {type(state).__name__}, not a state dict (a mapping of names "
            "to tensors)"
        ]
    return []


def index_file_problems(key: str, path: str | os.PathLike) -> list[str]:
    """An index file written by rag_mm (``retriever.index_io``): its header parses; the checksum is
    left to the loader, which reads the whole file anyway."""
    why = file_problem(key, path)
    if why:
        return [why]
    from retriever.errors import CorruptIndexError
    from retriever.index_io import read_metadata

    try:
        read_metadata(path)
    except (CorruptIndexError, OSError) as exc:
        return [f"{key}: {exc}"]
    return []


def output_file_problems(key: str, path: str, must_be: str = "") -> list[str]:
    """A file this process writes: not a directory, its directory writable or creatable. With
    ``must_be="index"`` an existing file must be a rag_mm index (it is replaced, anything else is
    kept)."""
    p = Path(path)
    if p.is_dir():
        return [f"{key}: {path} is a directory, expected a file path"]
    why = writable_dir_problem(key, p.absolute().parent)
    if why:
        return [why]
    if p.exists() and must_be == "index":
        found = index_file_problems(key, p)
        if found:
            return [f"{found[0]} (refusing to overwrite a file that is not a rag_mm index)"]
    return []


def path_problems(cfg: TrainConfig, training: bool = True) -> list[str]:
    """Every problem with the path-valued keys of a run's config. ``training=False`` (evaluation)
    leaves out ``resume`` and the writability of ``run_dir``."""
    e: list[str] = []
    if training:
        e += run_dir_problems("run_dir", cfg.run_dir)
        e += resume_problems("resume", cfg.resume)
    e += shard_problems(cfg)
    e += state_dict_problems("model.vision_checkpoint", cfg.model.vision_checkpoint)
    if (
        cfg.retriever.mode == "learned"
    ):  # the dual encoder, and with it its checkpoint, exists only then
        e += state_dict_problems("retriever.checkpoint", cfg.retriever.checkpoint)
    return e


def check_paths(cfg: TrainConfig, training: bool = True) -> None:
    """Raise one ConfigError naming every path-valued key that cannot work."""
    e = path_problems(cfg, training)
    if e:
        raise ConfigError("invalid paths:\n  - " + "\n  - ".join(e))


def data_key(cfg: TrainConfig, urls: list[str]) -> str:
    """The ``data.<split>`` key whose shards include all of ``urls`` ('' when none does)."""
    from rag_mm.data.urls import expand_urls

    for split in data_splits(cfg):
        if set(urls) <= set(expand_urls(cfg.data.root, getattr(cfg.data, split))):
            return f"data.{split}"
    return ""
