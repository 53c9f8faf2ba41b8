"""Dual encoder, retriever losses, memory refresh, and the index build script."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from retriever import losses
from retriever.config import RetrieverConfig, validate
from retriever.encoders import EOT, SOT, DualEncoder, clip_tokens
from retriever.memory import RetrievalMemory

REPO = Path(__file__).resolve().parents[2]
SMALL = dict(
    embed_dim=16,
    vision_width=32,
    vision_layers=1,
    vision_head_width=16,
    text_width=32,
    text_layers=1,
    text_heads=2,
    context_length=16,
)


def test_clip_tokens_places_markers():
    t = clip_tokens(torch.tensor([[5, 6, 7, 0], [8, 0, 0, 0]]), torch.tensor([3, 1]), 6)
    assert t.tolist() == [[SOT, 5, 6, 7, EOT, 0], [SOT, 8, EOT, 0, 0, 0]]
    long = clip_tokens(torch.arange(1, 11)[None], torch.tensor([10]), 6)  # truncated, EOT kept last
    assert long.tolist() == [[SOT, 1, 2, 3, 4, EOT]]


def test_dual_encoder_shapes_sharing_and_query_side_only():
    enc = DualEncoder(RetrieverConfig(**SMALL), 32)
    q = enc.embed_queries(
        torch.randn(3, 3, 32, 32), torch.randint(1, 100, (3, 5)), torch.tensor([5, 2, 1])
    )
    assert q.shape == (3, 16) and torch.allclose(q.norm(dim=-1), torch.ones(3), atol=1e-5)
    assert enc.doc is not enc.query
    shared = DualEncoder(RetrieverConfig(**SMALL, shared_towers=True), 32)
    assert shared.doc is shared.query
    frozen = DualEncoder(RetrieverConfig(**SMALL, query_side_only=True), 32)
    assert not any(p.requires_grad for p in frozen.doc.parameters())
    assert all(p.requires_grad for p in frozen.query.parameters())
    with pytest.raises(ValueError, match="separate towers"):
        DualEncoder(RetrieverConfig(**SMALL, query_side_only=True, shared_towers=True), 32)


def test_config_validation_names_keys():
    errs = validate(RetrieverConfig(mode="learned", top_k=0, loss="magic", text_heads=3))
    text = "\n".join(errs)
    assert "retriever.top_k" in text and "retriever.loss" in text and "retriever.text_heads" in text


def test_losses_point_the_retriever_at_the_reader():
    scores = torch.zeros(2, 3, requires_grad=True)
    nll = torch.tensor([[2.0, 0.1, 3.0], [0.5, 4.0, 4.0]])  # the reader prefers doc 1, then doc 0
    for loss in (
        losses.perplexity_distillation(scores, nll, 0.1),
        losses.emdr2(scores, -nll),
        losses.attention_distillation(scores, torch.softmax(-nll, -1)),
    ):
        (g,) = torch.autograd.grad(loss, scores)
        # gradient descent raises the score of the document the reader found most useful
        assert (-g).argmax(-1).tolist() == [1, 0]
    # contrastive: aligned pairs give a lower loss than shuffled ones; shared golds count as
    # positives
    q = torch.nn.functional.normalize(torch.randn(4, 8), dim=-1)
    gold = torch.tensor([0, 1, 2, 2])
    aligned = losses.contrastive(q, q, gold, torch.tensor(10.0))
    shuffled = losses.contrastive(q, q.roll(1, 0), gold, torch.tensor(10.0))
    assert aligned < shuffled


def test_contrastive_mask_gives_the_loss_of_the_valid_rows_alone():
    """A row left out by ``valid`` is neither a query nor a candidate: the loss and the gradients
    of the kept rows are those of the kept rows selected, with hard negatives too; gold ids shared
    with a left-out row do not make it a positive. No valid row: 0, with finite gradients."""
    g = torch.Generator().manual_seed(0)
    norm = torch.nn.functional.normalize
    q, d = (norm(torch.randn(6, 8, generator=g), dim=-1).requires_grad_() for _ in range(2))
    hard = norm(torch.randn(5, 8, generator=g), dim=-1)
    gold = torch.tensor([3, 1, 3, 2, 2, 7])  # row 4, left out, shares row 3's gold
    hard_ids = torch.tensor([1, 9, 3, 7, 2])
    valid = torch.tensor([True, False, True, True, False, True])
    scale = torch.tensor(10.0)
    for extra in ((), (hard, hard_ids)):
        masked = losses.contrastive(q, d, gold, scale, *extra, valid=valid)
        kept = losses.contrastive(q[valid], d[valid], gold[valid], scale, *extra)
        torch.testing.assert_close(masked, kept)
        gm = torch.autograd.grad(masked, (q, d))
        gk = torch.autograd.grad(kept, (q, d))
        for a, b in zip(gm, gk):
            torch.testing.assert_close(a, b)
            assert (a[~valid] == 0).all()
    none = losses.contrastive(q, d, gold, scale, hard, hard_ids, valid=torch.zeros(6, dtype=bool))
    assert none.item() == 0.0
    assert all(t.isfinite().all() for t in torch.autograd.grad(none, (q, d)))


def _memory(n=40, factory="Flat"):
    torch.manual_seed(0)
    enc = DualEncoder(RetrieverConfig(**SMALL), 32)
    mem = RetrievalMemory(
        enc,
        torch.randn(n, 3, 32, 32),
        torch.randint(1, 100, (n, 6)),
        torch.full((n,), 6),
        torch.arange(100, 100 + n),
        factory=factory,
        batch_size=16,
    )
    return enc, mem


def test_memory_refresh_sync_and_background():
    enc, mem = _memory()
    mem.refresh()
    emb = mem.embed()
    scores, ids = mem.search(emb[:5], 3)
    assert ids[:, 0].tolist() == [100, 101, 102, 103, 104]  # each document finds itself first
    v = mem.index.version
    with torch.no_grad():  # the encoder changes; a background refresh embeds a snapshot
        for p in enc.doc.parameters():
            p.add_(0.05 * torch.randn_like(p))
    new = mem.embed()
    mem.refresh(background=True, step=1)
    mem.wait()
    assert mem.index.version == v + 1 and len(mem.refresh_seconds) == 2
    _, ids2 = mem.search(new[:5], 1)
    assert ids2[:, 0].tolist() == [100, 101, 102, 103, 104]
    mem.close()


def test_build_index_script_round_trip(tmp_path):
    from rag_mm.data.knowledge_world import WorldConfig, generate

    world = tmp_path / "w"
    generate(
        WorldConfig(
            out=str(world),
            num_entities=20,
            train_queries_per_entity=1,
            val_queries_per_entity=1,
            test_queries_per_entity=1,
            shard_size=64,
        )
    )
    out = tmp_path / "memory.index"
    args = [
        sys.executable,
        "scripts/build_index.py",
        f"corpus={world}/corpus/corpus-000000.tar",
        f"out={out}",
        f"queries={world}/test/test-000000.tar",
        "k=5",
        f"save_embeddings={tmp_path}/emb_",
        *[f"retriever.{k}={v}" for k, v in SMALL.items()],
        "retriever.centre=true",  # a run that scores centred vectors: the file says it is raw
    ]
    res = subprocess.run(args, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    report = json.loads(res.stdout.strip().splitlines()[-1])
    assert (
        report["num_docs"] == 20 and report["recall@5_vs_exact"] == 1.0 and report["queries"] == 20
    )
    assert "retriever.centre" in report["note"]
    import numpy as np  # the saved embeddings are what scripts/bench/index.py --embeddings reads

    assert np.load(tmp_path / "emb_docs.npy").shape == (20, 16) and np.load(
        tmp_path / "emb_queries.npy"
    ).shape == (20, 16)
    from retriever.errors import IndexMismatchError
    from retriever.index import FaissIndex

    idx = FaissIndex.load(out, dim=16)
    assert idx.ntotal == 20
    with pytest.raises(IndexMismatchError):
        FaissIndex.load(out, dim=16, encoder_hash="another encoder")
    bad = subprocess.run(
        [sys.executable, "scripts/build_index.py", f"corpus={tmp_path}/none.tar"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert bad.returncode == 2 and "not found" in bad.stderr


def test_memory_bank_negatives_come_from_the_last_refresh():
    enc, mem = _memory()
    with pytest.raises(RuntimeError, match="refresh"):
        mem.negatives(4)
    mem.refresh()
    emb, ids = mem.negatives(4, torch.Generator().manual_seed(0))
    assert (
        emb.shape == (4, enc.cfg.embed_dim)
        and len(set(ids.tolist())) == 4
        and not emb.requires_grad
    )
    rows = [int(i) - 100 for i in ids]  # _memory's documents have ids 100 + row
    assert torch.allclose(emb, mem.embed()[rows], atol=1e-6)
    every, every_ids = mem.negatives(10_000)
    assert sorted(every_ids.tolist()) == sorted(mem.doc_ids.tolist()) and len(every) == len(mem)
    mem.close()


def test_resnet_tower_and_image_fusion_keep_only_used_parameters():
    """fusion=image drops the text tower (DDP rejects parameters that never get a gradient)."""
    cfg = RetrieverConfig(
        **{**SMALL, "vision_width": 16}, vision_tower="resnet", fusion="image", shared_towers=True
    )
    enc = DualEncoder(cfg, 32)
    names = [n for n, _ in enc.named_parameters()]
    assert any(".visual.layer4." in n for n in names) and not any(
        "token_embedding" in n for n in names
    )
    q = enc.embed_queries(
        torch.randn(3, 3, 32, 32), torch.randint(1, 100, (3, 5)), torch.tensor([5, 3, 1])
    )
    assert q.shape == (3, 16) and torch.allclose(q.norm(dim=-1), torch.ones(3))
    q.sum().backward()
    assert [n for n, p in enc.named_parameters() if p.grad is None] == ["logit_scale"]
    assert "retriever.vision_tower" in " ".join(validate(RetrieverConfig(vision_tower="cnn")))


def test_random_views_are_seeded_warps_of_the_picture():
    from retriever.augment import random_views

    x = torch.randn(5, 3, 32, 32)
    same = random_views(x, max_rotation_deg=0, scale=(1.0, 1.0), max_shift=0, colour=0, noise=0)
    assert torch.allclose(same, x, atol=1e-5)  # no change asked: the identity warp
    a = random_views(x, torch.Generator().manual_seed(3))
    b = random_views(x, torch.Generator().manual_seed(3))
    assert a.shape == x.shape and torch.equal(a, b) and not torch.allclose(a, x, atol=0.1)


def test_photo_views_put_the_thing_on_a_new_background():
    from retriever.augment import VIEW_STYLES, ViewStyle, photo_views

    x = torch.full((4, 3, 32, 32), 1.5)  # a plain, bright ground ...
    x[:, :, 8:24, 8:24] = -1.0  # ... with a dark square on it
    x[:, :, 14:18, 14:18] = 1.5  # whose hole has the ground's colour but is no ground
    # no warp, no blur: only the ground changes
    keep = ViewStyle(0.0, (1.0, 1.0), 0.0, 0.0, 0.0, 1.0, 0.0)
    v = photo_views(x, keep, torch.Generator().manual_seed(0))
    # the thing, hole included, is untouched
    assert torch.equal(v[:, :, 8:24, 8:24], x[:, :, 8:24, 8:24])
    ground = v[:, :, :8]
    assert (
        ground - 1.5
    ).abs().mean() > 0.3 and ground.std() > 0.2  # a textured ground, not the plain one
    a = photo_views(x, VIEW_STYLES["photo"], torch.Generator().manual_seed(1))
    b = photo_views(x, VIEW_STYLES["photo"], torch.Generator().manual_seed(1))
    assert a.shape == x.shape and torch.equal(a, b) and torch.isfinite(a).all()


def test_random_restyle_changes_the_look_not_the_layout():
    from retriever.augment import random_restyle

    # three colours whose channels are no rescaling of one another (a 1 x 1 colour mix of a
    # two-colour picture, brought back to each channel's mean and spread, is the picture itself)
    colour = lambda *c: torch.tensor(c).view(1, 3, 1, 1)  # noqa: E731
    x = colour(1.5, -0.5, 0.2).expand(16, 3, 64, 64).clone()  # a plain ground ...
    x[:, :, 20:44, 20:44] = colour(-1.0, 1.0, 0.5)  # ... with a square on it ...
    x[:, :, 28:36, 28:36] = colour(0.3, -1.2, 1.4)  # ... and another inside
    x = x + 0.3 * torch.randn(16, 3, 1, 1)  # each picture its own shade
    assert torch.equal(random_restyle(x, 0.0), x)  # share 0: untouched
    a = random_restyle(x, 1.0, torch.Generator().manual_seed(0))
    b = random_restyle(x, 1.0, torch.Generator().manual_seed(0))
    assert torch.equal(a, b) and torch.isfinite(a).all()
    # every picture redrawn, each to its own colours: the same picture restyled twice differs
    assert ((a - x).flatten(1).abs().amax(1) > 1e-3).all()
    assert not torch.allclose(a[0] - x[0], a[1] - x[1], atol=1e-3)
    # each channel keeps its mean (the look changes, not the exposure)
    torch.testing.assert_close(a.mean((2, 3)), x.mean((2, 3)), atol=1e-4, rtol=0)
    # a local filter: the ground far from the square and the frame stays flat, the square's edge
    # does not vanish
    far = a[:, :, 5:14, 5:58]  # at least 6 px from the square, 5 px from the frame
    assert far.std((2, 3)).amax() < 1e-4
    edge = (a[:, :, 30:34, 17:23] - a[:, :, 30:34, 6:12]).abs().mean((1, 2, 3))  # across the edge
    assert (edge > 1e-3).all()
    # about the share asked of a large batch is redrawn
    y = torch.randn(400, 3, 8, 8)
    changed = (random_restyle(y, 0.25, torch.Generator().manual_seed(1)) != y).flatten(1).any(1)
    assert 0.15 < changed.float().mean() < 0.35
    assert "retriever.pseudo_restyle" in " ".join(validate(RetrieverConfig(pseudo_restyle=1.5)))


def test_random_jpeg_compresses_colour_detail_and_keeps_the_picture():
    """A share of the views goes through a real JPEG round trip: colour stripes one pixel wide
    (what 4:2:0 chroma keeps at half resolution) lose most of their contrast, while the
    picture's mean colour and its coarse layout stay; share 0 leaves every view untouched, and a
    seeded draw repeats."""
    from rag_mm.data.pipeline import MEAN, STD
    from retriever.augment import random_jpeg

    # two colours of about one luminance in columns one pixel wide, on the left half; the right
    # half a flat grey
    u8 = torch.full((8, 3, 32, 32), 128, dtype=torch.uint8)
    u8[:, :, :, 0:16:2] = torch.tensor([200, 90, 90], dtype=torch.uint8).view(3, 1, 1)
    u8[:, :, :, 1:16:2] = torch.tensor([70, 140, 200], dtype=torch.uint8).view(3, 1, 1)
    x = (u8.float() / 255 - MEAN) / STD
    assert torch.equal(random_jpeg(x, 0.0, MEAN, STD), x)
    a = random_jpeg(x, 1.0, MEAN, STD, torch.Generator().manual_seed(0))
    b = random_jpeg(x, 1.0, MEAN, STD, torch.Generator().manual_seed(0))
    assert torch.equal(a, b) and a.shape == x.shape and a.dtype == x.dtype
    stripes = lambda v: (v[..., 8:24, 2:14:2] - v[..., 8:24, 3:15:2]).abs().mean((1, 2, 3))  # noqa: E731
    assert (stripes(a) < 0.5 * stripes(x)).all()  # the colour detail is gone ...
    # ... the colours are not: each half keeps its mean colour within a tenth of a std
    for half in (slice(0, 16), slice(16, 32)):
        got, want = a[..., half].mean((2, 3)), x[..., half].mean((2, 3))
        torch.testing.assert_close(got, want, atol=0.1, rtol=0)
    # about the share asked of a large batch is compressed
    y = (torch.randint(0, 256, (400, 3, 8, 8)).float() / 255 - MEAN) / STD
    changed = random_jpeg(y, 0.25, MEAN, STD, torch.Generator().manual_seed(1)) != y
    assert 0.15 < changed.flatten(1).any(1).float().mean() < 0.35
    assert "retriever.pseudo_jpeg" in " ".join(validate(RetrieverConfig(pseudo_jpeg=1.5)))


def test_random_surface_bends_stretches_and_lights_the_picture_but_keeps_it():
    """On a waving, unevenly lit surface: a straight vertical edge bends (a rigid warp would keep
    it straight) yet stays near where it was; a centred square is stretched one way or the other
    beyond what the wave alone does; a flat picture gets a smooth light, alike in every channel;
    amount 0 is the identity and a seeded draw repeats."""
    from retriever.augment import SURFACE_SHADE, random_surface

    N, S = 64, 32
    edge = torch.zeros(N, 3, S, S)
    edge[:, 0, :, : S // 2], edge[:, 0, :, S // 2 :] = 1.0, -1.0  # channel 1 stays 0
    assert random_surface(edge, 0.0) is edge
    out = random_surface(edge, 1.0, torch.Generator().manual_seed(0))
    assert torch.equal(out, random_surface(edge, 1.0, torch.Generator().manual_seed(0)))
    # the light is alike in every channel: channel 0 - channel 1 is the warped edge alone
    # (N, S) per row, the column where it crosses zero
    at = ((out[:, 0] - out[:, 1]) > 0).sum(-1).float()
    bent = at.amax(1) - at.amin(1)
    assert (bent >= 1).float().mean() > 0.8  # most edges bend by a pixel or more ...
    assert ((at - S / 2).abs() <= 0.2 * S).all()  # ... and stay near the middle
    # a centred square: width against height, in log
    square = torch.zeros(N, 3, S, S)
    square[:, 0, 8:24, 8:24] = 1.0
    sq = random_surface(square, 1.0, torch.Generator().manual_seed(1))
    inside = (sq[:, 0] - sq[:, 1]) > 0.5
    w, h = inside[:, S // 2].sum(-1).float(), inside[:, :, S // 2].sum(-1).float()
    assert (w / h).log().abs().mean() > 0.09
    # a flat picture: a smooth light, alike in every channel, within the designed range (bicubic
    # overshoots its knots a little)
    lit = random_surface(torch.zeros(N, 3, S, S), 1.0, torch.Generator().manual_seed(2))
    assert torch.allclose(lit[:, 0], lit[:, 2]) and torch.allclose(lit[:, 0], lit[:, 1])
    assert (lit.flatten(1).std(1) > 0.02).all()
    assert lit.abs().max() <= 1.3 * SURFACE_SHADE
    assert lit.diff(dim=-1).abs().max() < 0.15 and lit.diff(dim=-2).abs().max() < 0.15
    assert "retriever.pseudo_surface" in " ".join(validate(RetrieverConfig(pseudo_surface=-1)))


def test_random_tone_moves_each_colour_on_its_own():
    """A tone curve per channel: the identity at amount 0; two colours of one picture (red and
    orange: the same red, another green) move by different amounts, where a brightness change
    would move them alike; each pixel moves by at most the amount; a seeded draw repeats."""
    from retriever.augment import random_tone

    pics = torch.zeros(64, 3, 8, 8)
    pics[:, 0] = 1.5  # red everywhere
    pics[:, 1, :4], pics[:, 1, 4:] = -1.5, 0.2  # green low (red) above, mid (orange) below
    assert torch.equal(random_tone(pics, 0.0), pics)
    out = random_tone(pics, 0.5, torch.Generator().manual_seed(0))
    moved = out - pics
    assert moved.abs().max() <= 0.5 + 1e-6
    # within one region every pixel moves alike; the two regions' greens move differently
    assert torch.allclose(moved[:, 1, :4], moved[:, 1, :1, :1].expand(-1, 4, 8))
    apart = (moved[:, 1, 0, 0] - moved[:, 1, 7, 0]).abs()
    assert (apart > 0.05).float().mean() > 0.8
    # the red channel, alike in both regions, moves alike in both
    assert torch.allclose(moved[:, 0, 0, 0], moved[:, 0, 7, 0])
    again = random_tone(pics, 0.5, torch.Generator().manual_seed(0))
    assert torch.equal(out, again)
    assert "retriever.pseudo_tone" in " ".join(validate(RetrieverConfig(pseudo_tone=-1.0)))


def test_warmup_rate_floor_and_average_start_are_shares():
    """The warm-up's last rate (of its peak) and where its average starts (of its steps) are
    shares: outside [0, 1] is named; the ends pass."""
    for bad in (-0.1, 1.5):
        assert "retriever.warmup_min_lr_ratio" in " ".join(
            validate(RetrieverConfig(warmup_min_lr_ratio=bad))
        )
    assert not validate(RetrieverConfig(warmup_min_lr_ratio=0.0))
    assert not validate(RetrieverConfig(warmup_min_lr_ratio=1.0))
    assert "retriever.warmup_average_from" in " ".join(
        validate(RetrieverConfig(warmup_average_from=1.5))
    )


def test_pseudo_neighbours_is_a_share():
    assert "retriever.pseudo_neighbours" in " ".join(
        validate(RetrieverConfig(pseudo_neighbours=1.5))
    )
    assert not validate(RetrieverConfig(pseudo_neighbours=0.5))
