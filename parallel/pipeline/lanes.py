"""Shared-memory lanes for pipeline messages between ranks on one host (the p2p gate).

Why: gloo's tagged ``isend`` / ``irecv`` is a rendezvous over loopback TCP - the sender announces,
the receiver's posted buffer is announced back, gloo's I/O threads move the bytes - so every
message costs several thread wake-ups: with the ranks on busy cores, more than the compute of a
microbatch of the 8-block MLP (benchmarks/pipeline_cpu_*.md). A
``ShmChannel`` (``parallel.kernels.comm``) is a ring of slots in ``/dev/shm``: a send is a memcpy
into the ring, a receive a memcpy out, no other thread involved.

A channel is a FIFO without tags, so there is one per *edge*: the messages of one kind
(activations "f" or gradients "b") that one stage sends to a stage on another rank. An edge gets
a ring only when its receiver takes them in exactly the order they are sent, for the training
schedule and for the forward-only one; both orders are known on every rank, so every rank
reaches the same decision without communicating. (One ring per rank pair served 1F1B, but under
ZB-V rank 0 sends stage 0's activations and stage 3's gradients to rank 1 in one order and rank 1
takes them in another: that pair fell back to gloo, ~2 ms a message here, and ZB-V ran 49-109%
over the pipeline ideal; benchmarks/pipeline_cpu_*.md.) Each message goes through the ring
when it is small enough (``limit`` bytes; the receiver knows every size before it receives: from
the header, or from the gradient specs), else over tagged gloo - a deterministic per-message
choice both sides make alike.

A send into a full ring would wait for the receiver, and two ranks that both send before they
receive could then wait on each other. So the ring holds a whole step's messages of its edge
(every rank receives all of a step's messages within the step, and the step ends with a
collective that every rank joins, so at most one step is in flight): with ``b`` bundles per step
on the edge, each at most ``2 + ceil(limit / slot)`` slots (header, metadata up to one slot,
payload), the ring has that many slots and ``limit`` is lowered until it fits ``budget`` bytes.
Pages of ``/dev/shm`` are only backed once touched, so an unused large ring costs little.
"""

from __future__ import annotations

import logging

from .schedule import Action, forward_only

log = logging.getLogger(__name__)

SLOT_BYTES = 64 << 10  # 64 KiB: headers take one slot each; a 128 KiB activation takes 2
LANE_BUDGET = 64 << 20  # bytes of ring per lane at most (only touched pages are backed)
MAX_LIMIT = 16 << 20  # the largest message that goes through a ring


def messages(order: dict[int, list[Action]], stage_ranks: list[int]) -> tuple[dict, dict]:
    """Per ordered global rank pair (a, b): the keys a sends to b, in a's order, and the keys b
    receives from a, in b's order. Keys: ("f", sending stage, mb) / ("b", sending stage, mb)."""
    k = len(stage_ranks)
    sends: dict[tuple[int, int], list] = {}
    recvs: dict[tuple[int, int], list] = {}
    for acts in order.values():
        got_grads: set[tuple[int, int]] = set()
        for a in acts:
            s = a.stage
            if a.kind == "F":
                if s > 0 and stage_ranks[s - 1] != stage_ranks[s]:
                    recvs.setdefault((stage_ranks[s - 1], stage_ranks[s]), []).append(
                        ("f", s - 1, a.mb)
                    )
                if s < k - 1 and stage_ranks[s + 1] != stage_ranks[s]:
                    sends.setdefault((stage_ranks[s], stage_ranks[s + 1]), []).append(
                        ("f", s, a.mb)
                    )
            elif a.kind in ("B", "I", "W"):
                if (
                    s < k - 1
                    and stage_ranks[s + 1] != stage_ranks[s]
                    and (s, a.mb) not in got_grads
                ):
                    got_grads.add((s, a.mb))  # W reuses the gradients I received
                    recvs.setdefault((stage_ranks[s + 1], stage_ranks[s]), []).append(
                        ("b", s + 1, a.mb)
                    )
                if a.kind != "W" and s > 0 and stage_ranks[s - 1] != stage_ranks[s]:
                    sends.setdefault((stage_ranks[s], stage_ranks[s - 1]), []).append(
                        ("b", s, a.mb)
                    )
    return sends, recvs


def plan_lanes(orders: list[dict[int, list[Action]]], stage_ranks: list[int]) -> tuple[dict, str]:
    """{(a, b, kind, stage): (fwd bundles, bwd bundles) per step} for the edges a FIFO serves
    (stage ``stage`` on rank a sends rank b its "f" activations or "b" gradients; one of the two
    counts is 0), and why others are left to gloo ("" if none)."""
    lanes: dict[tuple, tuple[int, int]] = {}
    why = []
    bad: set[tuple] = set()
    for order in orders:
        sends, recvs = messages(order, stage_ranks)
        for pair in set(sends) | set(recvs):
            out, got = sends.get(pair, []), recvs.get(pair, [])
            for edge in sorted({k[:2] for k in out + got}):
                keys = [k for k in out if k[:2] == edge]
                key = (*pair, *edge)
                if keys != [k for k in got if k[:2] == edge]:
                    bad.add(key)
                    why.append(
                        f"rank {pair[1]} receives stage {edge[1]}'s "
                        f"{'activations' if edge[0] == 'f' else 'gradients'} in another order "
                        "than they are sent"
                    )
                    continue
                n = max(sum(lanes.get(key, (0, 0))), len(keys))  # the larger step of the two orders
                lanes[key] = (n, 0) if edge[0] == "f" else (0, n)
    for key in bad:
        lanes.pop(key, None)
    return lanes, "; ".join(sorted(set(why)))


def ring_size(
    fwd: int,
    bwd: int,
    budget: int | None = None,
    slot: int = SLOT_BYTES,
    max_limit: int = MAX_LIMIT,
) -> tuple[int, int]:
    """(slots, limit bytes): a ring that holds one step of the lane (see the module doc)."""
    budget = LANE_BUDGET if budget is None else budget
    n = fwd + bwd
    if n == 0:
        return 1, 0
    q = max(0, min(max_limit // slot, (budget // slot - 2 * fwd) // n))
    return max(1, 2 * fwd + q * n), q * slot


def open_lanes(
    train_order: dict[int, list[Action]],
    m: int,
    stage_ranks: list[int],
    rank: int,
    timeout_s: float,
    mode: str = "auto",
) -> tuple[dict, str]:
    """This rank's shared-memory channels, {(peer global rank, True: to it / False: from it, kind,
    sending stage): channel} (each with ``.limit``, the largest message it carries; an edge not in
    it goes over gloo), and the line that says what was chosen. A collective over the ranks of
    ``stage_ranks`` (all call it with the same arguments). ``mode``: auto (shared memory where
    possible) | shm (required) | gloo."""
    if mode == "gloo":
        return {}, "process group (p2p='gloo')"
    from parallel.kernels import comm

    built, why = comm.available()
    if not built:
        if mode == "shm":
            raise RuntimeError(f"p2p='shm' but the shared-memory extension is unavailable: {why}")
        return {}, f"process group (shared-memory extension unavailable: {why})"
    k = len(stage_ranks)
    pred = {
        r: forward_only([s for s in range(k) if stage_ranks[s] == r], m) for r in set(stage_ranks)
    }
    lanes, why = plan_lanes([train_order, pred], stage_ranks)
    out: dict[tuple, object] = {}
    used, other = [], []
    for a, b, kind, stage in sorted(lanes):  # the same order on every rank: handshakes cannot cross
        if rank not in (a, b):
            continue
        slots, limit = ring_size(*lanes[(a, b, kind, stage)])
        ch = comm.ShmChannel(a, b, slot_bytes=SLOT_BYTES, slots=slots, timeout_s=timeout_s)
        what = f"{a}->{b} stage {stage} {kind}"
        if not ch.uses_shm:
            ch.close()
            other.append(f"{what}: {ch.reason}")
            continue
        ch.limit = limit
        out[(b if rank == a else a, rank == a, kind, stage)] = ch
        used.append(f"{what} ({slots} x {SLOT_BYTES >> 10} KiB, messages <= {limit >> 10} KiB)")
    line = "shared memory " + ", ".join(used) if used else "process group"
    if other or why:
        line += " [gloo: " + "; ".join(other + ([why] if why else [])) + "]"
    return out, line
