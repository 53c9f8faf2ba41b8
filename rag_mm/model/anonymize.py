"""Answer anonymisation: training examples whose answer is renamed to random tokens, so that a
reader learns to copy a span whatever its tokens are.

A reader trained on a fixed set of answers learns, beside "copy the fact", features of the answer
tokens it saw: a copy gate or a stop decision that reads them fails on a name made of tokens never
trained as an answer (an unseen entity's name, a number it never said). Renaming, in a share of the
training examples, each answer token that the example's documents or question show to a random
token, consistently wherever that example shows it, leaves the task (find the fact, copy its span,
stop where it ends) and removes the tokens' identity from it: the anonymised entities of Hermann et
al. 2015 ("Teaching machines to read and comprehend"), applied to the answer's span only.

Only tokens the reader could copy are renamed: an answer it must generate ("yes", a count absent
from the passage) keeps its tokens, since a random token there could only be memorised.
"""

from __future__ import annotations

import torch

P = 2**31 - 1  # a Mersenne prime: the hash's modulus; products of two residues stay under 2**62


def mix(v: torch.Tensor) -> torch.Tensor:
    """int64 residues mod P -> pseudo-random residues mod P (two rounds of multiply-add)."""
    v = (v * 48271 + 12345) % P
    return (v * 69621 + 2**20 + 7) % P


def example_keys(
    q_ids: torch.Tensor, q_len: torch.Tensor, a_ids: torch.Tensor, a_len: torch.Tensor
) -> torch.Tensor:
    """(B,) a hash of each example's question and answer tokens (padding excluded): the renaming
    an example draws depends on it alone, so one process, data-parallel ranks holding parts of its
    batch and a pipeline's stages draw the same, and a replay after resume draws it again."""

    def fold(ids: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
        L = ids.shape[1]
        pos = torch.arange(L, device=ids.device)[None]
        w = mix(pos + 1)  # (1, L) a weight per position
        return ((ids.long() % P) * w % P * (pos < n[:, None])).sum(
            1
        ) % P  # (B,) each term under 2**31

    return mix(fold(q_ids, q_len) * 31 + fold(a_ids, a_len))


def anonymize_answers(x: dict, share: float, vocab_size: int) -> dict:
    """Reader inputs ``x`` (q_ids (B, Lq), q_len (B,), a_ids (B, La) ending in EOT, a_len (B,),
    optionally doc_ids (B, k, L)) with, in about ``share`` of the examples, each copyable answer
    token renamed to a pseudo-random id in [0, vocab_size) other than the answer's end token, in
    the answer, the question and the documents alike. Returns a new dict. Device-side throughout:
    no host synchronisation in the training step."""
    if share <= 0:
        return x
    a_ids, a_len, q_ids = x["a_ids"], x["a_len"], x["q_ids"]
    docs = x.get("doc_ids")
    B, La = a_ids.shape
    dev = a_ids.device
    key = example_keys(q_ids, x["q_len"], a_ids, a_len)  # (B,)
    pick = (mix(key) % 10_000) < share * 10_000  # (B,) examples renamed
    # (B, La) answer tokens before EOT
    span = torch.arange(La, device=dev)[None] < (a_len[:, None] - 1)
    ctx = (
        q_ids.reshape(B, -1)
        if docs is None
        else torch.cat([q_ids.reshape(B, -1), docs.reshape(B, -1)], 1)
    )
    # (B, La) the answer token is in the question or a document
    shown = (a_ids[:, :, None] == ctx[:, None, :]).any(-1)
    rename = span & shown & pick[:, None]  # (B, La)
    eot = a_ids.gather(1, (a_len - 1).clamp_min(0)[:, None])  # (B, 1)
    # the same token twice in one answer takes one replacement: the first occurrence's
    first = (a_ids[:, :, None] == a_ids[:, None, :]).to(torch.int8).argmax(-1)  # (B, La)
    # (B, La) the replacement of each answer token
    new = mix(mix(key[:, None] + first + 1)) % vocab_size
    # never the end token
    new = torch.where(new == eot, (new + 1) % vocab_size, new).to(a_ids.dtype)

    def renamed(
        t: torch.Tensor,
    ) -> torch.Tensor:  # (B, ...) -> (B, ...) with the answer's tokens replaced
        flat = t.reshape(B, -1)
        hit = (flat[:, :, None] == a_ids[:, None, :]) & rename[:, None, :]  # (B, N, La)
        j = hit.to(torch.int8).argmax(-1)  # (B, N) which answer token a position shows
        return torch.where(hit.any(-1), new.gather(1, j).to(t.dtype), flat).reshape(t.shape)

    out = dict(x)
    out["a_ids"] = renamed(a_ids)
    out["q_ids"] = renamed(q_ids)
    if docs is not None:
        out["doc_ids"] = renamed(docs)
    return out
