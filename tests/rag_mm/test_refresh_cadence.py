"""``components.refresh.IndexRefresh``: when the index is refreshed, and the recall it loses between
refreshes, counted by the age of the index each step searched (no training: the training runs of
test_train.py check that a refresh happens there)."""

from __future__ import annotations

import torch

from rag_mm.components.phases import StepSums
from rag_mm.components.refresh import IndexRefresh
from retriever.config import RetrieverConfig


class _Memory:
    """What IndexRefresh reads of a RetrievalMemory besides its refresh: the refresh times."""

    def __init__(self, seconds: list[float]) -> None:
        self.refresh_seconds = seconds

    def wait(self) -> None:
        pass


MEMORY = _Memory([1.0, 2.0])  # two refreshes, 3 s in all


def _refresh(memory=MEMORY, **rcfg) -> IndexRefresh:
    cfg = RetrieverConfig(mode="learned", top_k=2, **rcfg)
    return IndexRefresh(memory, None, cfg, watch=None, rank=0, stop_agreed=lambda: False)


def _step(hits: int, n: int = 8) -> StepSums:
    z = torch.zeros(())
    return StepSums(z, z, z, torch.tensor(hits), n)


def test_cadence_in_warmup_and_joint_training():
    r = _refresh(refresh_every=4)
    assert [i for i in range(1, 11) if r.due_in_warmup(i, 10)] == [4, 8, 10]
    # joint training: every 4 steps before the last (the final evaluation refreshes after it)
    assert [i for i in range(1, 13) if r.due(i, 12)] == [4, 8]
    assert not any(_refresh(refresh_every=4, query_side_only=True).due(i, 12) for i in (4, 8))
    assert not any(_refresh(refresh_every=0).due(i, 12) for i in range(1, 13))
    assert not _refresh(memory=None, refresh_every=4).due_in_warmup(4, 10)


def test_recall_drift_counts_steps_by_the_age_of_their_index():
    """refresh_every=4: steps 1-2 after a refresh searched a fresh index, steps 3-4 a stale one."""
    r = _refresh(refresh_every=4)
    for step, hits in zip(range(1, 9), (8, 6, 4, 2, 8, 6, 4, 2)):
        r.count(step, _step(hits))
    out = r.summary(train_time=7.0, warmup_time=0.0)
    assert out["train_recall@2_fresh_index"] == 28 / 32
    assert out["train_recall@2_stale_index"] == 12 / 32
    assert out["recall_drift"] == 28 / 32 - 12 / 32
    assert out["index_refreshes"] == 2 and out["refresh_fraction"] == 3.0 / 10.0
    assert out["refresh_mode"] == "sync"


def test_no_drift_without_refreshes_in_training():
    r = _refresh(refresh_every=4, query_side_only=True)
    r.count(1, _step(8))
    out = r.summary(train_time=1.0, warmup_time=0.0)
    assert out["recall_drift"] is None and out["refresh_mode"] == "off"
    assert _refresh(memory=None).summary(1.0, 0.0) == {}
