"""Which rank is stuck, and in which operation: progress reports through the rendezvous store.

A collective that times out (or fails because a peer died) says little by itself: gloo reports
"Timed out waiting 600000ms for recv", on the rank that waited, not on the one that is late. So
each rank publishes where it is -- ``(seq, step, what)`` -- to the c10d TCP store that torchrun
(or rank 0) already hosts. The trainer marks every operation that involves its peers (``at``:
a few attribute writes, no I/O); a background thread publishes the latest mark at most every
``PUBLISH_EVERY_S``, so a job of thousands of ranks puts about one store write per rank-second on
the store, not several per step. Ranks run the same program, so equal ``seq`` means the same
place; a rank with a smaller ``seq`` has not arrived yet. Two uses:

- ``explain(exc)``: when a collective raises, the error names this rank, the operation, the step
  and the ranks that were behind (the stuck ones) with what they were last doing.
- a background thread warns, before the collective timeout fires, when this rank has waited
  ``timeout_s / 4`` in one operation while another rank is behind.

Similar in spirit to NCCL's flight recorder, kept to what a data-parallel trainer needs.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from datetime import timedelta

import torch.distributed as dist

log = logging.getLogger(__name__)
STORE_TIMEOUT_S = 10  # store round trips are local-network quick; a dead store must not hang us
PUBLISH_EVERY_S = 0.5  # reports lag at most this; a stuck rank is stuck for far longer


def _client(prefix: str):
    """A fresh client of the job's TCP store (torchrun's agent or rank 0 hosts it)."""
    addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if not addr or not port:
        return None
    store = dist.TCPStore(
        addr,
        int(port),
        is_master=False,
        timeout=timedelta(seconds=STORE_TIMEOUT_S),
        wait_for_workers=False,
    )
    return dist.PrefixStore(prefix, store)


class Watchdog:
    """Per-rank progress reports; a no-op in a single process."""

    def __init__(self, rank: int, world_size: int, timeout_s: float) -> None:
        self.rank, self.world_size, self.timeout_s = rank, world_size, timeout_s
        self.seq, self.step, self.what, self.since = 0, 0, "start", time.monotonic()
        self._pub = self._reader = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._warned = -1
        self._published = -1
        if world_size <= 1:
            return
        # keys of an earlier incarnation (before a torchrun restart) must not be read as progress
        prefix = f"rag_mm/watchdog/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/"
        try:
            self._pub, self._reader = _client(prefix), _client(prefix)  # one client per thread
        except Exception as exc:  # no store reachable: train on, without the reports
            log.warning("watchdog disabled: cannot reach the rendezvous store: %s", exc)
            return
        self._publish()
        self._thread = threading.Thread(target=self._watch, name="rag_mm-watchdog", daemon=True)
        self._thread.start()

    # ---------------------------------------------------------------------------- reporting
    def at(self, what: str, step: int | None = None) -> None:
        """This rank now enters ``what`` (an operation its peers also run) at ``step``."""
        self.what, self.since = what, time.monotonic()
        if step is not None:
            self.step = step
        self.seq += 1  # last: the publisher thread reads seq to decide whether to publish

    def _publish(self) -> None:
        if self._pub is None:
            return
        seq = self.seq
        try:
            self._pub.set(
                str(self.rank),
                json.dumps({"seq": seq, "step": self.step, "what": self.what, "time": time.time()}),
            )
            self._published = seq
        except Exception as exc:  # the store went away (its host died): stop reporting
            log.warning("watchdog: cannot publish progress: %s", exc)
            self._pub = None

    def peers(self) -> dict[int, dict]:
        """The last report of every rank that has one (this rank's own state included)."""
        out = {
            self.rank: {"seq": self.seq, "step": self.step, "what": self.what, "time": time.time()}
        }
        if self._reader is None:
            return out
        for r in range(self.world_size):
            if r == self.rank:
                continue
            try:
                if self._reader.check([str(r)]):
                    out[r] = json.loads(self._reader.get(str(r)))
            except Exception:
                break  # store unreachable: report what we have
        return out

    def report(self) -> str:
        """Where every rank is; ranks behind this one are marked as the likely stuck ones."""
        now = time.time()
        peers = self.peers()
        lines = []
        for r in range(self.world_size):
            p = peers.get(r)
            if p is None:
                lines.append(
                    f"  rank {r}: no report (never started, or the store is gone)  <- stuck or "
                    "dead?"
                )
                continue
            mark = "  <- behind: stuck or dead?" if p["seq"] < self.seq else ""
            lines.append(
                f"  rank {r}: step {p['step']}, in '{p['what']}' (reported "
                f"{max(now - p['time'], 0.0):.1f} s ago){mark}"
            )
        return "\n".join(lines)

    def stuck_ranks(self) -> list[int]:
        peers = self.peers()
        return [r for r in range(self.world_size) if r not in peers or peers[r]["seq"] < self.seq]

    def explain(self, exc: BaseException) -> str:
        """A message naming this rank, its operation and step, and the ranks that were behind."""
        waited = time.monotonic() - self.since
        self._publish()  # let the peers (and the report) see where this rank failed
        stuck = self.stuck_ranks()
        who = (
            f"stuck rank(s): {', '.join(map(str, stuck))}"
            if stuck
            else "no rank was behind (a peer may have died inside the same operation)"
        )
        return (
            f"rank {self.rank} failed in '{self.what}' at step {self.step} after {waited:.1f} s "
            f"({type(exc).__name__}: "
            f"{str(exc).strip().splitlines()[0] if str(exc).strip() else ''}); "
            f"{who}\n{self.report()}"
        )

    # ---------------------------------------------------------------------------- watching
    def _watch(self) -> None:
        warn_after = max(self.timeout_s / 4, 1.0)
        while not self._stop.wait(PUBLISH_EVERY_S):
            if self._published != self.seq:
                self._publish()
            if self._warned == self.seq or time.monotonic() - self.since < warn_after:
                continue
            try:
                stuck = self.stuck_ranks()
            except Exception:
                continue
            if stuck:
                self._warned = self.seq
                log.error(
                    "rank %d has waited %.0f s in '%s' at step %d (timeout %s s); stuck rank(s): "
                    "%s\n%s",
                    self.rank,
                    time.monotonic() - self.since,
                    self.what,
                    self.step,
                    self.timeout_s,
                    ", ".join(map(str, stuck)),
                    self.report(),
                )

    def close(self) -> None:
        """Stop the publisher and wait for it: a daemon thread still inside a store call when the
        interpreter finalises is killed as it takes the GIL back, and that unwinding through the
        store's C++ frames aborts the process ("terminate called without an active exception")
        after its work is done. Bounded: a call on a dead store gives up after its timeout."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=STORE_TIMEOUT_S + PUBLISH_EVERY_S)
