"""Rewrite scikit-learn's bundled handwritten digits (``sklearn.datasets.load_digits``: 1,797
greyscale pictures of 8 x 8 pixels, 16 grey levels, ten classes) as picture questions in the
VQAv2 layout that ``scripts/convert.py vqa`` reads: a second public picture set of another kind
than easy-VQA's coloured shapes, shipped inside a package (nothing is downloaded).

    pip install scikit-learn
    python scripts/digits_to_vqa.py --out data/digits_raw
    python scripts/convert.py vqa --questions data/digits_raw/train_questions.json \
        --annotations data/digits_raw/train_annotations.json --images data/digits_raw/images \
        --out data/digits --split train          (the same for --split val and --split test)

Per picture three questions: "what digit is this?" (answered by the digit, "0" to "9") and two
yes/no questions "is this a K?", one about its own digit and one about another digit drawn at
random, so yes and no are equally frequent. The pictures are split at random (``--seed``) into
train / val / test; no picture is in two splits. Pictures are written at their own 8 x 8 pixels,
white on black as the data set has them.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

ANNOTATORS = 10  # VQAv2 asks ten people; one agreed answer counts ten times
CLASS_QUESTION = "what digit is this?"


def load() -> tuple[list, list]:
    """(pictures as 8 x 8 lists of 0-255 grey levels, digit labels)."""
    try:
        from sklearn.datasets import load_digits
    except ImportError:
        sys.exit("digits_to_vqa: error: scikit-learn is not installed (pip install scikit-learn)")
    d = load_digits()
    return [(img * 255.0 / 16.0).round().astype("uint8") for img in d.images], [
        int(t) for t in d.target
    ]


def questions_for(label: int, rng: random.Random) -> list[tuple[str, str]]:
    other = rng.choice([k for k in range(10) if k != label])
    yes_no = [(f"is this a {label}?", "yes"), (f"is this a {other}?", "no")]
    rng.shuffle(yes_no)
    return [(CLASS_QUESTION, str(label)), *yes_no]


def rewrite(out: Path, val: float, test: float, seed: int) -> dict:
    from PIL import Image

    pictures, labels = load()
    rng = random.Random(seed)
    order = list(range(len(labels)))
    rng.shuffle(order)
    n_test, n_val = int(test * len(order)), int(val * len(order))
    split_of = {i: "test" for i in order[:n_test]} | {
        i: "val" for i in order[n_test : n_test + n_val]
    }
    (out / "images").mkdir(parents=True, exist_ok=True)
    splits: dict[str, tuple[list, list]] = {s: ([], []) for s in ("train", "val", "test")}
    for i, (pic, label) in enumerate(
        zip(pictures, labels)
    ):  # COCO-style names: convert.py finds them
        Image.fromarray(pic, mode="L").convert("RGB").save(out / "images" / f"{i:012d}.png")
        qs, anns = splits[split_of.get(i, "train")]
        for n, (question, answer) in enumerate(questions_for(label, rng)):
            qid = i * 10 + n
            qs.append({"question_id": qid, "image_id": i, "question": question})
            anns.append(
                {
                    "question_id": qid,
                    "image_id": i,
                    "multiple_choice_answer": answer,
                    "answers": [{"answer": answer, "answer_id": j + 1} for j in range(ANNOTATORS)],
                }
            )
    counts = {}
    for name, (qs, anns) in splits.items():
        (out / f"{name}_questions.json").write_text(json.dumps({"questions": qs}))
        (out / f"{name}_annotations.json").write_text(json.dumps({"annotations": anns}))
        counts[name] = len(qs)
    return counts


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True, help="folder for the JSON files and images/")
    p.add_argument(
        "--val", type=float, default=0.1, help="share of the pictures held out as validation"
    )
    p.add_argument("--test", type=float, default=0.2, help="share of the pictures held out as test")
    p.add_argument(
        "--seed", type=int, default=0, help="seed of the split and of the yes/no questions"
    )
    args = p.parse_args(argv)
    if not (0 <= args.val and 0 < args.test and args.val + args.test < 1):
        p.error("--val and --test are shares of the pictures: 0 <= val, 0 < test, val + test < 1")
    print(
        json.dumps(
            {"out": str(args.out), "questions": rewrite(args.out, args.val, args.test, args.seed)}
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
