"""The vision tower's SimCLR warm-up (rag_mm.model.vision_ssl, rag_mm.components.vision_warmup):
what the views change and keep, the loss, and the trainer's phase on one and two gloo ranks."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from rag_mm.config import compose
from rag_mm.data.pipeline import MEAN, STD
from rag_mm.model.vision_ssl import nt_xent, picture_views
from rag_mm.trainer import Trainer
from tests.rag_mm.conftest import tiny_overrides

SSL = [
    "retriever=none",
    "data.corpus=null",
    "model.vision_ssl_steps=4",
    "max_steps=2",
    "ckpt_every=2",
]


def _square(n: int = 64) -> torch.Tensor:
    """(n, 3, 32, 32) white pictures with a red 8 x 8 square near the top left corner,
    normalised."""
    x = torch.ones(n, 3, 32, 32)
    x[:, 1:, 4:12, 4:12] = 0.0
    return (x - MEAN) / STD


def test_views_keep_the_background_and_move_and_recolour_the_thing():
    torch.manual_seed(0)
    pics = _square()
    views = picture_views(pics) * STD + MEAN  # back to pixels
    assert views.shape == pics.shape and torch.isfinite(views).all()
    # the background stays white under every warp and channel order (border pixels repeated)
    assert torch.allclose(views[:, :, 0, -1], torch.ones(64, 3), atol=1e-4)
    dark = views.min(1).values < 0.5  # (n, H, W) where the thing is
    # its place changes: the centre of mass moves between views
    ys = torch.arange(32.0)[None, :, None]
    cy = (dark * ys).sum((1, 2)) / dark.sum((1, 2)).clamp_min(1)
    assert cy.std() > 2.0
    # its colour changes: the brightest channel inside it is not always red
    inside = [views[i][:, dark[i]].mean(1) for i in range(64) if dark[i].any()]
    assert len({int(c.argmax()) for c in inside}) >= 2


def test_nt_xent_is_low_for_matching_views_and_high_for_mismatched():
    torch.manual_seed(0)
    z = torch.randn(16, 32)
    matched = nt_xent(torch.cat([z, z + 0.01 * torch.randn_like(z)]), 0.2)
    mismatched = nt_xent(torch.cat([z, z[torch.randperm(16)]]), 0.2)
    assert matched < 0.5 < 2.0 < mismatched


def test_warmup_batch_is_its_own(tiny_world, tmp_path):
    """``model.vision_ssl_batch`` sets the pictures per SimCLR step (more negatives) apart from the
    reader's batch; 0 keeps data.batch_size; 1 (no negative) is refused before anything runs."""
    from rag_mm.components.vision_warmup import _pictures
    from rag_mm.config import ConfigError, validate

    over = tiny_overrides(tiny_world, tmp_path / "run", *SSL, "data.batch_size=4")
    assert (
        next(
            _pictures(compose([*over, "model.vision_ssl_batch=6"]), 0, 1, torch.device("cpu"))
        ).shape[0]
        == 6
    )
    assert next(_pictures(compose(over), 0, 1, torch.device("cpu"))).shape[0] == 4
    with pytest.raises(ConfigError, match="vision_ssl_batch"):
        validate(compose([*over, "model.vision_ssl_batch=1"]))


def _tower(t: Trainer) -> dict:
    return {n: p.detach().clone() for n, p in t.model.vision.named_parameters()}


def test_warmup_trains_the_tower_on_a_fresh_start_only(tiny_world, tmp_path):
    """The warm-up is the first phase of ``fit`` (the reader is spread after it); a resumed run
    restores the tower from its checkpoint and runs no second warm-up."""
    over = tiny_overrides(tiny_world, tmp_path / "run", *SSL)
    torch.manual_seed(0)
    t = Trainer(compose(over))
    before = _tower(t)
    assert t.spread is None  # the plain tower trains first
    t.restore()
    t.fit()
    t.close()
    # the warm-up moved the tower (the two joint steps alone move it too, so against a run
    # without it, from the same seed)
    torch.manual_seed(0)
    plain = Trainer(
        compose([*over, "model.vision_ssl_steps=0", f"run_dir={tmp_path / 'plain'}"]),
        log_metrics=False,
    )
    assert all(torch.equal(before[n], p) for n, p in _tower(plain).items())  # same start
    plain.restore()
    plain.fit()
    plain.close()
    after, plain_after = _tower(t), _tower(plain)
    assert any(not torch.equal(after[n], plain_after[n]) for n in after)
    records = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    warm = [r for r in records if r["kind"] == "vision_warmup"]
    assert [r["step"] for r in warm] == [2, 4] and all(np.isfinite(r["loss"]) for r in warm)
    # resumed from its checkpoint: no second warm-up (the tower comes from the checkpoint)
    t2 = Trainer(compose([*over, "max_steps=4"]))
    assert t2.spread is not None
    t2.restore()
    t2.fit()
    t2.close()
    records = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len([r for r in records if r["kind"] == "vision_warmup"]) == 2
    assert max(r["step"] for r in records if r["kind"] == "train") == 4


def _warm_rank(rank, world, overrides):
    from rag_mm.components.vision_warmup import warm_up_vision
    from rag_mm.model.reader import build_vision_tower

    cfg = compose(overrides)
    torch.manual_seed(0)
    tower = build_vision_tower(cfg.model)
    warm_up_vision(cfg, tower, rank, world, torch.device("cpu"))
    return {n: p.detach().numpy().copy() for n, p in tower.named_parameters()}


@pytest.mark.multirank
def test_warmup_keeps_ranks_identical(tiny_world, tmp_path):
    """Two gloo ranks warm up on different pictures; the averaged gradients keep their towers
    equal."""
    from tests.distributed import run_ranks

    p0, p1 = run_ranks(
        _warm_rank, 2, tiny_overrides(tiny_world, tmp_path / "run", *SSL), timeout_s=300
    )
    assert all(np.array_equal(p0[n], p1[n]) for n in p0)


def test_warmup_trains_a_vlms_own_tower(tiny_world, tmp_path):
    """``model=hf_vlm``: the warm-up trains the VLM's vision tower (``picture_tower``) through
    the features its projector reads; frozen afterwards (``optim.vision_lr_scale=0``), what moved
    it is the warm-up alone."""
    over = tiny_overrides(
        tiny_world, tmp_path / "run", *SSL, "model=hf_vlm", "optim.vision_lr_scale=0"
    )
    torch.manual_seed(0)
    t = Trainer(compose(over))
    inner = t.model.vlm.model
    before = {n: p.detach().clone() for n, p in inner.vision_tower.named_parameters()}
    t.restore()
    t.fit()
    t.close()
    moved = [n for n, p in inner.vision_tower.named_parameters() if not torch.equal(before[n], p)]
    assert any("layers.0." in n for n in moved), moved
    records = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    warm = [r for r in records if r["kind"] == "vision_warmup"]
    assert [r["step"] for r in warm] == [2, 4] and all(np.isfinite(r["loss"]) for r in warm)


@pytest.mark.parametrize("model", ["small", "hf_vlm"])
@pytest.mark.parametrize("scale", [0.0, 0.25])
def test_vision_lr_scale_sets_the_towers_rate_or_freezes_it(tiny_world, tmp_path, scale, model):
    over = tiny_overrides(
        tiny_world,
        tmp_path / "run",
        "retriever=none",
        "data.corpus=null",
        f"model={model}",
        f"optim.vision_lr_scale={scale}",
    )
    t = Trainer(compose(over), log_metrics=False)
    t.close()
    tower = {id(p) for p in t.model.picture_tower.parameters()}
    assert tower
    lr = t.cfg.optim.lr
    in_opt = {id(p): g["initial_lr"] for g in t.opt.param_groups for p in g["params"]}
    if scale == 0:
        assert not any(p.requires_grad for p in t.model.picture_tower.parameters())
        assert not tower & set(in_opt)
    else:
        assert tower <= set(in_opt)
        assert {in_opt[i] for i in tower} == {scale * lr}
        assert {v for i, v in in_opt.items() if i not in tower} == {lr}
