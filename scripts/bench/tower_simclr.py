"""Does self-supervised pretraining on the pictures alone give the reader's vision tower the
features a VQA data set asks about? SimCLR (two augmented views of each training picture, NT-Xent)
on the training split's pictures, then a linear probe of an asked-for attribute on frozen features
of the validation split, for the freshly initialised and the pretrained tower.

    python scripts/bench/tower_simclr.py runs/vqa --steps 600 --answers circle,rectangle,triangle

``RUN`` is a run directory (its saved config names the data and the reader's tower). Views:
``retriever.augment.picture_views`` (random affine: rotation, flip, scale, shift; a random colour
permutation and greyscale), so what two views of one picture share is the thing's form. The probe
is the one of ``tower_contrastive.py``. Prints JSON lines: the loss every 50 steps, then one probe
result per tower (and ``--save`` writes the pretrained tower's state dict, which
``model.vision_checkpoint`` loads).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch
import torch.nn as nn

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from tower_contrastive import probe  # noqa: E402

from rag_mm.build import make_stream  # noqa: E402
from rag_mm.evaluate import load_config  # noqa: E402
from rag_mm.model.reader import build_vision_tower  # noqa: E402
from rag_mm.model.vision_ssl import nt_xent, picture_views  # noqa: E402


def pretrain(cfg, steps: int, lr: float, temperature: float) -> nn.Module:
    tower = build_vision_tower(cfg.model)
    w = cfg.model.vision_width
    head = nn.Sequential(nn.Linear(2 * w, w), nn.GELU(), nn.Linear(w, 64))  # SimCLR's projection MLP
    params = [*tower.parameters(), *head.parameters()]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.05)
    step, avg, t0 = 0, None, time.time()
    while step < steps:
        for b in make_stream(cfg, "train", True):
            for g in opt.param_groups:  # 50 warm-up steps, then cosine to a tenth
                g["lr"] = lr * min(1.0, (step + 1) / 50) * (0.1 + 0.45 * (1 + math.cos(math.pi * step / steps)))
            views = torch.cat([picture_views(b["image"]), picture_views(b["image"])])  # (2B, 3, H, W)
            pooled, toks = tower(views)
            z = head(torch.cat([pooled, toks.mean(1)], 1))
            loss = nt_xent(z, temperature)
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            avg = loss.item() if avg is None else 0.9 * avg + 0.1 * loss.item()
            step += 1
            if step % 50 == 0:
                print(json.dumps({"step": step, "loss": round(avg, 4), "seconds": round(time.time() - t0, 1)}), flush=True)
            if step >= steps:
                break
    return tower


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("run", type=Path)
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=0.2)
    ap.add_argument("--answers", default="circle,rectangle,triangle", help="the attribute's answers, comma-separated")
    ap.add_argument("--probe-limit", type=int, default=1500)
    ap.add_argument("--save", type=Path, default=None, help="write the pretrained tower's state dict here")
    ap.add_argument("overrides", nargs="*", help="config overrides, e.g. model.vision_layers=4")
    args = ap.parse_args()
    cfg = load_config(args.run, [f"data.batch_size={args.batch}", *args.overrides])
    answers = args.answers.split(",")
    torch.manual_seed(0)
    print(json.dumps({"tower": "init", **probe(cfg, build_vision_tower(cfg.model), answers, args.probe_limit)}), flush=True)
    torch.manual_seed(0)
    tower = pretrain(cfg, args.steps, args.lr, args.temperature)
    print(json.dumps({"tower": f"simclr {args.steps} steps", **probe(cfg, tower, answers, args.probe_limit)}), flush=True)
    if args.save:
        torch.save(tower.state_dict(), args.save)


if __name__ == "__main__":
    main()
