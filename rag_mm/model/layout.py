"""What every reader shares: the sequence layout, the answer scoring and greedy generation.

Sequence of one example (packed left, padded right to the batch's longest)::

    [doc_1 patches, doc_1 text] ... [doc_k patches, doc_k text] [query patches, question, answer]
     └──────── segment 0 ───────┘     └──────── segment k-1 ──┘  └────────── segment k ─────────┘

With ``question_first`` (``model.question_first``) the query segment is [question, query patches,
answer]: the patches, read after the question, attend to its words. With ``query_prefix``
(``model.query_prefix``, closed book only) the picture and question form a segment of their own
that attends both ways within itself, and the answer a last segment that reads it (a prefix-LM)::

    [query patches, question] [answer]      (or [question, query patches] [answer])
     └──── segment 0, both ways ───┘ └─ 1 ─┘

On an accelerator the slots are not trimmed: every example is padded to the batch's slot count,
known from the shapes, and the answer positions are picked into a fixed number of rows with a
validity mask, so the step reads nothing back from the device (sizing the packed sequence to the
longest example would cost a host sync per forward). Padding attends to nothing and carries no
label, so the loss and the scores are the packed sequence's.

Documents attend within themselves; the query segment attends to all documents and causally to
itself (``parallel.kernels.attention`` layout). Positions restart in every segment, so documents
form an unordered set. The loss is next-token cross-entropy on the answer tokens only.

A reader subclasses ``ReaderBase`` and provides ``embed_tokens``, ``encode_images``, ``rank_emb``
(a learned offset per retrieval rank), ``max_docs``/``max_segment_len`` and its ``forward``, which
runs its transformer over ``assemble``'s sequence and hands the hidden states to ``read_out``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from rag_mm.model.copy_head import segment_ids

IGNORE = -100  # label of positions without a loss (F.cross_entropy's ignore_index)
# token types: which part of the sequence a slot belongs to
DOC_IMAGE, DOC_TEXT, QUERY_IMAGE, QUESTION, ANSWER = range(5)


@dataclass
class ReaderOutput:
    loss: torch.Tensor  # () mean NLL over every answer token in the batch
    nll: torch.Tensor  # (B,) mean NLL of each example's answer tokens
    # (B,) bool: every answer token (EOT included) is the argmax (= greedy exact match)
    correct: torch.Tensor
    logits: torch.Tensor  # (M, V) logits at the M answer-prediction positions
    labels: torch.Tensor  # (M,) their targets
    example: torch.Tensor  # (M,) example index of each prediction position
    # (B, k) copy-attention mass of the answer positions on each document
    doc_attention: torch.Tensor | None = None
    # (M,) bool: which prediction rows are real; None: all of them. On an accelerator M is
    # B * max_predictions, the real rows first, then fill rows (example 0, position 0, target
    # IGNORE)
    valid: torch.Tensor | None = None

    @property
    def targets(self) -> list[list[int]]:
        """Each query's answer targets in order (EOT included): what greedy decoding reproduces for
        a query whose every target was the argmax (``correct``), since each answer position reads
        only the targets before it."""
        real = self.labels != IGNORE
        if self.valid is not None:
            real &= self.valid
        # (M,) prediction rows in order: example, then answer position
        targets: list[list[int]] = [[] for _ in range(len(self.correct))]
        for r, t in zip(self.example[real].tolist(), self.labels[real].tolist()):
            targets[r].append(t)
        return targets


@dataclass
class Assembled:
    """One batch laid out for the transformer (S: the longest packed example on the CPU, every slot
    elsewhere)."""

    x: torch.Tensor  # (B, S, D) token and patch embeddings (plus rank offsets), no positions
    # (B, S) next-token targets at answer-predicting positions, IGNORE elsewhere
    labels: torch.Tensor
    seg_offsets: torch.Tensor  # (B, k + 2) int32 segment starts, then the end of the query
    toks: torch.Tensor  # (B, S) token id per position, -1 for pictures and padding (not copyable)
    typ: torch.Tensor  # (B, S) DOC_IMAGE ... ANSWER, -1 for padding
    pos: torch.Tensor  # (B, S) position within the segment, restarting at 0 in every segment
    max_predictions: int = 0  # answer tokens an example predicts at most (EOT included)
    # retrieved documents: the first n_docs segments (a query prefix, if any, is the next one)
    n_docs: int = 0


class ReaderBase(nn.Module):
    """Layout, scoring and generation over a subclass's embeddings and transformer."""

    max_answer: int  # generated tokens at most, EOT included
    copy: nn.Module | None  # the copy head, or None
    # device types on which a batch is trimmed to its longest example and its answer rows counted:
    # the host, where reading a length back is free. Elsewhere the shapes are static (module doc).
    packed_devices: tuple[str, ...] = ("cpu",)
    # the query segment reads the question before its picture (``model.question_first``)
    question_first: bool = False
    # the picture and question attend both ways, the answer causally (``model.query_prefix``)
    query_prefix: bool = False

    def embed_tokens(self, ids: torch.Tensor) -> torch.Tensor:  # (..., L) -> (..., L, D)
        raise NotImplementedError

    def encode_images(self, pics: torch.Tensor) -> torch.Tensor:  # (N, 3, H, W) -> (N, P, D)
        raise NotImplementedError

    @property
    def picture_tower(self) -> nn.Module:
        """The vision tower alone, as the vision warm-up reads one: ``tower(pics) -> (pooled (N,
        W), tokens (N, P, W))`` before the reader's projection. Its parameters are what the
        warm-up trains, ``optim.vision_lr_scale`` scales and 0 freezes. The open_clip tower of the
        native and ``hf`` readers (``vision``); a VLM reader wraps its own."""
        return self.vision

    # ------------------------------------------------------------------------------ assembly
    def _slots(self, image, q_ids, q_len, a_ids, a_len, doc_image, doc_ids, doc_len):
        """Every candidate token in a fixed layout: embeddings, validity, positions, labels,
        segment."""
        B = image.shape[0]
        k = 0 if doc_image is None else doc_image.shape[1]
        dev = image.device
        # the vision tower once over the query pictures and every document picture
        # (B*k + B, 3, H, W)
        pics = image if k == 0 else torch.cat([doc_image.flatten(0, 1), image])
        patches = self.encode_images(pics)  # (B*k + B, P, D)
        P = patches.shape[1]
        q_patches = patches[B * k :]  # (B, P, D)

        parts, valid, pos, typ, seg, toks = [], [], [], [], [], []
        no_tok = lambda n: torch.full((B, n), -1, dtype=torch.long, device=dev)  # noqa: E731  pictures are not copyable
        ar = lambda n: torch.arange(n, device=dev)  # noqa: E731
        for j in range(k):
            Lt = doc_ids.shape[2]
            # retrieval rank of the document (FiD reads documents in rank order)
            rank = self.rank_emb.weight[j]
            parts += [
                patches[: B * k].view(B, k, P, -1)[:, j] + rank,
                self.embed_tokens(doc_ids[:, j]) + rank,
            ]
            valid += [
                torch.ones(B, P, dtype=torch.bool, device=dev),
                ar(Lt)[None] < doc_len[:, j, None],
            ]
            pos += [ar(P).expand(B, P), (P + ar(Lt)).expand(B, Lt)]
            typ += [
                torch.full((B, P), DOC_IMAGE, device=dev),
                torch.full((B, Lt), DOC_TEXT, device=dev),
            ]
            seg += [torch.full((B, P + Lt), j, device=dev)]
            toks += [no_tok(P), doc_ids[:, j]]
        Lq = q_ids.shape[1]
        # the final answer token (EOT) is only ever a target, never an input
        La = a_ids.shape[1] - 1
        n_before = sum(p.shape[1] for p in parts)  # slots before the query segment
        # the query's picture and question, in the order the reader reads them (causally)
        picture = (
            q_patches,
            torch.ones(B, P, dtype=torch.bool, device=dev),
            QUERY_IMAGE,
            no_tok(P),
        )
        question = (self.embed_tokens(q_ids), ar(Lq)[None] < q_len[:, None], QUESTION, q_ids)
        first, second = (question, picture) if self.question_first else (picture, question)
        for emb, ok, kind, tok in (first, second):
            parts.append(emb)
            valid.append(ok)
            typ.append(torch.full(ok.shape, kind, device=dev))
            toks.append(tok)
        if self.question_first:  # patches follow the question's real tokens
            pos += [ar(Lq).expand(B, Lq), q_len[:, None] + ar(P)[None]]
        else:
            pos += [ar(P).expand(B, P), (P + ar(Lq)).expand(B, Lq)]
        parts.append(self.embed_tokens(a_ids[:, :La]))
        valid.append(ar(La)[None] < (a_len - 1)[:, None])
        pos.append(P + q_len[:, None] + ar(La)[None])
        typ.append(torch.full((B, La), ANSWER, device=dev))
        toks.append(a_ids[:, :La])
        if self.query_prefix:  # picture and question: segment k, both ways; the answer: k + 1
            seg += [torch.full((B, P + Lq), k, device=dev), torch.full((B, La), k + 1, device=dev)]
        else:
            seg += [torch.full((B, P + Lq + La), k, device=dev)]

        # labels: the query's last slot before the answer predicts answer[0] (the question's last
        # token, or the last patch when the question comes first or is empty); answer slot j
        # predicts answer[j + 1]
        labels = torch.full((B, n_before + P + Lq + La), IGNORE, dtype=torch.long, device=dev)
        if self.question_first:
            anchor = torch.full_like(q_len, n_before + Lq + P - 1)
        else:
            anchor = n_before + P + torch.where(q_len > 0, q_len - 1, torch.full_like(q_len, -1))
        labels[ar(B), anchor] = a_ids[:, 0]
        if La > 0:
            # (B, La)
            nxt = torch.where(ar(La)[None] + 1 < a_len[:, None], a_ids[:, 1 : La + 1], IGNORE)
            labels[:, n_before + P + Lq :] = nxt
        # the largest position any slot can hold, from the shapes alone (documents: P + Lt - 1,
        # the query: P + Lq + La - 1); the longest real segment is at most this + 1
        bound = P + max(Lq + La, doc_ids.shape[2] if k else 0)
        return (
            torch.cat(parts, 1),
            torch.cat(valid, 1),
            torch.cat(pos, 1),
            torch.cat(typ, 1),
            torch.cat(seg, 1),
            labels,
            torch.cat(toks, 1),
            k,
            bound,
        )

    def assemble(
        self, image, q_ids, q_len, a_ids, a_len, doc_image=None, doc_ids=None, doc_len=None
    ) -> Assembled:
        """Pack each example's valid tokens to the left (see ``Assembled``)."""
        emb, valid, pos, typ, seg, labels, toks, k, bound = self._slots(
            image, q_ids, q_len, a_ids, a_len, doc_image, doc_ids, doc_len
        )
        if k > self.max_docs:
            raise ValueError(f"{k} documents per query > model.max_docs={self.max_docs}")
        if k and self.query_prefix:
            raise ValueError(
                f"model.query_prefix=true reads closed book, and this batch has {k} documents per "
                "query: a query prefix does not attend to documents (set retriever.mode=none, or "
                "model.query_prefix=false)"
            )
        # trimmed to the longest example on the CPU (reading it back is free there); shapes only
        # (planning on the meta device) and accelerators keep every slot (see the module doc)
        trim = emb.device.type in self.packed_devices
        if trim or (
            bound > self.max_segment_len and not emb.is_meta
        ):  # else every segment fits, whatever the lengths
            longest = int(pos.max()) + 1
            if longest > self.max_segment_len:
                raise ValueError(
                    f"a segment has {longest} tokens > model.max_segment_len={self.max_segment_len}"
                )
        S = int(valid.sum(1).max()) if trim else valid.shape[1]
        # valid slots first, in order
        order = torch.argsort((~valid).to(torch.int8), dim=1, stable=True)
        order = order[:, :S]
        take = lambda t: torch.gather(t, 1, order)  # noqa: E731  (B, N) -> (B, S)
        x = torch.gather(emb, 1, order[..., None].expand(-1, -1, emb.shape[-1]))  # (B, S, D)
        keep = take(valid)
        n_seg = k + 1 + int(self.query_prefix)  # documents, the query (prefix and answer)
        counts = torch.stack([((seg == s) & valid).sum(1) for s in range(n_seg)], 1)  # (B, n_seg)
        seg_offsets = F.pad(counts.cumsum(1), (1, 0)).to(torch.int32)  # (B, n_seg + 1)
        return Assembled(
            x,
            take(labels).masked_fill(~keep, IGNORE),
            seg_offsets,
            take(toks).masked_fill(~keep, -1),
            take(typ).masked_fill(~keep, -1),
            take(pos),
            a_ids.shape[1],
            k,
        )

    # ------------------------------------------------------------------------------ scoring
    def read_out(self, h_all: torch.Tensor, a: Assembled, lm_head, doc_prior=None) -> ReaderOutput:
        """h_all (B, S, D): the transformer's final, normed hidden states over ``a``'s sequence ->
        the answer distribution (vocabulary, mixed with the copy head's when there is one), the
        loss and the per-example scores."""
        labels, seg_offsets = a.labels, a.seg_offsets
        B = h_all.shape[0]
        valid = None
        if h_all.is_meta:  # shapes only: as many predictions as answer slots (full-length examples)
            rows = torch.empty(B * a.max_predictions, 2, dtype=torch.long, device="meta")
        elif h_all.device.type in self.packed_devices:
            rows = (labels != IGNORE).nonzero()  # (M, 2): example, position
        # no read-back: B * max_predictions rows, the real ones first (an example predicts at most
        # that many)
        else:
            # (M, 2)
            rows = torch.nonzero_static(labels != IGNORE, size=B * a.max_predictions, fill_value=-1)
            valid = rows[:, 0] >= 0  # (M,)
            # fill rows read example 0, position 0: target IGNORE, weight 0 below
            rows = rows.clamp_min(0)
        example = rows[:, 0]
        target = labels[rows[:, 0], rows[:, 1]]  # (M,)
        if valid is not None:
            target = target.masked_fill(~valid, IGNORE)
        # (M, D): only answer positions need the vocabulary projection
        h = h_all[rows[:, 0], rows[:, 1]]
        gen_logp = F.log_softmax(lm_head(h).float(), -1)  # (M, V)
        if self.copy is None:
            logp, doc_attention = gen_logp, None
        else:
            seg_id = segment_ids(seg_offsets, h_all.shape[1])
            logp, attn, aux = self.copy(
                h,
                example,
                rows[:, 1],
                h_all,
                a.toks,
                seg_id,
                a.typ == QUESTION,
                a.typ == ANSWER,
                gen_logp,
                doc_prior,
                target,
            )
            doc_attention = self._doc_mass(attn, example, seg_id, B, a.n_docs, valid)
        # (M,), 0 on fill rows
        tok_nll = F.nll_loss(logp, target, reduction="none", ignore_index=IGNORE)
        real = torch.ones_like(tok_nll) if valid is None else valid.to(tok_nll.dtype)  # (M,)
        # the training loss: the answer NLL plus the copy head's pointer supervision (0 when off)
        per_row = tok_nll if self.copy is None else tok_nll + aux * real
        loss = per_row.mean() if valid is None else per_row.sum() / real.sum().clamp_min(1)
        count = torch.zeros(B, device=h_all.device).index_add_(0, example, real)
        nll = torch.zeros(B, device=h_all.device).index_add_(0, example, tok_nll) / count.clamp_min(
            1
        )
        wrong = torch.zeros(B, device=h_all.device).index_add_(
            0, example, (logp.argmax(-1) != target).float() * real
        )
        return ReaderOutput(loss, nll, wrong == 0, logp, target, example, doc_attention, valid)

    @staticmethod
    def _doc_mass(attn, example, seg_id, B, k, valid=None):
        """Copy-attention mass on each of the k document segments, averaged over an example's answer
        positions: (B, k); ``valid`` (M,) the real prediction rows (None: all)."""
        if k == 0:
            return None
        seg = seg_id[example]  # (M, S)
        per_doc = torch.zeros(len(example), k + 1, device=attn.device).scatter_add_(
            1, seg.clamp(max=k), attn
        )[:, :k]
        # (M,)
        real = (
            torch.ones(len(example), device=attn.device)
            if valid is None
            else valid.to(per_doc.dtype)
        )
        count = torch.zeros(B, device=attn.device).index_add_(0, example, real)
        return (
            torch.zeros(B, k, device=attn.device).index_add_(0, example, per_doc * real[:, None])
            / count.clamp_min(1)[:, None]
        )

    @torch.no_grad()
    def generate(
        self,
        image,
        q_ids,
        q_len,
        doc_image=None,
        doc_ids=None,
        doc_len=None,
        eot_id: int = 49407,
        doc_prior=None,
    ):
        """Greedy answers (list of token-id lists), one full forward per generated token (no KV
        cache: the sequences are short, and every step re-reads the documents)."""
        B, dev = image.shape[0], image.device
        out = torch.zeros(B, 0, dtype=torch.long, device=dev)
        done = torch.zeros(B, dtype=torch.bool, device=dev)
        for _ in range(self.max_answer):
            # placeholder target at the end
            a_ids = torch.cat([out, torch.full((B, 1), eot_id, device=dev)], 1)
            a_len = torch.full((B,), a_ids.shape[1], device=dev)
            res = self(image, q_ids, q_len, a_ids, a_len, doc_image, doc_ids, doc_len, doc_prior)
            # the last prediction of each example (rows are in order; fill rows, if any, take no
            # part)
            rows = torch.arange(len(res.example), device=dev)
            if res.valid is not None:
                rows = rows.masked_fill(~res.valid, -1)
            last = torch.full((B,), -1, dtype=torch.long, device=dev).scatter_reduce_(
                0, res.example, rows, "amax"
            )
            nxt = res.logits[last].argmax(-1).masked_fill(done, eot_id)
            out = torch.cat([out, nxt[:, None]], 1)
            done |= nxt == eot_id
            if bool(done.all()):
                break
        return [[t for t in row if t != eot_id] for row in out.tolist()]
