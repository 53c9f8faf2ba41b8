"""Pipeline timeline: per-rank forward / backward / weight-gradient events per microbatch.

Each rank records ``Event(rank, kind, stage, mb, start, end)`` with ``time.perf_counter``: on Linux
``CLOCK_MONOTONIC``, one clock for every process of a host (``align`` puts other hosts on the first
rank's time base). ``gather`` collects the events on every rank, ``to_chrome_trace`` writes Chrome's
trace-event JSON (open in https://ui.perfetto.dev or chrome://tracing: one row per rank) and
``from_chrome_trace`` reads it back, ``figure`` draws a Gantt chart (``plot`` saves it as a PNG),
and ``bubble_fraction`` measures the idle share of the step:

    bubble = 1 - sum over ranks of busy time / (ranks x step time)

to compare with the theory (p - 1) / (m + p - 1) for GPipe / 1F1B. ``write_run_timeline`` does it
all for one step of a pipeline: the ranks' events merged on one rank, written as ``timeline.json``
and ``timeline.png``, with the bubble fraction.
"""

from __future__ import annotations

import json
import socket
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch.distributed as dist

COLORS = {
    "F": "#4c72b0",
    "B": "#dd8452",
    "I": "#c44e52",
    "W": "#55a868",
    "loss": "#8172b3",
    "sync": "#937860",
    "wait": "#dddddd",
}
COMPUTE = ("F", "B", "I", "W", "loss")


@dataclass
class Event:
    rank: int  # pipeline rank (row of the timeline)
    kind: str  # F | B | I | W | loss | sync
    stage: int  # pipeline stage (-1 for whole-rank work such as the gradient sync)
    mb: int  # microbatch (-1 if none)
    start: float  # seconds (perf_counter)
    end: float


def gather(events: list[Event], group=None) -> list[Event]:
    """All ranks' events on every rank (a collective: call it on every rank of ``group``)."""
    if not dist.is_initialized():
        return list(events)
    out: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, [asdict(e) for e in events], group=group)
    return [Event(**d) for part in out for d in part]


def _span(events: list[Event]) -> tuple[float, float]:
    return min(e.start for e in events), max(e.end for e in events)


def bubble_fraction(events: list[Event]) -> float:
    """Idle share of the step over all ranks (compute events only; sends overlap compute)."""
    comp = [e for e in events if e.kind in COMPUTE]
    if not comp:
        return 0.0
    t0, t1 = _span(comp)
    ranks = sorted({e.rank for e in comp})
    busy = sum(e.end - e.start for e in comp)
    return max(0.0, 1.0 - busy / (len(ranks) * (t1 - t0)))


def theory_bubble(p: int, m: int, v: int = 1) -> float:
    """GPipe / 1F1B idle share (p - 1) / (m + p - 1); interleaving divides the bubble by v."""
    b = (p - 1) / v
    return b / (m + b)


def to_chrome_trace(events: list[Event], path: str, metadata: dict | None = None) -> None:
    """Chrome trace-event JSON: one process per rank, complete ("X") events in microseconds;
    ``metadata`` goes under the format's free-form "otherData" key."""
    if not events:
        raise ValueError("no events recorded")
    t0 = min(e.start for e in events)
    out = []
    for r in sorted({e.rank for e in events}):
        out.append(
            {"name": "process_name", "ph": "M", "pid": r, "tid": 0, "args": {"name": f"rank {r}"}}
        )
    for e in events:
        name = f"{e.kind}{e.mb}" if e.mb >= 0 else e.kind
        out.append(
            {
                "name": name,
                "cat": e.kind,
                "ph": "X",
                "pid": e.rank,
                "tid": 0,
                "ts": (e.start - t0) * 1e6,
                "dur": max((e.end - e.start) * 1e6, 0.01),
                "args": {"stage": e.stage, "microbatch": e.mb},
            }
        )
    trace = {"traceEvents": out, "displayTimeUnit": "ms"}
    if metadata:
        trace["otherData"] = metadata
    with open(path, "w") as f:
        json.dump(trace, f)


def from_chrome_trace(trace: list[dict]) -> list[Event]:
    """The events of a trace ``to_chrome_trace`` wrote (its "X" entries), times in seconds."""
    out = []
    for e in trace:
        if e.get("ph") != "X":
            continue
        args = e.get("args", {})
        start = e["ts"] / 1e6
        out.append(
            Event(
                e["pid"],
                e.get("cat", e["name"]),
                args.get("stage", -1),
                args.get("microbatch", -1),
                start,
                start + e["dur"] / 1e6,
            )
        )
    return out


def figure(events: list[Event], title: str = ""):
    """A Gantt chart: one row per rank, boxes labelled with the microbatch; the matplotlib
    figure."""
    import matplotlib.pyplot as plt

    t0 = min(e.start for e in events)
    ranks = sorted({e.rank for e in events})
    fig, ax = plt.subplots(figsize=(12, 0.6 * len(ranks) + 1.2))
    for e in events:
        y = ranks.index(e.rank)
        x, w = (e.start - t0) * 1e3, (e.end - e.start) * 1e3
        ax.barh(
            y,
            w,
            left=x,
            height=0.8,
            color=COLORS.get(e.kind, "#999999"),
            edgecolor="black",
            linewidth=0.3,
        )
        if e.mb >= 0 and w > 0:
            ax.text(
                x + w / 2, y, f"{e.kind}{e.mb}", ha="center", va="center", fontsize=6, color="white"
            )
    ax.set_yticks(range(len(ranks)), [f"rank {r}" for r in ranks])
    ax.invert_yaxis()
    ax.set_xlabel("ms")
    bf = bubble_fraction(events)
    ax.set_title(f"{title} bubble {bf:.1%}".strip())
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in COLORS.values()]
    ax.legend(handles, list(COLORS), loc="upper right", fontsize=7, ncol=len(COLORS))
    fig.tight_layout()
    return fig


def plot(events: list[Event], path: str, title: str = "") -> None:
    """``figure`` written to ``path`` as a PNG (headless: the Agg backend)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig = figure(events, title)
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ----------------------------------------------------------------------------- one step of a run


def clock_id() -> str:
    """Which clock ``time.perf_counter`` reads here: ``CLOCK_MONOTONIC`` counts from the kernel's
    boot, so processes that see the same boot id share it (the host name where there is none)."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return socket.gethostname()


def align(parts: list[tuple[str, float, list[Event]]]) -> list[Event]:
    """The events of several ranks on the first rank's time base. ``parts``: per rank, its
    ``clock_id``, its ``perf_counter`` read on leaving a barrier that all ranks left together, and
    its events. Ranks that read the first rank's clock (its host) keep their times, exactly; each
    other clock (another host) is shifted so that its first rank's barrier read matches the first
    rank's, which is right to within the barrier's exit skew (a network latency)."""
    ref_clock, ref_t = parts[0][0], parts[0][1]
    first_read: dict[str, float] = {}
    for clock, t, _ in parts:
        first_read.setdefault(clock, t)
    out = []
    for clock, _, events in parts:
        shift = 0.0 if clock == ref_clock else ref_t - first_read[clock]
        out += [replace(e, start=e.start + shift, end=e.end + shift) for e in events]
    return out


def summary(events: list[Event]) -> dict:
    """The measured bubble fraction of one step against the GPipe / 1F1B theory, with the shape
    that theory reads off the events: p ranks, m microbatches, v stages per rank."""
    comp = [e for e in events if e.kind in COMPUTE]
    ranks = sorted({e.rank for e in comp})
    stages = {e.stage for e in comp if e.stage >= 0}
    p, m = len(ranks), max(len({e.mb for e in comp if e.mb >= 0}), 1)
    v = max(len(stages) // max(p, 1), 1)
    t0, t1 = _span(comp)
    return {
        "bubble_fraction": bubble_fraction(events),
        "theory_bubble": theory_bubble(p, m, v),
        "ranks": ranks,
        "microbatches": m,
        "stages_per_rank": v,
        "step_s": t1 - t0,
    }


def write_run_timeline(
    events: list[Event], out_dir: str | Path, group=None, title: str = ""
) -> dict | None:
    """One step's events of every rank of ``group`` (a pipeline), merged on its first rank and
    written to ``out_dir``: ``timeline.json`` (Chrome trace; ``summary`` under "otherData") and
    ``timeline.png`` (``plot``). Returns the summary on the group's first rank, None on the others.
    A collective: every rank of ``group`` calls it, right after the step it recorded."""
    if not dist.is_initialized():
        parts = [(clock_id(), 0.0, list(events))]
    else:
        dist.barrier(group=group)
        mine = (clock_id(), time.perf_counter(), [asdict(e) for e in events])
        first = dist.get_rank(group) == 0
        got: list | None = [None] * dist.get_world_size(group) if first else None
        dist.gather_object(mine, got, group=group, group_dst=0)
        if not first:
            return None
        parts = [(clock, t, [Event(**d) for d in evs]) for clock, t, evs in got]
    merged = align(parts)
    if not any(e.kind in COMPUTE for e in merged):
        raise ValueError("no compute events recorded: was record_timeline off for this step?")
    info = summary(merged)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    to_chrome_trace(merged, str(out / "timeline.json"), metadata=info)
    plot(merged, str(out / "timeline.png"), title)
    return info
