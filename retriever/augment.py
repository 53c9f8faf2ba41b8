"""Pseudo-queries from the memory itself: random views of document pictures.

Contriever (Izacard et al. 2021) trains a retriever without labels by matching two random crops
of one document; SimCLR (Chen et al. 2020) does the same for pictures with random geometry and
colour. Here a random view of a document's picture is a query whose gold document is the
document: it teaches the towers the invariances a query needs on *every* document of the memory,
including those no training query mentions (held-out entities), which labelled queries cannot.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def random_views(images: torch.Tensor, generator: torch.Generator | None = None, *, max_rotation_deg: float = 15.0,
                 scale: tuple[float, float] = (0.75, 1.1), max_shift: float = 0.12, colour: float = 0.25,
                 noise: float = 0.1) -> torch.Tensor:
    """(N, 3, H, W) normalised pictures -> (N, 3, H, W) random views: rotation, zoom and shift
    (one affine warp, border pixels repeated), per-channel brightness and Gaussian noise, all in
    the normalised space (std units)."""
    N, dev = images.shape[0], images.device
    # drawn on the pictures' device (copying host draws to an accelerator waits for it every call);
    # a given generator draws on its own device, as the same stream wherever the pictures are
    gen_dev = dev if generator is None else generator.device
    u = lambda *s: torch.rand(*s, generator=generator, device=gen_dev).to(dev)  # noqa: E731  U[0, 1)
    angle = (2 * u(N) - 1) * math.radians(max_rotation_deg)
    zoom = scale[0] + (scale[1] - scale[0]) * u(N)  # > 1 enlarges the content
    shift = (2 * u(N, 2) - 1) * 2 * max_shift  # affine_grid's coordinates span [-1, 1]
    cos, sin = torch.cos(angle) / zoom, torch.sin(angle) / zoom
    theta = torch.stack([torch.stack([cos, -sin, shift[:, 0]], 1), torch.stack([sin, cos, shift[:, 1]], 1)], 1)  # (N, 2, 3)
    grid = F.affine_grid(theta.to(images.dtype), list(images.shape), align_corners=False)
    out = F.grid_sample(images, grid, mode="bilinear", padding_mode="border", align_corners=False)
    out = out + colour * (2 * u(N, 3, 1, 1) - 1)
    return out + noise * torch.randn(out.shape, generator=generator, device=gen_dev).to(dev)
