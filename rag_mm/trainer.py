"""The training loop: build -> (restore) -> fit -> close.

One process per rank (torchrun). Every layout (one process, data parallel, FSDP2, tensor
parallel, a pipeline and their combinations) takes the same step path: the RagModel's reader is
spread by ``parallel.parallelize`` (``SpreadRag``), the retriever is whole on every rank.
Checkpoints, metrics and the resolved config live in ``cfg.run_dir``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import signal
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.optim.swa_utils import AveragedModel

from rag_mm.build import batch_inputs, build_rag, make_stream
from rag_mm.checks import gold
from rag_mm.components import checkpoint
from rag_mm.components.checkpoint import Checkpointer
from rag_mm.components.metrics import MetricsLogger, json_safe
from rag_mm.components.nonfinite import NonFiniteGuard
from rag_mm.components.optim import build_optimizer, build_scheduler
from rag_mm.components.phases import Phase, StepSums, run_phase
from rag_mm.components.refresh import IndexRefresh
from rag_mm.components.vision_warmup import starts_fresh, vision_phase
from rag_mm.config import ConfigError, TrainConfig
from rag_mm.distributed.env import all_reduce_sum, broadcast_object, cleanup, init_distributed
from rag_mm.distributed.spread import SpreadRag
from rag_mm.eval.in_training import RunEvaluation
from rag_mm.ft import disk, faults, preemption
from rag_mm.ft.watchdog import Watchdog
from rag_mm.model.attention_tuning import tune_reader_attention

log = logging.getLogger(__name__)
MAX_NONFINITE_STEPS = 10  # consecutive non-finite losses tolerated (skipped) before the run aborts


def accuracy_line(m: dict) -> str:
    """A split's exact-match accuracy with its seen / held-out parts; a group the split does not
    have (VQA data holds no held-out entities) is named as absent, not printed as nan."""
    parts = [
        f"{name} {m[key]:.3f}" if m[n] else f"no {name} entities"
        for name, key, n in (
            ("seen", "acc_seen", "n_seen"),
            ("held-out", "acc_heldout", "n_heldout"),
        )
    ]
    return f"acc {m['acc']:.3f} ({', '.join(parts)})"


class Trainer:
    def __init__(self, cfg: TrainConfig, log_metrics: bool = True) -> None:
        """``cfg`` as the entry point hands it over: values validated, paths and shards checked
        (``rag_mm.train``: ``config.validate``, ``paths.check_paths``), once per start."""
        # settings that need gold documents, against the data's first samples
        gold_queries = gold.check(cfg)
        self.cfg = cfg
        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        if cfg.deterministic:
            torch.use_deterministic_algorithms(True, warn_only=True)
        self.env = init_distributed(cfg.device, cfg.launch.backend, cfg.launch.timeout_s)
        self.device = self.env.device
        # names a stuck rank
        self.watch = Watchdog(self.env.rank, self.env.world_size, cfg.launch.timeout_s)
        torch.manual_seed(cfg.seed)
        self.run_dir = Path(cfg.run_dir)
        self.ckpt = Checkpointer(cfg, self.env.is_main, self.watch)
        parts = build_rag(cfg, self.device, gold_queries)
        self.tok, self.store, self.memory = parts.tok, parts.store, parts.memory
        self.model, self.rag = parts.reader, parts.rag
        # the whole model, before it is spread over ranks
        self.ckpt_bytes = disk.checkpoint_bytes(self.rag)
        self._check_disk()
        retriever = parts.retriever
        self._stop_signal = False
        # the components that own a cadence: index refresh, evaluation (checkpoints: self.ckpt)
        self.refresh = IndexRefresh(
            self.memory, retriever, cfg.retriever, self.watch, self.env.rank, self._stop_agreed
        )
        self.evaluation = RunEvaluation(
            cfg, self.env, self.watch, self.tok, lambda: self._stop_signal
        )
        # the vision warm-up trains the plain tower, before the reader is spread over the ranks:
        # then ``fit`` spreads it after that phase (a fresh start only; a resumed run restores
        # the tower)
        vision_first = bool(cfg.model.vision_ssl_steps) and starts_fresh(cfg, self.ckpt.dir)
        self.spread: SpreadRag | None = None
        if not vision_first:
            self._spread_reader()
        self.step = 0
        # training batches this rank has drawn (resume replays the stream past them)
        self.consumed = 0
        # per loader worker: cumulative dropped samples
        self.skipped: dict[int, dict[str, int]] = {}
        self.train_time = 0.0
        # the retriever-only warm-up phase, its refreshes excluded (not in samples/s)
        self.warmup_time = 0.0
        # the written step's bubble fraction (rank 0, parallel.pp > 1)
        self.pipeline: dict | None = None
        self.metrics = MetricsLogger(
            self.run_dir, self.env.is_main and log_metrics, cfg.max_steps, cfg.progress
        )
        # why the joint phase stopped early (a signal, stop_after_steps); None: it ran to the end
        self._stop_reason: str | None = None
        # the last trained step's loss (NaN: no step trained by this process)
        self._last_loss = torch.full((), float("nan"))
        n_params = sum(p.numel() for p in self.model.parameters())
        n_retr = sum(p.numel() for p in retriever.parameters()) if retriever is not None else 0
        log.info(
            "reader: %.2f M parameters, retriever: %.2f M, world size %d, device %s",
            n_params / 1e6,
            n_retr / 1e6,
            self.env.world_size,
            self.device,
        )

    def _spread_reader(self) -> None:
        """The reader over the ranks as cfg.parallel says (``SpreadRag``), its attention kernels
        chosen, and the joint phase's optimizer and schedule."""
        cfg = self.cfg
        if cfg.optim.vision_lr_scale == 0:
            # frozen before the reader is spread: no gradient, no optimizer state
            self.model.picture_tower.requires_grad_(False)
        self.spread = SpreadRag(self.rag, cfg, self.device)
        # a replica shares a batch
        self.data_rank, self.data_size = self.spread.dp_rank, self.spread.dp_size
        # backend=auto's attention kernels, chosen by measurement before the first step: a
        # collective (rank 0 times the candidates or reads its cache, every rank runs its choices)
        self.watch.at("attention tuning (rank 0's choices to every rank)", 0)
        tune_reader_attention(cfg, self.device)
        self.opt = build_optimizer(self.spread, cfg.optim)
        self.sched = build_scheduler(self.opt, cfg.optim, cfg.max_steps)

    def _check_disk(self) -> None:
        """Warn (or with ``disk_check=stop`` refuse to start) when run_dir's file system cannot hold
        keep_checkpoints + 1 checkpoints; the main rank looks, every rank hears."""
        if self.cfg.disk_check == "off":
            return
        problem = (
            disk.space_problem(self.ckpt.dir, self.ckpt_bytes, self.cfg.keep_checkpoints)
            if self.env.is_main
            else None
        )
        problem = broadcast_object(problem)
        if problem is None:
            return
        if self.cfg.disk_check == "stop":
            raise ConfigError(f"disk_check=stop: {problem}")
        if self.env.is_main:
            log.warning("%s (disk_check=stop refuses to start then)", problem)

    # ------------------------------------------------------------------------------ data
    def _stream(self, split: str, train: bool, skip_batches: int = 0):
        return make_stream(
            self.cfg, split, train, self.data_rank, self.data_size, skip_batches, device=self.device
        )

    def evaluate_split(self, split: str, final: bool = True) -> dict:
        """``split`` evaluated at this step (``RunEvaluation.run``): the final evaluations on an
        index of this step's document encoder, the validations during training on the latest."""
        if final:
            self.refresh.current(self.step)
        else:
            self.refresh.ensure(self.step)
        return self.evaluation.run(
            self.spread,
            self._stream(split, train=False),
            split,
            self.step,
            replica_ranks=self.env.world_size // self.data_size,
            # a few queries with their answers and documents, generated by the whole reader
            examples=self.env.is_main and self.memory is not None and self.spread.whole_reader,
            final=final,
        )

    # ------------------------------------------------------------------------------ checkpoints
    def _state(self) -> tuple[dict, dict]:
        """(state, strided) as ``checkpoint.savable`` makes them: each rank its part (its stages',
        its shards), under the RagModel's names."""
        return checkpoint.savable(
            self.spread.model_state(), self.opt, self.spread.named_parameters()
        )

    def save(self) -> Path:
        trainer_state = {
            "step": self.step,
            "consumed": self.consumed,
            "train_time": self.train_time,
            "scheduler": self.sched.state_dict(),
            "skipped": self.skipped,
        }
        return self.ckpt.save(self.step, self._state()[0], trainer_state)

    def restore(self) -> None:
        """Resume according to ``cfg.resume``: auto | never | a checkpoint path."""
        ts = self.ckpt.restore(self._state)
        if ts is None:
            return
        self.sched.load_state_dict(ts["scheduler"])
        # the optimizer's state is saved per parameter, its groups come from the config: their
        # learning rate is the schedule's at the restored step (a scheduler's load sets none)
        for group, lr in zip(self.opt.param_groups, self.sched.get_last_lr()):
            group["lr"] = lr
        self.step, self.consumed, self.train_time = ts["step"], ts["consumed"], ts["train_time"]
        self.skipped = {int(k): v for k, v in ts.get("skipped", {}).items()}

    # ------------------------------------------------------------------------------ training
    def _on_sigterm(self, signum, frame) -> None:
        log.warning(
            "received signal %d: checkpointing after this step (or batch), then exiting", signum
        )
        self._stop_signal = True

    def _stop_agreed(self) -> bool:
        """Whether any rank got a stop signal (a collective: every rank asks at the same point)."""
        return preemption.any_rank(self._stop_signal)

    def _stopped(self, why: str, loss: torch.Tensor) -> dict:
        """The run stops on a signal (or stop_after_steps): say where, and what resume=auto does."""
        self._stop_signal = True
        if self.memory is not None:
            self.memory.cancel()  # a background refresh stops at its next batch
        if self.ckpt.saved_step != self.step:
            after = "nothing checkpointed yet: resume=auto starts over"
        else:
            then = (
                "runs the final evaluation"
                if self.step >= self.cfg.max_steps
                else "continues from it"
            )
            after = f"checkpoint of step {self.step} saved: resume=auto {then}"
        log.warning("stopping at step %d (%s); %s", self.step, why, after)
        return {"stopped_at": self.step, "loss": loss.item()}

    def _skipped_total(self) -> dict[str, int]:
        total: dict[str, int] = {}
        for counts in self.skipped.values():
            for k, v in counts.items():
                total[k] = total.get(k, 0) + v
        return total

    def _next_inputs(self, it) -> dict:
        """The next training batch as the model's inputs (its skipped-sample counts noted)."""
        batch = next(it)
        self.consumed += 1
        wid, counts = batch["skipped"]
        if counts:
            self.skipped[wid] = counts
        return batch_inputs(batch, self.device)

    def _no_queries(self) -> dict:
        """Inputs without queries: the warm-up's step when pseudo-queries alone make its loss."""
        none = torch.zeros(0, dtype=torch.long, device=self.device)
        return {
            "image": torch.zeros(0, device=self.device),
            "q_ids": none,
            "q_len": none,
            "gold": none,
        }

    def _step(
        self,
        it,
        autocast,
        loss: str,
        guard: NonFiniteGuard,
        sched=None,
        accum: int = 1,
        contrastive: bool = True,
    ) -> StepSums | None:
        """One optimizer step: the step of the retriever's warm-up and of joint training.
        ``accum`` micro-steps, each the forward and backward of one batch (gradients synchronised
        over the ranks once, on the last: ``SpreadRag.train_step(sync=...)``), the one gradient
        clipper, the non-finite check every rank agrees on (``guard``, which holds the phase's
        optimizer), then the optimizer and ``sched``. ``loss``: ``joint`` (reader and retriever)
        or ``retriever`` (the warm-up; no batch is read when pseudo-queries alone make its loss);
        ``contrastive``: the joint loss takes the retriever's contrastive terms. Returns the
        step's detached sums, or None when the step was skipped (non-finite)."""
        c = self.cfg
        reads = loss == "joint" or self.rag.gold_queries
        loss_sum = torch.zeros((), device=self.device)
        r_loss_sum = torch.zeros((), device=self.device)
        # the search's counts, on its device (the host, or the GPU with the device search): read
        # at log steps, not here
        hits = n_hit = 0
        # every micro-step's batch first: the reader's loss is the token mean of the whole step,
        # whose count over the replicas is known before the first backward
        batches = [self._next_inputs(it) if reads else self._no_queries() for _ in range(accum)]
        tokens = self.spread.step_answer_tokens(batches) if loss == "joint" else None
        for i, inputs in enumerate(batches):
            with autocast:  # train_step keeps it on the forwards only
                out = self.spread.train_step(
                    inputs,
                    scale=1 / accum,
                    sync=i == accum - 1,
                    loss=loss,
                    contrastive=contrastive,
                    answer_tokens=tokens,
                )
            # joint: each micro-step's reader loss is its share of the step's token mean
            loss_sum += out.loss if tokens is not None else out.loss / accum
            if out.retriever_loss is not None:
                r_loss_sum += out.retriever_loss / accum
            if out.hits is not None:
                hits, n_hit = hits + out.hits[0], n_hit + out.hits[1]
        gnorm = self.spread.clip_grad_norm_(c.optim.grad_clip or float("inf"))
        # every rank must take the same decision, so agree on finiteness
        self.watch.at("all_reduce: non-finite check")
        opt = guard.opt
        if not guard.check(self.step, loss_sum, gnorm):  # skipped on the host: not counted
            opt.zero_grad(set_to_none=True)
            return None
        opt.step()
        if sched is not None:
            sched.step()
        opt.zero_grad(set_to_none=True)
        r_loss = r_loss_sum if self.memory is not None else None
        return StepSums(loss_sum, gnorm, r_loss, hits, n_hit)

    def _run(self, phase: Phase) -> int:
        """``run_phase`` with this run's metrics: each window's record in metrics.jsonl under the
        phase's name (its line in the log is the phase's own, from its cadences); the loss
        averaged over the ranks."""

        def mean_over_ranks(loss: torch.Tensor) -> torch.Tensor:
            self.watch.at(f"all_reduce: {phase.name} loss")
            return all_reduce_sum(loss.clone()) / self.env.world_size

        def log_record(rec: dict) -> None:
            self.metrics.log(rec, prefix=phase.name)

        return run_phase(phase, self.cfg.log_every, log_record, mean_over_ranks)

    def _vision_warmup(self) -> None:
        """SimCLR on the plain vision tower (``components.vision_warmup``), then the reader is
        spread over the ranks."""
        self.watch.at("vision warm-up (gradient all_reduce)", 0)
        t0 = time.perf_counter()
        self._run(
            vision_phase(
                self.cfg, self.model.picture_tower, self.env.rank, self.env.world_size, self.device
            )
        )
        log.info("vision warm-up done in %.0f s", time.perf_counter() - t0)
        self._spread_reader()

    def _retriever_warmup(self, it, autocast) -> Phase:
        """Retriever-only contrastive steps before joint training (DPR-style warm-up): a random
        retriever hands the reader random documents, from which it learns nothing. The same step
        as joint training with the retriever's loss (``_step(loss="retriever")``), one batch per
        step, its own optimizer at ``retriever.warmup_lr`` (fresh Adam moments for the retriever
        alone), constant or falling by a cosine to ``warmup_min_lr_ratio`` of it at the last step;
        the index re-embedded every ``retriever.refresh_every`` steps and after the last. Not
        checkpointed: a run stopped during the warm-up restarts it."""
        c, r = self.cfg, self.cfg.retriever
        opt = build_optimizer(self.rag.retriever, c.optim, lr=r.warmup_lr)
        # no ramp: the warm-up starts at its peak, as it always has; ratio 1 keeps it there
        sched = build_scheduler(
            opt, c.optim, r.warmup_steps, warmup_steps=0, min_ratio=r.warmup_min_lr_ratio
        )
        guard = NonFiniteGuard(opt, self.device, MAX_NONFINITE_STEPS, c.log_every)
        # the dense weight average of the steps after ``average_from`` (every rank holds the same
        # weights, so the same average); a copy of the retriever, its buffers averaged too
        average_from = round(r.warmup_average_from * r.warmup_steps)
        average = (
            AveragedModel(self.rag.retriever, use_buffers=True)
            if average_from < r.warmup_steps
            else None
        )
        labelled = self.rag.gold_queries  # else pseudo-queries alone: no training batch is read
        log.info(
            "retriever warm-up: %d contrastive steps at lr %g%s, %d bank negatives%s",
            r.warmup_steps,
            r.warmup_lr,
            "" if r.warmup_min_lr_ratio == 1 else f" (cosine to {r.warmup_min_lr_ratio:g}x)",
            r.bank_negatives,
            "" if labelled else f", on {r.pseudo_queries} pseudo-queries alone (no gold documents)",
        )

        def step(done: int) -> StepSums | None:
            self.watch.at("retriever warm-up (gradient all_reduce)", done + 1)
            return self._step(it, autocast, "retriever", guard, sched)

        def after(i: int, done: StepSums, logged: dict | None) -> bool:
            faults.inject("warmup", i, self.env.rank)
            if average is not None and i > average_from:
                average.update_parameters(self.rag.retriever)
                if i == r.warmup_steps:  # before the last refresh: the joint phase's index
                    self.rag.retriever.load_state_dict(average.module.state_dict())
                    log.info(
                        "retriever warm-up: the average of steps %d-%d replaces its weights",
                        average_from + 1,
                        i,
                    )
            if self._stop_agreed():
                raise preemption.Stopped(
                    f"the retriever warm-up stopped after step {i} of {r.warmup_steps} "
                    "(it is not checkpointed)"
                )
            if self.refresh.due_in_warmup(i, r.warmup_steps):
                self.refresh.run(self.step)  # joint step 0: the warm-up is not checkpointed
            if logged is not None:
                recall = logged[f"train_recall@{r.top_k}"]
                log.info(
                    "retriever warm-up %d/%d: loss %.3f, train recall@%d %s",
                    i,
                    r.warmup_steps,
                    logged["loss"],
                    r.top_k,
                    "n/a (no gold documents)" if recall is None else f"{recall:.3f}",
                )
            return False

        return Phase(
            "warmup",
            r.warmup_steps,
            step,
            c.data.batch_size * self.data_size if labelled else r.pseudo_queries,
            after=after,
            flush=guard.flush,
            extra=lambda: {"lr": sched.get_last_lr()[0]},
            recall_key=f"train_recall@{r.top_k}",
        )

    def _joint_phase(self, it, autocast) -> Phase:
        """Reader and retriever together, from the restored step to ``max_steps``. The cadences
        after a step: index refresh, validation, the pipeline timeline, the stop-signal agreement
        and the checkpoint (a stop checkpoints the step, then ends the phase)."""
        c, r = self.cfg, self.cfg.retriever
        # skips non-finite steps; on an accelerator decided on the device, read at log steps
        guard = NonFiniteGuard(self.opt, self.device, MAX_NONFINITE_STEPS, c.log_every)
        stop_at = self.step + c.stop_after_steps if c.stop_after_steps else None
        # the pipeline timeline of the run's last planned step: past the first steps' one-off costs
        # (allocator growth, lazy initialisation), written once; recorded on that step only
        timeline_step = min(c.max_steps, stop_at or c.max_steps) if self.spread.pipelined else -1

        def step(done: int) -> StepSums | None:
            faults.inject("step", done, self.env.rank)
            self.spread.record_timeline(done + 1 == timeline_step)
            self.watch.at("forward/backward (gradient reduction)", done)
            t0 = time.perf_counter()
            contrastive = r.contrastive_steps < 0 or done < r.contrastive_steps
            out = self._step(
                it, autocast, "joint", guard, self.sched, c.optim.grad_accum, contrastive
            )
            if out is not None:
                self.train_time += time.perf_counter() - t0
            return out

        def after(i: int, done: StepSums, logged: dict | None) -> bool:
            self.step, self._last_loss = i, done.loss
            self.refresh.count(i, done)
            if logged is not None:
                self.metrics.progress(
                    i, f"loss {logged['loss']:.4f} | {logged['samples_per_s']:.0f} samples/s"
                )
            # a stop signal ends an index refresh or an evaluation between two of its batches,
            # on every rank together (Stopped): the step is done, so it is checkpointed below
            abandoned = False
            if self.refresh.due(i, c.max_steps):
                abandoned, _ = self._abandonable(lambda: self.refresh.run(i))
            if self.evaluation.due(i, c.max_steps) and not abandoned:
                abandoned, val = self._abandonable(lambda: self.evaluate_split("val", final=False))
                if not abandoned:
                    self.metrics.log({"step": i, **val}, prefix="val")
                    log.info("step %d val: %s", i, accuracy_line(val))
            if i == timeline_step:  # after the step's timing and logging: not counted in them
                self.watch.at("pipeline timeline (gather of events)", i)
                self._write_timeline()
            self.watch.at("all_reduce: stop-signal agreement", i)
            if preemption.any_rank(self._stop_signal):  # every rank stops after the same step
                self._stop_signal = True
            stopping = self._stop_signal or (stop_at is not None and i >= stop_at)
            if self.ckpt.due(i, stopping):
                self.save()
            if stopping:
                self._stop_reason = "signal" if self._stop_signal else "stop_after_steps"
            return stopping

        return Phase(
            "train",
            c.max_steps,
            step,
            c.data.batch_size * c.optim.grad_accum * self.data_size,
            first=self.step,
            after=after,
            flush=guard.flush,
            extra=lambda: {
                "lr": self.sched.get_last_lr()[0],
                "skipped": sum(self._skipped_total().values()),
            },
            recall_key=f"train_recall@{r.top_k}" if self.memory is not None else None,
        )

    def fit(self) -> dict:
        """The phases in order: the vision warm-up (a fresh start with ``model.vision_ssl_steps``),
        the retriever's warm-up (a fresh start with ``retriever.warmup_steps``), joint training;
        then the final evaluation. Each phase runs through ``run_phase``."""
        c, r = self.cfg, self.cfg.retriever
        prev = signal.signal(signal.SIGTERM, self._on_sigterm)
        autocast = (
            torch.autocast(self.device.type, dtype=torch.bfloat16)
            if c.optim.precision == "bf16"
            else contextlib.nullcontext()
        )
        try:
            if self.spread is None:
                self._vision_warmup()
            it = iter(self._stream("train", train=True, skip_batches=self.consumed))
            # before the first step: the index and the retriever warm-up (neither is checkpointed)
            try:
                self.refresh.ensure(self.step)
                if self.step == 0 and r.warmup_steps and self.memory is not None:
                    t0, refreshed = time.perf_counter(), self.refresh.seconds
                    self._run(self._retriever_warmup(it, autocast))
                    # its refreshes are counted as refresh time, not warm-up
                    refreshed = self.refresh.seconds - refreshed
                    self.warmup_time = time.perf_counter() - t0 - refreshed
            except preemption.Stopped as why:
                return self._stopped(f"signal: {why}", self._last_loss)
            self._run(self._joint_phase(it, autocast))
            if self._stop_reason is not None:
                return self._stopped(self._stop_reason, self._last_loss)
            if self.ckpt.saved_step != self.step:
                self.save()
            self.watch.at("all_reduce: stop-signal agreement", self.step)
            if self._stop_agreed():
                # a signal during the last step's checkpoint: no final evaluation
                return self._stopped("signal; the final evaluation was not run", self._last_loss)
            try:
                return self.finish(self._last_loss.item())
            except preemption.Stopped as why:  # the checkpoint of the last step is on disk already
                return self._stopped(
                    f"signal: {why}; the final evaluation was not finished", self._last_loss
                )
        finally:
            signal.signal(signal.SIGTERM, prev)

    def _abandonable(self, phase) -> tuple[bool, object]:
        """(whether a stop signal ended it, its result): ``phase()`` run, ``Stopped`` caught (it is
        raised on every rank together, so every rank goes on the same way)."""
        try:
            return False, phase()
        except preemption.Stopped as why:
            log.warning("%s (signal)", why)
            self._stop_signal = True
            return True, None

    def _write_timeline(self) -> None:
        # rank 0 writes it and gets the summary
        self.pipeline = self.spread.write_timeline(self.run_dir)
        if self.pipeline is not None:
            self.pipeline["step"] = self.step
            log.info(
                "pipeline timeline of step %d in %s: bubble %.1f%% (GPipe / 1F1B theory %.1f%%)",
                self.step,
                self.run_dir / "timeline.png",
                100 * self.pipeline["bubble_fraction"],
                100 * self.pipeline["theory_bubble"],
            )

    def finish(self, last_loss: float) -> dict:
        """Final evaluation on val and test; metrics.json in the run directory."""
        val, test = self.evaluate_split("val"), self.evaluate_split("test")
        world = {}
        world_json = Path(self.cfg.data.root) / "world.json"
        if world_json.is_file():
            world = json.loads(world_json.read_text())
        summary = {
            "step": self.step,
            "final_train_loss": last_loss,
            "train_time_s": self.train_time,
            "retriever_warmup_time_s": self.warmup_time,
            "samples_per_s": self.step
            * self.cfg.data.batch_size
            * self.cfg.optim.grad_accum
            * self.data_size
            / max(self.train_time, 1e-9),
            "world_size": self.env.world_size,
            "retrieval": self.cfg.retriever.mode,
            "val": val,
            "test": test,
            # None (null) when the data does not say
            "chance_accuracy": world.get("chance_accuracy"),
            "skipped_samples": self._skipped_total(),
            "skipped_documents": self.store.skipped,
            **self.refresh.summary(self.train_time, self.warmup_time),
        }
        if self.pipeline is not None:
            summary["pipeline"] = self.pipeline
        stats = self.spread.pmodel.grad_reduce_stats
        if stats is not None:  # bytes this rank sent between hosts (nccl-tests bus factors)
            summary["grad_reduce"] = {
                "kind": self.cfg.parallel.grad_reduce,
                "inter_host_bytes": stats.inter_bytes,
                "inter_host_calls": stats.inter_calls,
            }
        summary = json_safe(summary)  # strict JSON: null, not NaN, for a mean over no queries
        if self.env.is_main:
            self.metrics.log({"step": self.step, **summary["test"]}, prefix="test")
            (self.run_dir / "metrics.json").write_text(
                json.dumps(summary, indent=1, allow_nan=False)
            )
        return summary

    def close(self) -> None:
        if self.memory is not None:
            self.memory.close()
        self.metrics.close()
        self.watch.at("close (final barrier)")
        self.watch.close()
        if dist.is_initialized():
            dist.barrier()
        cleanup()
