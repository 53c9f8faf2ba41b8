"""The retrieval memory's index refreshes during training: when they run, how every rank runs one
together, and what they cost and lose.

When: in the retriever's warm-up every ``retriever.refresh_every`` steps and after its last step
(the joint phase starts on a current index); in joint training every ``refresh_every`` steps before
the last, unless the document side is frozen (``query_side_only``) or ``refresh_every`` is 0; and
once more before the final evaluation, so that the run's figures are those of its last checkpoint as
``rag_mm.evaluate`` indexes it, not of an index ``refresh_every - 1`` steps old. How: the retriever
copies are checked to be one, then every rank re-embeds its share (``RetrievalMemory.refresh``); a
stop signal ends a refresh between two forward passes on every rank together
(``preemption.Stopped``). What they lose: training recall by the age of the index a step searched,
the first half of a refresh interval (fresh) against the second (stale: the query tower has moved on
since the memory was embedded). Their difference is the recall drift the schedule costs; the refresh
time's share of training is what it costs in time.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable

from rag_mm.components.phases import StepSums
from rag_mm.ft import faults, preemption
from rag_mm.ft.watchdog import Watchdog
from retriever import sync as retriever_sync
from retriever.config import RetrieverConfig
from retriever.errors import RefreshInterrupted
from retriever.memory import RetrievalMemory

log = logging.getLogger(__name__)


class IndexRefresh:
    """The run's index refreshes (every call a no-op without a learned memory)."""

    def __init__(
        self,
        memory: RetrievalMemory | None,
        retriever,
        rcfg: RetrieverConfig,
        watch: Watchdog,
        rank: int,
        stop_agreed: Callable[[], bool],
    ) -> None:
        self.memory, self.retriever, self.rcfg = memory, retriever, rcfg
        self.watch, self.rank = watch, rank
        # a collective: whether any rank got a stop signal (asked before each forward pass)
        self.stop_agreed = stop_agreed
        # [hits, queries] of training steps on a fresh / stale index
        self.drift = [[0, 0], [0, 0]]
        # the step whose document encoder the index holds (None: no refresh in this process yet)
        self.at: int | None = None
        # the final evaluation's refreshes and their seconds: evaluation's, not training's
        self.eval_refreshes, self.eval_seconds = 0, 0.0

    @property
    def in_training(self) -> bool:
        """Whether joint training refreshes the index (a learned memory whose document side
        trains, and a cadence)."""
        r = self.rcfg
        return self.memory is not None and r.refresh_every > 0 and not r.query_side_only

    @property
    def seconds(self) -> float:
        """Wall time of every refresh so far (embedding and index build)."""
        return sum(self.memory.refresh_seconds) if self.memory is not None else 0.0

    # ------------------------------------------------------------------------------ cadence
    def due_in_warmup(self, step: int, steps: int) -> bool:
        """After warm-up step ``step`` of ``steps``: fresher bank negatives every
        ``refresh_every`` steps, and a current index for the joint phase after the last."""
        every = self.rcfg.refresh_every
        return self.memory is not None and ((every and step % every == 0) or step == steps)

    def due(self, step: int, last: int) -> bool:
        """After joint step ``step`` (``last``: the phase's last, which the final evaluation's
        refresh follows)."""
        return self.in_training and step % self.rcfg.refresh_every == 0 and step < last

    # ------------------------------------------------------------------------------ refresh
    def run(self, step: int, background: bool | None = None) -> None:
        """Re-embed the memory with the current document encoder, on every rank together
        (``background``: None for ``retriever.refresh_background``)."""
        if self.memory is None:
            return
        if background is None:
            background = self.rcfg.refresh_background
        # every rank searches for itself: the retriever copies must be one
        self.watch.at("index refresh (retriever copies check)", step)
        retriever_sync.check_copies(self.retriever)
        self.watch.at("index refresh (all_gather of document embeddings)", step)
        asked = itertools.count()

        def stop() -> bool:  # asked before each forward pass; the fault point is after the first
            if next(asked) == 1:
                faults.inject("refresh", step, self.rank)
            return self.stop_agreed()

        try:
            self.memory.refresh(background=background, step=step, stop=stop)
        except RefreshInterrupted as exc:
            raise preemption.Stopped(
                f"index refresh at step {step} stopped after {exc.done} of its {exc.total} passes"
            ) from None
        self.at = step
        if self.memory.refresh_seconds:
            log.info("index refresh at step %d: %.2fs", step, self.memory.refresh_seconds[-1])

    def ensure(self, step: int) -> None:
        """An index to search: the first refresh, if none ran yet."""
        if self.memory is not None and not self.memory.built:
            self.run(step)

    def current(self, step: int) -> None:
        """An index of the document encoder at ``step``, for the final evaluation: joint training
        moved the document tower on since the last refresh (``due`` stops before the last step),
        so the memory is re-embedded now, synchronously, after any background refresh."""
        if self.memory is None:
            return
        if not self.in_training or self.at == step:
            self.ensure(step)
            return
        self.memory.wait()
        before = self.seconds
        self.run(step, background=False)
        self.eval_refreshes += 1
        self.eval_seconds += self.seconds - before

    # ------------------------------------------------------------------------------ drift
    def count(self, step: int, done: StepSums) -> None:
        """Joint step ``step``'s gold-document hits, by the age of the index it searched (this
        rank's queries)."""
        if not self.in_training:
            return
        every = self.rcfg.refresh_every
        since = (step - 1) % every  # steps searched on this index before this one
        half = int(since >= every / 2)
        # counts on the search's device, read once by summary(): no host sync in the step
        self.drift[half][0] += done.hits
        self.drift[half][1] += done.n_hit

    def summary(self, train_time: float, warmup_time: float) -> dict:
        """metrics.json's refresh entries: count, time and its share of training, recall on a
        fresh and a stale index and their difference (null where not measured)."""
        if self.memory is None:
            return {}
        r = self.rcfg
        self.memory.wait()
        total = self.seconds - self.eval_seconds  # training's refreshes and the first
        (fh, fn), (sh, sn) = ((int(h), int(n)) for h, n in self.drift)
        fresh, stale = (fh / fn if fn else None), (sh / sn if sn else None)
        return {
            "index_refreshes": len(self.memory.refresh_seconds) - self.eval_refreshes,
            "refresh_time_s": total,
            "eval_refresh_time_s": self.eval_seconds,
            f"train_recall@{r.top_k}_fresh_index": fresh,
            f"train_recall@{r.top_k}_stale_index": stale,
            "recall_drift": fresh - stale if fresh is not None and stale is not None else None,
            "refresh_fraction": None
            if r.refresh_background
            else total / max(total + train_time + warmup_time, 1e-9),
            "refresh_mode": (
                ("background" if r.refresh_background else "sync") if self.in_training else "off"
            ),
        }
