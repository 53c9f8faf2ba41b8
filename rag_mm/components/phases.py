"""The training phases and the one loop that runs them.

A run is a sequence of phases: the vision tower's SimCLR warm-up, the retriever's warm-up and joint
training (``Trainer.fit``). Each is a ``Phase``: its step (one optimizer step, with the optimizer
and schedule the phase built through ``components.optim``), how many samples a step reads, and the
cadences of the components it drives (index refresh, evaluation, checkpoint, stop), asked after
every step. ``run_phase`` is the loop all three share: step, count, and every ``log_every`` steps
one metrics window (mean loss over the ranks, samples/s, recall of the gold documents).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class StepSums:
    """One optimizer step's detached sums, as a phase's step returns them."""

    loss: torch.Tensor  # () the logged loss, mean over the step's micro-steps
    grad_norm: torch.Tensor  # () the global gradient norm before clipping
    # () the retriever's loss, mean over the micro-steps; None: the phase trains no retriever
    retriever_loss: torch.Tensor | None = None
    # queries naming their gold document whose top-k holds it, out of ``n_hit`` such queries:
    # () tensors on the search's device (read at log steps only) or 0
    hits: torch.Tensor | int = 0
    n_hit: torch.Tensor | int = 0


def _no_cadence(step: int, done: StepSums, logged: dict | None) -> bool:
    return False


@dataclass
class Phase:
    """One training phase as ``run_phase`` runs it."""

    # the metrics prefix and the name in the log ("vision_warmup", "warmup", "train")
    name: str
    # the phase's last step (steps count from 1)
    steps: int
    # one optimizer step, given the steps done so far; None when it was skipped (not finite): a
    # skipped step is not counted and the next one is taken in its place
    step: Callable[[int], StepSums | None]
    # samples one step reads over all ranks (samples/s)
    samples_per_step: int
    # steps done before this start (a resumed joint phase)
    first: int = 0
    # the cadences after step ``i`` (``logged``: the window's record when one was written at
    # ``i``); True ends the phase there
    after: Callable[[int, StepSums, dict | None], bool] = _no_cadence
    # called at log steps before the window is read: the non-finite guard's deferred skips
    flush: Callable[[], None] = lambda: None
    # further scalars of a log record (the learning rate, skipped samples)
    extra: Callable[[], dict] = field(default=dict)
    # the record's name for the training recall of gold documents (None: not reported)
    recall_key: str | None = None


class Window:
    """The steps since the last log record, read (and emptied) at a log step."""

    def __init__(self, samples_per_step: int) -> None:
        self.samples_per_step = samples_per_step
        self.steps: list[StepSums] = []
        self.t0 = time.perf_counter()

    def add(self, done: StepSums) -> None:
        self.steps.append(done)

    def record(
        self, recall_key: str | None, mean_over_ranks: Callable[[torch.Tensor], torch.Tensor]
    ) -> dict:
        """Mean loss (over the window and the ranks), the last gradient norm, samples/s, the
        retriever's mean loss and the gold documents' recall when the phase has them."""
        n = len(self.steps)
        loss = mean_over_ranks(torch.stack([s.loss for s in self.steps]).mean())
        rec = {
            "loss": loss.item(),
            "grad_norm": float(self.steps[-1].grad_norm),
            "samples_per_s": n * self.samples_per_step / (time.perf_counter() - self.t0),
        }
        r_losses = [s.retriever_loss for s in self.steps if s.retriever_loss is not None]
        if r_losses:
            rec["retriever_loss"] = float(torch.stack(r_losses).mean())
        if recall_key is not None:
            n_hit = int(sum(s.n_hit for s in self.steps))
            rec[recall_key] = float(sum(s.hits for s in self.steps)) / n_hit if n_hit else None
        self.steps, self.t0 = [], time.perf_counter()
        return rec


def run_phase(
    phase: Phase,
    log_every: int,
    log: Callable[[dict], None],
    mean_over_ranks: Callable[[torch.Tensor], torch.Tensor] = lambda t: t,
) -> int:
    """Run ``phase`` from its ``first`` step to its last, or until its cadences end it; every
    ``log_every`` steps and at the last step ``log`` gets the window's record ({step, loss,
    grad_norm, samples_per_s, ...}). ``mean_over_ranks`` is a collective: every rank logs at the
    same steps. Returns the steps done."""
    window = Window(phase.samples_per_step)
    i = phase.first
    while i < phase.steps:
        done = phase.step(i)
        if done is None:
            continue
        i += 1
        window.add(done)
        logged = None
        if i % log_every == 0 or i == phase.steps:
            phase.flush()
            logged = {"step": i, **window.record(phase.recall_key, mean_over_ranks)}
            logged.update(phase.extra())
            log(logged)
        if phase.after(i, done, logged):
            break
    return i
