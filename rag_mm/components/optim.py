"""AdamW with decoupled weight decay on matrices only, and warm-up + cosine learning rate: the one
optimizer and schedule of every training phase (the vision warm-up, the retriever warm-up, joint
training), each phase passing its own rate where it has one."""

from __future__ import annotations

import math

import torch

from rag_mm.config import OptimConfig


def is_vision_tower(name: str) -> bool:
    """Whether parameter ``name`` (as ``named_parameters`` gives it, wrappers' prefixes included)
    belongs to the reader's vision tower (``ReaderBase.picture_tower``): the open_clip module
    ``vision`` of the native and ``hf`` readers, a transformers VLM's ``vision_tower``."""
    return name.startswith("vision.") or ".vision." in name or ".vision_tower." in name


def build_optimizer(
    model: torch.nn.Module,
    cfg: OptimConfig,
    lr: float | None = None,
    weight_decay: float | None = None,
) -> torch.optim.Optimizer:
    """AdamW over ``model``'s trainable parameters: matrices decayed, norms, biases and embeddings
    not; the vision tower's groups at ``cfg.vision_lr_scale`` times the rate (the scheduler scales
    every group's own base rate). ``cfg``: the run's ``optim``; ``lr`` and ``weight_decay``, when
    given, replace its peak rate and decay (a warm-up phase's own)."""
    lr = cfg.lr if lr is None else lr
    weight_decay = cfg.weight_decay if weight_decay is None else weight_decay
    # (decayed, scaled) -> parameters; the first two groups always, in the order checkpoints hold
    # them
    groups: dict[tuple[bool, bool], list] = {(True, False): [], (False, False): []}
    seen = set()
    for name, p in model.named_parameters():
        if not p.requires_grad or id(p) in seen:  # tied weights appear once
            continue
        seen.add(id(p))
        # norms, biases and embeddings are not decayed (GPT-2 / nanoGPT convention)
        decayed = not (
            p.dim() < 2
            or "emb" in name.split(".")[-2:][0]
            or name.endswith(("class_embedding", "positional_embedding"))
        )
        scaled = cfg.vision_lr_scale != 1 and is_vision_tower(name)
        groups.setdefault((decayed, scaled), []).append(p)
    params = [p for ps in groups.values() for p in ps]
    param_groups = [
        {
            "params": ps,
            "weight_decay": weight_decay if decayed else 0.0,
            "lr": lr * (cfg.vision_lr_scale if scaled else 1.0),
        }
        for (decayed, scaled), ps in groups.items()
    ]
    # fused on CUDA (torchtitan's default): one kernel per update, and it skips itself on a
    # device-side non-finite flag without a host sync (rag_mm.components.nonfinite); the CPU keeps
    # torch's default
    fused = True if params and all(p.is_cuda for p in params) else None
    return torch.optim.AdamW(
        param_groups, lr=lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, fused=fused
    )


def lr_factor(step: int, warmup: int, total: int, min_ratio: float) -> float:
    """Multiplier of the peak lr at ``step``: linear warm-up, then cosine down to ``min_ratio``."""
    if warmup > 0 and step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def build_scheduler(
    opt: torch.optim.Optimizer,
    cfg: OptimConfig,
    total_steps: int,
    warmup_steps: int | None = None,
    min_ratio: float | None = None,
) -> torch.optim.lr_scheduler.LambdaLR:
    """``lr_factor`` over ``total_steps`` with ``cfg``'s warm-up and floor (``optim``), or a
    phase's own ``warmup_steps`` / ``min_ratio``."""
    warmup = cfg.warmup_steps if warmup_steps is None else warmup_steps
    floor = cfg.min_lr_ratio if min_ratio is None else min_ratio
    return torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: lr_factor(s, warmup, total_steps, floor)
    )
