"""Late interaction (retriever.late_interaction): MaxSim on a real tower's grid."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from retriever.config import RetrieverConfig
from retriever.encoders import DualEncoder
from retriever.late_interaction import GridTokens, maxsim, maxsim_pairs


def _unit(*shape: int) -> torch.Tensor:
    return F.normalize(torch.randn(*shape), dim=-1)


def test_maxsim_is_colberts_score_both_ways_in_any_chunking():
    torch.manual_seed(0)
    q, d = _unit(7, 9, 16), _unit(5, 4, 16)
    s = torch.einsum("qte,rue->qrtu", q, d)  # (Q, R, T, U)
    ref = 0.5 * (s.amax(3).mean(2) + s.amax(2).mean(2))
    for chunk in (1, 3, 64):
        torch.testing.assert_close(maxsim(q, d, chunk=chunk), ref)
    torch.testing.assert_close(maxsim_pairs(q[:5, :4], d), torch.diagonal(maxsim(q[:5, :4], d)))


def test_a_picture_whose_parts_moved_still_matches_itself_first():
    """A document's grid with its tokens moved to other cells (each part drawn elsewhere) scores
    1 against that document and well below it against every other: each token finds its own
    counterpart wherever it sits (with a mean in place of the max, nothing scores near 1)."""
    torch.manual_seed(1)
    docs = _unit(32, 36, 8)  # 32 documents, 6 x 6 grids of 8-dim tokens
    moved = docs[:, torch.randperm(36)]  # every document's parts in other cells
    s = maxsim(moved, docs)  # (32, 32)
    torch.testing.assert_close(torch.diagonal(s), torch.ones(32))
    assert (s.argmax(1) == torch.arange(32)).all()
    assert (s - torch.eye(32) * 2).amax() < 0.9  # every other document well below 1


def test_grid_tokens_read_a_resnet_stage_and_train_it():
    """GridTokens on the recipe's tower (open_clip ModifiedResNet, 48 px): the layer2 grid of the
    last call as unit vectors, and a MaxSim loss reaches the tower's weights through it."""
    torch.manual_seed(2)
    cfg = RetrieverConfig(
        mode="learned", vision_tower="resnet", vision_width=16, vision_layers=1, fusion="image"
    )
    model = DualEncoder(cfg, 48)
    visual = model.query.clip.visual
    grid = GridTokens(visual.layer2, channels=128, dim=32)
    pics = torch.randn(6, 3, 48, 48)
    model.query(pics, None)
    tok = grid.take()
    assert tok.shape == (6, 36, 32)  # 48 px / 8 = a 6 x 6 grid
    torch.testing.assert_close(tok.norm(dim=-1), torch.ones(6, 36))
    loss = torch.nn.functional.cross_entropy(
        grid.scale() * maxsim(tok[:3], tok[3:]), torch.arange(3)
    )
    loss.backward()
    assert visual.conv1.weight.grad is not None and visual.conv1.weight.grad.abs().sum() > 0
    assert visual.layer4[0].conv1.weight.grad is None  # past the stage: not on the path
    try:
        grid.take()  # the grid was taken: a second take has nothing to give
    except RuntimeError as exc:
        assert "before the tower ran" in str(exc)
    else:
        raise AssertionError("take() gave a stale grid")
