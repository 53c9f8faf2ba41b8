"""Pseudo-queries from the memory itself: random views of document pictures.

Contriever (Izacard et al. 2021) trains a retriever without labels by matching two random crops
of one document; SimCLR (Chen et al. 2020) does the same for pictures with random geometry and
colour. Here a random view of a document's picture is a query whose gold document is the
document: it teaches the towers the invariances a query needs on *every* document of the memory,
including those no training query mentions (held-out entities), which labelled queries cannot.
"""

from __future__ import annotations

import io
import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image


def random_views(
    images: torch.Tensor,
    generator: torch.Generator | None = None,
    *,
    max_rotation_deg: float = 15.0,
    scale: tuple[float, float] = (0.75, 1.1),
    max_shift: float = 0.12,
    colour: float = 0.25,
    noise: float = 0.1,
) -> torch.Tensor:
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
    # (N, 2, 3)
    theta = torch.stack(
        [torch.stack([cos, -sin, shift[:, 0]], 1), torch.stack([sin, cos, shift[:, 1]], 1)], 1
    )
    grid = F.affine_grid(theta.to(images.dtype), list(images.shape), align_corners=False)
    out = F.grid_sample(images, grid, mode="bilinear", padding_mode="border", align_corners=False)
    out = out + colour * (2 * u(N, 3, 1, 1) - 1)
    return out + noise * torch.randn(out.shape, generator=generator, device=gen_dev).to(dev)


@dataclass(frozen=True)
class ViewStyle:
    """How far a pseudo-query strays from its document's picture (``retriever.pseudo_view``)."""

    max_rotation_deg: float  # turn, either way
    scale: tuple[float, float]  # zoom range; < 1 shrinks the content inside the frame
    max_shift: float  # offset, as a fraction of the side
    colour: float  # per-channel brightness change, std units
    noise: float  # Gaussian pixel noise, std units
    background: float  # probability of putting the content on a random textured background
    blur: float  # largest Gaussian blur sigma, pixels


VIEW_STYLES = {
    # small pose and colour changes: queries that are renderings of the memory's own pictures
    "jitter": ViewStyle(15.0, (0.75, 1.1), 0.12, 0.25, 0.1, 0.0, 0.0),
    # photo-like: the object smaller and turned on a busy background, blurred, as a photo of the
    # thing looks next to a clean reference picture (InfoSeek / Encyclopedic-VQA queries)
    "photo": ViewStyle(25.0, (0.55, 1.0), 0.2, 0.3, 0.1, 0.9, 1.0),
}


def _smooth_texture(N: int, H: int, W: int, u, randn) -> torch.Tensor:
    """(N, 3, H, W) random backgrounds in std units: a colour gradient plus low-frequency blotches
    and a little grain."""
    a, b = 2 * u(N, 3, 1, 1) - 1, 2 * u(N, 3, 1, 1) - 1  # end colours, about +-1 std
    t = torch.linspace(0, 1, H, device=a.device).view(1, 1, H, 1).expand(N, 1, H, W)
    blotch = F.interpolate(
        randn(N, 3, 4, 4) * 0.5, size=(H, W), mode="bilinear", align_corners=False
    )
    return a + (b - a) * t + blotch + 0.1 * randn(N, 3, H, W)


def _blur(x: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
    """(N, C, H, W) blurred by a separable Gaussian of per-picture ``sigma`` (N,) pixels (5
    taps)."""
    taps = torch.arange(-2, 3, device=x.device, dtype=x.dtype)  # (5,)
    w = torch.exp(-0.5 * (taps[None] / sigma.clamp_min(1e-3)[:, None].to(x.dtype)) ** 2)  # (N, 5)
    w = w / w.sum(1, keepdim=True)
    N, C, H, W = x.shape
    y = x.reshape(1, N * C, H, W)
    k = w.repeat_interleave(C, 0)  # (N*C, 5): one kernel per picture, shared by its channels
    y = F.conv2d(F.pad(y, (2, 2, 0, 0), mode="replicate"), k[:, None, None, :], groups=N * C)
    y = F.conv2d(F.pad(y, (0, 0, 2, 2), mode="replicate"), k[:, None, :, None], groups=N * C)
    return y.view(N, C, H, W)


def photo_views(
    images: torch.Tensor, style: ViewStyle, generator: torch.Generator | None = None
) -> torch.Tensor:
    """(N, 3, H, W) normalised memory pictures -> (N, 3, H, W) views in ``style``: the warp of
    ``random_views``, then (with probability ``style.background``) the plain background swapped
    for a random texture, then a blur. The background is what matches the picture's border
    colour (the median of its outermost pixels, within 0.35 std) and connects to the frame:
    memory pictures show one thing on a plain ground, as reference pictures (a knowledge base's, a
    catalogue's) do."""
    N, dev = images.shape[0], images.device
    gen_dev = dev if generator is None else generator.device
    u = lambda *s: torch.rand(*s, generator=generator, device=gen_dev).to(dev)  # noqa: E731
    randn = lambda *s: torch.randn(*s, generator=generator, device=gen_dev).to(dev)  # noqa: E731
    H, W = images.shape[-2:]
    out = random_views(
        images,
        generator,
        max_rotation_deg=style.max_rotation_deg,
        scale=style.scale,
        max_shift=style.max_shift,
        colour=0.0,
        noise=0.0,
    )
    if style.background > 0:
        ring = torch.cat(
            [images[..., 0, :], images[..., -1, :], images[..., :, 0], images[..., :, -1]], -1
        )
        # (N, 3, 1, 1) the plain background's colour
        ground = ring.median(-1).values[..., None, None]
        # the warp repeats border pixels, so a shrunken picture is framed by its background colour
        near = ((out - ground).abs().amax(1, keepdim=True) < 0.35).to(out.dtype)  # (N, 1, H, W)
        # the ground is what of it connects to the frame (a white heart inside a white-framed
        # picture stays): grow the frame's near pixels through near pixels, 2 px per round
        edge = torch.ones_like(near)
        edge[..., 1:-1, 1:-1].zero_()  # an in-place fill: no host scalar copied in
        is_ground = near * edge
        for _ in range((max(H, W) + 3) // 4):
            is_ground = F.max_pool2d(is_ground, 5, stride=1, padding=2) * near
        is_ground = is_ground * (u(N, 1, 1, 1) < style.background).to(out.dtype)
        out = out * (1 - is_ground) + _smooth_texture(N, H, W, u, randn).to(out.dtype) * is_ground
    if style.blur > 0:
        out = _blur(out, style.blur * u(N))
    out = out + style.colour * (2 * u(N, 3, 1, 1) - 1)
    return out + style.noise * randn(*out.shape).to(out.dtype)


def random_tone(
    images: torch.Tensor,
    amount: float,
    generator: torch.Generator | None = None,
    knots: int = 5,
) -> torch.Tensor:
    """(N, 3, H, W) normalised pictures -> each channel of each picture through its own random
    tone curve (a colour-curves augmentation): a value v becomes v + c(v), c the piecewise-linear
    interpolation of ``knots`` offsets drawn in [-amount, amount] (std units) at levels spread
    evenly over [-2, 2] std. Unlike a brightness shift, the colours of one picture move each on
    its own (red and orange differ in green, so their green moves by different amounts), as when
    a picture's colours are each redrawn a little off (another print, another camera's colour
    response, a renderer that jitters every colour)."""
    N, C = images.shape[:2]
    dev = images.device
    gen_dev = dev if generator is None else generator.device
    offsets = (
        2 * torch.rand(N, C, knots, generator=generator, device=gen_dev).to(dev) - 1
    ) * amount
    pos = (images.clamp(-2.0, 2.0) + 2.0) / 4.0 * (knots - 1)  # (N, C, H, W) in knot units
    lo = pos.floor().clamp(max=knots - 2)
    frac = pos - lo  # (N, C, H, W) in [0, 1]
    lo = lo.long().flatten(2)  # (N, C, H*W)
    at_lo = offsets.gather(2, lo).view_as(images)
    at_hi = offsets.gather(2, lo + 1).view_as(images)
    return images + (at_lo + (at_hi - at_lo) * frac).to(images.dtype)


def random_restyle(
    images: torch.Tensor, share: float, generator: torch.Generator | None = None
) -> torch.Tensor:
    """(N, 3, H, W) normalised pictures -> (N, 3, H, W) with a ``share`` of them redrawn in a
    random style: RandConv (Xu et al., ICLR 2021). Each chosen picture goes through its own random
    k x k convolution (k in 1, 3, 5, 7; He-scaled normal weights, colours mixed), is brought back
    to its own per-channel mean and spread, and is blended with itself by a random weight. Stroke,
    texture and colour change; where the shapes are stays. Another artist's drawing of the same
    thing differs in those, which pose, background and blur (``photo_views``) do not teach."""
    N, C, H, W = images.shape
    dev = images.device
    gen_dev = dev if generator is None else generator.device
    u = lambda *s: torch.rand(*s, generator=generator, device=gen_dev).to(dev)  # noqa: E731
    K = 7  # largest kernel; a smaller one sits zero-padded in its centre (the same convolution)
    k = 2 * torch.randint(0, 4, (N,), generator=generator, device=gen_dev).to(dev) + 1  # (N,)
    w = torch.randn(N, C, C, K, K, generator=generator, device=gen_dev).to(dev, images.dtype)
    r = torch.arange(K, device=dev) - K // 2  # (K,) tap offsets
    inside = (r.abs()[None] <= (k[:, None] // 2)).to(images.dtype)  # (N, K)
    w = w * (inside[:, None, None, :, None] * inside[:, None, None, None, :])
    w = w / (C * k.to(images.dtype) ** 2).sqrt()[:, None, None, None, None]
    # one grouped convolution: picture n's C output channels read its own C input channels
    y = F.conv2d(
        images.reshape(1, N * C, H, W), w.reshape(N * C, C, K, K), padding=K // 2, groups=N
    )
    y = y.view(N, C, H, W)
    mu, sd = images.mean((2, 3), keepdim=True), images.std((2, 3), keepdim=True)
    y = (y - y.mean((2, 3), keepdim=True)) / (y.std((2, 3), keepdim=True) + 1e-6) * sd + mu
    alpha = u(N, 1, 1, 1)  # how much of the picture's own look stays
    y = alpha * images + (1 - alpha) * y
    pick = (u(N) < share)[:, None, None, None]
    return torch.where(pick, y, images)


# libjpeg quality of a compressed view: the range web photos and phone uploads are saved at
JPEG_QUALITY = (30, 80)


def random_jpeg(
    images: torch.Tensor,
    share: float,
    mean: torch.Tensor,
    std: torch.Tensor,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """(N, 3, H, W) normalised pictures (``mean``, ``std``: (3, 1, 1), the pipeline's) -> (N, 3,
    H, W) with a ``share`` of them saved as a JPEG at a random quality in ``JPEG_QUALITY`` and
    read back. A photo reaches the query side compressed: its colours are kept at half the
    resolution (4:2:0), its 8 x 8 blocks lose fine detail, edges ring. A small emblem or a thin
    band of colour is what that blurs, and blur alone does not teach it.

    The codec is Pillow's (libjpeg, 4:2:0), one picture at a time on the host: a JPEG has no
    batched, differentiable form that matches what a photo went through, and the views carry no
    gradient. On an accelerator the chosen views make a round trip to the host."""
    N, dev = images.shape[0], images.device
    gen_dev = dev if generator is None else generator.device
    pick = torch.rand(N, generator=generator, device=gen_dev) < share
    lo, hi = JPEG_QUALITY
    quality = torch.randint(lo, hi + 1, (N,), generator=generator, device=gen_dev)
    rows = pick.nonzero().flatten().tolist()
    if not rows:
        return images
    m, s = mean.to(dev, images.dtype), std.to(dev, images.dtype)
    # (n, H, W, 3) bytes, as a picture file holds them
    u8 = ((images[rows] * s + m).clamp(0, 1) * 255).round().to(torch.uint8).permute(0, 2, 3, 1)
    back = torch.from_numpy(
        np.stack([_jpeg_round_trip(x, q) for x, q in zip(u8.cpu().numpy(), quality[rows].tolist())])
    ).permute(0, 3, 1, 2)
    out = images.clone()
    out[rows] = (back.to(dev, images.dtype) / 255 - m) / s
    return out


def _jpeg_round_trip(pixels: np.ndarray, quality: int) -> np.ndarray:
    """(H, W, 3) uint8 -> the same saved as a JPEG at ``quality`` and decoded."""
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="JPEG", quality=quality)
    return np.asarray(Image.open(buf).convert("RGB"))


# at amount 1: the largest stretch of one side against the other (a picture seen at a slant, a
# flag drawn wider or squarer), the largest displacement of the smooth warp (grid units: the side
# spans 2, so 0.08 moves a pixel up to 4 % of the side) and the largest change of the light
# (std units)
SURFACE_ASPECT = 1.3
SURFACE_WARP = 0.08
SURFACE_SHADE = 0.5
SURFACE_KNOTS = 4  # control points per side of the warp and the light: a wave or two, no crumple


def random_surface(
    images: torch.Tensor, amount: float, generator: torch.Generator | None = None
) -> torch.Tensor:
    """(N, 3, H, W) normalised pictures -> (N, 3, H, W) as if printed on a surface that is not
    flat and not lit evenly: one side stretched against the other (log-uniform up to
    ``SURFACE_ASPECT ** amount``), a smooth random displacement (a ``SURFACE_KNOTS`` square grid
    of offsets up to ``SURFACE_WARP * amount``, interpolated bicubically: a wave, a bend) and a
    smooth random light (offsets up to ``SURFACE_SHADE * amount`` std on the same kind of grid,
    alike in every channel: shading is not a colour). A flag waving in the wind, a bent page, a
    sign on a curved wall; another artist drawing the same flag with another wave and another
    sheen. The affine and photo views (``photo_views``) move the picture rigidly and light it
    evenly, which teaches neither. Border pixels are repeated at the edges."""
    N, C, H, W = images.shape
    if amount <= 0:
        return images
    dev, dt = images.device, images.dtype
    gen_dev = dev if generator is None else generator.device
    u = lambda *s: torch.rand(*s, generator=generator, device=gen_dev).to(dev, dt)  # noqa: E731
    K = SURFACE_KNOTS
    # (N, 2) x and y scales: one side against the other, the area kept
    log_aspect = (2 * u(N) - 1) * amount * math.log(SURFACE_ASPECT)
    scale = torch.stack([torch.exp(-log_aspect / 2), torch.exp(log_aspect / 2)], 1)
    eye = torch.zeros(N, 2, 3, device=dev, dtype=dt)
    eye[:, 0, 0], eye[:, 1, 1] = scale[:, 0], scale[:, 1]
    grid = F.affine_grid(eye, [N, C, H, W], align_corners=False)  # (N, H, W, 2)
    knots = (2 * u(N, 2, K, K) - 1) * (SURFACE_WARP * amount)
    offset = F.interpolate(knots, size=(H, W), mode="bicubic", align_corners=True)
    grid = grid + offset.permute(0, 2, 3, 1)
    out = F.grid_sample(images, grid, mode="bilinear", padding_mode="border", align_corners=False)
    light = (2 * u(N, 1, K, K) - 1) * (SURFACE_SHADE * amount)
    return out + F.interpolate(light, size=(H, W), mode="bicubic", align_corners=True)
