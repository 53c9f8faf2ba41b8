"""The reader: a joint text-image transformer over retrieved documents and the query.

Sequence of one example (packed left, padded right to the batch's longest)::

    [doc_1 patches, doc_1 text] ... [doc_k patches, doc_k text] [query patches, question, answer]
     └──────── segment 0 ───────┘     └──────── segment k-1 ──┘  └────────── segment k ─────────┘

Documents attend within themselves; the query segment attends to all documents and causally to
itself (``parallel.kernels.attention`` layout). Positions restart in every segment, so documents
form an unordered set. The loss is next-token cross-entropy on the answer tokens only.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import open_clip
import torch
import torch.nn as nn
import torch.nn.functional as F
from open_clip.model import CLIPVisionCfg

from rag_mm.model.blocks import Block

log = logging.getLogger(__name__)

IGNORE = -100  # label of positions without a loss (F.cross_entropy's ignore_index)
# token types: which part of the sequence a slot belongs to
DOC_IMAGE, DOC_TEXT, QUERY_IMAGE, QUESTION, ANSWER = range(5)


@dataclass
class ReaderOutput:
    loss: torch.Tensor  # () mean NLL over every answer token in the batch
    nll: torch.Tensor  # (B,) mean NLL of each example's answer tokens
    correct: torch.Tensor  # (B,) bool: every answer token (EOT included) is the argmax (= greedy exact match)
    logits: torch.Tensor  # (M, V) logits at the M answer-prediction positions
    labels: torch.Tensor  # (M,) their targets
    example: torch.Tensor  # (M,) example index of each prediction position
    doc_attention: torch.Tensor | None = None  # (B, k) copy-attention mass of the answer positions on each document


def build_vision_tower(cfg) -> nn.Module:
    """An open_clip ViT that also returns its patch tokens (random init or a local checkpoint)."""
    vcfg = CLIPVisionCfg(
        layers=cfg.vision_layers,
        width=cfg.vision_width,
        head_width=cfg.vision_head_width,
        patch_size=cfg.patch_size,
        image_size=cfg.image_size,
        output_tokens=True,
    )
    tower = open_clip.model._build_vision_tower(embed_dim=cfg.vision_width, vision_cfg=vcfg)
    tower.proj = None  # the reader uses patch tokens only; an unused projection would stall DDP
    if cfg.vision_checkpoint:
        state = torch.load(cfg.vision_checkpoint, map_location="cpu", weights_only=True)
        state = state.get("state_dict", state)
        # accept a whole open_clip CLIP state dict: keep the 'visual.' entries
        if any(k.startswith("visual.") for k in state):
            state = {k[len("visual."):]: v for k, v in state.items() if k.startswith("visual.")}
        missing, unexpected = tower.load_state_dict(state, strict=False)
        log.info("vision tower: loaded %s (missing %d, unexpected %d keys)", cfg.vision_checkpoint, len(missing), len(unexpected))
    return tower


def segment_ids(seg_offsets: torch.Tensor, S: int) -> torch.Tensor:
    """(B, n_seg + 1) offsets -> (B, S) segment index of each position (n_seg for padding)."""
    pos = torch.arange(S, device=seg_offsets.device).expand(seg_offsets.shape[0], S).contiguous()
    return torch.searchsorted(seg_offsets[:, 1:].contiguous(), pos, right=True)


class CopyHead(nn.Module):
    """Pointer-generator mixing (See et al. 2017, arXiv 1704.04368): p(w) = g p_vocab(w) +
    (1 - g) sum_{s: token(s) = w} a_s, with a an attention of the answer position over the text
    tokens before it (documents and question). Gradients reach the attention scores directly,
    so "find the fact and copy it" needs no value/output circuit to be learned first.

    Keys are "smeared" over the two tokens before each position (Olsson et al. 2022, "In-context
    learning and induction heads"): the key of "forest" in "habitat: forest" also carries
    "habitat", so matching the question's attribute to the fact is a single learned bilinear map.
    """

    SMEAR = 2  # previous tokens mixed into each key: attribute name and separator

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.q = nn.Linear(dim, dim)
        self.q_question = nn.Linear(dim, dim, bias=False)  # the pooled question joins the query (DrQA)
        self.pool = nn.Linear(dim, 1)  # attention pooling weights over question tokens
        self.k = nn.Linear(dim, dim)
        self.k_prev = nn.ModuleList(nn.Linear(dim, dim, bias=False) for _ in range(self.SMEAR))
        self.gate = nn.Linear(dim, 1)

    def keys(self, h_all: torch.Tensor, seg_id: torch.Tensor) -> torch.Tensor:
        """(B, S, D) -> (B, S, D): own key plus learned keys of the SMEAR positions before it in
        the same segment (documents stay independent)."""
        S = h_all.shape[1]
        k = self.k(h_all)
        for lag, proj in enumerate(self.k_prev, start=1):
            prev = F.pad(proj(h_all), (0, 0, lag, 0))[:, :S]  # (B, S, D) shifted right by lag
            same = seg_id == F.pad(seg_id, (lag, 0), value=-1)[:, :S]  # (B, S) same segment as s - lag
            k = k + prev * same[..., None]
        return k

    def question_vector(self, h_all: torch.Tensor, is_question: torch.Tensor) -> torch.Tensor:
        """Attention-pooled question encoding (Chen et al. 2017, DrQA): (B, S, D) -> (B, D)."""
        w = self.pool(h_all).squeeze(-1).masked_fill(~is_question, float("-inf"))  # (B, S)
        return torch.einsum("bs,bsd->bd", torch.softmax(w, -1).nan_to_num(0.0), h_all)

    def forward(self, h_rows, rows_ex, rows_pos, h_all, tok_all, seg_id, is_question, gen_logp, doc_prior=None):
        """h_rows (M, D) answer-position states, of example rows_ex (M,) at rows_pos (M,);
        h_all (B, S, D), tok_all (B, S) token id per position (-1: not copyable), seg_id (B, S)
        segment of each position, is_question (B, S); gen_logp (M, V); doc_prior (B, k) log
        retrieval probabilities of the documents or None.
        Returns log p (M, V) and the copy attention (M, S)."""
        D = h_all.shape[-1]
        keys = self.keys(h_all, seg_id)[rows_ex]  # (M, S, D)
        query = self.q(h_rows) + self.q_question(self.question_vector(h_all, is_question))[rows_ex]  # (M, D)
        scores = torch.einsum("md,msd->ms", query, keys) / math.sqrt(D)  # (M, S)
        if doc_prior is not None:
            # copy from document d with weight k p(d | q) exp(score): the copy distribution becomes a
            # mixture over documents weighted by the retriever, as RAG-token marginalises (Lewis et
            # al. 2020). Relative to a uniform prior (log k added), so a uniform prior changes
            # nothing and question positions (segment k) keep their share.
            k = doc_prior.shape[1]
            prior = F.pad(doc_prior + math.log(k), (0, 1))  # (B, k + 1)
            scores = scores + torch.gather(prior, 1, seg_id.clamp(max=prior.shape[1] - 1))[rows_ex]
        S = h_all.shape[1]
        tok = tok_all[rows_ex]  # (M, S)
        allowed = (torch.arange(S, device=h_all.device)[None] <= rows_pos[:, None]) & (tok >= 0)
        # fp32 softmax: CUDA autocast promotes softmax to fp32, CPU autocast does not, and the
        # scatter into copy_p (gen_logp's dtype, fp32 under autocast) needs one dtype
        attn = torch.softmax(scores.float().masked_fill(~allowed, float("-inf")), -1).nan_to_num(0.0)  # (M, S)
        copy_p = torch.zeros_like(gen_logp).scatter_add_(1, tok.clamp_min(0), (attn * allowed).to(gen_logp.dtype))  # (M, V)
        g = torch.sigmoid(self.gate(h_rows)).clamp(1e-6, 1 - 1e-6)  # (M, 1)
        logp = torch.logaddexp(g.log() + gen_logp, (1 - g).log() + copy_p.clamp_min(1e-30).log())
        return logp, attn


class Reader(nn.Module):
    def __init__(self, cfg, vocab_size: int) -> None:
        super().__init__()
        self.cfg = cfg
        self.num_patches = (cfg.image_size // cfg.patch_size) ** 2
        self.vision = build_vision_tower(cfg)
        self.image_proj = nn.Linear(cfg.vision_width, cfg.dim)
        self.tok_emb = nn.Embedding(vocab_size, cfg.dim)
        self.pos_emb = nn.Embedding(cfg.max_segment_len, cfg.dim)
        self.type_emb = nn.Embedding(5, cfg.dim)
        self.rank_emb = nn.Embedding(cfg.max_docs, cfg.dim)
        self.blocks = nn.ModuleList(
            Block(cfg.dim, cfg.heads, cfg.mlp_ratio, cfg.dropout, cfg.attention_backend) for _ in range(cfg.layers)
        )
        self.ln_f = nn.LayerNorm(cfg.dim)
        self.lm_head = nn.Linear(cfg.dim, vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.tok_emb.weight
        self.copy = CopyHead(cfg.dim) if cfg.copy_head else None
        self._init_weights()

    def _init_weights(self) -> None:
        # GPT-2 init: N(0, 0.02), residual output projections scaled by 1/sqrt(2 * layers).
        for name, p in self.named_parameters():
            if name.startswith("vision."):
                continue  # open_clip initialises its own tower
            if p.dim() >= 2:
                std = 0.02 / math.sqrt(2 * self.cfg.layers) if name.endswith("proj.weight") and "blocks" in name else 0.02
                nn.init.normal_(p, 0.0, std)
            elif name.endswith("bias"):
                nn.init.zeros_(p)

    # ------------------------------------------------------------------------------ assembly
    def _slots(self, image, q_ids, q_len, a_ids, a_len, doc_image, doc_ids, doc_len):
        """Every candidate token in a fixed layout: embeddings, validity, positions, labels, segment."""
        B, P = image.shape[0], self.num_patches
        k = 0 if doc_image is None else doc_image.shape[1]
        dev = image.device
        # vision tower once over the query pictures and every document picture
        pics = image if k == 0 else torch.cat([doc_image.flatten(0, 1), image])  # (B*k + B, 3, H, W)
        _, patches = self.vision(pics)  # (B*k + B, P, Wv)
        patches = self.image_proj(patches)  # (B*k + B, P, D)
        q_patches = patches[B * k:]  # (B, P, D)

        parts, valid, pos, typ, seg, toks = [], [], [], [], [], []
        no_tok = lambda n: torch.full((B, n), -1, dtype=torch.long, device=dev)  # noqa: E731  pictures are not copyable
        ar = lambda n: torch.arange(n, device=dev)  # noqa: E731
        for j in range(k):
            Lt = doc_ids.shape[2]
            rank = self.rank_emb.weight[j]  # retrieval rank of the document (FiD reads documents in rank order)
            parts += [patches[:B * k].view(B, k, P, -1)[:, j] + rank, self.tok_emb(doc_ids[:, j]) + rank]
            valid += [torch.ones(B, P, dtype=torch.bool, device=dev), ar(Lt)[None] < doc_len[:, j, None]]
            pos += [ar(P).expand(B, P), (P + ar(Lt)).expand(B, Lt)]
            typ += [torch.full((B, P), DOC_IMAGE, device=dev), torch.full((B, Lt), DOC_TEXT, device=dev)]
            seg += [torch.full((B, P + Lt), j, device=dev)]
            toks += [no_tok(P), doc_ids[:, j]]
        Lq = q_ids.shape[1]
        La = a_ids.shape[1] - 1  # the final answer token (EOT) is only ever a target, never an input
        parts += [q_patches, self.tok_emb(q_ids), self.tok_emb(a_ids[:, :La])]
        valid += [torch.ones(B, P, dtype=torch.bool, device=dev), ar(Lq)[None] < q_len[:, None], ar(La)[None] < (a_len - 1)[:, None]]
        pos += [ar(P).expand(B, P), (P + ar(Lq)).expand(B, Lq), P + q_len[:, None] + ar(La)[None]]
        typ += [torch.full((B, P), QUERY_IMAGE, device=dev), torch.full((B, Lq), QUESTION, device=dev),
                torch.full((B, La), ANSWER, device=dev)]
        seg += [torch.full((B, P + Lq + La), k, device=dev)]
        toks += [no_tok(P), q_ids, a_ids[:, :La]]

        # labels: the last question token predicts answer[0]; answer slot j predicts answer[j + 1]
        n_before = sum(p.shape[1] for p in parts[:-2])  # slots before the question
        labels = torch.full((B, n_before + Lq + La), IGNORE, dtype=torch.long, device=dev)
        anchor = n_before + torch.where(q_len > 0, q_len - 1, torch.full_like(q_len, -1))  # question end or last patch
        labels[ar(B), anchor] = a_ids[:, 0]
        if La > 0:
            nxt = torch.where(ar(La)[None] + 1 < a_len[:, None], a_ids[:, 1:La + 1], IGNORE)  # (B, La)
            labels[:, n_before + Lq:] = nxt
        return (torch.cat(parts, 1), torch.cat(valid, 1), torch.cat(pos, 1), torch.cat(typ, 1),
                torch.cat(seg, 1), labels, torch.cat(toks, 1), k)

    def assemble(self, image, q_ids, q_len, a_ids, a_len, doc_image=None, doc_ids=None, doc_len=None):
        """Pack each example's valid tokens to the left.

        Returns x (B, S, D), labels (B, S), seg_offsets (B, k+2), token ids (B, S) (-1 = picture/padding),
        token types (B, S) (DOC_IMAGE ... ANSWER; -1 = padding).
        """
        emb, valid, pos, typ, seg, labels, toks, k = self._slots(image, q_ids, q_len, a_ids, a_len, doc_image, doc_ids, doc_len)
        if k > self.cfg.max_docs:
            raise ValueError(f"{k} documents per query > model.max_docs={self.cfg.max_docs}")
        if int(pos.max()) >= self.cfg.max_segment_len:
            raise ValueError(f"a segment has {int(pos.max()) + 1} tokens > model.max_segment_len={self.cfg.max_segment_len}")
        x = emb + self.pos_emb(pos) + self.type_emb(typ)  # (B, N, D)
        order = torch.argsort((~valid).to(torch.int8), dim=1, stable=True)  # valid slots first, in order
        S = int(valid.sum(1).max())
        order = order[:, :S]
        x = torch.gather(x, 1, order[..., None].expand(-1, -1, x.shape[-1]))  # (B, S, D)
        keep = torch.gather(valid, 1, order)
        labels = torch.gather(labels, 1, order).masked_fill(~keep, IGNORE)
        toks = torch.gather(toks, 1, order).masked_fill(~keep, -1)
        typ = torch.gather(typ, 1, order).masked_fill(~keep, -1)
        counts = torch.stack([((seg == s) & valid).sum(1) for s in range(k + 1)], 1)  # (B, k+1)
        seg_offsets = F.pad(counts.cumsum(1), (1, 0)).to(torch.int32)  # (B, k+2)
        return x, labels, seg_offsets, toks, typ

    # ------------------------------------------------------------------------------ forward
    def forward(self, image, q_ids, q_len, a_ids, a_len, doc_image=None, doc_ids=None, doc_len=None,
                doc_prior=None) -> ReaderOutput:
        """image (B,3,H,W); q_ids (B,Lq); a_ids (B,La) ending in EOT; doc_* (B,k,...) or None;
        doc_prior (B,k) log retrieval probabilities of the documents (copy head only) or None."""
        x, labels, seg_offsets, toks, typ = self.assemble(image, q_ids, q_len, a_ids, a_len, doc_image, doc_ids, doc_len)
        for block in self.blocks:
            x = block(x, seg_offsets)
        where = labels != IGNORE  # (B, S)
        rows = where.nonzero()  # (M, 2): example, position
        example = rows[:, 0]
        target = labels[where]
        B = image.shape[0]
        if self.copy is None:
            h = self.ln_f(x[where])  # (M, D): only answer positions need the vocabulary projection
            logp = F.log_softmax(self.lm_head(h).float(), -1)  # (M, V)
            doc_attention = None
        else:
            h_all = self.ln_f(x)  # (B, S, D): every text token may be copied
            h = h_all[where]
            seg_id = segment_ids(seg_offsets, x.shape[1])
            logp, attn = self.copy(h, example, rows[:, 1], h_all, toks, seg_id, typ == QUESTION,
                                   F.log_softmax(self.lm_head(h).float(), -1), doc_prior)
            doc_attention = self._doc_mass(attn, example, seg_id, B, seg_offsets.shape[1] - 2)
        tok_nll = F.nll_loss(logp, target, reduction="none")  # (M,)
        count = torch.zeros(B, device=x.device).index_add_(0, example, torch.ones_like(tok_nll))
        nll = torch.zeros(B, device=x.device).index_add_(0, example, tok_nll) / count.clamp_min(1)
        wrong = torch.zeros(B, device=x.device).index_add_(0, example, (logp.argmax(-1) != target).float())
        return ReaderOutput(tok_nll.mean(), nll, wrong == 0, logp, target, example, doc_attention)

    @staticmethod
    def _doc_mass(attn, example, seg_id, B, k):
        """Copy-attention mass on each of the k document segments, averaged over an example's answer positions: (B, k)."""
        if k == 0:
            return None
        seg = seg_id[example]  # (M, S)
        per_doc = torch.zeros(len(example), k + 1, device=attn.device).scatter_add_(1, seg.clamp(max=k), attn)[:, :k]
        count = torch.zeros(B, device=attn.device).index_add_(0, example, torch.ones(len(example), device=attn.device))
        return torch.zeros(B, k, device=attn.device).index_add_(0, example, per_doc) / count.clamp_min(1)[:, None]

    @torch.no_grad()
    def generate(self, image, q_ids, q_len, doc_image=None, doc_ids=None, doc_len=None, eot_id: int = 49407,
                 doc_prior=None):
        """Greedy answers (list of token-id lists), one full forward per generated token."""
        B, dev = image.shape[0], image.device
        out = torch.zeros(B, 0, dtype=torch.long, device=dev)
        done = torch.zeros(B, dtype=torch.bool, device=dev)
        for _ in range(self.cfg.max_answer):
            a_ids = torch.cat([out, torch.full((B, 1), eot_id, device=dev)], 1)  # placeholder target at the end
            a_len = torch.full((B,), a_ids.shape[1], device=dev)
            res = self(image, q_ids, q_len, a_ids, a_len, doc_image, doc_ids, doc_len, doc_prior)
            last = torch.zeros(B, dtype=torch.long, device=dev)
            last[res.example] = torch.arange(len(res.example), device=dev)  # the last prediction of each example
            nxt = res.logits[last].argmax(-1).masked_fill(done, eot_id)
            out = torch.cat([out, nxt[:, None]], 1)
            done |= nxt == eot_id
            if bool(done.all()):
                break
        return [[t for t in row if t != eot_id] for row in out.tolist()]
