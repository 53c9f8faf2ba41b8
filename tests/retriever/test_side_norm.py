"""Batch norms with running statistics per side of a shared tower (retriever/side_norm.py)."""

from __future__ import annotations

import torch
import torch.nn as nn

from retriever.config import RetrieverConfig, validate
from retriever.encoders import DualEncoder
from retriever.memory import _FrozenDocSide
from retriever.side_norm import SideBatchNorm, on_side

TOWER = dict(
    mode="learned",
    vision_tower="resnet",
    vision_width=16,
    vision_layers=1,
    embed_dim=16,
    fusion="image",
    shared_towers=True,
    context_length=16,
)


def test_each_side_keeps_and_reads_its_own_running_statistics():
    """Training passes on each side move only that side's statistics; an evaluation pass on a side
    normalises by that side's; a checkpoint carries both."""
    gen = torch.Generator().manual_seed(0)
    norm = SideBatchNorm(3)
    docs = torch.randn(64, 3, 4, 4, generator=gen) * 2.0 + 3.0  # (N, C, H, W): mean 3, std 2
    queries = torch.randn(64, 3, 4, 4, generator=gen) * 0.5 - 1.0  # mean -1, std 0.5
    for _ in range(100):  # momentum 0.1: the running values settle on each side's own
        with on_side(norm, "doc"):
            norm(docs)
        norm(queries)  # the query side is the default
    assert norm.side == "query"
    torch.testing.assert_close(norm.doc_running_mean, docs.mean((0, 2, 3)), atol=1e-3, rtol=0)
    torch.testing.assert_close(norm.running_mean, queries.mean((0, 2, 3)), atol=1e-3, rtol=0)
    assert int(norm.doc_num_batches_tracked) == int(norm.num_batches_tracked) == 100

    norm.eval()
    for side, x in (("doc", docs), ("query", queries)):
        with on_side(norm, side):
            y = norm(x)
        ref = nn.functional.batch_norm(x, x.mean((0, 2, 3)), x.var((0, 2, 3)), eps=norm.eps)
        torch.testing.assert_close(y, ref, atol=2e-2, rtol=0)  # its own statistics, not the other's

    again = SideBatchNorm(3)
    again.load_state_dict(norm.state_dict())
    torch.testing.assert_close(again.doc_running_var, norm.doc_running_var)
    torch.testing.assert_close(again.running_var, norm.running_var)


def test_dual_encoder_embeds_documents_and_queries_on_their_sides():
    """With ``side_norm`` every batch norm of the shared ResNet tower is split; after training
    passes on two kinds of picture, evaluation embeds a document and a query picture each by its
    own side's statistics (the same picture differs by side), and without it one tower is one
    function."""
    torch.manual_seed(0)
    enc = DualEncoder(RetrieverConfig(**TOWER, side_norm=True), 32)
    sides = [m for m in enc.modules() if isinstance(m, SideBatchNorm)]
    plain = [m for m in enc.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    assert sides and len(sides) == len(plain)  # every batch norm wrapped, none left out
    ids, lens = torch.zeros(8, 4, dtype=torch.long), torch.ones(8, dtype=torch.long)
    bright, dark = torch.rand(8, 3, 32, 32) + 1.0, torch.rand(8, 3, 32, 32) * 0.2
    for _ in range(5):
        enc.embed_docs(bright, ids, lens)
        enc.embed_queries(dark, ids, lens)
    stem = sides[0]
    assert not torch.allclose(stem.doc_running_mean, stem.running_mean)
    enc.eval()
    with torch.no_grad():
        as_doc, as_query = enc.embed_docs(dark, ids, lens), enc.embed_queries(dark, ids, lens)
    assert (as_doc - as_query).abs().max() > 1e-3
    assert all(m.side == "query" for m in sides)  # the calls put the side back
    # the background refresh's frozen copy of the document side embeds on that side too
    frozen = _FrozenDocSide(enc)
    with torch.no_grad():
        torch.testing.assert_close(frozen.embed_docs(dark, ids, lens), as_doc)

    shared = DualEncoder(RetrieverConfig(**TOWER), 32).eval()
    with torch.no_grad():
        torch.testing.assert_close(
            shared.embed_docs(dark, ids, lens), shared.embed_queries(dark, ids, lens)
        )


def test_export_keeps_both_sides_and_stays_an_open_clip_state_dict(tmp_path):
    """``rag_mm.export`` writes the query side under open_clip's keys and the document side apart:
    a side_norm retriever built from the file has both sides back, a plain tower loads it with no
    key left over, and a plain tower's file starts both sides of a side_norm one alike."""
    from rag_mm.export import export_retriever

    torch.manual_seed(0)
    enc = DualEncoder(RetrieverConfig(**TOWER, side_norm=True), 32)
    ids, lens = torch.zeros(8, 4, dtype=torch.long), torch.ones(8, dtype=torch.long)
    enc.embed_docs(torch.rand(8, 3, 32, 32) + 1.0, ids, lens)  # the sides' statistics apart
    enc.embed_queries(torch.rand(8, 3, 32, 32) * 0.2, ids, lens)
    export_retriever(enc, tmp_path, enc.cfg)
    path = str(tmp_path / "retriever.pt")
    saved = torch.load(path, weights_only=True)
    assert saved["side_norm_doc"] and not any(".doc_" in k for k in saved if k != "side_norm_doc")

    back = DualEncoder(RetrieverConfig(**TOWER, side_norm=True, checkpoint=path), 32)
    for a, b in zip(enc.state_dict().items(), back.state_dict().items(), strict=True):
        assert a[0] == b[0] and torch.equal(a[1], b[1]), a[0]

    plain = DualEncoder(RetrieverConfig(**TOWER), 32)
    state = {k: v for k, v in saved.items() if k not in ("mix", "side_norm_doc")}
    missing, unexpected = plain.query.clip.load_state_dict(state, strict=False)
    assert not missing and not unexpected

    plain.embed_queries(torch.rand(8, 3, 32, 32) * 3.0, ids, lens)  # statistics of its own
    export_retriever(plain, tmp_path / "plain", plain.cfg)
    cfg = RetrieverConfig(**TOWER, side_norm=True, checkpoint=str(tmp_path / "plain/retriever.pt"))
    stem = next(m for m in DualEncoder(cfg, 32).modules() if isinstance(m, SideBatchNorm))
    first = next(m for m in plain.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm))
    assert not torch.equal(first.running_var, torch.ones_like(first.running_var))
    assert torch.equal(stem.doc_running_var, first.running_var)
    assert torch.equal(stem.running_var, first.running_var)


def test_side_norm_is_refused_where_there_is_no_shared_batch_norm():
    for bad in (dict(vision_tower="vit"), dict(shared_towers=False), dict(fusion="text")):
        errors = validate(RetrieverConfig(**{**TOWER, **bad}, side_norm=True))
        assert any("retriever.side_norm" in e for e in errors), (bad, errors)
    assert validate(RetrieverConfig(**TOWER, side_norm=True)) == []
