"""The RagModel with its reader spread by ``parallel.parallelize``, for every layout: one
process, data parallel, FSDP2 / HSDP (``parallel.dp_shard``), tensor parallel (``parallel.tp``),
pipelined (``parallel.pp``) and their combinations. The trainer's one step path.

The retrieval, the retriever losses and the answer scoring are the RagModel's own
(``reader_inputs``, ``retriever_loss``); only the reader is spread. The retriever stays whole on
every rank. Every rank of one model replica (its pipeline stages and tensor-parallel ranks) draws
the same batch, so in ``learned`` mode each of them runs the query encoder, the faiss search and
the contrastive loss identically (same batch, same seed) and feeds the same documents to the
reader's stages. The contrastive loss gathers the embeddings of every replica
(``RagModel.replicas``), so its negatives are the global batch's, as in one process.

The reader-driven retriever losses read the spread reader as one process reads it:

- pdist / emdr need the reader's answer NLL with each document alone: a forward-only pass over
  the reader on (B*k) one-document inputs. That input makes the reader run another sequence of
  module calls than the training batch (one document embedding instead of k), so the reader is
  parallelized with a second input structure, ``one_document``, replayed on its own plan;
- adist needs the reader's copy attention per document: the last stage keeps it from the
  training step's own forward and hands it to every rank of the pipeline.

Step loss convention: the reader's loss is the mean over the answer tokens of the whole
optimizer step, as one process computes it over the global batch: the trainer counts the step's
answer tokens over the data-parallel replicas and accumulation micro-steps
(``optim.grad_accum``) before the step (``SpreadRag.step_answer_tokens``, one all-reduce), and each
pipeline microbatch, micro-step and replica weighs in by its own token count
(``ParallelModel.train_step(weight_fn=, weight_total=)``). Averaging the replicas' token means
as equals, as DDP does, would weigh a replica whose answers are short above its share. The
reader's gradients are reduced over its data-parallel ranks by ``ParallelModel`` (FSDP's
reduce-scatter, or an all-reduce of what FSDP does not shard, ``parallel.grad_reduce`` choosing
how); the retriever's over every rank (``retriever.sync``); both once per optimizer step, on the
last accumulated micro-step (``train_step(sync=True)``). The reader loss takes no gradient path
into the retriever (the retrieval prior is detached), so the two backwards give the gradients of
the joint loss. ``train_step(loss="retriever")`` is the retriever warm-up's step: the
retriever's contrastive loss alone, no reader pass.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from types import SimpleNamespace

import torch
import torch.distributed as dist

import parallel
from parallel.timeline import write_run_timeline
from rag_mm.config import ConfigError, TrainConfig, parallel_config
from rag_mm.model.rag import RagModel, RagOutput, gold_hits, one_document_inputs
from retriever import sync as retriever_sync
from retriever.replicas import Replicas

log = logging.getLogger(__name__)
# train_step's choice of loss: joint training, the retriever warm-up
STEP_LOSSES = (
    "joint",
    "retriever",
)


@dataclass(frozen=True)
class StepOut:
    """What one ``train_step`` call hands back (detached, on every rank)."""

    # () the logged loss: the reader's NLL (joint; with ``answer_tokens`` this batch's share of the
    # step's), the contrastive loss (retriever warm-up)
    loss: torch.Tensor
    # () the retriever's loss, before its weight (None: no learned retriever)
    retriever_loss: torch.Tensor | None
    # () counts, on the search's device: queries naming their gold document whose top-k holds
    # it, and queries naming one (``rag_mm.model.rag.gold_hits``); None: no retrieval
    hits: tuple[torch.Tensor, torch.Tensor] | None


def _answer_tokens(inputs: dict, _target=None) -> torch.Tensor:
    """Tokens in the reader's loss: ``a_len`` per example (its answer tokens and the closing EOT:
    the question's last slot predicts the first, answer slot j the one after it; ``Layout``), a
    () tensor on the inputs' device (an accelerator's is not read back: that would be a host
    sync)."""
    return inputs["a_len"].sum()


class SpreadRag:
    """The RagModel as the trainer trains it: its reader spread over the ranks as ``parallel``
    says."""

    def __init__(self, rag: RagModel, cfg: TrainConfig, device: torch.device) -> None:
        self.rag, self.cfg, self.device = rag, cfg, device
        self.pcfg = parallel_config(cfg, dist.get_world_size() if dist.is_initialized() else 1)
        if self.pcfg.compile and cfg.model.attention_backend == "flex" and device.type == "cpu":
            # a training step's flex on the CPU is flex's forward and a hand-written backward
            # (parallel.kernels.flex._FlexCPU) around a cached block mask, which a fullgraph block
            # cannot trace (the forward alone, an evaluation's, compiles)
            raise ConfigError(
                "model.attention_backend=flex with parallel.compile=true does not train on the "
                "CPU: flex has no CPU backward that a compiled block can trace. Use "
                "model.attention_backend=auto (the fused CPU kernel) or sdpa, or "
                "parallel.compile=false"
            )
        # the same example on every rank: rank 0 traces it, every rank plans the replay on it
        example = self._example(cfg.data.batch_size)
        self.per_document = rag.needs_doc_nll
        if self.pcfg.compile and self.pcfg.compile_scope == "model":
            # one graph of the whole reader: the accelerator's static layout (every slot kept, no
            # length read back, rag_mm/model/layout.py), on every device, the CPU included
            rag.reader.packed_devices = ()
            log.info("parallel.compile_scope=model: the reader keeps the static layout")
        structures = {}
        if self.per_document:  # (B*k) queries with one document each: another module-call sequence
            structures["one_document"] = one_document_inputs(
                {n: example[n] for n in ("image", "q_ids", "q_len", "a_ids", "a_len")},
                {n: example[n] for n in ("doc_image", "doc_ids", "doc_len")},
            )
        self.pmodel = parallel.parallelize(
            rag.reader,
            self.pcfg,
            example,
            timeout_s=float(cfg.launch.timeout_s),
            structures=structures,
        )
        lay = self.pmodel.layout
        # the contrastive loss over the whole global batch: gathered over this rank's data-parallel
        # peers (the same pipeline stage and tensor-parallel index in every replica)
        rag.replicas = Replicas(lay.dp_group, lay.dp_rank, lay.dp_size)
        if self.pmodel.layout.rank == 0 and self.pmodel.partition is not None:
            log.info("reader pipeline partition:\n%s", self.pmodel.partition.table())
        self.training = True

    # ------------------------------------------------------------------ layout
    @property
    def dp_rank(self) -> int:
        """Which share of the data this rank draws: its data-parallel index (the pipeline and
        tensor-parallel ranks of one replica share it)."""
        return self.pmodel.dp_rank

    @property
    def dp_size(self) -> int:
        return self.pmodel.dp_size

    @property
    def whole_reader(self) -> bool:
        """Every rank holds the whole, unsharded reader (one process or plain data parallel)."""
        c = self.pcfg
        return c.pp == 1 and c.tp == 1 and c.dp_shard == 1

    @property
    def reader(self):
        """The reader module (whole only where ``whole_reader``)."""
        return self.rag.reader

    @property
    def rcfg(self):
        return self.rag.rcfg

    @property
    def store(self):
        return self.rag.store

    def named_parameters(self):
        """This rank's trainable parameters under the RagModel's names (held reader part +
        retriever)."""
        for n, q in self.pmodel.named_parameters():
            yield f"reader.{n}", q
        if self.rag.retriever is not None:
            for n, q in self.rag.retriever.named_parameters():
                yield f"retriever.{n}", q

    def parameters(self):
        return (q for _, q in self.named_parameters())

    def train(self, mode: bool = True):
        self.training = mode
        self.rag.train(mode)
        return self

    def eval(self):
        return self.train(False)

    # ------------------------------------------------------------------ inputs
    def _example(self, b: int) -> dict:
        """A fixed synthetic batch shaped like the training batches (longest question / answer)."""
        m, g = self.cfg.model, torch.Generator().manual_seed(0)
        vocab = self.rag.reader.vocab_size
        x = {
            "image": torch.randn(b, 3, m.image_size, m.image_size, generator=g),
            "q_ids": torch.randint(0, vocab, (b, m.max_question), generator=g),
            "q_len": torch.full((b,), m.max_question),
            "a_ids": torch.randint(0, vocab, (b, m.max_answer), generator=g),
            "a_len": torch.full((b,), m.max_answer),
        }
        if self.rcfg.mode != "none":
            ids = torch.as_tensor(self.store.ids[:1]).repeat(b, self.rcfg.top_k)  # (b, k)
            x.update(self.store.fetch(ids))
            if (
                self.rcfg.mode == "learned" and self.rcfg.reader_prior
            ):  # log p(d | q) over the k documents
                x["doc_prior"] = torch.full((b, self.rcfg.top_k), -math.log(self.rcfg.top_k))
        return {k: v.to(self.device) for k, v in x.items()}

    def _reader_inputs(self, inputs: dict, train: bool, search_k: int = 0):
        """(reader inputs, retrieved ids or None, (queries, RagModel.reader_inputs' learned-mode
        tuple) or None). In learned mode every rank of a replica searches for itself: the same
        batch and the same retriever give the same documents."""
        q = {k: inputs[k] for k in ("image", "q_ids", "q_len", "a_ids", "a_len")}
        x, ids, ret = self.rag.reader_inputs(q, inputs.get("gold"), search_k=search_k, grad=train)
        return x, ids, (q, *ret) if ret is not None else None

    @torch.no_grad()
    def _per_document_nll(self, q: dict, docs: dict) -> torch.Tensor:
        """RagModel._per_document_nll over the pipeline: (B, k), on every rank of it: the last
        stage's, broadcast on the device."""
        B, k = docs["doc_ids"].shape[:2]
        res = self.pmodel.predict(
            one_document_inputs(q, docs),
            # (a copy: a compiled reader replaying CUDA graphs overwrites its outputs next call)
            output_fn=lambda out, _: out.nll.float().clone(),
            structure="one_document",
            to_all=False,
        )
        last = self.pmodel.is_last_stage
        nll = torch.cat(res) if last else torch.empty(B * k, device=self.device)
        return self.pmodel.last_stage_tensor_(nll.to(self.device)).view(B, k)

    # ------------------------------------------------------------------ training
    def step_answer_tokens(self, batches: list[dict]) -> torch.Tensor:
        """The answer tokens of one optimizer step over every data-parallel replica, a () float
        tensor on the batches' device: the sum of ``a_len`` over this rank's accumulation
        ``batches``, summed over the world (one all-reduce) and divided by the ranks that read
        each replica's batch (its pipeline and tensor-parallel ranks)."""
        tokens = sum(_answer_tokens(b) for b in batches).float().reshape(1)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(tokens)
            tokens /= dist.get_world_size() // self.dp_size
        return tokens[0]

    def train_step(
        self,
        inputs: dict,
        scale: float = 1.0,
        sync: bool = True,
        loss: str = "joint",
        contrastive: bool = True,
        answer_tokens: torch.Tensor | None = None,
    ) -> StepOut:
        """Forward + backward of one batch (gradients of ``scale * loss`` accumulate into .grad).
        ``sync``: this is the optimizer step's last micro-step: gradients are synchronised over
        the ranks now, once for everything accumulated (``ParallelModel.train_step``). ``loss``:
        ``joint`` (the reader's NLL and the retriever's loss) or ``retriever`` (the warm-up's
        contrastive loss alone; ``inputs`` may hold no queries when pseudo-queries make it).
        ``contrastive``: the joint loss takes the retriever's contrastive terms this step.
        ``answer_tokens``: the whole step's (``step_answer_tokens``): the reader's loss is then
        this batch's share of the step's token mean (the shares of a step's micro-steps sum to
        it; ``scale`` weighs the retriever's loss only). None: this batch's token mean times
        ``scale``."""
        if loss not in STEP_LOSSES:
            raise ValueError(f"loss must be one of {STEP_LOSSES} (got {loss!r})")
        retriever_sync.broadcast_buffers(self.rag.retriever)
        if loss == "retriever":
            r_loss, hits = self.rag.retriever_warmup(**inputs)
            with torch.autocast(self.device.type, enabled=False):  # a backward: no autocast
                (scale * r_loss).backward()
            if sync:
                retriever_sync.average_grads(self.rag.retriever)
            return StepOut(r_loss.detach(), r_loss.detach(), hits)
        x, ids, ret = self._reader_inputs(inputs, train=True)
        attention = (
            self.rcfg.mode == "learned" and self.rcfg.loss == "adist" and self.rcfg.top_k > 1
        )
        # the target: which batch rows a microbatch holds (adist's target gathers the reader's
        # copy attention there, on the last stage)
        rows = torch.arange(x["image"].shape[0], device=self.device)
        doc_att = torch.zeros(len(rows), self.rcfg.top_k, device=self.device) if attention else None

        r_scale = scale if answer_tokens is None else 1.0

        def loss_fn(out, mb_rows):
            if doc_att is not None:  # adist's target, from the training forward itself (last stage)
                doc_att[mb_rows] = out.doc_attention.detach().float()
            return out.loss * r_scale

        reader_loss = (
            self.pmodel.train_step(
                x,
                target=rows,
                loss_fn=loss_fn,
                weight_fn=_answer_tokens,
                sync=sync,
                weight_total=answer_tokens,
            )
            / r_scale
        )
        if ret is None:
            if sync:  # the retriever's gradients, if any, are the one reduce's too
                retriever_sync.average_grads(self.rag.retriever)
            return StepOut(reader_loss, None, None)
        q, q_emb, top, docs, _ = ret
        gold = inputs.get("gold")
        # the last stage's attention on every rank of the pipeline
        att = self.pmodel.last_stage_tensor_(doc_att) if attention else None
        nll = self._per_document_nll(q, docs) if self.per_document else None
        r_loss, _ = self.rag.retriever_loss(q, q_emb, top, docs, gold, nll, att, contrastive)
        with torch.autocast(self.device.type, enabled=False):  # a backward: no autocast
            (self.rcfg.loss_weight * scale * r_loss).backward()
        if sync:
            retriever_sync.average_grads(self.rag.retriever)
        hits = None
        if gold is not None and ids is not None:  # recall of the queries naming their gold document
            hits = gold_hits(ids[:, : self.rcfg.top_k], gold)
        return StepOut(reader_loss, r_loss.detach(), hits)

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Global-norm clipping over the whole model, reader and retriever
        (``ParallelModel.clip_grad_norm_``)."""
        retriever = self.rag.retriever.parameters() if self.rag.retriever is not None else ()
        return self.pmodel.clip_grad_norm_(max_norm, also=retriever)

    # ------------------------------------------------------------------ pipeline timeline
    @property
    def pipelined(self) -> bool:
        return self.pmodel.layout.pp_size > 1

    def record_timeline(self, on: bool) -> None:
        """Whether the next ``train_step`` records the pipeline's per-action events."""
        self.pmodel.set_record_timeline(on)

    def write_timeline(self, run_dir) -> dict | None:
        """The recorded step of the pipeline that holds global rank 0, its ranks' events merged
        on rank 0 into ``run_dir`` (timeline.json / timeline.png); the summary (bubble fraction)
        on rank 0, None elsewhere. A collective over that pipeline: its ranks call it together,
        the other replicas' pipelines skip it."""
        lay = self.pmodel.layout
        if not self.pipelined or 0 not in lay.pp_ranks:
            return None
        title = f"pp={lay.pp_size}, {self.pcfg.microbatches} microbatches, {self.pcfg.schedule}:"
        return write_run_timeline(self.pmodel.events, run_dir, lay.pp_group, title)

    # ------------------------------------------------------------------ evaluation
    @torch.no_grad()
    def __call__(
        self,
        image,
        q_ids,
        q_len,
        a_ids,
        a_len,
        gold=None,
        retriever_loss: bool = False,
        search_k: int = 0,
    ) -> RagOutput:
        """Forward-only over the spread reader (what ``evaluate`` needs: per-example correct and
        NLL, the retrieved ids and their scores)."""
        inputs = dict(image=image, q_ids=q_ids, q_len=q_len, a_ids=a_ids, a_len=a_len, gold=gold)
        retriever_sync.broadcast_buffers(self.rag.retriever)
        x, ids, ret = self._reader_inputs(inputs, train=False, search_k=search_k)
        res = self.pmodel.predict(
            x,
            output_fn=lambda out, _: (out.correct.cpu(), out.nll.cpu(), out.targets),
        )
        correct = torch.cat([c for c, _, _ in res])
        nll = torch.cat([n for _, n, _ in res])
        # each query's targets: evaluation's greedy answers take them where ``correct``
        targets = [t for _, _, ts in res for t in ts]
        reader = SimpleNamespace(correct=correct, nll=nll, loss=nll.mean(), targets=targets)
        scores = self.rag.index_scores(ret[-1]) if ret is not None else None
        return RagOutput(reader.loss, reader, None, ids, scores)

    # ------------------------------------------------------------------ checkpoints
    def model_state(self) -> dict:
        """This rank's part of the RagModel's state under its original names (DCP writes each key
        once; together the ranks hold every key); ``rag_mm.components.checkpoint.savable`` makes it
        DCP's."""
        sd = {f"reader.{k}": v for k, v in self.pmodel.state_dict().items()}
        if self.rag.retriever is not None:
            sd.update({f"retriever.{k}": v for k, v in self.rag.retriever.state_dict().items()})
        return sd
