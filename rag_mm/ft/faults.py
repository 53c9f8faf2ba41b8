"""Fault injection: rehearse a crash, a hang or a preemption at an exact point of a real run.

The fault-tolerance tests use it, and so can users checking their own recovery path before a
week-long job. Nothing happens unless ``RAG_MM_FAULT`` is set::

    RAG_MM_FAULT="kill:step=5:rank=1"     # SIGKILL rank 1 as it begins step 6 (5 steps done)
    RAG_MM_FAULT="kill:save=4:rank=0"     # SIGKILL rank 0 inside the save of checkpoint 4, after
                                          # its DCP shards are written, before the manifest
    RAG_MM_FAULT="hang:step=3:rank=1"     # rank 1 stops responding (a stuck rank, for timeouts)
    RAG_MM_FAULT="term:step=2"            # SIGTERM to itself (what a spot reclaim sends)
    RAG_MM_FAULT="term:eval=4"            # ... during the evaluation after step 4 (after its first
                                          # batch)
    RAG_MM_FAULT="term:refresh=2"         # ... during the index refresh after step 2 (after its
                                          # first pass)
    RAG_MM_FAULT="term:warmup=1"          # ... after the first step of the retriever warm-up
    RAG_MM_FAULT="enospc:save=4"          # the checkpoint write of step 4 fails: no space left on
                                          # device
    RAG_MM_FAULT="erofs:step=3"           # a write as step 4 begins fails: read-only file system

Several faults are separated by ``;``. ``rank`` defaults to every rank. A fault fires only in the
first incarnation of a torchrun worker group (``restart=0``, compared with torchrun's
``TORCHELASTIC_RESTART_COUNT``): the restarted group must get through, as after a real crash.
The kill is a real ``SIGKILL`` of the process: no Python cleanup, no flush, nothing saved.
``enospc`` and ``erofs`` raise the ``OSError`` a full or read-only disk raises, naming the file the
trainer was writing there (for tests on machines where no small file system can be mounted).
"""

from __future__ import annotations

import errno
import logging
import os
import signal
import sys
import time
from dataclasses import dataclass
from functools import cache

log = logging.getLogger(__name__)
ENV = "RAG_MM_FAULT"
ACTIONS = ("kill", "hang", "term", "enospc", "erofs")
POINTS = ("step", "save", "eval", "refresh", "warmup")
HANG_S = 3600.0  # a hung rank sleeps this long: far beyond any collective timeout


@dataclass(frozen=True)
class Fault:
    action: str  # kill | hang | term | enospc | erofs
    # step (start of a training step) | save (inside a checkpoint save, its DCP files written) |
    # eval (an evaluation after that step, after its first batch) | refresh (an index refresh
    # after that step, after its first forward pass) | warmup (after that retriever warm-up step)
    point: str
    step: int  # completed optimizer steps when it fires (warm-up steps for warmup)
    rank: int | None  # None: every rank
    restart: int  # torchrun restart count (incarnation) in which it fires


def parse(spec: str) -> list[Fault]:
    """``"kill:step=5:rank=1;term:step=2"`` -> faults; a malformed spec raises ValueError."""
    faults = []
    for part in filter(None, (p.strip() for p in spec.split(";"))):
        action, *fields = part.split(":")
        kv = dict(f.split("=", 1) for f in fields if "=" in f)
        points = [p for p in POINTS if p in kv]
        if action not in ACTIONS or len(points) != 1 or len(kv) != len(fields):
            raise ValueError(
                f"{ENV}: cannot parse {part!r} (want ACTION:POINT=STEP[:rank=R][:restart=K], "
                f"ACTION in {ACTIONS}, POINT in {POINTS})"
            )
        rank = kv.get("rank")
        faults.append(
            Fault(
                action,
                points[0],
                int(kv[points[0]]),
                None if rank is None else int(rank),
                int(kv.get("restart", 0)),
            )
        )
    return faults


@cache
def _armed() -> tuple[Fault, ...]:
    spec = os.environ.get(ENV, "")
    faults = tuple(parse(spec)) if spec else ()
    if faults:
        log.warning("fault injection armed (%s=%s)", ENV, spec)
    return faults


def inject(point: str, step: int, rank: int, path: str = "") -> None:
    """Called by the trainer at each ``point``; fires the faults that match. Free when unset.
    ``path``: the file a disk fault names (the one being written there)."""
    if not _armed():
        return
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    for f in _armed():
        if f.point == point and f.step == step and f.rank in (None, rank) and f.restart == restart:
            _fire(f, rank, path)


def _fire(f: Fault, rank: int, path: str = "") -> None:
    msg = f"fault injection: {f.action} rank {rank} at {f.point}={f.step} (restart {f.restart})"
    # the log may be buffered; the kill leaves no chance later
    print(msg, file=sys.stderr, flush=True)
    if f.action == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif f.action == "term":
        os.kill(os.getpid(), signal.SIGTERM)
    elif f.action in ("enospc", "erofs"):
        code = errno.ENOSPC if f.action == "enospc" else errno.EROFS
        raise OSError(code, os.strerror(code), path or None)
    elif f.action == "hang":
        # A stuck rank does not checkpoint on SIGTERM: let the launcher's stop signal end it.
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        time.sleep(HANG_S)
