"""Steady host allocations: fixed glibc malloc thresholds for CPU training.

Why: glibc moves its mmap threshold up and its trim threshold to twice that as large blocks are
freed. A training step on CPU allocates and frees the same megabyte-sized buffers (a Linear's
weight gradient, activations) every microbatch; with the dynamic thresholds glibc hands the top
of the heap back to the OS after a free and the next allocation faults every page in again. On
the pipeline benchmark's 8-block MLP (benchmarks/pipeline_cpu_*.md) a pipeline rank took 1.6-3.8
thousand page faults per step, as many as the one-process run doing twice its work, and its
matrix products' output scaling (first touch of fresh pages) took twice as long. With the
thresholds fixed, ~230 faults per step remain.

Fixing them is what glibc's ``MALLOC_MMAP_THRESHOLD_`` / ``MALLOC_TRIM_THRESHOLD_`` environment
variables do; doing it from code means a user's launch line does not have to know. jemalloc or
tcmalloc (``LD_PRELOAD``) solve the same problem and are left alone: the call only applies to
glibc's malloc and is a no-op (with the reason logged) elsewhere.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import sys

log = logging.getLogger("parallel.host_malloc")

M_TRIM_THRESHOLD = -1  # mallopt parameter numbers (malloc.h)
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 << 20  # glibc's own ceiling for the dynamic value (DEFAULT_MMAP_THRESHOLD_MAX)
TRIM_THRESHOLD = 128 << 20  # keep up to this much free memory at the top of the heap

_done: str | None = None


def steady_malloc() -> str:
    """Fix glibc's mmap / trim thresholds once per process; returns what was done (also logged).
    Thresholds the user set through the environment are kept."""
    global _done
    if _done is not None:
        return _done
    if not sys.platform.startswith("linux"):
        _done = f"left as is (not glibc: {sys.platform})"
    elif "MALLOC_MMAP_THRESHOLD_" in os.environ or "MALLOC_TRIM_THRESHOLD_" in os.environ:
        _done = "left as the environment set it (MALLOC_*_THRESHOLD_)"
    elif os.environ.get("LD_PRELOAD", "").find("malloc") >= 0:
        _done = f"left as is (another allocator is preloaded: {os.environ['LD_PRELOAD']})"
    else:
        try:
            libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
            ok = libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) and libc.mallopt(
                M_TRIM_THRESHOLD, TRIM_THRESHOLD
            )
            _done = (
                f"glibc mmap threshold {MMAP_THRESHOLD >> 20} MiB, trim threshold "
                f"{TRIM_THRESHOLD >> 20} MiB"
                if ok
                else "left as is (mallopt refused the thresholds)"
            )
        except (OSError, AttributeError) as e:
            _done = f"left as is (no glibc mallopt: {e})"
    log.info("host allocations: %s", _done)
    return _done
