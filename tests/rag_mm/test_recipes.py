"""Every recipe under conf/experiment composes into a config the trainer accepts: a key a recipe
misspells or a value out of its range is caught here, before a user's first run."""

from __future__ import annotations

from pathlib import Path

import pytest
from omegaconf import OmegaConf

from rag_mm.config import ConfigError, TrainConfig, compose, validate

RECIPES = sorted(p.stem for p in (Path(__file__).parents[2] / "conf" / "experiment").glob("*.yaml"))


def test_the_recipes_are_found():
    assert {"demo", "kvqa", "vqa"} <= set(RECIPES)


@pytest.mark.parametrize("name", RECIPES)
def test_recipe_composes_and_validates(name):
    # data.root: the custom-data recipes leave it for the user (???)
    cfg = OmegaConf.to_object(compose([f"+experiment={name}", "data.root=DATA"]))
    assert isinstance(cfg, TrainConfig) and cfg.name == name
    validate(cfg)


def test_a_recipe_value_out_of_range_is_refused():
    cfg = OmegaConf.to_object(
        compose(["+experiment=kvqa", "data.root=DATA", "retriever.pseudo_restyle=2"])
    )
    with pytest.raises(ConfigError, match="retriever.pseudo_restyle"):
        validate(cfg)
