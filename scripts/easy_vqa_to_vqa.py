"""Rewrite the easy-VQA data set (the ``easy-vqa`` package on PyPI) in the VQAv2 layout that
``scripts/convert.py vqa`` reads, so a public data set nobody on the team drew goes through the
same path a user's VQA data takes.

    pip install easy-vqa
    python scripts/easy_vqa_to_vqa.py --out data/easy_vqa_raw
    python scripts/convert.py vqa --questions data/easy_vqa_raw/train_questions.json \
        --annotations data/easy_vqa_raw/train_annotations.json --images data/easy_vqa_raw/images \
        --out data/easy_vqa --split train
    (the same for --split val and --split test)
    # retrieval corpus
    python scripts/convert.py corpus --docs data/easy_vqa_raw/docs --out data/easy_vqa

easy-VQA: 64 x 64 pictures of one coloured shape (3 shapes, 8 colours), 38,575 training and
9,673 test questions about 4,000 and 1,000 pictures, 13 answers. Each question is
``[question, answer, image_id]`` with image ids numbered per split from 0; here they are made
unique (test ids follow the training ones) and the pictures are linked under COCO's file names.
The package has no validation split: the last ``--val-images`` training pictures and every
question about them become one, so validation never shares a picture with training. The single
answer is written as ten agreeing annotators, which the VQA accuracy scores as fully right.

``docs/`` holds a document memory for retrieval: one document per training picture (never a
validation or test one), its picture and a passage of every question asked about it with its
answer ("what color is the shape? blue. is there a circle? no. ..."). A query about an unseen
picture can only be helped by documents of pictures like it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

ANNOTATORS = 10  # VQAv2 asks ten people; one agreed answer counts ten times


def package_data() -> Path:
    try:
        import easy_vqa
    except ImportError:
        sys.exit(
            "easy_vqa_to_vqa: error: the easy-vqa package is not installed (pip install easy-vqa)"
        )
    return Path(easy_vqa.__file__).parent / "data"


def rewrite(src: Path, out: Path, val_images: int) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    (out / "images").mkdir(exist_ok=True)
    splits: dict[str, tuple[list, list]] = {"train": ([], []), "val": ([], []), "test": ([], [])}
    (out / "docs").mkdir(exist_ok=True)
    passages: dict[int, list[str]] = {}  # training picture -> its questions with their answers
    offset = 0
    for split in ("train", "test"):
        questions = json.loads((src / split / "questions.json").read_text())
        n_images = len(os.listdir(src / split / "images"))
        for i in range(n_images):  # COCO-style names, so convert.py finds them by image id
            link = out / "images" / f"{offset + i:012d}.png"
            if not link.exists():
                link.symlink_to((src / split / "images" / f"{i}.png").resolve())
        for n, (question, answer, image) in enumerate(questions):
            name = split if split == "test" or image < n_images - val_images else "val"
            qid = (offset + image) * 100 + n % 100  # unique over both splits
            qs, anns = splits[name]
            if name == "train":
                passages.setdefault(offset + image, []).append(f"{question} {answer}.")
            qs.append({"question_id": qid, "image_id": offset + image, "question": question})
            anns.append(
                {
                    "question_id": qid,
                    "image_id": offset + image,
                    "multiple_choice_answer": answer,
                    "answers": [{"answer": answer, "answer_id": j + 1} for j in range(ANNOTATORS)],
                }
            )
        offset += n_images
    for image, lines in passages.items():
        doc = out / "docs" / f"{image:012d}"
        if not doc.with_suffix(".png").exists():
            doc.with_suffix(".png").symlink_to((out / "images" / f"{image:012d}.png").resolve())
        doc.with_suffix(".txt").write_text(" ".join(lines))
    counts = {"docs": len(passages)}
    for name, (qs, anns) in splits.items():
        (out / f"{name}_questions.json").write_text(json.dumps({"questions": qs}))
        (out / f"{name}_annotations.json").write_text(json.dumps({"annotations": anns}))
        counts[name] = len(qs)
    return counts


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True, help="folder for the JSON files and images/")
    p.add_argument(
        "--src", type=Path, help="easy-VQA's data folder (default: the installed package's)"
    )
    p.add_argument(
        "--val-images",
        type=int,
        default=400,
        help="training pictures held out as validation (default 400)",
    )
    args = p.parse_args(argv)
    counts = rewrite(args.src or package_data(), args.out, args.val_images)
    print(json.dumps({"out": str(args.out), "questions": counts}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
