"""Where does the reader lose what a linear model on the pixels keeps? Linear probes along the
picture path of a VQA reader, each against the same probe on the raw pixels.

    python scripts/bench/picture_probe.py runs/vqa          # a trained run's newest checkpoint
    python scripts/bench/picture_probe.py runs/vqa --init   # the same config, freshly initialised
    python scripts/bench/picture_probe.py runs/vqa --init model.image_size=8 model.patch_size=1

For every question text of the data (a "kind": "what digit is this?", "is this a 3?", ...) a
logistic regression (scikit-learn, one per text) is fitted on up to ``--train-queries`` training
queries and scored on up to ``--test-queries`` queries of ``--split``, on each stage's features:

* ``pixels``: the picture as the reader gets it (``model.image_size``, normalised), flattened:
  the plain classifier the reader must match;
* ``tower``: the vision tower's patch tokens, flattened (their place kept); ``tower_pooled``: their
  mean and max;
* ``answer_input`` and ``answer_block<i>``: the reader's hidden state at its answer position before
  the first block and after each block.

A stage where the probe falls below the pixels' is where the signal is lost. Also printed: the
reader's own exact match on the scored queries, the blind prior (each text's most frequent training
answer), the pictures' own size in the shards against ``model.image_size`` / ``model.patch_size``,
all split into yes/no questions and the rest. Prints one JSON object. Native readers only.
"""

from __future__ import annotations

import argparse
import io
import sys
import tarfile
import warnings
from collections import Counter, defaultdict
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from rag_mm.build import build_rag, make_stream  # noqa: E402
from rag_mm.components import checkpoint  # noqa: E402
from rag_mm.components.metrics import strict_dumps  # noqa: E402
from rag_mm.components.vision_warmup import warm_up_vision  # noqa: E402
from rag_mm.data.urls import expand_urls  # noqa: E402
from rag_mm.evaluate import load_config, load_model_state  # noqa: E402
from rag_mm.model.layout import IGNORE  # noqa: E402

YES_NO = {"yes", "no"}


def native_size(cfg, split: str = "train") -> list[int]:
    """Width and height of the first picture in the split's first shard (as stored)."""
    from PIL import Image

    url = expand_urls(cfg.data.root, getattr(cfg.data, split))[0]
    with tarfile.open(url) as tar:
        for member in tar:
            if member.name.rsplit(".", 1)[-1] in ("png", "jpg", "jpeg", "webp"):
                return list(Image.open(io.BytesIO(tar.extractfile(member).read())).size)
    raise SystemExit(f"picture_probe: no picture in {url}")


@torch.no_grad()
def features(reader, cfg, split: str, limit: int, pixels_only: bool = False) -> dict:
    """Per query of ``split`` (up to ``limit``): its question, answer, reader correctness and every
    stage's feature vector (float32 numpy)."""
    out: dict = defaultdict(list)
    n = 0
    for batch in make_stream(cfg, split, train=False):
        x = {k: batch[k] for k in ("image", "q_ids", "q_len", "a_ids", "a_len")}
        out["question"] += list(batch["question"])
        out["answer"] += list(batch["answer"])
        n += len(x["image"])
        if pixels_only:
            out["pixels"].append(x["image"].flatten(1).numpy())
            if n >= limit:
                break
            continue
        _, tokens = reader.vision(x["image"])  # (B, P, Wv)
        a = reader.assemble(**x)
        anchor = (a.labels != IGNORE).int().argmax(1)  # first answer-predicting position
        rows = torch.arange(len(anchor))
        h = a.x + reader.pos_emb(a.pos) + reader.type_emb(a.typ.clamp_min(0))
        stages = {
            "pixels": x["image"].flatten(1),
            "tower": tokens.flatten(1),
            "tower_pooled": torch.cat([tokens.mean(1), tokens.amax(1)], -1),
            "answer_input": h[rows, anchor],
        }
        for i, block in enumerate(reader.blocks):
            h = block(h, a.seg_offsets)
            stages[f"answer_block{i + 1}"] = h[rows, anchor]
        for k, v in stages.items():
            out[k].append(v.float().numpy())
        out["correct"].append(reader(**x).correct.numpy())
        if n >= limit:
            break
    res = {
        k: (np.concatenate(v)[:limit] if k not in ("question", "answer") else v[:limit])
        for k, v in out.items()
    }
    return res


def probe(train: dict, test: dict, stage: str) -> np.ndarray:
    """Per test query: whether one logistic regression per question text, fitted on ``stage``'s
    training features, answers it right (a text with one training answer: that answer)."""
    from sklearn.linear_model import LogisticRegression
    from sklearn.preprocessing import StandardScaler

    by_text = defaultdict(list)
    for i, q in enumerate(train["question"]):
        by_text[q].append(i)
    right = np.zeros(len(test["question"]), dtype=bool)
    test_by_text = defaultdict(list)
    for i, q in enumerate(test["question"]):
        test_by_text[q].append(i)
    for text, idx in test_by_text.items():
        truth = np.array([test["answer"][i] for i in idx])
        tr = by_text.get(text, [])
        answers = [train["answer"][i] for i in tr]
        if len(set(answers)) < 2:
            right[idx] = truth == (answers[0] if answers else "")
            continue
        scale = StandardScaler().fit(train[stage][tr])
        with warnings.catch_warnings():
            # lbfgs stopping at max_iter on separable data is fine here
            warnings.simplefilter("ignore")
            lr = LogisticRegression(max_iter=300, C=0.1).fit(
                scale.transform(train[stage][tr]), answers
            )
        right[idx] = lr.predict(scale.transform(test[stage][idx])) == truth
    return right


def blind(train: dict, test: dict) -> np.ndarray:
    prior = {}
    for text in set(train["question"]):
        prior[text] = Counter(
            a for q, a in zip(train["question"], train["answer"]) if q == text
        ).most_common(1)[0][0]
    return np.array([prior.get(q) == a for q, a in zip(test["question"], test["answer"])])


def by_kind(right: np.ndarray, test: dict) -> dict:
    yn = np.array([a in YES_NO for a in test["answer"]])
    res = {"all": round(float(right.mean()), 4)}
    for name, mask in (("yes_no", yn), ("other", ~yn)):
        if mask.any():
            res[name] = round(float(right[mask].mean()), 4)
    return res


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "run",
        type=Path,
        help="run directory (its saved config; its newest checkpoint unless --init)",
    )
    p.add_argument("overrides", nargs="*", help="config overrides key=value")
    p.add_argument(
        "--init", action="store_true", help="probe the freshly initialised reader instead"
    )
    p.add_argument(
        "--ssl-steps",
        type=int,
        default=0,
        help="with --init: first this many SimCLR warm-up steps on the tower (model.vision_ssl_*)",
    )
    p.add_argument(
        "--pixels-only", action="store_true", help="only the pixel probe and the blind prior"
    )
    p.add_argument("--split", default="test", help="split the probes are scored on (default test)")
    p.add_argument(
        "--train-queries", type=int, default=4000, help="training queries the probes fit on"
    )
    p.add_argument("--test-queries", type=int, default=2000, help="queries of --split scored")
    args = p.parse_intermixed_args(argv)
    torch.manual_seed(0)
    cfg = load_config(args.run, args.overrides)
    if cfg.model.family != "native":
        sys.exit("picture_probe: native readers only (model.family=native)")
    parts = build_rag(cfg, torch.device("cpu"))
    reader, step = parts.reader, 0
    if not args.init:
        ckpt = checkpoint.latest_valid(args.run / "checkpoints")
        if ckpt is None:
            sys.exit(
                f"picture_probe: no valid checkpoint in {args.run / 'checkpoints'} (or pass --init)"
            )
        step = load_model_state(parts.rag, ckpt)["step"]
    if args.ssl_steps:
        if not args.init:
            sys.exit("picture_probe: --ssl-steps warms up a fresh tower: pass --init too")
        cfg.model.vision_ssl_steps = args.ssl_steps
        warm_up_vision(cfg, reader.vision, 0, 1, torch.device("cpu"))
    reader.eval()
    train = features(reader, cfg, "train", args.train_queries, args.pixels_only)
    test = features(reader, cfg, args.split, args.test_queries, args.pixels_only)
    stages = [k for k in train if k not in ("question", "answer", "correct")]
    reader_right = test["correct"].astype(bool) if "correct" in test else None
    m = cfg.model
    res = {
        "run": str(args.run),
        "step": step,
        "split": args.split,
        "train_queries": len(train["answer"]),
        "test_queries": len(test["answer"]),
        "question_texts": len(set(train["question"])),
        "native_size": native_size(cfg),
        "image_size": m.image_size,
        "patch_size": m.patch_size,
        "patch_grid": m.image_size // m.patch_size,
        "native_px_per_patch": round(native_size(cfg)[0] * m.patch_size / m.image_size, 2),
        "ssl_steps": args.ssl_steps,
        "reader": None if reader_right is None else by_kind(reader_right, test),
        "blind_prior": by_kind(blind(train, test), test),
        "probe": {s: by_kind(probe(train, test, s), test) for s in stages},
    }
    print(strict_dumps(res))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
