"""The one phase loop (rag_mm.components.phases.run_phase): what it counts, when it logs, what a
window reports, and how a phase's cadences end it."""

from __future__ import annotations

import pytest
import torch

from rag_mm.components.phases import Phase, StepSums, run_phase


def _steps(losses, skipped=(), hits=None):
    """A step function handing out ``losses`` in order; the calls listed in ``skipped`` return
    None (a non-finite step, skipped)."""
    calls = iter(range(10_000))
    it = iter(losses)

    def step(done: int) -> StepSums | None:
        if next(calls) in skipped:
            return None
        loss = next(it)
        return StepSums(
            loss=torch.tensor(float(loss)),
            grad_norm=torch.tensor(float(done)),
            hits=1 if hits and hits(done) else 0,
            n_hit=1 if hits else 0,
        )

    return step


def test_skipped_steps_are_not_counted_and_windows_average_their_steps():
    records = []
    phase = Phase(
        "warmup",
        5,
        _steps([1, 2, 3, 4, 5], skipped={1, 4}),
        samples_per_step=8,
        recall_key="train_recall@4",
    )
    done = run_phase(phase, 2, records.append)
    assert done == 5
    assert [r["step"] for r in records] == [2, 4, 5]  # every 2 steps and at the last
    assert [r["loss"] for r in records] == pytest.approx([1.5, 3.5, 5.0])
    assert [r["grad_norm"] for r in records] == [1.0, 3.0, 4.0]  # the window's last step
    assert all(r["samples_per_s"] > 0 and r["train_recall@4"] is None for r in records)
    assert "retriever_loss" not in records[0]


def test_recall_and_the_mean_over_ranks_and_extras():
    records = []
    phase = Phase(
        "train",
        4,
        _steps([2, 2, 2, 2], hits=lambda done: done % 2 == 0),
        samples_per_step=1,
        extra=lambda: {"lr": 0.5},
        recall_key="train_recall@1",
    )
    run_phase(phase, 4, records.append, mean_over_ranks=lambda t: t / 2)
    (rec,) = records
    assert rec["loss"] == pytest.approx(1.0) and rec["lr"] == 0.5
    assert rec["train_recall@1"] == pytest.approx(0.5)


def test_a_cadence_ends_the_phase_and_a_resumed_phase_starts_after_its_first_steps():
    seen = []

    def after(i, done, logged):
        seen.append((i, logged is not None))
        return i == 6

    phase = Phase("train", 10, _steps(range(10)), 1, first=3, after=after)
    assert run_phase(phase, 2, lambda rec: None) == 6
    assert seen == [(4, True), (5, False), (6, True)]
