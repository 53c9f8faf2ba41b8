"""The RagModel with its reader spread by ``parallel.parallelize``, for every layout: one
process, data parallel, FSDP2 / HSDP (``parallel.dp_shard``), tensor parallel (``parallel.tp``),
pipelined (``parallel.pp``) and their combinations. The trainer's one step path.

The retrieval, the retriever losses and the answer scoring are the RagModel's own
(``reader_inputs``, ``retriever_loss``); only the reader is spread. The retriever stays whole on
every rank. Every rank of one model replica (its pipeline stages and tensor-parallel ranks) draws
the same batch, so in ``learned`` mode each of them runs the query encoder, the faiss search and
the contrastive loss identically (same batch, same seed) and feeds the same documents to the
reader's stages. The contrastive loss gathers the embeddings of every replica (``RagModel.replicas``),
so its negatives are the global batch's, as in one process.

The reader-driven retriever losses read the spread reader as one process reads it:

- pdist / emdr need the reader's answer NLL with each document alone: a forward-only pass over
  the reader on (B*k) one-document inputs. That input makes the reader run another sequence of
  module calls than the training batch (one document embedding instead of k), so the reader is
  parallelized with a second input structure, ``one_document``, replayed on its own plan;
- adist needs the reader's copy attention per document: the last stage keeps it from the
  training step's own forward and hands it to every rank of the pipeline.

Step loss convention: the reader's loss is a mean over answer tokens, so microbatches are
weighted by their answer-token count: the step loss and gradients equal the full batch's. The
reader's gradients are reduced over its data-parallel ranks by ``ParallelModel`` (FSDP's
reduce-scatter, or an all-reduce of what FSDP does not shard, ``parallel.grad_reduce`` choosing
how); the retriever's here, over every rank (see ``_average_retriever_grads``). The reader loss
takes no gradient path into the retriever (the retrieval prior is detached), so the two
backwards give the gradients of the joint loss.
"""

from __future__ import annotations

import logging
import math
from types import SimpleNamespace

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

import parallel
from parallel.collectives import all_reduce_mean_, flat_collective
from parallel.timeline import write_run_timeline
from rag_mm.config import parallel_config
from rag_mm.model.rag import RagModel, RagOutput, one_document_inputs
from retriever.replicas import Replicas

log = logging.getLogger(__name__)


def _answer_tokens(inputs: dict, _target=None) -> float:
    """Tokens in the reader's loss: every answer token after the first (a_len - 1 per example)."""
    return float((inputs["a_len"] - 1).clamp_min(0).sum())


class SpreadRag:
    """The RagModel as the trainer trains it: its reader spread over the ranks as ``parallel`` says."""

    def __init__(self, rag: RagModel, cfg, device: torch.device) -> None:
        self.rag, self.cfg, self.device = rag, cfg, device
        self.pcfg = parallel_config(cfg, dist.get_world_size() if dist.is_initialized() else 1)
        # the same example on every rank: rank 0 traces it, every rank plans the replay on it
        example = self._example(cfg.data.batch_size)
        r = self.rcfg
        self.per_document = r.mode == "learned" and r.loss in ("pdist", "emdr") and r.top_k > 1
        structures = {}
        if self.per_document:  # (B*k) queries with one document each: another module-call sequence
            structures["one_document"] = one_document_inputs(
                {n: example[n] for n in ("image", "q_ids", "q_len", "a_ids", "a_len")},
                {n: example[n] for n in ("doc_image", "doc_ids", "doc_len")})
        self.pmodel = parallel.parallelize(rag.reader, self.pcfg, example, timeout_s=float(cfg.launch.timeout_s),
                                           structures=structures)
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
    def pp_rank(self) -> int:
        return self.pmodel.pp_rank

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
        """This rank's trainable parameters under the RagModel's names (held reader part + retriever)."""
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
            if self.rcfg.mode == "learned" and self.rcfg.reader_prior:  # log p(d | q) over the k documents
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
        """RagModel._per_document_nll over the pipeline: (B, k), on every rank of it."""
        B, k = docs["doc_ids"].shape[:2]
        res = self.pmodel.predict(one_document_inputs(q, docs), output_fn=lambda out, _: out.nll.cpu(),
                                  structure="one_document")
        return torch.cat(res).view(B, k).to(self.device)

    # ------------------------------------------------------------------ training
    def train_step(self, inputs: dict, scale: float = 1.0) -> RagOutput:
        """Forward + backward of one batch (gradients of ``scale * loss`` accumulate into .grad);
        a RagOutput of detached values, the reader loss being the batch's (every rank)."""
        self._broadcast_retriever_buffers()
        x, ids, ret = self._reader_inputs(inputs, train=True)
        attention = self.rcfg.mode == "learned" and self.rcfg.loss == "adist" and self.rcfg.top_k > 1
        rows = torch.arange(x["image"].shape[0])  # the target: which batch rows a microbatch holds
        doc_att = torch.zeros(len(rows), self.rcfg.top_k) if attention else None

        def loss_fn(out, mb_rows):
            if doc_att is not None:  # adist's target, from the training forward itself (last stage)
                doc_att[mb_rows] = out.doc_attention.detach().float().cpu()
            return out.loss * scale

        loss = self.pmodel.train_step(x, target=rows, loss_fn=loss_fn, weight_fn=_answer_tokens) / scale
        r_det = None
        if ret is not None:
            q, q_emb, top, docs, _ = ret
            gold = inputs.get("gold")
            att = self.pmodel.from_last_stage(doc_att).to(self.device) if attention else None
            nll = self._per_document_nll if self.per_document else None
            r_loss, _ = self.rag.retriever_loss(q, q_emb, top, docs, gold, nll, att)
            with torch.autocast(self.device.type, enabled=False):  # a backward: no autocast
                (self.rcfg.loss_weight * scale * r_loss).backward()
            self._average_retriever_grads()
            r_det = r_loss.detach()
        total = loss + (self.rcfg.loss_weight * r_det if r_det is not None else 0.0)
        return RagOutput(total, SimpleNamespace(loss=loss), r_det, ids, None)

    def _average_retriever_grads(self) -> None:
        """Mean over every rank, as the retriever warm-up does: the retriever is replicated on all.
        Ranks of one replica read the same batch, but need not make the same random draws
        (pseudo-queries, bank negatives): each stage draws from the global generator for its own
        blocks (dropout), so the streams part once the model uses randomness. Averaged, every copy
        takes the same step and every rank of a pipeline retrieves the same documents, which its
        stages need (``check_retriever_copies``). The contrastive term is the global batch's on
        every replica, and its gather's backward sums each replica's share into the rows it
        embedded, so this mean is one process's gradient of it (``retriever/replicas.py``).
        Linear, so calling it after every accumulated micro-step is exact."""
        if self.rag.retriever is None or not dist.is_initialized() or dist.get_world_size() == 1:
            return
        flat_collective([q.grad for q in self.rag.retriever.parameters() if q.grad is not None], all_reduce_mean_)

    @torch.no_grad()
    def _broadcast_retriever_buffers(self) -> None:
        """The retriever's buffers from rank 0 to every rank, before each use, as DDP's
        ``broadcast_buffers`` does for the one-process model. BatchNorm's running statistics (the
        ResNet tower) move in every train-mode forward, the index refresh's too, and there each
        rank embeds its own share of the memory: left alone, the copies' statistics drift apart
        and evaluation, which reads them, retrieves different documents on the stages."""
        bufs = [b for b in self.rag.retriever.buffers() if b.is_floating_point()] if self.rag.retriever else []
        if not bufs or not dist.is_initialized() or dist.get_world_size() == 1:
            return
        flat_collective(bufs, lambda flat: dist.broadcast(flat, src=0))

    @torch.no_grad()
    def check_retriever_copies(self) -> None:
        """Raise unless every rank holds the same retriever parameters, bit for bit (buffers are
        broadcast before each use). Stages of one pipeline each run their own search; with
        diverged retrievers they would read different documents and the cut tensors would no
        longer fit the receiving stage's own batch (a shape error at best, a silently wrong step
        at worst). A collective; the checksum is an integer sum of the parameters' bits, exact
        whatever the summation order."""
        if self.rag.retriever is None or not dist.is_initialized() or dist.get_world_size() == 1:
            return
        bits = [q.detach().reshape(-1).contiguous().view(torch.int32).long().sum() for q in self.rag.retriever.parameters()
                if q.dtype == torch.float32]
        mine = torch.stack(bits).sum().reshape(1)
        every = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
        dist.all_gather(every, mine)
        sums = [int(t) for t in every]
        if len(set(sums)) > 1:
            raise RuntimeError(f"the retriever copies differ between ranks (parameter checksums {sums}): the ranks of "
                               "a pipeline would retrieve different documents")

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Global-norm clipping over the whole model: the reader's squared norms are summed over
        the pipeline (a replicated tied weight counted once), the retriever's counted once."""
        pm = self.pmodel
        sq = torch.zeros((), dtype=torch.float64)
        copies = {n: len({pm.partition.stage_rank[s] for s in pm.partition.param_stages.get(n, [0])})
                  for n in pm._replicated}
        for n, q in pm.named_parameters():
            if q.grad is not None:
                g2 = q.grad.detach().double().pow(2).sum()
                if isinstance(g2, DTensor):  # a TP / FSDP shard: the sum over its mesh (a collective)
                    g2 = g2.full_tensor()
                sq += g2.cpu() / copies.get(n, 1)
        if dist.is_initialized() and pm.layout.pp_size > 1:
            dist.all_reduce(sq, group=pm.layout.pp_group)
        if self.rag.retriever is not None:
            for q in self.rag.retriever.parameters():
                if q.grad is not None:
                    sq += q.grad.detach().double().pow(2).sum().cpu()
        norm = sq.sqrt().float()
        if math.isfinite(max_norm) and float(norm) > max_norm:
            coef = max_norm / (float(norm) + 1e-6)
            for q in self.parameters():
                if q.grad is not None:
                    q.grad.mul_(coef)
        return norm

    # ------------------------------------------------------------------ pipeline timeline
    @property
    def pipelined(self) -> bool:
        return self.pmodel.layout.pp_size > 1

    def record_timeline(self, on: bool) -> None:
        """Whether the next ``train_step`` records the pipeline's per-action events."""
        self.pmodel.record_timeline = on

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
    def __call__(self, image, q_ids, q_len, a_ids, a_len, gold=None, retriever_loss: bool = False,
                 search_k: int = 0) -> RagOutput:
        """Forward-only over the spread reader (what ``evaluate`` needs: per-example correct and
        NLL, the retrieved ids and their scores)."""
        inputs = dict(image=image, q_ids=q_ids, q_len=q_len, a_ids=a_ids, a_len=a_len, gold=gold)
        self._broadcast_retriever_buffers()
        x, ids, ret = self._reader_inputs(inputs, train=False, search_k=search_k)
        res = self.pmodel.predict(x, output_fn=lambda out, _: (out.correct.cpu(), out.nll.cpu()))
        correct = torch.cat([c for c, _ in res])
        nll = torch.cat([n for _, n in res])
        reader = SimpleNamespace(correct=correct, nll=nll, loss=nll.mean())
        scores = None
        if ret is not None:  # the index's similarities, scaled as the retriever scores
            scores = self.rag.retriever.scale().detach() * ret[-1][:, :self.rcfg.top_k]
        return RagOutput(reader.loss, reader, None, ids, scores)

    # ------------------------------------------------------------------ checkpoints
    def model_state(self) -> dict:
        """This rank's part of the RagModel's state under its original names (DCP writes each key
        once; together the ranks hold every key)."""
        sd = {f"reader.{k}": v for k, v in self.pmodel.state_dict().items()}
        if self.rag.retriever is not None:
            sd.update({f"retriever.{k}": v for k, v in self.rag.retriever.state_dict().items()})
        return self._savable(sd, "model")

    def _savable(self, sd: dict, part: str) -> dict:
        """DCP cannot plan TP's strided shards (fused q|k|v blocks split per block on a 1-D mesh:
        its chunk offsets overlap), so those tensors go to the checkpoint whole (gathered over
        their mesh, then written once like any replicated tensor); ``load_done`` scatters a
        restored one back into the shards."""
        if not hasattr(self, "_strided"):
            self._strided: dict[tuple, DTensor] = {}
        out = {}
        for k, v in sd.items():
            if isinstance(v, dict):
                out[k] = {j: self._gathered(w, (part, k, j)) for j, w in v.items()}
            else:
                out[k] = self._gathered(v, (part, k))
        return out

    def _gathered(self, v, key: tuple):
        if isinstance(v, DTensor) and any(type(pl).__name__ == "_StridedShard" for pl in v.placements):
            self._strided[key] = v
            return v.full_tensor()
        return v

    @torch.no_grad()
    def load_done(self, state: dict) -> None:
        """After a restore: copy the whole tensors ``_savable`` handed to DCP into the shards."""
        from torch.distributed.tensor import distribute_tensor

        for key, dt in getattr(self, "_strided", {}).items():
            full = state[key[0]][key[1]] if len(key) == 2 else state[key[0]][key[1]][key[2]]
            dt.copy_(distribute_tensor(full.to(dt.dtype), dt.device_mesh, dt.placements))

    def optim_state(self, opt: torch.optim.Optimizer) -> dict:
        """Optimizer state per parameter name (created now if the optimizer has not stepped yet,
        so a restore has tensors to load into); param groups come from the config."""
        names = {id(q): n for n, q in self.named_parameters()}
        if not opt.state:
            for group in opt.param_groups:
                for q in group["params"]:
                    opt.state[q] = {"step": torch.zeros((), dtype=torch.float32),
                                    "exp_avg": torch.zeros_like(q), "exp_avg_sq": torch.zeros_like(q)}
        return self._savable({names[id(q)]: st for q, st in opt.state.items()}, "optim")
