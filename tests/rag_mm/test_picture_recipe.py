"""The VQA recipe's picture settings chosen from the data (rag_mm.data.picture_recipe, printed by
``scripts/convert.py vqa``), and SimCLR views that keep a picture's orientation."""

from __future__ import annotations

import json

import pytest
import torch

from rag_mm.config import compose
from rag_mm.data.convert import convert_vqa
from rag_mm.data.picture_recipe import picture_size, recipe_overrides
from rag_mm.model.vision_ssl import picture_views


@pytest.mark.parametrize("side", [5, 8, 28, 32, 64, 640])
def test_picture_size_is_32_px_through_an_8_by_8_grid(side):
    assert picture_size(side) == (32, 4)


def test_colour_jitter_only_when_no_question_names_a_colour():
    assert "data.colour_jitter=0.0" in recipe_overrides(
        [64], ["what color is the shape?", "is there a circle?"]
    )
    assert "data.colour_jitter=0.0" in recipe_overrides([64], ["is the shape not red?"])
    assert "data.colour_jitter=0.1" in recipe_overrides(
        [8, 8, 9], ["what digit is this?", "is this a 3?"]
    )
    with pytest.raises(ValueError):
        recipe_overrides([], ["what digit is this?"])


def test_convert_prints_the_recipe_from_the_pictures(tmp_path):
    from PIL import Image

    (tmp_path / "images").mkdir()
    for i in range(3):
        Image.new("RGB", (16, 16), (255, 0, 0)).save(tmp_path / "images" / f"{i:012d}.png")
    qs = [{"question_id": i, "image_id": i, "question": "what is it?"} for i in range(3)]
    anns = [
        {
            "question_id": i,
            "image_id": i,
            "multiple_choice_answer": "a square",
            "answers": [{"answer": "a square", "answer_id": 1}],
        }
        for i in range(3)
    ]
    (tmp_path / "q.json").write_text(json.dumps({"questions": qs}))
    (tmp_path / "a.json").write_text(json.dumps({"annotations": anns}))
    res = convert_vqa(
        tmp_path / "q.json", tmp_path / "a.json", tmp_path / "images", tmp_path / "out", "train"
    )
    assert res["recipe"] == ["model.image_size=32", "model.patch_size=4", "data.colour_jitter=0.1"]


def test_views_without_turn_or_mirror_keep_the_orientation():
    """A bar on the left half stays on the left when views neither turn nor mirror; with any
    turn and mirror it lands on the right in some views."""
    torch.manual_seed(0)
    x = torch.full((64, 3, 16, 16), -1.0)
    x[:, :, 2:14, 2:5] = 1.0  # a bright vertical bar near the left edge

    def right_share(views):
        bright = views.mean(1) > 0
        return (bright[:, :, 8:].sum((1, 2)) / bright.sum((1, 2)).clamp_min(1)).max()

    assert right_share(picture_views(x, rotate=0.0, mirror=False)) < 0.2
    assert right_share(picture_views(x, rotate=180.0, mirror=True)) > 0.8
    # the recipe's views (the config's defaults) keep it on the left
    m = compose(["+experiment=vqa"]).model
    assert (
        right_share(picture_views(x, rotate=m.vision_ssl_rotate, mirror=m.vision_ssl_mirror)) < 0.2
    )
