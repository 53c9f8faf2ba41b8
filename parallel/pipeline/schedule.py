"""Microbatch schedules: the per-rank list of (action, stage, microbatch) every rank executes.

GPipe, 1F1B and eager 1F1B are written out here (a few lines each; the first two are identical
in every torch release, torch has no third); the multi-stage schedules - interleaved 1F1B,
looped BFS, interleaved zero-bubble (ZB1P), ZB-V and DualPipeV - come from
``torch.distributed.pipelining``: the schedule class is built over lightweight stand-in stages
(its constructor only computes the order) and its ``pipeline_order`` is read, so our runtime
follows exactly torch's order without depending on torch's ``PipelineStage`` (which needs fixed
shapes and tensor-only outputs).

Actions: "F" forward, "B" full backward, "I" backward for inputs, "W" backward for weights.
Receives and sends are implied by the action (F receives from stage s - 1 and sends to s + 1;
B/I do the reverse); sends never block, so any order torch accepts cannot deadlock here.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import NamedTuple

import torch
from torch import nn

TORCH_SCHEDULES = {
    "interleaved_1f1b": "ScheduleInterleaved1F1B",
    "looped_bfs": "ScheduleLoopedBFS",
    "zero_bubble": "ScheduleInterleavedZeroBubble",
    "zbv": "ScheduleZBVZeroBubble",
    "dualpipev": "ScheduleDualPipeV",
}
V_SHAPED = ("zbv", "dualpipev")  # stage s and 2p - 1 - s on one rank


class Action(NamedTuple):
    kind: str  # F | B | I | W
    stage: int
    mb: int


def stages_per_rank(schedule: str, requested: int) -> int:
    if schedule in ("gpipe", "1f1b", "eager_1f1b"):
        return 1
    if schedule in V_SHAPED:
        return 2
    if schedule in ("interleaved_1f1b", "looped_bfs"):
        return max(requested, 2)  # with one stage per rank these are plain 1F1B / GPipe
    return max(requested, 1)  # zero_bubble (ZB1P) also runs with one stage per rank (ZB-H1)


def stage_rank(stage: int, p: int, schedule: str) -> int:
    """Pipeline rank of a stage: round-robin, or a V for the V-shaped schedules."""
    if schedule in V_SHAPED:
        return stage if stage < p else 2 * p - 1 - stage
    return stage % p


def gpipe(rank: int, p: int, m: int) -> list[Action]:
    return [Action("F", rank, i) for i in range(m)] + [Action("B", rank, i) for i in range(m)]


def one_f_one_b(rank: int, p: int, m: int, eager: bool = False) -> list[Action]:
    """PipeDream-Flush: p - rank - 1 warm-up forwards, then alternate, then drain.

    ``eager``: 2 (p - rank - 1) warm-up forwards (Megatron's interleaved warm-up with one chunk).
    In plain 1F1B, rank r + 1 finishes B_i and then needs F_{i+1+w}'s activation, which rank r makes
    only after it received B_i's gradient, ran B_i and F_{i+1+w}: in steady state both hand-overs
    sit on the critical path of every microbatch, and when the stages are balanced the next rank can
    wait for them. With one extra warm-up forward per downstream rank, rank r + 1 has a whole
    F + B of other work queued while the gradient and the next activation travel. Cost: rank r
    holds 2 (p - r) - 1 microbatches' activations instead of p - r; the bubble is unchanged.
    Measured on 2 CPU ranks: benchmarks/pipeline_cpu_*.md."""
    warm = min(m, (2 if eager else 1) * (p - rank - 1))
    out = [Action("F", rank, i) for i in range(warm)]
    f, b = warm, 0
    while f < m:
        out.append(Action("F", rank, f))
        f += 1
        out.append(Action("B", rank, b))
        b += 1
    out += [Action("B", rank, i) for i in range(b, m)]
    return out


def torch_order(schedule: str, p: int, v: int, m: int) -> dict[int, list[Action]]:
    from torch.distributed.pipelining import schedules as S

    cls = getattr(S, TORCH_SCHEDULES[schedule], None)
    if cls is None:
        raise ValueError(
            f"schedule {schedule!r} is not in this torch release ({torch.__version__})"
        )
    stub = nn.Linear(1, 1)  # some schedules inspect stage.submod for torch.compile
    stages = [
        SimpleNamespace(
            group_size=p,
            group_rank=0,
            num_stages=p * v,
            stage_index=i * p,
            submod=stub,
            is_first=False,
            is_last=False,
        )
        for i in range(v)
    ]
    sched = cls(stages, m)
    out: dict[int, list[Action]] = {}
    for r, acts in sched.pipeline_order.items():
        seq = []
        for a in acts:
            if a is None:
                continue
            kind = str(a.computation_type)
            kind = {
                "FORWARD": "F",
                "FULL_BACKWARD": "B",
                "BACKWARD_INPUT": "I",
                "BACKWARD_WEIGHT": "W",
            }.get(getattr(a.computation_type, "name", kind), kind.split(".")[-1])
            if kind in ("F", "B", "I", "W"):
                seq.append(Action(kind, a.stage_index, a.microbatch_index))
            elif kind in ("OVERLAP_F_B",):  # DualPipeV's fused pair: run its parts in order
                for sub in a.sub_actions or ():
                    k2 = {
                        "FORWARD": "F",
                        "FULL_BACKWARD": "B",
                        "BACKWARD_INPUT": "I",
                        "BACKWARD_WEIGHT": "W",
                    }[sub.computation_type.name]
                    seq.append(Action(k2, sub.stage_index, sub.microbatch_index))
        out[r] = seq
    return out


# backwards split at the end of a step on every rank but the first (see below). Measured against
# no split on 2 CPU ranks (scripts/bench/drain_depth.py): one split -10.8% at m = 2 and -6% at
# m = 4, two -16% and -8%, three no better than two; m = 8 and 16 alike within the noise
DRAIN_DEPTH = 2


def split_last_backward(
    order: dict[int, list[Action]], depth: int | None = None
) -> dict[int, list[Action]]:
    """Every rank but the first runs its last ``depth`` backwards as I, and their W after the last
    I.

    Why: the step ends with the drain - rank r's last backward, its gradient handed to rank
    r - 1, rank r - 1's last backward, and so on down to rank 0. After its last backward a rank
    has nothing left to do, so it sends the input gradient as soon as the dX chain is done (I)
    and computes weight gradients (W) while the upstream rank already runs. With one split the
    upstream rank's last backward (a whole I + W) still outlasts the W that covers it (about half
    a backward); deferring the W of the backward before it too starts that last backward one W
    sooner, and two W's about cover it (p = 2; deeper pipelines shorten their hops the same way).
    Each split costs one graph analysis and one engine call per weight group
    (split_backward.py), and a deferred W keeps its microbatch's weight-gradient inputs until the
    end of the step: at most ``depth`` microbatches, counted by the cost model's in-flight count."""
    depth = DRAIN_DEPTH if depth is None else depth
    out = {}
    for r, acts in order.items():
        bs = [i for i, a in enumerate(acts) if a.kind == "B"]
        if r == 0 or not bs or depth < 1:
            out[r] = acts
            continue
        split = set(bs[-depth:])
        new = [Action("I", a.stage, a.mb) if i in split else a for i, a in enumerate(acts)]
        last = max(split)
        ws = [Action("W", acts[i].stage, acts[i].mb) for i in sorted(split)]
        out[r] = new[: last + 1] + ws + new[last + 1 :]
    return out


def pipeline_order(
    schedule: str, p: int, v: int, m: int, split_drain: bool = False
) -> dict[int, list[Action]]:
    """Every rank's actions for one step (all ranks compute the same dictionary).
    ``split_drain``: GPipe and the 1F1B family split each non-first rank's last ``DRAIN_DEPTH``
    backwards (``split_last_backward``)."""
    if schedule == "gpipe":
        order = {r: gpipe(r, p, m) for r in range(p)}
        return split_last_backward(order) if split_drain else order
    if schedule in ("1f1b", "eager_1f1b"):
        order = {r: one_f_one_b(r, p, m, eager=schedule == "eager_1f1b") for r in range(p)}
        return split_last_backward(order) if split_drain else order
    if schedule not in TORCH_SCHEDULES:
        raise ValueError(f"unknown schedule {schedule!r}")
    order = torch_order(schedule, p, v, m)
    _check(order, p * v, m)
    return order


def _check(order: dict[int, list[Action]], k: int, m: int) -> None:
    """Every stage runs F once per microbatch and B (or I and W) once."""
    seen: dict[tuple[str, int, int], int] = {}
    for acts in order.values():
        for a in acts:
            seen[a] = seen.get(a, 0) + 1
    for s in range(k):
        for i in range(m):
            if seen.get(Action("F", s, i)) != 1:
                raise RuntimeError(f"schedule misses or repeats F{i} on stage {s}")
            full = seen.get(Action("B", s, i), 0)
            split = (seen.get(Action("I", s, i), 0), seen.get(Action("W", s, i), 0))
            if not (full == 1 and split == (0, 0)) and not (full == 0 and split == (1, 1)):
                raise RuntimeError(
                    f"schedule has no single backward for microbatch {i} on stage {s}"
                )


def forward_only(stages: list[int], m: int) -> list[Action]:
    """Evaluation: every microbatch through this rank's stages in stage order."""
    return [Action("F", s, i) for s in sorted(stages) for i in range(m)]
