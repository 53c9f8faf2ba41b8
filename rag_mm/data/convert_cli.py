"""The command line of ``scripts/convert.py``: ``vqa`` and ``corpus`` (``rag_mm.data.convert``),
``hf`` (``rag_mm.data.convert_hf``), ``kb`` (``rag_mm.data.convert_kb``), ``infoseek`` and ``evqa``
(``rag_mm.data.convert_kvqa``). It sits above the converters, which import nothing from it."""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path

from rag_mm.data import convert_hf
from rag_mm.data.convert import SPLITS, ConvertError, convert_corpus, convert_vqa
from rag_mm.data.convert_answers import Normaliser
from rag_mm.data.convert_kb import convert_kb
from rag_mm.data.convert_kvqa import convert_evqa, convert_infoseek


def _positive(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be positive (got {value})")
    return value


def _non_negative(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0 (got {value})")
    return value


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="convert.py", description="Your own data as rag_mm shards.")
    sub = p.add_subparsers(dest="kind", required=True)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--out", type=Path, required=True, help="output root (data.root); shards go to OUT/<split>/"
    )
    common.add_argument(
        "--shard-size", type=_positive, default=1000, help="samples per shard (default 1000)"
    )
    common.add_argument(
        "--image-size",
        type=_non_negative,
        default=0,
        help=(
            "center-crop and resize pictures to this many pixels (default 0: store them as "
            "they are)"
        ),
    )
    common.add_argument(
        "--overwrite", action="store_true", help="replace shards of the same name already in OUT"
    )
    v = sub.add_parser(
        "vqa", parents=[common], help="VQAv2 / OK-VQA / A-OKVQA questions -> query shards"
    )
    v.add_argument(
        "--questions", type=Path, required=True, help="VQA questions JSON, or the A-OKVQA JSON list"
    )
    v.add_argument("--annotations", type=Path, help="VQA annotations JSON (not for A-OKVQA)")
    v.add_argument(
        "--images",
        type=Path,
        required=True,
        help="folder with the COCO pictures (searched recursively)",
    )
    v.add_argument(
        "--split", choices=SPLITS, required=True, help="which query split the shards are"
    )
    v.add_argument(
        "--keep-answers",
        action="store_true",
        help="store the human answers as given (default: normalised as the VQA release)",
    )
    c = sub.add_parser("corpus", parents=[common], help="documents -> corpus shards")
    src = c.add_mutually_exclusive_group(required=True)
    src.add_argument(
        "--docs", type=Path, help="folder of name.<jpg|jpeg|png|webp> + name.txt pairs"
    )
    src.add_argument(
        "--shards", help="img2dataset-style tar shards (brace pattern): jpg + txt (+ json) per key"
    )
    convert_hf.add_parser(sub, common)
    _kvqa_parsers(sub, common)
    return p


def _kvqa_parsers(sub, common) -> None:
    """``kb``, ``infoseek`` and ``evqa``: knowledge-VQA data with its gold links."""
    k = sub.add_parser(
        "kb", parents=[common], help="a knowledge base -> corpus shards + doc-id map"
    )
    src = k.add_mutually_exclusive_group(required=True)
    src.add_argument("--jsonl", type=Path, help="plain JSONL: doc_id, title, text, image (a path)")
    src.add_argument("--infoseek", type=Path, help="InfoSeek's (OVEN's) Wiki6M_ver_1_0.jsonl")
    src.add_argument(
        "--evqa",
        type=Path,
        help="Encyclopedic-VQA's encyclopedic_kb_wiki.json (one doc per section)",
    )
    src.add_argument(
        "--okvqa",
        type=Path,
        help="OK-VQA's Google-Search passages (okvqa_full_corpus.csv: kid, text)",
    )
    k.add_argument(
        "--images", type=Path, help="folder with the documents' pictures (searched recursively)"
    )
    k.add_argument(
        "--linked",
        type=Path,
        nargs="+",
        help="keep only the entities these question files name (InfoSeek _withkb JSONL, E-VQA CSV)",
    )
    answers = argparse.ArgumentParser(add_help=False)
    answers.add_argument(
        "--images",
        type=Path,
        required=True,
        help="folder with the query pictures (searched recursively)",
    )
    answers.add_argument(
        "--split", choices=SPLITS, required=True, help="which query split the shards are"
    )
    answers.add_argument(
        "--keep-answers",
        action="store_true",
        help="store the answers as given (default: normalised as the VQA release)",
    )
    i = sub.add_parser(
        "infoseek", parents=[common, answers], help="InfoSeek questions -> query shards with gold"
    )
    i.add_argument(
        "--questions",
        type=Path,
        required=True,
        help="infoseek_<split>.jsonl (or its _withkb variant)",
    )
    i.add_argument(
        "--withkb", type=Path, help="infoseek_<split>_withkb.jsonl: each question's entity_id"
    )
    i.add_argument(
        "--qtype", type=Path, help="infoseek_<split>_qtype.jsonl: STRING / TIME / NUMERICAL"
    )
    e = sub.add_parser(
        "evqa", parents=[common, answers], help="Encyclopedic-VQA CSV -> query shards with gold"
    )
    e.add_argument("--csv", type=Path, required=True, help="train.csv / val.csv / test.csv")


def _run_kvqa(args) -> dict:
    a = args
    if a.kind == "kb":
        layout = next(n for n in ("jsonl", "infoseek", "evqa", "okvqa") if getattr(a, n))
        return convert_kb(
            layout,
            getattr(a, layout),
            a.out,
            a.images,
            a.linked,
            a.shard_size,
            a.image_size,
            a.overwrite,
        )
    if a.kind == "infoseek":
        return convert_infoseek(
            a.questions,
            a.images,
            a.out,
            a.split,
            a.withkb,
            a.qtype,
            a.shard_size,
            a.image_size,
            a.overwrite,
            not a.keep_answers,
        )
    return convert_evqa(
        a.csv, a.images, a.out, a.split, a.shard_size, a.image_size, a.overwrite, not a.keep_answers
    )


def main(argv: list[str] | None = None) -> int:
    """Convert; print the summary as one JSON line (stdout) and in words (stderr). Bad input: 2."""
    args = parser().parse_args(argv)
    try:
        if args.kind == "vqa":
            res = convert_vqa(
                args.questions,
                args.annotations,
                args.images,
                args.out,
                args.split,
                args.shard_size,
                args.image_size,
                args.overwrite,
                not args.keep_answers,
            )
        elif args.kind == "hf":
            res = convert_hf.run(args)
        elif args.kind in ("kb", "infoseek", "evqa"):
            res = _run_kvqa(args)
        else:
            res = convert_corpus(
                args.out, args.docs, args.shards, args.shard_size, args.image_size, args.overwrite
            )
    except ConvertError as exc:
        print(f"convert: error: {exc}", file=sys.stderr)
        return 2
    skipped = (
        ", ".join(
            f"{k}={v}"
            + (
                f" (e.g. question ids {', '.join(map(str, res['skipped_examples'][k]))})"
                if k in res["skipped_examples"]
                else ""
            )
            for k, v in res["skipped"].items()
        )
        or "none"
    )
    # as typed in a shell
    shell = " ".join(shlex.quote(o) if "'" not in o else f'"{o}"' for o in res["overrides"])
    print(
        f"convert: {res['written']} {res['kind']}s of {res['read']} written in {res['shards']} "
        f"shard(s) to {res['out']}; skipped: {skipped}\nconvert: read them with {shell}",
        file=sys.stderr,
    )
    if "normalised" in res:
        print(f"convert: {Normaliser.describe(res['normalised'])}", file=sys.stderr)
    if "gold" in res:
        print(f"convert: gold documents: {res['gold'] or 'none'}", file=sys.stderr)
    if "recipe" in res:  # picture questions: the +experiment=vqa settings these pictures call for
        print(
            f"convert: with +experiment=vqa add {' '.join(res['recipe'])} (docs/pictures.md)",
            file=sys.stderr,
        )
    print(json.dumps(res))
    return 0
