import types

import pytest
import torch

from rag_mm.config import ModelConfig
from rag_mm.model import Reader
from rag_mm.model.layout import IGNORE

EOT = 49407


def tiny_reader(**kw):
    cfg = ModelConfig(
        dim=32,
        layers=2,
        heads=2,
        vision_width=32,
        vision_layers=1,
        vision_head_width=16,
        attention_backend="reference",
        **kw,
    )
    torch.manual_seed(0)
    return Reader(cfg, vocab_size=49408).eval()


def batch(B=3, k=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randint(1, 1000, s, generator=g)  # noqa: E731
    return dict(
        image=torch.randn(B, 3, 32, 32, generator=g),
        q_ids=r(B, 6),
        q_len=torch.tensor([6, 3, 1])[:B],
        a_ids=torch.cat([r(B, 2), torch.full((B, 1), EOT)], 1),
        a_len=torch.tensor([3, 2, 3])[:B],
        doc_image=torch.randn(B, k, 3, 32, 32, generator=g),
        doc_ids=r(B, k, 10),
        doc_len=torch.tensor([[10, 4], [7, 7], [1, 9]])[:B, :k],
    )


def test_assembly_offsets_and_labels():
    m = tiny_reader()
    b = batch()
    a = m.assemble(**b)
    x, labels, seg = a.x, a.labels, a.seg_offsets
    P = m.num_patches  # 16
    doc_counts = (P + b["doc_len"]).tolist()
    query = (P + b["q_len"] + b["a_len"] - 1).tolist()
    for i in range(3):
        assert seg[i].tolist() == [
            0,
            doc_counts[i][0],
            sum(doc_counts[i]),
            sum(doc_counts[i]) + query[i],
        ]
    # one label per answer token, EOT included, in order
    for i in range(3):
        got = labels[i][labels[i] != IGNORE].tolist()
        assert got == b["a_ids"][i, : b["a_len"][i]].tolist()
    assert x.shape == (3, int(seg[:, -1].max()), 32)


def test_documents_are_isolated_and_query_is_causal():
    m = tiny_reader()
    b = batch()
    out1 = m(**b)
    # changing a document token the example has marked invalid (beyond doc_len) changes nothing
    b2 = {k: v.clone() for k, v in b.items()}
    b2["doc_ids"][0, 1, 8] += 1  # doc_len[0, 1] = 4: padding
    assert torch.allclose(m(**b2).logits, out1.logits)
    # the answer's last token never influences earlier predictions (causal query)
    a = m.assemble(**b)
    x, seg = a.x, a.seg_offsets
    h1 = _hidden(m, x, seg)
    x2 = x.clone()
    last = int(seg[0, -1]) - 1
    x2[0, last] += 1.0
    h2 = _hidden(m, x2, seg)
    assert torch.allclose(h1[0, :last], h2[0, :last], atol=1e-6) and not torch.allclose(
        h1[0, last], h2[0, last]
    )
    # a document's hidden states do not depend on the other document
    x3 = x.clone()
    d1 = slice(int(seg[0, 1]), int(seg[0, 2]))
    x3[0, d1] += 1.0
    h3 = _hidden(m, x3, seg)
    assert torch.allclose(h1[0, : int(seg[0, 1])], h3[0, : int(seg[0, 1])], atol=1e-6)


def _hidden(m, x, seg):
    for blk in m.blocks:
        x = blk(x, seg)
    return x


def test_query_prefix_reads_picture_and_question_both_ways():
    """``model.query_prefix``: the picture and the question are one segment that attends both ways
    (a question word reads the patches after it, which a causal query segment forbids), the
    answer reads them causally, nothing reads the answer, and a batch with documents is refused."""
    import pytest

    from rag_mm.model.layout import ANSWER, QUERY_IMAGE, QUESTION

    b = {k: v for k, v in batch().items() if not k.startswith("doc_")}
    P = 16
    for first in (False, True):
        for prefix in (False, True):
            m = tiny_reader(question_first=first, query_prefix=prefix)
            a = m.assemble(**b)
            # a segment for the prefix and one for the answer, or one for the whole query
            assert a.seg_offsets.shape == (3, 3 if prefix else 2)
            for i in range(3):
                ql, al = int(b["q_len"][i]), int(b["a_len"][i]) - 1
                assert a.seg_offsets[i].tolist() == (
                    [0, P + ql, P + ql + al] if prefix else [0, P + ql + al]
                )
                got = a.labels[i][a.labels[i] != IGNORE].tolist()
                assert got == b["a_ids"][i, : b["a_len"][i]].tolist()
            # the first of the two parts reads the second only with the prefix
            earlier, later = (QUESTION, QUERY_IMAGE) if first else (QUERY_IMAGE, QUESTION)
            x2 = a.x.clone()
            at = int((a.typ[0] == later).nonzero()[-1])
            x2[0, at] += torch.randn(x2.shape[-1], generator=torch.Generator().manual_seed(0))
            h1, h2 = _hidden(m, a.x, a.seg_offsets), _hidden(m, x2, a.seg_offsets)
            rows = a.typ[0] == earlier
            moved = (h1[0, rows] - h2[0, rows]).abs().max()
            assert (moved > 1e-4) == prefix, (first, prefix, moved)
            # an answer token never changes what the prefix, or the answer before it, holds
            x3 = a.x.clone()
            last = int((a.typ[0] == ANSWER).nonzero()[-1])
            x3[0, last] += torch.randn(x3.shape[-1], generator=torch.Generator().manual_seed(1))
            h3 = _hidden(m, x3, a.seg_offsets)
            assert torch.equal(h1[0, :last], h3[0, :last])
            # trains and generates through the same layout
            assert torch.isfinite(m(**b).loss)
            assert len(m.generate(b["image"], b["q_ids"], b["q_len"], eot_id=EOT)) == 3
    with pytest.raises(ValueError, match="query_prefix=true reads closed book"):
        tiny_reader(query_prefix=True).assemble(**batch())
    # and a run that would retrieve is refused before any work
    from rag_mm.config import ConfigError, TrainConfig, validate

    cfg = TrainConfig()
    cfg.model.query_prefix = True
    with pytest.raises(ConfigError, match="model.query_prefix=true reads closed book"):
        validate(cfg)
    cfg.retriever.mode = "none"
    cfg.data.corpus = None
    validate(cfg)


def test_backends_agree_and_closed_book_runs():
    b = batch()
    ref = tiny_reader()
    sdpa = tiny_reader(**{})
    for blk in sdpa.blocks:
        blk.attn.backend = "sdpa"
    assert torch.allclose(ref(**b).loss, sdpa(**b).loss, atol=1e-5)
    closed = {k: v for k, v in b.items() if not k.startswith("doc_")}
    out = ref(**closed)
    assert out.nll.shape == (3,) and torch.isfinite(out.loss)


@pytest.mark.parametrize(
    "layout",
    [{}, {"question_first": True}, {"query_prefix": True}],
    ids=["picture_first", "question_first", "query_prefix"],
)
def test_teacher_forced_argmax_reproduces_greedy_generation(layout):
    """Evaluation takes a query's target as its greedy answer when every teacher-forced argmax was
    the target (``rag_mm.evaluate.greedy_answers``): fed its own greedy answers (three, two and one
    tokens copied from what it reads, EOT after each), each query must be ``correct`` with those
    tokens as its targets, with documents and the copy head, in every layout (a prefix-LM reads
    closed book)."""
    from rag_mm.evaluate import _teacher_forced_answers

    def pad(answers):  # token lists, EOT appended -> (a_ids, a_len)
        a = [x + [EOT] for x in answers]
        L = max(map(len, a))
        return torch.tensor([x + [0] * (L - len(x)) for x in a]), torch.tensor(list(map(len, a)))

    m = tiny_reader(**layout).train()
    b = batch()
    if layout.get("query_prefix"):
        b = {k: v for k, v in b.items() if not k.startswith("doc_")}
    docs = [b.get(k) for k in ("doc_image", "doc_ids", "doc_len")]
    # taught to copy three, two and one tokens of its first document (of its question, closed
    # book) and stop: an untrained reader runs to the length limit and never says EOT
    source = b["doc_ids"][:, 0] if docs[0] is not None else b["q_ids"]
    taught = dict(zip(("a_ids", "a_len"), pad([source[i, : 3 - i].tolist() for i in range(3)])))
    opt = torch.optim.Adam(m.parameters(), lr=1e-2)
    for _ in range(60):
        opt.zero_grad()
        m(**{**b, **taught}).loss.backward()
        opt.step()
    m.eval()
    gen = m.generate(b["image"], b["q_ids"], b["q_len"], *docs, eot_id=EOT)
    assert sorted(map(len, gen)) == [1, 2, 3], gen  # each greedy answer ended with EOT
    a_ids, a_len = pad(gen)
    out = m(**{**b, "a_ids": a_ids, "a_len": a_len})
    pred = out.logits.argmax(-1)
    for i, g in enumerate(gen):  # every argmax reproduces the next greedy token, EOT included
        assert pred[out.example == i].tolist() == g + [EOT]
    assert out.correct.all()
    assert _teacher_forced_answers(out, EOT) == dict(enumerate(gen))
    # a target holding an EOT inside its text: greedy decoding stops at the first one
    inside = types.SimpleNamespace(correct=torch.tensor([True]), targets=[[5, EOT, 6, EOT]])
    assert _teacher_forced_answers(inside, EOT) == {0: [5]}


def test_tied_embeddings_share_storage():
    m = tiny_reader()
    assert m.lm_head.weight is m.tok_emb.weight


def test_retrieval_prior_weighs_the_copy_attention():
    """A prior that is sure of one document puts (nearly) all copy attention on it; a uniform
    prior changes nothing (softmax is shift invariant); a missing prior is the uniform one."""
    m = tiny_reader()
    b = batch(k=2)
    plain = m(**b)
    uniform = m(**b, doc_prior=torch.full((3, 2), 0.5).log())
    assert torch.allclose(plain.logits, uniform.logits, atol=1e-5)
    for j in (0, 1):
        sure = torch.full((3, 2), -30.0)
        sure[:, j] = 0.0
        mass = m(**b, doc_prior=sure).doc_attention  # (B, 2) copy mass on each document
        assert (mass[:, j] > 0.999 * mass.sum(1)).all(), mass


def test_question_first_lets_the_picture_read_the_question():
    """``model.question_first``: the query segment is question, patches, answer; the first answer
    token is predicted at the last patch, and the patches' hidden states depend on the question
    (with the default order they cannot: the question comes after them)."""
    from rag_mm.model.layout import ANSWER, QUERY_IMAGE, QUESTION

    b = batch()
    P = 16
    for first in (False, True):
        m = tiny_reader(question_first=first)
        a = m.assemble(**b)
        for i in range(3):
            q = slice(int(a.seg_offsets[i, -2]), int(a.seg_offsets[i, -1]))
            ql, al = int(b["q_len"][i]), int(b["a_len"][i]) - 1
            kinds = [QUESTION] * ql + [QUERY_IMAGE] * P
            if not first:
                kinds = kinds[ql:] + kinds[:ql]
            assert a.typ[i, q].tolist() == kinds + [ANSWER] * al
            # positions run on through the segment, whatever the order
            assert a.pos[i, q].tolist() == list(range(P + ql + al))
            # the answer's first token is the label of the slot just before the answer
            assert int(a.labels[i, q][P + ql - 1]) == int(b["a_ids"][i, 0])
            got = a.labels[i][a.labels[i] != IGNORE].tolist()
            assert got == b["a_ids"][i, : b["a_len"][i]].tolist()
        # a question token changes the picture's hidden states only when the question comes first
        x2 = a.x.clone()
        start = int(a.seg_offsets[0, -2])
        qpos = start + (0 if first else P)  # the question's first token
        # (a shift along every channel would vanish in the blocks' LayerNorm)
        x2[0, qpos] += torch.randn(x2.shape[-1], generator=torch.Generator().manual_seed(0))
        patch_rows = a.typ[0] == QUERY_IMAGE
        h1, h2 = _hidden(m, a.x, a.seg_offsets), _hidden(m, x2, a.seg_offsets)
        moved = (h1[0, patch_rows] - h2[0, patch_rows]).abs().max()
        assert (moved > 1e-4) == first, (first, moved)
        # greedy generation reads the same layout
        gen = m.generate(
            b["image"],
            b["q_ids"],
            b["q_len"],
            b["doc_image"],
            b["doc_ids"],
            b["doc_len"],
            eot_id=EOT,
        )
        assert len(gen) == 3


@pytest.mark.parametrize("projector", [None, "linear", "mlp2x_gelu"])
def test_projector_maps_each_patch_as_asked_and_trains(projector):
    """``model.projector`` on the native reader: None and linear keep one affine map (the
    checkpoint key ``image_proj.weight`` of every native run), mlp2x_gelu is LLaVA's two layers, a
    map of each patch that is not affine; the answer loss reaches its first layer."""
    m = tiny_reader(projector=projector).train()
    mlp = projector == "mlp2x_gelu"
    keys = {k for k in m.state_dict() if k.startswith("image_proj.")}
    assert keys == (
        {f"image_proj.fc{i}.{p}" for i in (1, 2) for p in ("weight", "bias")}
        if mlp
        else {"image_proj.weight", "image_proj.bias"}
    )
    g = torch.Generator().manual_seed(1)
    x1, x2 = torch.randn(2, 5, 32, generator=g)  # two pictures' patch features (P=5, width 32)
    f = m.image_proj
    # affine: f(x1) + f(x2) = f(x1 + x2) + f(0)
    gap = (f(x1) + f(x2) - f(x1 + x2) - f(torch.zeros_like(x1))).abs().max().item()
    assert (gap > 1e-3) if mlp else (gap < 1e-5)
    out = m(**batch())
    out.loss.backward()
    first = m.image_proj.fc1.weight if mlp else m.image_proj.weight
    assert first.grad is not None and first.grad.abs().sum() > 0
