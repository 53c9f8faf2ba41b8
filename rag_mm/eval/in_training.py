"""The evaluations a training run makes: validation every ``eval_every`` joint steps, and the final
evaluation of val and test that metrics.json reports.

Every rank evaluates its share of the split (``rag_mm.evaluate.evaluate``) and the counts are summed
over the ranks. The blind prior's table (``rag_mm.eval.blind_prior``) is read from the training
shards once per run on the main rank (cached in the run directory, so a resumed run or the
command-line evaluation reuses it) and sent to the other ranks. A stop signal ends an evaluation
between two batches, on every rank together (``preemption.Stopped``).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable
from pathlib import Path

from rag_mm.config import TrainConfig
from rag_mm.data.urls import expand_urls
from rag_mm.distributed.env import DistEnv, broadcast_object
from rag_mm.eval.blind_prior import CACHE_NAME, BlindPrior, load_or_build
from rag_mm.evaluate import evaluate
from rag_mm.ft import faults, preemption
from rag_mm.ft.watchdog import Watchdog


class RunEvaluation:
    """A training run's evaluations: when they run and what each reads."""

    def __init__(
        self,
        cfg: TrainConfig,
        env: DistEnv,
        watch: Watchdog,
        tokenizer,
        stop_signal: Callable[[], bool],
    ) -> None:
        self.cfg, self.env, self.watch, self.tok = cfg, env, watch, tokenizer
        self.run_dir = Path(cfg.run_dir)
        # this rank's stop flag (no collective): asked before each batch
        self.stop_signal = stop_signal
        self._prior: BlindPrior | None = None
        self._prior_ready = False

    def due(self, step: int, last: int) -> bool:
        """Validation after joint step ``step``: every ``eval_every`` steps before the phase's
        ``last`` (the final evaluation follows it)."""
        every = self.cfg.eval_every
        return bool(every) and step % every == 0 and step < last

    def blind_prior(self, step: int) -> BlindPrior | None:
        """The blind prior's table, read once per run; None when no training sample is usable."""
        if not self._prior_ready:
            table, stopped = None, False
            if self.env.is_main:  # a stop signal ends the read between two shards
                try:
                    prior = load_or_build(
                        expand_urls(self.cfg.data.root, self.cfg.data.train),
                        self.run_dir / CACHE_NAME,
                        stop=self.stop_signal,
                    )
                    table = prior.to_json("") if prior is not None else None
                except preemption.Stopped:
                    stopped = True
            self.watch.at("blind prior (broadcast of the table)", step)
            # plain JSON data, checked again on arrival
            table, stopped = broadcast_object((table, stopped))
            if stopped:
                raise preemption.Stopped(
                    "reading the blind prior's table from the training shards stopped"
                )
            self._prior = BlindPrior.from_json(table) if table is not None else None
            self._prior_ready = True
        return self._prior

    def run(
        self,
        spread,
        batches: Iterable[dict],
        split: str,
        step: int,
        replica_ranks: int,
        examples: bool,
        final: bool = True,
    ) -> dict:
        """Evaluate ``split`` (its ``batches``, this rank's share) with the spread RagModel at
        ``step``. ``replica_ranks``: the ranks that read each replica's batch (its counts are
        divided by them). ``examples``: write a few queries with their answers and documents
        (``retrieved_examples.json``; the main rank, a whole reader). ``final`` (the evaluations
        metrics.json reports) adds the image ablation (one more forward per batch) and logs the
        split's summary line and warnings; the periodic validations leave both out."""
        prior = self.blind_prior(step)
        self.watch.at(f"evaluation on {split} (all_reduce of counts)")
        asked = itertools.count()

        def stop() -> bool:  # asked before each batch; the fault point is after the first one
            if next(asked) == 1:
                faults.inject("eval", step, self.env.rank)
            return self.stop_signal()

        return evaluate(
            spread,
            batches,
            self.env.device,
            0,  # every batch of the split
            examples_path=self.run_dir / "retrieved_examples.json" if examples else None,
            n_examples=self.cfg.retriever.eval_examples,
            tokenizer=self.tok,
            replicas=replica_ranks,
            prior=prior,
            ablation=final,
            split=split if final else "",
            stop=stop,
            name=f"evaluation of {split} at step {step}",
        )
