"""The reader answers with strings it was never trained to say, by copying them from a document.

Each query asks for one of three facts; its document states all three as ``<attr> : <value> .``,
each value two tokens. Training values take their tokens from one pool, test values from a
disjoint pool: no test answer, nor any of its tokens, is ever seen in training. Only copying from
the document answers the test queries; with the copy path cut the reader generates from its
vocabulary, which has only learned to say the training pool. Training renames a share of the
answers to random tokens (``model.copy_anonymize``) as RagModel does before the reader reads.
"""

import pytest
import torch

from rag_mm.config import ModelConfig
from rag_mm.model import Reader
from rag_mm.model.anonymize import anonymize_answers
from rag_mm.model.copy_head import CopyHead

EOT = 49407
ATTRS = (400, 401, 402)  # token ids of the three attribute names
COLON, STOP = 25, 26  # ":" and "." stand-ins
TRAIN_POOL = torch.arange(1000, 1200)  # value tokens of training answers
TEST_POOL = torch.arange(2000, 2200)  # value tokens never seen as an answer


def tiny_reader(**kw) -> Reader:
    cfg = ModelConfig(
        dim=64,
        layers=2,
        heads=2,
        vision_width=32,
        vision_layers=1,
        vision_head_width=16,
        image_size=16,
        patch_size=8,
        max_answer=4,
        attention_backend="reference",
        **kw,
    )
    torch.manual_seed(0)
    return Reader(cfg, vocab_size=49408)


def make_batch(B: int, pool: torch.Tensor, g: torch.Generator) -> dict:
    """B queries, each with its one document: (question = the attribute's token) -> its two-token
    value; every value drawn from ``pool``."""
    values = pool[torch.randint(0, len(pool), (B, len(ATTRS), 2), generator=g)]  # (B, 3, 2)
    asked = torch.randint(0, len(ATTRS), (B,), generator=g)
    # facts in random order
    order = torch.stack([torch.randperm(len(ATTRS), generator=g) for _ in range(B)])
    # (B, 15)
    doc = torch.stack(
        [
            torch.cat(
                [torch.tensor([ATTRS[a], COLON, *values[b, a].tolist(), STOP]) for a in order[b]]
            )
            for b in range(B)
        ]
    )
    answer = values[torch.arange(B), asked]  # (B, 2)
    return dict(
        image=torch.randn(B, 3, 16, 16, generator=g),
        q_ids=torch.tensor(ATTRS)[asked][:, None],
        q_len=torch.ones(B, dtype=torch.long),
        a_ids=torch.cat([answer, torch.full((B, 1), EOT)], 1),
        a_len=torch.full((B,), 3),
        doc_image=torch.randn(B, 1, 3, 16, 16, generator=g),
        doc_ids=doc[:, None],
        doc_len=torch.full((B, 1), doc.shape[1]),
    )


def train(reader: Reader, steps: int = 130) -> Reader:
    """Train on the training pool, answers renamed as RagModel.reader_inputs renames them."""
    g = torch.Generator().manual_seed(0)
    opt = torch.optim.AdamW(reader.parameters(), lr=2e-3)
    reader.train()
    for _ in range(steps):
        batch = anonymize_answers(
            make_batch(32, TRAIN_POOL, g), reader.cfg.copy_anonymize, reader.vocab_size
        )
        loss = reader(**batch).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    return reader.eval()


def exact_match_unseen(reader: Reader) -> float:
    """On the test pool: the share of answers whose every token, the end of text included, is the
    argmax given the gold prefix (greedy decoding's exact match)."""
    with torch.no_grad():
        out = reader(**make_batch(256, TEST_POOL, torch.Generator().manual_seed(1)))
    return out.correct.float().mean().item()


def test_the_reader_copies_answers_it_never_saw_and_stops():
    assert exact_match_unseen(train(tiny_reader())) >= 0.9


def test_renaming_answers_shows_the_span_and_keeps_what_must_be_generated():
    """The renaming is consistent (answer, document), leaves answers the example does not show
    alone, and depends on the example only (half a batch renames as the whole batch does)."""
    b = make_batch(8, TRAIN_POOL, torch.Generator().manual_seed(2))
    b["a_ids"][0, :2] = torch.tensor([7, 8])  # not in its document: generated, never renamed
    r = anonymize_answers(b, 1.0, 49408)
    assert torch.equal(r["a_ids"][0], b["a_ids"][0])
    for i in range(1, 8):
        new = r["a_ids"][i, :2]
        assert not torch.isin(new, b["a_ids"][i]).any() and r["a_ids"][i, 2] == EOT
        assert (
            torch.isin(new, r["doc_ids"][i]).all()
            and not torch.isin(b["a_ids"][i, :2], r["doc_ids"][i]).any()
        )
    half = anonymize_answers({k: v[4:] for k, v in b.items()}, 1.0, 49408)
    assert torch.equal(half["a_ids"], r["a_ids"][4:]) and torch.equal(
        half["doc_ids"], r["doc_ids"][4:]
    )


@pytest.mark.slow
def test_without_the_copy_path_unseen_answers_fail(monkeypatch):
    """The control: the same training with the copy head's mixture bypassed answers nothing."""

    def no_copy(self, h, ex, pos, h_all, tok, seg, q, a, gen_logp, prior=None, target=None):
        return gen_logp, torch.zeros(len(ex), h_all.shape[1]), torch.zeros(len(ex))

    monkeypatch.setattr(CopyHead, "forward", no_copy)
    assert exact_match_unseen(train(tiny_reader())) < 0.05


@pytest.mark.slow
def test_without_renaming_the_reader_does_not_stop_after_an_unseen_span():
    """The control for the stop: trained on its answers as given, the reader copies the span but
    goes on copying past its end (the end-of-text row), so few unseen answers are exact."""
    assert exact_match_unseen(train(tiny_reader(copy_anonymize=0.0))) < 0.5


def copy_pointers(passage: list[int], answer: list[int]) -> list[set[int]]:
    """Where an untrained copy head may point, per answer row (the question's last token, then
    each answer token read), for one document ``passage`` and a one-token question."""
    D, V, question = 16, 64, [8]
    toks = torch.tensor([passage + question + answer])  # (1, S)
    S, P = toks.shape[1], len(passage)
    seg_id = torch.tensor([[0] * P + [1] * (S - P)])  # the document, then question and answer
    is_question = torch.zeros(1, S, dtype=torch.bool)
    is_question[0, P] = True
    is_answer = torch.zeros(1, S, dtype=torch.bool)
    is_answer[0, P + 1 :] = True
    rows_pos = torch.arange(P, S)  # the question's token, then every answer token
    torch.manual_seed(0)
    h_all = torch.randn(1, S, D)
    _, attn, _ = CopyHead(D)(
        h_all[0, rows_pos],
        torch.zeros(len(rows_pos), dtype=torch.long),
        rows_pos,
        h_all,
        toks,
        seg_id,
        is_question,
        is_answer,
        torch.log_softmax(torch.randn(len(rows_pos), V), -1),
    )
    return [set(torch.nonzero(a).flatten().tolist()) for a in attn]


def test_a_span_with_a_repeated_token_is_copied_on_not_looped():
    """A code point such as "1f62f" repeats a token: after "1 f" and after "1 f 6 2 f" the copy
    must go on after the "f" the span has reached, not after the other one, which would loop
    "1f62f62f..."; and a span that ends its passage ("version: 12.0.") has nothing to continue
    with, so the row is not sent back into it ("12.0.0.0...")."""
    # attribute, "1 f 6 2 f", "."
    pointed = copy_pointers([5, 1, 7, 6, 2, 7, 9], [1, 7, 6, 2, 7, 9])
    # after "1", "1 f", "1 f 6", "1 f 6 2": the span's next token (positions 2, 3, 4, 5)
    assert pointed[1:5] == [{2}, {3}, {4}, {5}]
    assert pointed[5] == {6}  # after "1 f 6 2 f": the "." that ends it, not the "6" at 3
    # attribute, "1 2 . 0 ." at the passage's end
    pointed = copy_pointers([5, 1, 2, 9, 0, 9], [1, 2, 9, 0, 9, 4])
    assert pointed[1:5] == [{2}, {3}, {4}, {5}]  # "1 2 . 0 ." copied in order
    # after "1 2 . 0 .": no continuation; anything copyable, not "0" (position 4) alone
    assert pointed[5] == {0, 1, 2, 3, 4, 5, 6}


def test_the_stop_reads_the_token_after_the_next_one():
    """A "." inside "13.0" and the "." that ends a fact are one token: whether to copy it or stop
    is told by the token after it, so a continuing row's p(generate) must move with that token's
    state (and, its copy being the one continuation, nothing else there moves its answer)."""
    D, V = 16, 64
    # attribute, "1 3 . 0", "."; question; the answer read so far: "1 3"
    toks = torch.tensor([[5, 1, 3, 9, 0, 9, 8, 1, 3]])
    S = toks.shape[1]
    seg_id = torch.tensor([[0] * 6 + [1] * 3])
    is_question = torch.zeros(1, S, dtype=torch.bool)
    is_question[0, 6] = True
    is_answer = torch.zeros(1, S, dtype=torch.bool)
    is_answer[0, 7:] = True
    row = torch.tensor([8])  # reads "3": the continuation is the "." at 3, then "0" at 4
    torch.manual_seed(0)
    head = CopyHead(D)
    h_all = torch.randn(1, S, D)
    gen_logp = torch.log_softmax(torch.randn(1, V), -1)

    def answer(h):
        ex = torch.zeros(1, dtype=torch.long)
        args = (toks, seg_id, is_question, is_answer, gen_logp)
        return head(h[0, row], ex, row, h, *args)[0]

    moved = h_all.clone()
    moved[0, 4] += 1.0  # the token after the continuation
    assert not torch.allclose(answer(h_all), answer(moved))
    other = h_all.clone()
    other[0, 0] += 1.0  # a token the row neither continues with nor looks past
    torch.testing.assert_close(answer(h_all), answer(other))
