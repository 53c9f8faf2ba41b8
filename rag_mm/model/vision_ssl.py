"""Self-supervision of the reader's vision tower from the pictures alone (SimCLR).

Two random views of each picture are pulled together and pushed away from the other pictures of
the batch (NT-Xent, Chen et al. 2020). The views change what a thing's *form* does not depend on:
rotation, mirror image, size and place (one affine warp) and colour (a random permutation of the
channels, or grey), so what two views share, and what the tower must encode to match them, is the
form. A reader trained on question-answer pairs alone can instead tell its training pictures
apart by colour, size and place and memorise per picture what it was asked about them.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from rag_mm.data.pipeline import MEAN, STD

PROJECTION = 64  # SimCLR's projection width: the loss is computed there, the tower keeps the rest


def picture_views(
    images: torch.Tensor,
    *,
    scale: tuple[float, float] = (0.7, 1.2),
    max_shift: float = 0.15,
    grey: float = 0.2,
    rotate: float = 180.0,
    mirror: bool = True,
) -> torch.Tensor:
    """(N, 3, H, W) normalised pictures -> (N, 3, H, W) random views: a rotation up to ``rotate``
    degrees either way (180: any), a mirror image half the time (``mirror``), zoom ``scale`` (> 1
    enlarges), shift up to ``max_shift`` of the side (border pixels repeated), the colour channels
    permuted at random and, with probability ``grey``, grey."""
    N, dev, dt = images.shape[0], images.device, images.dtype
    mean, std = MEAN.to(dev, dt), STD.to(dev, dt)
    x = images * std + mean  # back to [0, 1] pixels: a channel permutation must keep white white
    u = lambda *s: torch.rand(*s, device=dev)  # noqa: E731  U[0, 1)
    angle = math.radians(rotate) * (2 * u(N) - 1)
    zoom = scale[0] + (scale[1] - scale[0]) * u(N)
    flip = torch.where(u(N) < (0.5 if mirror else 0.0), -1.0, 1.0)
    shift = (2 * u(N, 2) - 1) * 2 * max_shift  # affine_grid's coordinates span [-1, 1]
    cos, sin = torch.cos(angle) / zoom, torch.sin(angle) / zoom
    # (N, 2, 3)
    theta = torch.stack(
        [
            torch.stack([cos * flip, -sin, shift[:, 0]], 1),
            torch.stack([sin * flip, cos, shift[:, 1]], 1),
        ],
        1,
    )
    grid = F.affine_grid(theta.to(dt), list(x.shape), align_corners=False)
    x = F.grid_sample(x, grid, mode="bilinear", padding_mode="border", align_corners=False)
    perm = torch.rand(N, 3, device=dev).argsort(1)  # (N, 3) a channel order per picture
    x = x.gather(1, perm[:, :, None, None].expand_as(x))
    x = torch.where(u(N, 1, 1, 1) < grey, x.mean(1, keepdim=True).expand_as(x), x)
    return (x - mean) / std


def nt_xent(z: torch.Tensor, temperature: float) -> torch.Tensor:
    """SimCLR's loss over (2N, E) projections whose rows i and i + N are two views of one
    picture."""
    n = z.shape[0] // 2
    z = F.normalize(z, dim=-1)
    sim = z @ z.T / temperature  # (2N, 2N)
    sim = sim.masked_fill(torch.eye(2 * n, dtype=torch.bool, device=z.device), float("-inf"))
    target = torch.cat([torch.arange(n, 2 * n), torch.arange(n)]).to(z.device)
    return F.cross_entropy(sim, target)


# builds a phase's optimizer and learning-rate schedule over a module's parameters
# (rag_mm.components.vision_warmup.ssl_optimizer)
MakeOptimizer = Callable[
    [nn.Module], tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]
]


class SimCLR:
    """SimCLR on an open_clip tower (``tower(x) -> (pooled, patch tokens)``), trained in place one
    optimizer step per ``step`` call, each on two views of a batch of pictures (N, 3, H, W) viewed
    by ``picture_views`` (``rotate``, ``mirror``). ``make_optimizer`` builds the optimizer and its
    schedule over the tower and the projection MLP, which lives only here (its width is read from
    the tower's output on ``sample``). ``grad_sync`` averages the gradients over data-parallel
    ranks, so every rank takes the same step. The loop around it is the trainer's
    (``rag_mm.components.phases.run_phase``)."""

    def __init__(
        self,
        tower: nn.Module,
        sample: torch.Tensor,
        make_optimizer: MakeOptimizer,
        *,
        temperature: float = 0.2,
        grad_sync: Callable[[list[torch.Tensor]], None] | None = None,
        rotate: float = 180.0,
        mirror: bool = True,
    ) -> None:
        self.tower, self.temperature, self.grad_sync = tower, temperature, grad_sync
        self.rotate, self.mirror = rotate, mirror
        tower.train()
        dev = next(tower.parameters()).device
        with torch.no_grad():
            pooled, toks = tower(sample[:1].to(dev))
        width = pooled.shape[-1] + toks.shape[-1]
        self.head = nn.Sequential(
            nn.Linear(width, width // 2), nn.GELU(), nn.Linear(width // 2, PROJECTION)
        ).to(dev)
        self.params = [p for p in (*tower.parameters(), *self.head.parameters()) if p.requires_grad]
        self.opt, self.sched = make_optimizer(nn.ModuleDict({"tower": tower, "head": self.head}))

    def step(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One optimizer step on the batch ``x``; returns its detached (loss, gradient norm)."""
        views = [picture_views(x, rotate=self.rotate, mirror=self.mirror) for _ in range(2)]
        pooled, toks = self.tower(torch.cat(views))  # (2N, W), (2N, P, W)
        loss = nt_xent(self.head(torch.cat([pooled, toks.mean(1)], 1)), self.temperature)
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        if self.grad_sync is not None:
            self.grad_sync([p.grad for p in self.params if p.grad is not None])
        gnorm = torch.nn.utils.clip_grad_norm_(self.params, 1.0)
        self.opt.step()
        self.sched.step()
        return loss.detach(), gnorm.detach()
