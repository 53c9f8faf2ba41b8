"""Atomic, verified checkpoints with torch.distributed.checkpoint (DCP).

A checkpoint is a directory ``step_XXXXXXXX`` holding DCP's files, ``trainer_state.json`` and a
``manifest.json`` with the size and SHA-256 of every file. It is written as ``*.tmp`` and renamed
only after every rank finished and the manifest is on disk, so a crash never leaves a directory
that looks complete. ``latest_valid`` re-checks the manifest and skips (with a warning) a
checkpoint whose files are missing, truncated or altered.

``Checkpointer`` is the run's side: where, when, how many, which to resume.

``savable`` turns this rank's model and optimizer state into what DCP writes (optimizer state by
parameter name, tensor-parallel strided shards whole); ``scatter_strided`` puts a restored whole
tensor back into its shards.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.tensor import DTensor, distribute_tensor

from rag_mm.components import checkpoint_safety
from rag_mm.components.checkpoint_safety import one_process_quiet
from rag_mm.components.metrics import strict_dumps
from rag_mm.config import TrainConfig
from rag_mm.distributed.env import barrier, broadcast_object
from rag_mm.ft import disk, faults
from rag_mm.ft.watchdog import Watchdog

log = logging.getLogger(__name__)
MANIFEST = "manifest.json"
STATE = "trainer_state.json"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def save(root: Path, step: int, state: dict, trainer_state: dict, keep: int, is_main: bool) -> Path:
    """Collective: every rank calls it. Returns the final checkpoint directory. A write that fails
    for space or permission (``rag_mm.ft.disk.fault``) raises ``disk.WriteFailed`` on every rank,
    its partial ``.tmp`` directory removed where the file system still allows it."""
    final = root / f"step_{step:08d}"
    tmp = root / f"step_{step:08d}.tmp"
    rank = dist.get_rank() if dist.is_initialized() else 0
    try:
        _on_main(is_main, lambda: _start(tmp))
        barrier()
        with one_process_quiet():
            dcp.save(state, checkpoint_id=str(tmp), no_dist=not dist.is_initialized())
        faults.inject("save", step, rank, path=str(tmp / f"__{rank}_0.distcp"))
        barrier()
        _on_main(is_main, lambda: _finish(root, tmp, final, step, trainer_state, keep))
    except BaseException as exc:  # DCP's CheckpointException is a BaseException
        found = disk.fault(exc)
        if found is None:
            raise
        removed = _remove(tmp) if is_main else None
        raise disk.WriteFailed(found, tmp, removed) from exc
    barrier()
    return final


def _start(tmp: Path) -> None:
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)


def _finish(root: Path, tmp: Path, final: Path, step: int, trainer_state: dict, keep: int) -> None:
    """The main rank's part once every rank's DCP files are written: the trainer state, the
    manifest, the rename that makes the checkpoint complete, and pruning."""
    _write_atomic(tmp / STATE, strict_dumps(trainer_state))
    files = {
        p.name: {"bytes": p.stat().st_size, "sha256": _sha256(p)}
        for p in sorted(tmp.iterdir())
        if p.is_file()
    }
    _write_atomic(tmp / MANIFEST, strict_dumps({"step": step, "files": files}, indent=1))
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    _fsync_dir(root)
    _prune(root, keep)


def _on_main(is_main: bool, fn) -> None:
    """``fn()`` on the main rank; an OSError there is raised on every rank (the others would wait
    in the next collective for a rank that left)."""
    err = None
    if is_main:
        try:
            fn()
        except OSError as exc:
            err = exc
    sent = broadcast_object(None if err is None else (err.errno, err.strerror, err.filename))
    if err is not None:
        raise err
    if sent is not None:
        raise OSError(*sent)


def _remove(tmp: Path) -> bool | None:
    """Remove a partial checkpoint directory: whether it is gone (None: there was none)."""
    if not tmp.exists():
        return None
    shutil.rmtree(tmp, ignore_errors=True)
    return not tmp.exists()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _prune(root: Path, keep: int) -> None:
    done = sorted(p for p in root.glob("step_*") if p.is_dir() and not p.name.endswith(".tmp"))
    for old in done[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    for stale in root.glob("step_*.tmp"):  # left by a crash mid-save
        shutil.rmtree(stale, ignore_errors=True)


def verify(ckpt: Path) -> str | None:
    """None if ``ckpt`` is complete and unaltered, else the reason it is not."""
    man = ckpt / MANIFEST
    if not man.is_file():
        return "no manifest (incomplete write)"
    try:
        files = json.loads(man.read_text())["files"]
    except (json.JSONDecodeError, KeyError) as exc:
        return f"unreadable manifest: {exc}"
    for name, meta in files.items():
        p = ckpt / name
        if not p.is_file():
            return f"missing file {name}"
        if p.stat().st_size != meta["bytes"]:
            return (
                f"{name} has {p.stat().st_size} bytes, manifest says {meta['bytes']} (truncated?)"
            )
        if _sha256(p) != meta["sha256"]:
            return f"{name} checksum mismatch"
    return None


def latest_valid(root: Path) -> Path | None:
    """The newest verified checkpoint under ``root`` (rank 0 decides; all ranks get the answer)."""
    choice = None
    if not dist.is_initialized() or dist.get_rank() == 0:
        for ckpt in sorted(
            (p for p in root.glob("step_*") if p.is_dir() and not p.name.endswith(".tmp")),
            reverse=True,
        ):
            why = verify(ckpt)
            if why is None:
                choice = str(ckpt)
                break
            log.warning("skipping damaged checkpoint %s: %s", ckpt, why)
    choice = broadcast_object(choice)
    return Path(choice) if choice else None


def load(ckpt: Path, state: dict) -> dict:
    """Load DCP tensors into ``state`` in place (collective); return the trainer state JSON."""
    why = verify(ckpt)
    if why is not None:
        raise RuntimeError(f"checkpoint {ckpt} failed verification: {why}")
    # DCP unpickles .metadata and non-tensor entries: plain data only
    checkpoint_safety.load(state, ckpt)
    return json.loads((ckpt / STATE).read_text())


# ------------------------------------------------------------------ the state DCP writes
def savable(model_state: dict, opt: torch.optim.Optimizer, named_parameters) -> tuple[dict, dict]:
    """(state, strided): this rank's part of the model state (under the model's names) and of
    ``opt``'s state (per parameter name, from ``named_parameters``), as DCP writes and loads them;
    ``strided`` maps where each whole-written strided tensor sits to the shard it came from.

    The optimizer's state is created now for every parameter it has none for (not stepped yet, or
    never given a gradient, as a closed-book reader's unused embeddings), so a restore has tensors
    to load into and a checkpoint holds them all; its param groups come from the config. DCP
    cannot plan TP's strided shards (fused q|k|v blocks split per block on a 1-D mesh: its chunk
    offsets overlap), so those tensors go to the checkpoint whole (gathered over their mesh, then
    written once like any replicated tensor); ``scatter_strided`` puts a restored one back into
    the shards."""
    names = {id(q): n for n, q in named_parameters}
    for group in opt.param_groups:
        for q in group["params"]:
            if q not in opt.state:
                # AdamW's state before its first step on q: its next step is step 1
                opt.state[q] = {
                    "step": torch.zeros((), dtype=torch.float32),
                    "exp_avg": torch.zeros_like(q),
                    "exp_avg_sq": torch.zeros_like(q),
                }
    optim = {names[id(q)]: st for q, st in opt.state.items()}
    strided: dict[tuple, DTensor] = {}
    state = {
        "model": _whole(model_state, ("model",), strided),
        "optim": _whole(optim, ("optim",), strided),
    }
    return state, strided


def _whole(tree: dict, path: tuple, strided: dict) -> dict:
    out = {}
    for k, v in tree.items():
        if isinstance(v, dict):
            out[k] = _whole(v, (*path, k), strided)
        elif isinstance(v, DTensor) and any(
            type(pl).__name__ == "_StridedShard" for pl in v.placements
        ):
            strided[(*path, k)] = v
            out[k] = v.full_tensor()
        else:
            out[k] = v
    return out


@torch.no_grad()
def scatter_strided(state: dict, strided: dict) -> None:
    """After ``load`` into ``state``: copy each whole tensor ``savable`` wrote into its shards."""
    for path, dt in strided.items():
        full = state
        for k in path:
            full = full[k]
        dt.copy_(distribute_tensor(full.to(dt.dtype), dt.device_mesh, dt.placements))


class Checkpointer:
    """The run's checkpoints: where (``run_dir/checkpoints``), when (every ``ckpt_every`` steps
    and at a stop), how many are kept (``keep_checkpoints``) and which one a start resumes from
    (``resume``: auto, never or a path)."""

    def __init__(self, cfg: TrainConfig, is_main: bool, watch: Watchdog) -> None:
        self.dir = Path(cfg.run_dir) / "checkpoints"
        self.every, self.keep, self.resume = cfg.ckpt_every, cfg.keep_checkpoints, cfg.resume
        self.is_main, self.watch = is_main, watch
        # the step of the newest checkpoint written or restored (None: none yet)
        self.saved_step: int | None = None

    def due(self, step: int, stopping: bool) -> bool:
        """After step ``step``: every ``ckpt_every`` steps, and when the run stops there."""
        return stopping or bool(self.every and step % self.every == 0)

    def save(self, step: int, state: dict, trainer_state: dict) -> Path:
        """This rank's ``state`` (``savable``'s) and the trainer's as step ``step``; every rank
        calls it together."""
        self.watch.at("checkpoint save (DCP write + barriers)")
        path = save(self.dir, step, state, trainer_state, self.keep, self.is_main)
        self.saved_step = step
        log.info("checkpoint saved: %s", path)
        return path

    def restore(self, make_state: Callable[[], tuple[dict, dict]]) -> dict | None:
        """The checkpoint ``resume`` names loaded in place into the state ``make_state()`` gives
        (``savable``'s (state, strided): its gathered tensor-parallel blocks are scattered back),
        which is asked for only when there is a checkpoint; the trainer state saved with it, or
        None when there is none to resume from."""
        if self.resume == "never":
            return None
        self.watch.at("checkpoint restore")
        path = latest_valid(self.dir) if self.resume == "auto" else Path(self.resume)
        if path is None:
            log.info("no checkpoint to resume from in %s: starting fresh", self.dir)
            return None
        state, strided = make_state()
        trainer_state = load(path, state)
        scatter_strided(state, strided)
        self.saved_step = trainer_state["step"]
        log.info("resumed from %s at step %d", path, self.saved_step)
        return trainer_state
