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


def train(reader: Reader, steps: int = 200) -> Reader:
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
