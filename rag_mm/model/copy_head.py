"""The copy head: a pointer-generator answer distribution over the text tokens the reader saw."""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F


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

    Trained on its own answer NLL alone, the mixture lets the vocabulary path win: a reader can
    memorise its training answers and put the gate on generating, and then says what it was
    trained to say when the document holds a name it never saw. ``supervision`` > 0 adds, on every
    answer token the reader could copy (it occurs among the tokens the head may point at), the
    NLL of the copy distribution alone and a gate target of "copy" (pointer supervision, as
    CopyNet (Gu et al. 2016) and pointer-sentinel models train it); on a token it cannot copy, a
    gate target of "generate".
    """

    SMEAR = 2  # previous tokens mixed into each key: attribute name and separator
    # answer tokens a span continuation is matched back over (continuations); a repeat longer
    # than this inside one passage is the only case it leaves ambiguous
    MAX_RUN = 8

    def __init__(self, dim: int, supervision: float = 0.0) -> None:
        super().__init__()
        self.supervision = supervision
        self.q = nn.Linear(dim, dim)
        # the pooled question joins the query (DrQA)
        self.q_question = nn.Linear(dim, dim, bias=False)
        self.pool = nn.Linear(dim, 1)  # attention pooling weights over question tokens
        self.k = nn.Linear(dim, dim)
        self.k_prev = nn.ModuleList(nn.Linear(dim, dim, bias=False) for _ in range(self.SMEAR))
        self.gate = nn.Linear(dim, 1)  # p(generate) from the answer row's state, except ...
        # ... on a row that continues a copied span: there from the state of the token the span
        # would continue with alone, so that a span's end ("." or ",") says "stop copying"
        # whatever the span was (the row's own state carries the last answer token, which for a
        # name never trained as an answer says nothing the gate has learned)
        self.gate_next = nn.Linear(dim, 1)
        # ... plus the token after that one: whether a separator continues the span or ends it
        # is told by what follows it ("13" "." "0" against "emotion" "." "group"), which the
        # byte-pair tokens of a number and of a sentence's end do not tell apart themselves
        self.gate_after = nn.Linear(dim, 1, bias=False)

    @classmethod
    def continuations(cls, tok_all, seg_id, is_answer, allowed, rows_ex, rows_pos, in_answer):
        """(M, S): the positions that continue the span the answer rows are copying.

        A span's end is where the most of the answer's last tokens occur in a row (matched back
        one answer token at a time, at most ``MAX_RUN``, within one segment); its continuation is
        the position after that end, in the same segment. Matching the last token alone would
        let a token that occurs twice in a passage ("1f62f", "version: 12.0.") loop back to its
        earlier occurrence ("1f62f62f...", "12.0.0.0..."), and a span that ends its segment has
        no continuation: then none is returned and the row may copy anything or stop. Rows that
        read no answer token (the question's last) and rows whose last token occurs nowhere (a
        generated word) get none either. A fixed trip count with no data-dependent exit, so no
        host sync."""
        S = tok_all.shape[1]
        # (M, S) positions a span can end at: copyable (documents and question, before the row)
        alive = allowed & in_answer[:, None]
        # (M, S) answer tokens matched, the run ending at e
        run = torch.zeros_like(alive, dtype=torch.int32)
        for lag in range(1, cls.MAX_RUN + 1):
            if lag == 1:  # the row's own token (in_answer, in alive, says it is the answer's)
                want = tok_all[rows_ex, rows_pos]  # (M,)
            else:
                at = rows_pos - (lag - 1)  # (M,) position of the answer's lag-th token from its end
                here = (at >= 0) & is_answer[rows_ex, at.clamp_min(0)]  # (M,) still in the answer
                # (M,) that token; -2 where the answer is shorter (matches nothing: ids >= -1)
                want = tok_all[rows_ex, at.clamp_min(0)].masked_fill(~here, -2)
            # (B, S) the token lag - 1 before each position e, -3 outside e's segment
            same = seg_id == F.pad(seg_id, (lag - 1, 0), value=-1)[:, :S]
            before = F.pad(tok_all, (lag - 1, 0), value=-1)[:, :S].masked_fill(~same, -3)
            alive = alive & (before[rows_ex] == want[:, None]) & (want[:, None] >= 0)
            run = run + alive
        longest = run.amax(1, keepdim=True)  # (M, 1)
        ends = (run == longest) & (longest > 0)  # (M, S)
        # (M, S) position s in the segment of s - 1
        same_next = (seg_id == F.pad(seg_id, (1, 0), value=-1)[:, :S])[rows_ex]
        return F.pad(ends, (1, 0), value=False)[:, :S] & same_next & allowed

    def keys(self, h_all: torch.Tensor, seg_id: torch.Tensor) -> torch.Tensor:
        """(B, S, D) -> (B, S, D): own key plus learned keys of the SMEAR positions before it in
        the same segment (documents stay independent)."""
        S = h_all.shape[1]
        k = self.k(h_all)
        for lag, proj in enumerate(self.k_prev, start=1):
            prev = F.pad(proj(h_all), (0, 0, lag, 0))[:, :S]  # (B, S, D) shifted right by lag
            # (B, S) same segment as s - lag
            same = seg_id == F.pad(seg_id, (lag, 0), value=-1)[:, :S]
            k = k + prev * same[..., None]
        return k

    def question_vector(self, h_all: torch.Tensor, is_question: torch.Tensor) -> torch.Tensor:
        """Attention-pooled question encoding (Chen et al. 2017, DrQA): (B, S, D) -> (B, D)."""
        w = self.pool(h_all).squeeze(-1).masked_fill(~is_question, float("-inf"))  # (B, S)
        return torch.einsum("bs,bsd->bd", torch.softmax(w, -1).nan_to_num(0.0), h_all)

    def forward(
        self,
        h_rows,
        rows_ex,
        rows_pos,
        h_all,
        tok_all,
        seg_id,
        is_question,
        is_answer,
        gen_logp,
        doc_prior=None,
        target=None,
    ):
        """h_rows (M, D) answer-position states, of example rows_ex (M,) at rows_pos (M,);
        h_all (B, S, D), tok_all (B, S) token id per position (-1: not copyable), seg_id (B, S)
        segment of each position, is_question and is_answer (B, S) the question's and the answer's
        tokens; gen_logp (M, V); doc_prior (B, k) log
        retrieval probabilities of the documents or None; target (M,) the answer tokens (negative:
        no target) or None.
        Returns log p (M, V), the copy attention (M, S) and the pointer-supervision loss of each
        row (M,) (zeros without a target or with ``supervision`` 0)."""
        D = h_all.shape[-1]
        keys = self.keys(h_all, seg_id)[rows_ex]  # (M, S, D)
        # (M, D)
        query = self.q(h_rows) + self.q_question(self.question_vector(h_all, is_question))[rows_ex]
        scores = torch.einsum("md,msd->ms", query, keys) / math.sqrt(D)  # (M, S)
        if doc_prior is not None:
            # copy from document d with weight k p(d | q) exp(score): the copy distribution becomes
            # a mixture over documents weighted by the retriever, as RAG-token marginalises (Lewis
            # et al. 2020). Relative to a uniform prior (log k added), so a uniform prior changes
            # nothing and question positions (segment k) keep their share.
            k = doc_prior.shape[1]
            prior = F.pad(doc_prior + math.log(k), (0, 1))  # (B, k + 1)
            scores = scores + torch.gather(prior, 1, seg_id.clamp(max=prior.shape[1] - 1))[rows_ex]
        S = h_all.shape[1]
        tok = tok_all[rows_ex]  # (M, S)
        # copyable: the documents' and the question's tokens before the row; not the answer's own
        # prefix (its last token would match itself)
        allowed = (
            (torch.arange(S, device=h_all.device)[None] <= rows_pos[:, None])
            & (tok >= 0)
            & ~is_answer[rows_ex]
        )
        # past the answer's first token, copying continues a span: only the token after the span
        # the answer has copied so far is copyable (an induction head's rule, exact on token
        # ids), so a span of tokens never trained as answers is copied to its end
        # (M,) the row reads an answer token, not the question's last
        in_answer = ~is_question[rows_ex, rows_pos]
        follows = self.continuations(
            tok_all, seg_id, is_answer, allowed, rows_ex, rows_pos, in_answer
        )  # (M, S)
        allowed = torch.where(follows.any(1, keepdim=True), follows, allowed)
        # fp32 softmax: CUDA autocast promotes softmax to fp32, CPU autocast does not, and the
        # scatter into copy_p (gen_logp's dtype, fp32 under autocast) needs one dtype
        # (M, S)
        attn = torch.softmax(scores.float().masked_fill(~allowed, float("-inf")), -1).nan_to_num(
            0.0
        )
        # (M, V)
        copy_p = torch.zeros_like(gen_logp).scatter_add_(
            1, tok.clamp_min(0), (attn * allowed).to(gen_logp.dtype)
        )
        has_next = follows.any(1)  # (M,) the row continues a span
        nxt = follows.to(torch.int8).argmax(1)  # (M,) the first position that continues it
        h_next = h_all[rows_ex, nxt]  # (M, D)
        after = (nxt + 1).clamp(max=S - 1)  # (M,) the position after the continuation ...
        # ... when it is in the same segment (a span's last token has nothing after it)
        in_seg = (seg_id[rows_ex, after] == seg_id[rows_ex, nxt]) & (nxt + 1 < S)
        h_after = h_all[rows_ex, after] * in_seg[:, None]  # (M, D)
        # fp32: in bf16, 1 - 1e-6 rounds to 1 and log(1 - g) to -inf
        # (M,)
        gate_logit = torch.where(
            has_next,
            (self.gate_next(h_next) + self.gate_after(h_after)).float().squeeze(1),
            self.gate(h_rows).float().squeeze(1),
        )
        g = torch.sigmoid(gate_logit).clamp(1e-6, 1 - 1e-6)[:, None]  # (M, 1) p(generate)
        logp = torch.logaddexp(g.log() + gen_logp, (1 - g).log() + copy_p.clamp_min(1e-30).log())
        aux = gen_logp.new_zeros(len(rows_ex))
        if target is not None and self.supervision > 0:
            at_target = (
                tok == target[:, None]
            ) & allowed  # (M, S) positions holding the answer token
            copyable = at_target.any(1) & (target >= 0)  # (M,)
            # (M,) log copy mass on the answer token
            point = (attn * at_target).sum(1).clamp_min(1e-30).log()
            # from the logit: autocast refuses binary_cross_entropy on probabilities
            # (M,)
            gate = F.binary_cross_entropy_with_logits(
                gate_logit, (~copyable).float(), reduction="none"
            )
            aux = self.supervision * (gate * (target >= 0) - point * copyable)
        return logp, attn, aux
