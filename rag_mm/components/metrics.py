"""Run outputs: metrics.jsonl (every record), TensorBoard scalars, console progress (rank 0)."""

from __future__ import annotations

import json
import logging
import math
import sys
import threading
import time
from pathlib import Path

log = logging.getLogger(__name__)


def json_safe(obj):
    """``obj`` with every non-finite float (NaN: an accuracy over no queries; inf) replaced by None,
    recursively through dicts, lists and tuples, so ``json.dumps(..., allow_nan=False)`` writes
    strict JSON (``null``) where Python's default would write the non-standard ``NaN``.

    >>> json_safe({"acc": 0.5, "acc_heldout": float("nan"), "by": [float("inf"), 1]})
    {'acc': 0.5, 'acc_heldout': None, 'by': [None, 1]}
    """
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v) for v in obj]
    return obj


def strict_dumps(obj, **kwargs) -> str:
    """``json.dumps`` of ``obj`` as strict JSON: every non-finite float becomes ``null``
    (``json_safe``), and anything else that is not JSON raises instead of writing ``NaN``."""
    return json.dumps(json_safe(obj), allow_nan=False, **kwargs)


def _quiet_tensorboard_writer_thread() -> None:
    """TensorBoard writes events on a thread of its own: when the disk refuses a write (full,
    read-only), that thread keeps the OSError, hands it to the next ``add_scalar`` in the training
    thread (where rag_mm.train explains it in one message), and raises it once more as it dies,
    which Python prints as an "Exception in thread" traceback. Only that second print is dropped
    here: an OSError ending TensorBoard's writer thread; any other thread's exception prints."""
    try:
        from tensorboard.summary.writer.event_file_writer import _AsyncWriterThread
    except ImportError:
        return
    previous = threading.excepthook
    if getattr(previous, "rag_mm_tensorboard", False):
        return

    def hook(args) -> None:
        if isinstance(args.thread, _AsyncWriterThread) and isinstance(args.exc_value, OSError):
            return
        previous(args)

    hook.rag_mm_tensorboard = True
    threading.excepthook = hook


class MetricsLogger:
    """Writes only on the main rank; other ranks get a logger that does nothing."""

    def __init__(self, run_dir: Path, enabled: bool, total_steps: int, progress: bool) -> None:
        self.enabled = enabled
        self.total = total_steps
        self._tb = None
        self._bar = None
        self._task = None
        if not enabled:
            return
        run_dir.mkdir(parents=True, exist_ok=True)
        self._jsonl = open(run_dir / "metrics.jsonl", "a")
        try:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(str(run_dir / "tb"))
            _quiet_tensorboard_writer_thread()
        except Exception as exc:  # tensorboard missing or broken: keep training, say so
            log.warning("TensorBoard disabled: %s", exc)
        if progress and sys.stderr.isatty():
            from rich.progress import (
                BarColumn,
                Progress,
                TextColumn,
                TimeElapsedColumn,
                TimeRemainingColumn,
            )

            self._bar = Progress(
                TextColumn("[bold]train"),
                BarColumn(),
                TextColumn("{task.completed}/{task.total}"),
                TextColumn("{task.fields[info]}"),
                TimeElapsedColumn(),
                TextColumn("ETA"),
                TimeRemainingColumn(),
                transient=False,
            )
            self._bar.start()
            self._task = self._bar.add_task("train", total=total_steps, info="")

    def log(self, record: dict, prefix: str = "train") -> None:
        if not self.enabled:
            return
        record = {"time": time.time(), "kind": prefix, **record}
        self._jsonl.write(strict_dumps(record) + "\n")  # null, not NaN: an accuracy over no queries
        self._jsonl.flush()
        if self._tb is not None:
            step = record.get("step", 0)
            for k, v in record.items():
                if isinstance(v, (int, float)) and k not in ("step", "time"):
                    self._tb.add_scalar(f"{prefix}/{k}", v, step)

    def progress(self, step: int, info: str) -> None:
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.update(self._task, completed=step, info=info)
        else:
            log.info("step %d/%d %s", step, self.total, info)

    def close(self) -> None:
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.stop()
        if self._tb is not None:
            self._tb.close()
        self._jsonl.close()
