"""Procedural pictures of knowledge-world entities.

A canonical rendering (centred, upright, unit scale, plain background) illustrates the entity's
document; a query rendering of the same entity changes pose, scale, position, colours and adds
noise, so matching a query to its document is a real (if small) vision problem.
"""

from __future__ import annotations

import math
import random

import numpy as np
from PIL import Image, ImageDraw

from rag_mm.data.world import HUES, Entity

_SUPERSAMPLE = 4  # draw at 4x and downsample: anti-aliased edges at 32 px


def _shape_mask(shape: str, size: int) -> Image.Image:
    """A white-on-black mask of ``shape`` filling about 70% of a ``size`` x ``size`` canvas."""
    m = Image.new("L", (size, size), 0)
    d = ImageDraw.Draw(m)
    c, r = size / 2, size * 0.35

    def poly(n: int, phase: float, radius: float = r) -> list[tuple[float, float]]:
        return [
            (
                c + radius * math.cos(phase + 2 * math.pi * i / n),
                c + radius * math.sin(phase + 2 * math.pi * i / n),
            )
            for i in range(n)
        ]

    if shape == "circle":
        d.ellipse([c - r, c - r, c + r, c + r], fill=255)
    elif shape == "square":
        d.rectangle([c - r * 0.85, c - r * 0.85, c + r * 0.85, c + r * 0.85], fill=255)
    elif shape == "triangle":
        d.polygon(poly(3, -math.pi / 2), fill=255)
    elif shape == "diamond":
        d.polygon(poly(4, 0.0), fill=255)
    elif shape == "crescent":  # a disc with an offset disc cut out
        d.ellipse([c - r, c - r, c + r, c + r], fill=255)
        d.ellipse([c - r * 0.45, c - r * 1.05, c + r * 1.35, c + r * 0.75], fill=0)
    elif shape == "star":
        pts = []
        for i in range(10):
            rad = r if i % 2 == 0 else r * 0.45
            a = -math.pi / 2 + math.pi * i / 5
            pts.append((c + rad * math.cos(a), c + rad * math.sin(a)))
        d.polygon(pts, fill=255)
    elif shape == "cross":
        w = r * 0.38
        d.rectangle([c - w, c - r, c + w, c + r], fill=255)
        d.rectangle([c - r, c - w, c + r, c + w], fill=255)
    elif shape == "ring":
        d.ellipse([c - r, c - r, c + r, c + r], fill=255)
        d.ellipse([c - r * 0.55, c - r * 0.55, c + r * 0.55, c + r * 0.55], fill=0)
    else:
        raise ValueError(f"unknown shape {shape!r}")
    return m


def _texture(texture: str, size: int, period: int) -> Image.Image:
    """A mask of the secondary colour's pattern (white where the second hue shows)."""
    y, x = np.mgrid[0:size, 0:size]
    if texture == "solid":
        a = np.zeros((size, size), bool)
    elif texture == "stripes":
        a = (x // period) % 2 == 0
    elif texture == "dots":
        a = ((x % (2 * period) - period) ** 2 + (y % (2 * period) - period) ** 2) < (
            period * 0.6
        ) ** 2
    elif texture == "checker":
        a = ((x // period) + (y // period)) % 2 == 0
    else:
        raise ValueError(f"unknown texture {texture!r}")
    return Image.fromarray((a * 255).astype(np.uint8), "L")


def _jitter(rgb: tuple[int, int, int], rng: random.Random, amount: int) -> tuple[int, int, int]:
    return tuple(int(min(255, max(0, v + rng.randint(-amount, amount)))) for v in rgb)  # type: ignore[return-value]


def render(entity: Entity, size: int = 32, rng: random.Random | None = None) -> Image.Image:
    """Draw ``entity``. ``rng=None`` gives the canonical picture; otherwise a random variation."""
    big = size * _SUPERSAMPLE
    variant = rng is not None
    rng = rng or random.Random(0)
    hue = _jitter(HUES[entity.hue], rng, 30) if variant else HUES[entity.hue]
    hue2 = _jitter(HUES[entity.hue2], rng, 30) if variant else HUES[entity.hue2]
    bg_level = rng.randint(200, 250) if variant else 235
    background = Image.new("RGB", (big, big), (bg_level,) * 3)

    mask = _shape_mask(entity.shape, big)
    period = max(2, big // 10)
    body = Image.new("RGB", (big, big), hue)
    pattern = Image.new("RGB", (big, big), hue2)
    body.paste(pattern, (0, 0), _texture(entity.texture, big, period))

    if variant:  # pose, scale and position change; the texture turns with the body
        # well below 45 degrees, so a turned square never becomes a diamond
        angle = rng.uniform(-15, 15)
        scale = rng.uniform(0.75, 1.1)
        shift = (rng.uniform(-0.12, 0.12) * big, rng.uniform(-0.12, 0.12) * big)
        body = body.rotate(angle, resample=Image.BILINEAR)
        mask = mask.rotate(angle, resample=Image.BILINEAR)
        new = max(8, int(big * scale))
        body, mask = (
            body.resize((new, new), Image.BILINEAR),
            mask.resize((new, new), Image.BILINEAR),
        )
        canvas_b, canvas_m = Image.new("RGB", (big, big)), Image.new("L", (big, big), 0)
        off = (int((big - new) / 2 + shift[0]), int((big - new) / 2 + shift[1]))
        canvas_b.paste(body, off)
        canvas_m.paste(mask, off)
        body, mask = canvas_b, canvas_m
    background.paste(body, (0, 0), mask)
    img = background.resize((size, size), Image.LANCZOS)
    if variant:  # sensor noise
        arr = np.asarray(img).astype(np.int16)
        noise = (
            np.random.default_rng(rng.randint(0, 2**31)).normal(0, 8, arr.shape).astype(np.int16)
        )
        img = Image.fromarray(np.clip(arr + noise, 0, 255).astype(np.uint8))
    return img
