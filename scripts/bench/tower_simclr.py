"""Does self-supervised pretraining on the pictures alone give the reader's vision tower the
features a VQA data set asks about? SimCLR (two augmented views of each training picture, NT-Xent;
``rag_mm.components.vision_warmup``, the trainer's vision warm-up) on the training split's
pictures, then a linear probe of an asked-for attribute on frozen features of the validation split,
for the freshly initialised and the pretrained tower.

    python scripts/bench/tower_simclr.py runs/vqa --steps 600 --answers circle,rectangle,triangle

``RUN`` is a run directory (its saved config names the data and the reader's tower). Views:
``rag_mm.model.vision_ssl.picture_views`` (random affine: rotation, flip, scale, shift; a random
colour permutation and greyscale), so what two views of one picture share is the thing's form. The
probe is the one of ``tower_contrastive.py``. Prints JSON lines: the loss every ``log_every``
steps, then one probe result per tower (and ``--save`` writes the pretrained tower's state
dict, which ``model.vision_checkpoint`` loads).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn as nn

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from tower_contrastive import probe  # noqa: E402

from rag_mm.components.vision_warmup import warm_up_vision  # noqa: E402
from rag_mm.evaluate import load_config  # noqa: E402
from rag_mm.model.reader import build_vision_tower  # noqa: E402


def pretrain(cfg, steps: int, lr: float) -> nn.Module:
    """The recipe's tower after ``steps`` of the vision warm-up the trainer runs
    (``vision_phase``, through the trainer's phase loop)."""
    tower = build_vision_tower(cfg.model)
    cfg.model.vision_ssl_steps, cfg.model.vision_ssl_lr = steps, lr
    cfg.model.vision_ssl_batch = cfg.data.batch_size  # --batch
    t0 = time.time()
    for rec in warm_up_vision(cfg, tower, 0, 1, torch.device("cpu")):
        print(json.dumps({"step": rec["step"], "loss": round(rec["loss"], 4)}), flush=True)
    print(json.dumps({"simclr_seconds": round(time.time() - t0, 1)}), flush=True)
    return tower


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("run", type=Path)
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument(
        "--answers",
        default="circle,rectangle,triangle",
        help="the attribute's answers, comma-separated",
    )
    ap.add_argument("--probe-limit", type=int, default=1500)
    ap.add_argument(
        "--save", type=Path, default=None, help="write the pretrained tower's state dict here"
    )
    ap.add_argument("overrides", nargs="*", help="config overrides, e.g. model.vision_layers=4")
    args = ap.parse_args()
    cfg = load_config(args.run, [f"data.batch_size={args.batch}", *args.overrides])
    answers = args.answers.split(",")
    torch.manual_seed(0)
    print(
        json.dumps(
            {
                "tower": "init",
                **probe(cfg, build_vision_tower(cfg.model), answers, args.probe_limit),
            }
        ),
        flush=True,
    )
    torch.manual_seed(0)
    tower = pretrain(cfg, args.steps, args.lr)
    print(
        json.dumps(
            {"tower": f"simclr {args.steps} steps", **probe(cfg, tower, answers, args.probe_limit)}
        ),
        flush=True,
    )
    if args.save:
        torch.save(tower.state_dict(), args.save)


if __name__ == "__main__":
    main()
