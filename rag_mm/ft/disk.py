"""The run directory's disk: room for the checkpoints before training, and a write that fails for
space or permission told in one message.

* ``checkpoint_bytes``: one checkpoint's size, estimated from the model before any is written:
  its parameters and buffers, AdamW's two moments per trainable parameter, and DCP's per-tensor
  bookkeeping. The document index is not in a checkpoint (a resumed run re-embeds the memory), so
  it costs nothing here.
* ``space_problem``: whether the run directory's file system holds ``keep_checkpoints + 1`` of
  them (the kept ones and the one being written) -- the trainer warns, or refuses to start with
  ``disk_check=stop``.
* ``fault``: whether an exception is a write that failed for space (ENOSPC, EDQUOT, or DCP's
  wrapped short write, "unexpected pos N vs M") or permission (a read-only file system, EACCES);
  ``failure_message`` says so with the path, free against needed bytes, the newest complete
  checkpoint and ``resume=auto`` as the way on.
"""

from __future__ import annotations

import errno
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

FULL = (errno.ENOSPC, errno.EDQUOT)  # no space left, disk quota exceeded
READ_ONLY = (errno.EROFS, errno.EACCES, errno.EPERM)  # read-only file system, permissions
# torch's zip writer when the file under it took fewer bytes than written (a full disk under DCP)
SHORT_WRITE = "unexpected pos"
# DCP's bookkeeping per saved tensor (its entry in .metadata; the optimizer's per-parameter step,
# written as a small pickle): measured 4-7 KiB on the demo readers, rounded up
PER_TENSOR_BYTES = 8 << 10
FIXED_BYTES = 64 << 10  # trainer_state.json, manifest.json and DCP's headers


def human(n: float) -> str:
    """Bytes in decimal units, as df -H prints them: 26.4 MB."""
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} PB"


def checkpoint_bytes(model, optimizer_moments: int = 2) -> int:
    """One checkpoint of ``model`` (the whole RagModel, before it is spread over ranks) with an
    optimizer holding ``optimizer_moments`` tensors the size of each trainable parameter (AdamW:
    2). DCP writes every rank's share once, so the whole model is what the run directory holds."""
    state = model.state_dict()
    tensors = sum(t.numel() * t.element_size() for t in state.values())
    trainable = [p for p in model.parameters() if p.requires_grad]
    moments = optimizer_moments * sum(p.numel() * p.element_size() for p in trainable)
    return tensors + moments + PER_TENSOR_BYTES * (len(state) + len(trainable)) + FIXED_BYTES


def free_bytes(path: str | os.PathLike) -> int:
    """Free bytes (for this user) on the file system that holds ``path`` or would hold it."""
    p = Path(path).absolute()
    while not p.exists():
        p = p.parent
    return shutil.disk_usage(p).free


def complete_checkpoints(root: Path) -> list[Path]:
    """The complete checkpoints under ``root``, oldest first: ``step_*`` directories with their
    manifest (written last; its checksums are left to ``rag_mm.components.checkpoint.verify``)."""
    if not root.is_dir():
        return []
    return sorted(
        p
        for p in root.glob("step_*")
        if not p.name.endswith(".tmp") and (p / "manifest.json").is_file()
    )


def space_problem(ckpt_dir: Path, one: int, keep: int) -> str | None:
    """Why the file system of ``ckpt_dir`` cannot hold ``keep + 1`` checkpoints of ``one`` bytes
    (None when it can). The complete checkpoints already there count as written."""
    there = len(complete_checkpoints(ckpt_dir))
    peak = max(there, keep) + 1  # the kept ones and the one being written (pruned after it)
    more = (peak - there) * one
    free = free_bytes(ckpt_dir)
    if free >= more:
        return None
    held = f", {there} already there" if there else ""
    return (
        f"{ckpt_dir}: its file system has {human(free)} free, and keep_checkpoints={keep} needs "
        f"room for {peak} checkpoints of ~{human(one)} (the kept ones and the one being "
        f"written{held}): {human(more)} more. Free space, lower keep_checkpoints or move run_dir"
    )


@dataclass
class Fault:
    """A write that failed for space or permission."""

    kind: str  # full | read-only
    path: str | None  # the file or directory being written, when the error names it
    cause: str  # the system's words: "No space left on device", "Read-only file system", ...


def fault(exc: BaseException) -> Fault | None:
    """The space or permission failure in ``exc``: itself, the exceptions it was raised from, or
    the per-rank failures of DCP's ``CheckpointException`` (a short write there is a full disk:
    torch's writer reports it as "unexpected pos", without the OSError). None for anything else."""
    seen: set[int] = set()
    todo = [exc]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, WriteFailed):
            return e.fault
        if isinstance(e, OSError) and e.errno in FULL + READ_ONLY:
            kind = "full" if e.errno in FULL else "read-only"
            return Fault(
                kind,
                os.fsdecode(e.filename) if e.filename else None,
                e.strerror or os.strerror(e.errno),
            )
        if isinstance(e, RuntimeError) and SHORT_WRITE in str(e):
            return Fault(
                "full", None, "a short write: the file system took fewer bytes than written"
            )
        # torch.distributed.checkpoint.api.CheckpointException
        failures = getattr(e, "failures", None)
        if isinstance(failures, dict):
            todo += [f[0] if isinstance(f, tuple) else f for f in failures.values()]
        todo += [e.__cause__, e.__context__]
    return None


class WriteFailed(OSError):
    """A checkpoint write that failed for space or permission, its partial directory dealt with:
    ``removed`` True (gone), False (the file system refused) or None (none was made, or another
    rank removes it)."""

    def __init__(self, found: Fault, partial: Path, removed: bool | None) -> None:
        code = errno.ENOSPC if found.kind == "full" else errno.EROFS
        super().__init__(code, found.cause, found.path or str(partial))
        self.fault, self.partial, self.removed = found, partial, removed


def failure_message(
    found: Fault, run_dir: Path, ckpt_dir: Path, one: int, keep: int, exc: BaseException
) -> str:
    """What happened, with the numbers, what is left on disk and how to go on."""
    what = "the disk is full" if found.kind == "full" else "the run directory is not writable"
    where = found.path or (str(exc.partial) if isinstance(exc, WriteFailed) else str(run_dir))
    lines = [f"{what}: writing {where} failed ({found.cause})"]
    try:
        free = human(free_bytes(run_dir))
    except OSError:
        free = "unknown"
    lines.append(
        f"free space: {free} on the file system of {run_dir}; one checkpoint needs ~{human(one)}, "
        f"keep_checkpoints={keep} needs ~{human((keep + 1) * one)} (the kept ones and the one "
        "being written)"
    )
    if isinstance(exc, WriteFailed):
        if exc.removed:
            lines.append(f"the partial checkpoint {exc.partial} was removed")
        elif exc.removed is False:
            lines.append(
                f"the partial checkpoint {exc.partial} could not be removed ({found.cause}): "
                "resume=auto skips it, and the next checkpoint removes it"
            )
    done = complete_checkpoints(ckpt_dir)
    lines.append(
        f"last complete checkpoint: {done[-1]}"
        if done
        else "no complete checkpoint yet: resume=auto starts over"
    )
    fix = (
        "free space (or move run_dir elsewhere)"
        if found.kind == "full"
        else "make run_dir writable again (or copy it to a writable place)"
    )
    lines.append(
        f"to go on: {fix}, then run the same command with resume=auto"
        + (f" (it continues from {done[-1].name})" if done else "")
    )
    return "\n  ".join(lines)
