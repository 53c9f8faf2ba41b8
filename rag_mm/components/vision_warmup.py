"""The vision tower's self-supervised warm-up (``model.vision_ssl_steps``): SimCLR on the training
split's pictures before the reader trains, run on the plain reader before it is spread over the
ranks. Every rank trains on its own share of the pictures and averages the gradients (all-reduce),
so from the same initial tower (the run's seed) every rank takes the same steps and the copies stay
equal to the bit. Not checkpointed: it runs on a fresh start only (a resumed run restores the
tower)."""

from __future__ import annotations

import copy
import itertools
import logging
from collections.abc import Iterator

import torch
import torch.distributed as dist
import torch.nn as nn

from parallel.collectives import all_reduce_mean_, flat_collective
from rag_mm.build import make_stream
from rag_mm.components import checkpoint
from rag_mm.components.optim import build_optimizer, build_scheduler
from rag_mm.components.phases import Phase, StepSums, run_phase
from rag_mm.config import OptimConfig, TrainConfig
from rag_mm.model.vision_ssl import MakeOptimizer, SimCLR

log = logging.getLogger(__name__)

# SimCLR's schedule and decay, its own and not the joint phase's: 50 warm-up steps, cosine to a
# tenth of the peak, and the heavier weight decay of self-supervised pretraining
SSL_WARMUP_STEPS = 50
SSL_MIN_LR_RATIO = 0.1
SSL_WEIGHT_DECAY = 0.05


def ssl_optimizer(optim_cfg: OptimConfig, lr: float, steps: int) -> MakeOptimizer:
    """The vision warm-up's optimizer and schedule (``SimCLR``'s ``make_optimizer``):
    the run's AdamW (``optim``: betas, eps; decay on matrices only) at the phase's peak ``lr``,
    warm-up then cosine over its ``steps``."""

    def make(module: nn.Module):
        opt = build_optimizer(module, optim_cfg, lr=lr, weight_decay=SSL_WEIGHT_DECAY)
        return opt, build_scheduler(
            opt, optim_cfg, steps, warmup_steps=SSL_WARMUP_STEPS, min_ratio=SSL_MIN_LR_RATIO
        )

    return make


def starts_fresh(cfg: TrainConfig, ckpt_dir) -> bool:
    """Whether ``restore`` will find nothing to resume from (``resume``: never | auto | a path)."""
    return cfg.resume == "never" or (
        cfg.resume == "auto" and checkpoint.latest_valid(ckpt_dir) is None
    )


def _pictures(
    cfg: TrainConfig, rank: int, world: int, device: torch.device
) -> Iterator[torch.Tensor]:
    """This rank's training pictures, ``model.vision_ssl_batch`` at a time (0: ``data.batch_size``),
    epoch after epoch."""
    if cfg.model.vision_ssl_batch:
        cfg = copy.deepcopy(cfg)
        cfg.data.batch_size = cfg.model.vision_ssl_batch
    while True:
        n = 0
        for b in make_stream(
            cfg, "train", True, rank=rank, world_size=world, balance=False, device=device
        ):
            n += 1
            yield b["image"].to(device, non_blocking=True)
        if n == 0:
            raise RuntimeError("the vision warm-up read no training batch")


def _mean_over_ranks(grads: list[torch.Tensor]) -> None:
    # one all-reduce for the whole tower, as every flat all-reduce of the runtime and the app
    flat_collective(grads, all_reduce_mean_)


def vision_phase(
    cfg: TrainConfig, tower: nn.Module, rank: int, world: int, device: torch.device
) -> Phase:
    """The warm-up as a phase (``run_phase``): ``model.vision_ssl_steps`` SimCLR steps on
    ``tower`` in place, at ``model.vision_ssl_lr``, each rank on its own share of the training
    pictures, gradients averaged over the ranks."""
    steps, lr = cfg.model.vision_ssl_steps, cfg.model.vision_ssl_lr
    distributed = dist.is_initialized() and world > 1
    pictures = _pictures(cfg, rank, world, device)
    first = next(pictures)
    simclr = SimCLR(
        tower,
        first,
        ssl_optimizer(cfg.optim, lr, steps),
        grad_sync=_mean_over_ranks if distributed else None,
        rotate=cfg.model.vision_ssl_rotate,
        mirror=cfg.model.vision_ssl_mirror,
    )
    batches = itertools.chain([first], pictures)

    def step(i: int) -> StepSums:
        loss, gnorm = simclr.step(next(batches))
        return StepSums(loss=loss, grad_norm=gnorm)

    def after(i: int, done: StepSums, logged: dict | None) -> bool:
        if logged is not None:
            log.info("vision warm-up %d/%d: SimCLR loss %.3f", i, steps, logged["loss"])
        return False

    batch = cfg.model.vision_ssl_batch or cfg.data.batch_size
    log.info(
        "vision warm-up: %d SimCLR steps on the training pictures at lr %g, batch %d x 2 views%s",
        steps,
        lr,
        batch,
        f" per rank over {world} ranks" if distributed else "",
    )
    return Phase("vision_warmup", steps, step, samples_per_step=batch * world, after=after)


def _mean_loss(t: torch.Tensor) -> torch.Tensor:
    if dist.is_initialized() and dist.get_world_size() > 1:
        all_reduce_mean_(t)
    return t


def warm_up_vision(
    cfg, tower: nn.Module, rank: int, world: int, device: torch.device
) -> list[dict]:
    """The warm-up run on its own (``vision_phase`` through ``run_phase``), outside a trainer;
    returns its log records."""
    records: list[dict] = []
    run_phase(
        vision_phase(cfg, tower, rank, world, device),
        cfg.log_every,
        records.append,
        _mean_loss,
    )
    return records
