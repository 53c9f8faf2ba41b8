"""Backend choice by measurement: time the candidates once per key, keep the fastest correct one.

``attention.py`` asks this module which backend ``auto`` runs. This module builds the tuning
inputs of a key (``attention_case``) but does not import ``attention.py``: the caller hands it the
function that runs a backend by name.

Key: op (``fwd`` or ``fwd+bwd``), layout, dtype, head size, sequence-length bucket (next power of
two), thread count (``torch.get_num_threads()``) and device type. The same key on another machine
is another entry: the cache holds one section per machine, named by a hash of the CPU model and
flags (and GPU name / capability on CUDA), the torch version and the fused kernels' ISA cap.

Measuring (``measure``): every candidate runs once on inputs of the key's bucket shape (warm-up,
lazy initialisation) and its output (and gradients for ``fwd+bwd``) is compared with the
reference; a candidate that disagrees or raises is dropped and can never win. The survivors are
then timed interleaved, in an order rotated every round (a load spike hits all alike), and each is
scored by its fastest call: other load only ever adds time, and on a shared machine a median of a
few calls still carries descheduling spikes of several milliseconds. With one CPU thread the clock
is the thread's CPU time (time slices lost to other processes do not count), with several threads
or on CUDA wall time. The bound: rounds stop once every candidate has had ``MIN_REPS`` timed calls
and ``BUDGET_S`` of timed calls each, or ``TOTAL_CAP_S`` of timed calls have passed over all
candidates, or ``MAX_REPS`` rounds ran. Then a run-off: the candidates within ``RUNOFF_MARGIN`` of
the fastest (kernels a few percent apart, where a handful of calls on a shared core can rank them
either way) are timed on, interleaved, until each has ``RUNOFF_MIN_REPS`` more calls and
``RUNOFF_BUDGET_S`` more time, or ``RUNOFF_CAP_S`` passed. So a key costs the check calls, the fp64
reference, at most max(MIN_REPS calls, BUDGET_S) per candidate (``TOTAL_CAP_S`` over all) and the
run-off (``RUNOFF_CAP_S``), once per machine: the choice is cached.

Cache: a JSON file, ``$RAG_MM_ATTN_AUTOTUNE_CACHE`` or ``~/.cache/rag_mm/attn_autotune.json``,
read once per process and rewritten atomically (temporary file + ``os.replace``) after each
tuned key; two processes tuning at once may lose one of their entries, which only costs a retune.
An unwritable cache is logged once and the choice kept in memory.

When nothing is timed (``can_time``): ``RAG_MM_ATTN_AUTOTUNE=0`` (the caller's fixed rule
decides), torch.compile / dynamo tracing, TorchScript tracing, fake or meta tensors, tensor
subclasses, CUDA graph capture: there the cached choice is used if any, else the fixed rule.

torch.distributed: every rank must run the same kernel (kernels differ in rounding), and a rank
cannot time on its own at the first call of a key: ranks reach that call at different moments (a
pipeline stage may never reach it), so a collective there would deadlock and independent timings
would differ. Hence, in a process group of more than one rank:

* nothing is timed or read from disk lazily; a key uses the choice that ``share`` installed, else
  the fixed rule (the same on every rank of one machine type);
* ``share(choices_of_rank0, group)`` is a collective (every rank calls it at the same point,
  before the first step): rank 0 measures (or reads its cache) and broadcasts its choices, and
  every rank installs them. ``attention.autotune(specs, group)`` is that call for attention.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

log = logging.getLogger(__name__)

ENV = "RAG_MM_ATTN_AUTOTUNE"  # "0": never measure, the caller's fixed rule decides
CACHE_ENV = "RAG_MM_ATTN_AUTOTUNE_CACHE"  # path of the JSON cache file
FORMAT = 1  # cache file layout version; another version is ignored and rewritten

# The time bound of one key (see the module doc): each candidate gets MIN_REPS timed calls (the
# fastest of 5 steadies the score on a busy machine) and BUDGET_S of timed calls (tens of calls of
# a small shape, MIN_REPS of a long one); TOTAL_CAP_S caps the timed calls of all candidates
# together, MAX_REPS the rounds. Paid once per key and machine: the choice is cached.
BUDGET_S = 0.03
MIN_REPS = 5
MAX_REPS = 30
TOTAL_CAP_S = 1.0
# The run-off between close candidates: within 10% of the fastest, the first rounds' fastest calls
# rank them by noise (two copies of one kernel timed side by side differ by up to 5% here). Each
# finalist then gets at least RUNOFF_MIN_REPS more calls and RUNOFF_BUDGET_S more time, RUNOFF_CAP_S
# over all finalists (a 12 ms call: ~40 calls for two finalists).
RUNOFF_MARGIN = 0.10
RUNOFF_MIN_REPS = 20
RUNOFF_BUDGET_S = 0.15
RUNOFF_CAP_S = 1.0

_lock = threading.RLock()
_disk: dict | None = None  # this machine's section of the cache file: key -> record
_pinned: dict[str, dict] = {}  # key -> record installed by ``share`` (the rank-0 choice)
_write_failed = False
_generation = 0  # bumped whenever a choice may have changed (callers memoise on it)
stats = {"measured": 0}  # keys measured in this process (tests read it)


@dataclass(frozen=True)
class Key:
    """What one choice is valid for."""

    op: str  # "fwd" (no gradient) or "fwd+bwd" (inputs require grad)
    layout: str
    dtype: str  # "float32", "bfloat16", ...
    head_dim: int
    seq_bucket: int  # next power of two of the sequence length (packed: of the total token count)
    threads: int  # torch.get_num_threads() at the call
    device: str  # "cpu" | "cuda"

    def __str__(self) -> str:
        return (
            f"{self.op}/{self.layout}/{self.dtype}/d{self.head_dim}/s{self.seq_bucket}"
            f"/t{self.threads}/{self.device}"
        )

    def shape_id(self) -> str:
        """The key without the thread count: what ``share`` pins, so a rank whose thread count
        differs from rank 0's still runs rank 0's choice."""
        return (
            f"{self.op}/{self.layout}/{self.dtype}/d{self.head_dim}/s{self.seq_bucket}"
            f"/{self.device}"
        )


def seq_bucket(n: int) -> int:
    """Next power of two of ``n``, at least 16: timings change smoothly within a factor of two."""
    return max(16, 1 << max(0, int(n) - 1).bit_length())


def enabled() -> bool:
    return os.environ.get(ENV, "1").strip().lower() not in ("0", "false", "off", "no")


def distributed_world() -> int:
    d = torch.distributed
    return d.get_world_size() if d.is_available() and d.is_initialized() else 1


_tracing = [0]  # > 0 while attention.py decides a backend for a graph being traced (no timing)


def _dispatch_modes() -> list[str]:
    """Names of the Python dispatch modes active here (``FlopCounterMode``, ``FakeTensorMode``)."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    return [type(m).__name__ for m in _get_current_dispatch_mode_stack()]


def can_time(q: torch.Tensor) -> tuple[bool, str]:
    """Whether a call with ``q`` may measure now; else why not (the cached choice or the fixed rule
    decides)."""
    if not enabled():
        return False, f"{ENV}=0"
    tracing = torch.jit.is_tracing() or torch.jit.is_scripting() or _tracing[0]
    if torch.compiler.is_compiling() or tracing:
        return False, "inside torch.compile / tracing"
    modes = _dispatch_modes()
    if modes:  # a FLOP counter, a profiler mode: timings there are skewed and it would see them
        return False, f"inside a dispatch mode ({', '.join(modes)})"
    if type(q) not in (torch.Tensor, torch.nn.Parameter) or q.is_meta:
        return (
            False,
            f"{type(q).__name__} on {q.device} (fake, meta or subclass tensors are never timed)",
        )
    if q.device.type not in ("cpu", "cuda"):
        return False, f"no timing on {q.device.type}"
    if q.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return False, "inside CUDA graph capture"
    if distributed_world() > 1:
        return False, "torch.distributed: only autotune(...) measures, on rank 0"
    return True, "measuring"


# ----------------------------------------------------------------------------- cache
def cache_path() -> Path:
    p = os.environ.get(CACHE_ENV)
    if p:
        return Path(p)
    return (
        Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
        / "rag_mm"
        / "attn_autotune.json"
    )


def _cpu_description() -> tuple[str, str]:
    """(model name, flags) from /proc/cpuinfo; the platform's names elsewhere."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine(), ""
    field = lambda name: next(  # noqa: E731
        (
            ln.split(":", 1)[1].strip()
            for ln in text.splitlines()
            if ln.split(":", 1)[0].strip() == name
        ),
        "",
    )
    return field("model name") or platform.machine(), field("flags") or field("Features")


def machine(device: str, isa_cap: str | None) -> tuple[str, dict]:
    """(hash, description) of what a cached choice depends on besides its key."""
    model, flags = _cpu_description()
    desc = {
        "cpu": model,
        "torch": torch.__version__,
        "isa_cap": isa_cap,
        "flags_sha": hashlib.sha256(flags.encode()).hexdigest()[:12],
    }
    if device == "cuda" and torch.cuda.is_available():
        desc["gpu"] = torch.cuda.get_device_name()
        desc["capability"] = ".".join(map(str, torch.cuda.get_device_capability()))
    return hashlib.sha256(json.dumps(desc, sort_keys=True).encode()).hexdigest()[:16], desc


def _read_file() -> dict:
    try:
        data = json.loads(cache_path().read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) and data.get("format") == FORMAT else {}


def _section(mid: str) -> dict:
    global _disk
    if _disk is None:
        _disk = _read_file().get("machines", {})
    return _disk.setdefault(mid, {}).setdefault("choices", {})


def _write(mid: str, desc: dict, key: str, record: dict) -> None:
    """Merge one record into the file (re-read first, so other keys other processes wrote stay)."""
    global _write_failed
    path = cache_path()
    data = _read_file() or {"format": FORMAT, "machines": {}}
    sec = data.setdefault("machines", {}).setdefault(mid, {"machine": desc, "choices": {}})
    sec.setdefault("choices", {})[key] = record
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=1, sort_keys=True)
        os.replace(tmp, path)
    except OSError as e:
        if not _write_failed:
            _write_failed = True
            log.warning(
                "attention autotune: cannot write %s (%s); choices kept in memory only", path, e
            )


def reset() -> None:
    """Forget what this process knows (memory, pinned choices, counters); the file stays."""
    global _disk, _write_failed, _generation
    with _lock:
        _disk, _write_failed = None, False
        _generation += 1
        _pinned.clear()
        stats["measured"] = 0


def generation() -> int:
    return _generation


def lookup(key: Key, mid: str, distributed: bool = True) -> dict | None:
    """The record for ``key``: the pinned (rank-0) one, else the cache's; under torch.distributed
    (unless ``distributed=False``, rank 0 measuring inside ``share``) the pinned one only."""
    with _lock:
        pinned = _pinned.get(key.shape_id())
        if pinned is not None or (distributed and distributed_world() > 1):
            return pinned
        return _section(mid).get(str(key))


def pin(records: dict[str, dict]) -> None:
    """Install ``share``'s records (keyed by ``Key.shape_id``)."""
    global _generation
    with _lock:
        _pinned.update(records)
        _generation += 1


# ----------------------------------------------------------------------------- attention cases
# Agreement with the fp64 reference a candidate needs to be timed at all: max error over max |ref|
# (``_max_rel_err``). fp32 kernels land near 1e-6, bf16 / fp16 rounding near 1e-2.
TOLERANCE = {torch.float64: 1e-9, torch.float32: 1e-3, torch.bfloat16: 5e-2, torch.float16: 2e-2}


@dataclass(frozen=True)
class TuneSpec:
    """One attention call shape for ``attention.autotune``: what the model will run."""

    layout: str  # one of attention.LAYOUTS
    seq_len: int  # S (packed: total tokens T)
    head_dim: int
    dtype: torch.dtype = torch.float32
    grad: bool = True  # training: forward and backward are timed together
    device: str = "cpu"


def attention_case(key: Key, names, run) -> tuple[dict, list[torch.Tensor], float]:
    """Inputs of ``key``'s bucket shape; (candidates, reference outputs, tolerance).

    ``run(name, q, k, v, kw)`` runs backend ``name`` (``"reference"`` included) on the case, ``kw``
    holding ``causal``, ``seg_offsets`` or ``cu_seqlens`` / ``max_seqlen``.

    Heads: max(4, 2 x threads) on the CPU (every thread busy in every backend), 64 on CUDA. Masked
    layouts take the benchmark's shapes: retrieval 8 documents of S/10 and the query; packed four
    sequences of T/2, T/4, T/8, T/8. Inputs come from a private generator (the global RNG stays).
    """
    S, D, dev = key.seq_bucket, key.head_dim, key.device
    dtype = getattr(torch, key.dtype)
    h = min(32, max(4, 2 * key.threads)) if dev == "cpu" else 64
    gen = torch.Generator().manual_seed(0)
    rnd = lambda *shape: torch.randn(*shape, generator=gen).to(device=dev, dtype=dtype)  # noqa: E731
    kw: dict = {"causal": key.layout == "causal"}
    if key.layout == "packed":  # S is the total token count T here
        lens = [S // 2, S // 4, S // 8, S - S // 2 - S // 4 - S // 8]
        cu = torch.tensor(
            [0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=dev
        )
        shape, kw = (S, h, D), {"cu_seqlens": cu, "max_seqlen": max(lens)}
    else:
        shape = (1, h, S, D)
        if key.layout == "retrieval":
            doc = max(1, S // 10)
            kw = {
                "seg_offsets": torch.tensor(
                    [[i * doc for i in range(9)] + [S]], dtype=torch.int32, device=dev
                )
            }
    q, k, v, g = (rnd(*shape) for _ in range(4))
    grad = key.op == "fwd+bwd"
    inputs = [t.requires_grad_(grad) for t in (q, k, v)]

    def outputs(name, q, k, v, g):
        if not grad:
            with torch.no_grad():
                return [run(name, q, k, v, kw)]
        q, k, v = (t.detach().requires_grad_(True) for t in (q, k, v))
        out = run(name, q, k, v, kw)
        return [out.detach(), *torch.autograd.grad(out, (q, k, v), g)]

    ref = [[] for _ in range(4 if grad else 1)]  # fp64, one head at a time (an (S, S) matrix each)
    for i in range(h):
        head = [t.detach().narrow(1, i, 1).double() for t in (*inputs, g)]
        for acc, t in zip(ref, outputs("reference", *head)):
            acc.append(t)
    ref = [torch.cat(parts, 1) for parts in ref]
    cands = candidates(names, lambda name: outputs(name, *inputs, g))
    return cands, ref, TOLERANCE.get(dtype, 1e-3)


def candidates(names, call) -> dict:
    """name -> zero-argument callable returning the candidate's outputs (tests wrap this)."""
    return {name: (lambda name=name: call(name)) for name in names}


# ----------------------------------------------------------------------------- measuring
def _max_rel_err(got, want) -> float:
    """max |got - want| / max(max |want|, 1), over a list of tensors (NaN counts as infinite)."""
    worst = 0.0
    for g, w in zip(got, want):
        w = w.double()
        d = (g.double() - w).abs().max().item() if g.numel() else 0.0
        d = d / max(w.abs().max().item() if w.numel() else 0.0, 1.0)
        worst = max(worst, d if d == d else float("inf"))
    return worst


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def measure(
    key: Key,
    candidates: dict[str, Callable[[], list[torch.Tensor]]],
    reference: list[torch.Tensor],
    tol: float,
) -> dict:
    """Check, then time, every candidate; return the record of the fastest correct one.

    Each candidate returns the tensors to compare with ``reference`` (the output, plus the input
    gradients for ``fwd+bwd``). Record: ``choice`` (None when no candidate was correct), ``ms``
    (fastest call per correct candidate), ``median_ms`` and ``rejected`` (name -> why).
    """
    rejected, ok = {}, {}
    for name, fn in candidates.items():
        try:
            err = _max_rel_err(fn(), reference)
        except Exception as e:  # a candidate that cannot run this key is not a candidate
            rejected[name] = f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
            continue
        if err > tol:
            rejected[name] = f"max error {err:.3g} > {tol:g}"
        else:
            ok[name] = fn
    times = {name: [] for name in ok}
    # One CPU thread: the thread's CPU time, which time slices lost to other processes do not
    # lengthen (a call longer than a scheduler slice on a busy machine has no undisturbed wall
    # time to find); several threads or a GPU: wall time.
    clock = time.thread_time if key.device == "cpu" and key.threads == 1 else time.perf_counter
    rounds = _time_rounds(ok, times, clock, key.device, MIN_REPS, MAX_REPS, BUDGET_S, TOTAL_CAP_S)
    if times:
        best = min(min(t) for t in times.values())
        finalists = {n: ok[n] for n, t in times.items() if min(t) <= best * (1 + RUNOFF_MARGIN)}
        if len(finalists) > 1:
            extra = {n: [] for n in finalists}
            rounds += _time_rounds(
                finalists,
                extra,
                clock,
                key.device,
                RUNOFF_MIN_REPS,
                10 * RUNOFF_MIN_REPS,
                RUNOFF_BUDGET_S,
                RUNOFF_CAP_S,
            )
            for n, t in extra.items():
                times[n] += t
    ms = {name: round(min(t) * 1e3, 4) for name, t in times.items()}
    choice = min(ms, key=ms.get) if ms else None
    stats["measured"] += 1
    return {
        "choice": choice,
        "ms": ms,
        "rejected": rejected,
        "rounds": rounds,
        "median_ms": {name: round(statistics.median(t) * 1e3, 4) for name, t in times.items()},
        "tuned_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def _time_rounds(
    fns: dict,
    times: dict,
    clock,
    device: str,
    min_reps: int,
    max_reps: int,
    budget_s: float,
    cap_s: float,
) -> int:
    """Time ``fns`` interleaved into ``times`` (name -> an empty list, filled with seconds per call)
    until each has ``min_reps`` calls and ``budget_s`` of them, or ``cap_s`` over all, or
    ``max_reps`` rounds; the rounds run."""
    order, total, rounds = list(fns.items()), 0.0, 0
    while order and rounds < max_reps:
        # rotated every round: a call right after another candidate (its allocations, its cache
        # footprint) runs differently, so each candidate takes each position in turn
        for name, fn in order[rounds % len(order) :] + order[: rounds % len(order)]:
            _sync(device)
            t = clock()
            fn()
            _sync(device)
            dt = clock() - t
            times[name].append(dt)
            total += dt
        rounds += 1
        if rounds >= min_reps and (total >= cap_s or all(sum(times[n]) >= budget_s for n in fns)):
            break
    return rounds


def tune(
    key: Key, mid: str, desc: dict, candidates: dict, reference: list[torch.Tensor], tol: float
) -> dict:
    """Measure ``key`` and cache the record (memory and file); logs the choice once, at INFO."""
    global _generation
    with _lock:
        rec = measure(key, candidates, reference, tol)
        _section(mid)[str(key)] = rec
        _write(mid, desc, str(key), rec)
        _generation += 1
    log.info(
        "attention autotune %s -> %s (fastest call, ms: %s%s; cache %s)",
        key,
        rec["choice"],
        rec["ms"],
        f"; rejected {rec['rejected']}" if rec["rejected"] else "",
        cache_path(),
    )
    return rec


def share(local: Callable[[], dict[str, dict]], group=None) -> dict[str, dict]:
    """Collective: rank 0 of ``group`` runs ``local()`` (key -> record, measuring what it must) and
    every rank installs rank 0's records as its choices. Without a process group (or with one rank)
    ``local()``'s records are installed as they are."""
    d = torch.distributed
    if distributed_world() == 1:
        records = local()
    else:
        src = d.get_global_rank(group, 0) if group is not None else 0
        box, err = [None], None
        if d.get_rank() == src:
            try:
                box[0] = local()
            except Exception as e:  # tell the other ranks instead of leaving them in the broadcast
                err = e
                box[0] = {"__error__": f"{type(e).__name__}: {e}"}
        d.broadcast_object_list(box, src=src, group=group)
        if err is not None:
            raise err
        records = box[0]
        if "__error__" in records:
            raise RuntimeError(f"attention autotune failed on rank {src}: {records['__error__']}")
    pin(records)
    return records
