"""The picture settings of the VQA recipe (``+experiment=vqa``) chosen from the data itself:
``scripts/convert.py vqa`` prints them beside the data overrides, and ``docs/pictures.md`` says why.

* Picture size and patch grid: an 8 x 8 grid of patches (64 tokens, the recipe's
  ``model.max_segment_len`` of 96 leaves room for the question and answer) over 32 px. Larger
  pictures are shrunk to it (the tower's cost grows with its pixels); smaller ones are blown up to
  it, so that each patch holds one or more of the picture's own pixels with their neighbourhood:
  read at their own 8 px through 1-px patches, digits reach the untrained reader's answer position
  less well than blown up to 32 px through 4-px patches (benchmarks/vqa_pictures.md).
* Colour jitter only when no question names a colour: a brightness shift per channel teaches the
  reader to ignore what such a question asks.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

GRID = 8  # patches per side: 64 picture tokens
LARGEST = 32  # px: the picture size; larger pictures are shrunk to it, smaller ones blown up
JITTER = 0.1  # the per-channel shift used when no question is about colour (DataConfig's default)
COLOURS = re.compile(
    r"\b(colou?rs?|red|green|blue|yellow|orange|purple|pink|brown|black|white|gr[ae]y|teal)\b",
    re.IGNORECASE,
)


def picture_size(side: int) -> tuple[int, int]:
    """(model.image_size, model.patch_size) for pictures ``side`` px on their shorter side: 32 px
    through the 8 x 8 grid, whatever the side (shrunk or blown up to it)."""
    if side < 1:
        raise ValueError(f"a picture side must be positive (got {side})")
    return LARGEST, LARGEST // GRID


def asks_colour(questions: Iterable[str]) -> bool:
    return any(COLOURS.search(q) for q in questions)


def recipe_overrides(sides: list[int], questions: list[str]) -> list[str]:
    """The ``+experiment=vqa`` overrides for pictures of shorter sides ``sides`` (their median
    decides) asked ``questions``."""
    if not sides:
        raise ValueError("no picture to choose the picture size from")
    size, patch = picture_size(sorted(sides)[len(sides) // 2])
    jitter = 0.0 if asks_colour(questions) else JITTER
    return [f"model.image_size={size}", f"model.patch_size={patch}", f"data.colour_jitter={jitter}"]
