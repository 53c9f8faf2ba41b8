"""Does contrastive pretraining give the reader's vision tower the features a VQA data set asks
about? CLIP-style training of the tower on (picture, question + answer) pairs of the training
split, then a linear probe of each asked-for attribute on frozen features of the validation split.

    python scripts/bench/tower_contrastive.py runs/vqa --steps 600 \\
        --answers circle,rectangle,triangle

``RUN`` is a run directory (its saved config names the data and the reader's tower). The tower is
the reader's (``rag_mm.model.reader.build_vision_tower``); the text side is a small open_clip text
transformer over the question followed by its answer. Pairs whose texts are equal are all
positives of each other (``retriever.losses.contrastive``'s multi-positive targets): many
questions share a text. The probe is ridge regression to the answer's one-hot over the tower's
pooled and mean patch features, fit on 70% of the validation questions whose answer is one of
``--answers`` and scored on the rest, for the freshly initialised tower and the trained one.
Prints JSON lines: the training loss every 50 steps, then one probe result per tower.
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
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from open_clip.transformer import TextTransformer  # noqa: E402

from rag_mm.build import make_stream  # noqa: E402
from rag_mm.evaluate import load_config  # noqa: E402
from rag_mm.model.reader import build_vision_tower  # noqa: E402
from retriever.encoders import clip_tokens  # noqa: E402
from retriever.losses import contrastive  # noqa: E402

EMBED = 128  # joint embedding width of the picture and text sides
CONTEXT = 32  # text tokens: an easy question plus its answer fit
RIDGE = 10.0  # probe's L2 penalty on standardised features


def qa_tokens(b: dict, text_ids: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """open_clip tokens of each question followed by its answer (no EOT), and an id per distinct
    text."""
    rows = [
        torch.cat([b["q_ids"][i, : b["q_len"][i]], b["a_ids"][i, : b["a_len"][i] - 1]])
        for i in range(len(b["q_len"]))
    ]
    lens = torch.tensor([len(r) for r in rows])
    ids = torch.zeros(len(rows), int(lens.max()), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = r
    tid = torch.tensor([text_ids.setdefault(tuple(r.tolist()), len(text_ids)) for r in rows])
    return clip_tokens(ids, lens, CONTEXT), tid


def pretrain(cfg, steps: int, lr: float) -> nn.Module:
    tower = build_vision_tower(cfg.model)
    head = nn.Linear(cfg.model.vision_width, EMBED)
    text = TextTransformer(
        context_length=CONTEXT, vocab_size=49408, width=128, heads=4, layers=2, output_dim=EMBED
    )
    scale = nn.Parameter(torch.tensor(math.log(1 / 0.07)))  # CLIP's initial temperature
    params = [*tower.parameters(), *head.parameters(), *text.parameters(), scale]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.05)
    text_ids: dict = {}
    step, avg, t0 = 0, None, time.time()
    while step < steps:
        for b in make_stream(cfg, "train", True):
            for g in opt.param_groups:  # 100 warm-up steps, then cosine to a tenth
                g["lr"] = (
                    lr
                    * min(1.0, (step + 1) / 100)
                    * (0.1 + 0.45 * (1 + math.cos(math.pi * step / steps)))
                )
            tok, tid = qa_tokens(b, text_ids)
            pooled, _ = tower(b["image"])
            loss = contrastive(
                F.normalize(head(pooled), dim=-1),
                F.normalize(text(tok), dim=-1),
                tid,
                scale.clamp(max=math.log(100)).exp(),
            )
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            avg = loss.item() if avg is None else 0.9 * avg + 0.1 * loss.item()
            step += 1
            if step % 50 == 0:
                print(
                    json.dumps(
                        {
                            "step": step,
                            "loss": round(avg, 4),
                            "seconds": round(time.time() - t0, 1),
                            "distinct_texts": len(text_ids),
                        }
                    ),
                    flush=True,
                )
            if step >= steps:
                break
    return tower


@torch.no_grad()
def probe(cfg, tower: nn.Module, answers: list[str], limit: int) -> dict:
    tower.eval()
    feats, labels = [], []
    for b in make_stream(cfg, "val", False):
        keep = [i for i, a in enumerate(b["answer"]) if a in answers]
        if keep:
            pooled, toks = tower(b["image"][keep])
            feats.append(torch.cat([pooled, toks.mean(1)], 1))
            labels += [answers.index(b["answer"][i]) for i in keep]
        if len(labels) >= limit:
            break
    X, y = torch.cat(feats), torch.tensor(labels)
    n = int(0.7 * len(y))
    Z = (X - X[:n].mean(0)) / (X[:n].std(0) + 1e-6)
    Z = torch.cat([Z, torch.ones(len(Z), 1)], 1)
    T = F.one_hot(y, len(answers)).float()
    W = torch.linalg.solve(Z[:n].T @ Z[:n] + RIDGE * torch.eye(Z.shape[1]), Z[:n].T @ T[:n])
    majority = torch.bincount(y[n:], minlength=len(answers)).max().item() / (len(y) - n)
    return {
        "n": len(y),
        "probe_acc": round((Z[n:] @ W).argmax(1).eq(y[n:]).float().mean().item(), 3),
        "majority": round(majority, 3),
    }


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
    args = ap.parse_args()
    cfg = load_config(args.run, [f"data.batch_size={args.batch}"])
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
            {
                "tower": f"contrastive {args.steps} steps",
                **probe(cfg, tower, answers, args.probe_limit),
            }
        ),
        flush=True,
    )


if __name__ == "__main__":
    main()
