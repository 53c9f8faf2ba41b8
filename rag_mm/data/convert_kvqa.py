"""Knowledge-VQA questions (InfoSeek, Encyclopedic-VQA) as query shards linked to gold documents.

    python scripts/convert.py infoseek --questions infoseek_val.jsonl \\
        --withkb infoseek_val_withkb.jsonl \\
        --qtype infoseek_val_qtype.jsonl --images OVEN_PICS --out OUT --split val
    python scripts/convert.py evqa --csv val.csv --images INAT_AND_GLDV2_PICS --out OUT --split val

Convert the knowledge base first (``scripts/convert.py kb``, ``rag_mm.data.convert_kb``) into the
same ``--out``: its ``corpus/doc_ids.json`` gives each question its gold ``doc_id``.

* InfoSeek: JSONL rows ``{"data_id", "image_id" ("oven_..."), "question", "answer" [..],
  "answer_eval" [aliases] or [{"wikidata", "range": [lo, hi]}], "data_split"}``; the ``_withkb``
  file (or the row itself) adds ``entity_id`` (the Wikidata id: the gold document), the qtype file
  ``{"data_id", "question_type"}`` (STRING / TIME / NUMERICAL; without it a range answer means
  NUMERICAL, the rest STRING). ``data_split`` ending in ``unseen_entity`` marks the query held out.
  Pictures: ``<image_id>.<ext>`` anywhere under ``--images``.
* Encyclopedic-VQA: CSV rows with ``question``, ``answer`` (``|`` between annotators' answers,
  ``&&`` between the parts of a multi_answer), ``dataset_image_ids`` (up to 5, ``|``-separated: one
  query per picture), ``question_type``, ``wikipedia_url`` and ``evidence_section_id`` (the gold
  section; two-hop rows name two of each, the last holds the answer),
  ``wikipedia_url_used_in_train`` (False: the entity is unseen in training, the query held out).
  Pictures: ``<image id>.<ext>``.

Query json: ``answer`` (the training target), ``doc_id`` (gold, where the knowledge base has it),
``heldout``, ``question_id``, ``image_id`` and ``kvqa`` ``{"source", "aliases", "qtype", "range"?,
"split"?}``: what ``rag_mm.eval.kvqa_metric`` scores the greedy answer with (InfoSeek's relaxed
numeric match, E-VQA's multi-answer match). Answers are normalised as
``rag_mm.data.convert_answers`` says (``--keep-answers``: as given); numeric ranges stay numbers.
"""

from __future__ import annotations

import json
import sys
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

from rag_mm.data.convert import EXAMPLES, SPLITS, ConvertError, ShardSink, _summary, picture
from rag_mm.data.convert_answers import Normaliser
from rag_mm.data.convert_kb import csv_rows, index_pictures, jsonl_rows, load_doc_map

UNSEEN_ENTITY = "unseen_entity"  # InfoSeek's data_split suffix of the held-out entities
FALSE = ("false", "0", "no")  # how a CSV spells a false wikipedia_url_used_in_train


def _numeric_range(answer_eval) -> list[float] | None:
    """InfoSeek's numeric answer range ``[lo, hi]`` from ``answer_eval`` (None: a string answer)."""
    items = answer_eval if isinstance(answer_eval, list) else [answer_eval]
    for a in items:
        if isinstance(a, dict) and isinstance(a.get("range"), list) and len(a["range"]) >= 2:
            try:
                return [float(a["range"][0]), float(a["range"][1])]
            except (TypeError, ValueError):
                return None
    return None


class _Writer:
    """Query samples into the split's shards, the picture of each image id read once."""

    def __init__(
        self,
        out: Path,
        split: str,
        shard_size: int,
        image_size: int,
        overwrite: bool,
        pictures: dict[str, Path],
    ) -> None:
        self.args = (out, split, shard_size, overwrite)
        # opened at the first good query: bad input leaves no shard
        self.sink: ShardSink | None = None
        self.image_size, self.pictures = image_size, pictures
        self.cache: tuple[str, tuple[str, bytes]] | None = None
        self.skipped: Counter[str] = Counter()
        self.examples: dict[str, list] = {}

    def skip(self, why: str, qid) -> None:
        self.skipped[why] += 1
        self.examples.setdefault(why, [])
        if len(self.examples[why]) < EXAMPLES:
            self.examples[why].append(qid)

    def write(self, image_id: str, question: str, meta: dict) -> None:
        path = self.pictures.get(image_id)
        if path is None:
            return self.skip("missing_image", meta["question_id"])
        try:
            if self.cache is None or self.cache[0] != image_id:
                self.cache = (image_id, picture(path.read_bytes(), self.image_size))
        except Exception as exc:  # an unreadable file, or bytes PIL cannot open (several types)
            print(
                f"convert: skipping question {meta['question_id']}: picture {path}: {exc}",
                file=sys.stderr,
            )
            return self.skip("bad_image", meta["question_id"])
        ext, data = self.cache[1]
        if self.sink is None:
            self.sink = ShardSink(*self.args)
        self.sink.write(
            {
                "__key__": f"q{self.sink.count:09d}",
                ext: data,
                "txt": question,
                "json": json.dumps(meta),
            }
        )

    def summary(self, layout: str, read: int, norm: Normaliser, **extra) -> dict:
        out, split = self.args[0], self.args[1]
        if self.sink is None:
            raise ConvertError(
                f"no question was written ({read} read): skipped {dict(self.skipped) or 'none'}"
            )
        return _summary(
            "question",
            self.sink,
            out,
            split,
            read,
            self.skipped,
            self.examples,
            layout=layout,
            normalised=norm.report(),
            **extra,
        )


def _gold(doc_map: dict[str, int] | None, key: str | None, counts: Counter) -> dict:
    """``{"doc_id": ...}`` for a gold key the knowledge base has, else {} (counted)."""
    if doc_map is None or not key:
        counts["no_link" if not key else "no_kb"] += 1
        return {}
    if key not in doc_map:
        counts["not_in_kb"] += 1
        return {}
    counts["linked"] += 1
    return {"doc_id": doc_map[key]}


# ------------------------------------------------------------------------------ InfoSeek
def convert_infoseek(
    questions: Path,
    images: Path,
    out: Path,
    split: str,
    withkb: Path | None = None,
    qtype: Path | None = None,
    shard_size: int = 1000,
    image_size: int = 0,
    overwrite: bool = False,
    normalise: bool = True,
) -> dict:
    """Write InfoSeek questions as the query shards of ``split``; return the summary."""
    if split not in SPLITS:
        raise ConvertError(f"unknown split {split!r} (one of {', '.join(SPLITS)})")
    entity = (
        {
            r["data_id"]: str(r["entity_id"])
            for _, r in jsonl_rows(withkb, "--withkb file")
            if "data_id" in r and r.get("entity_id")
        }
        if withkb
        else {}
    )
    qtypes = (
        {
            r["data_id"]: str(r["question_type"]).lower()
            for _, r in jsonl_rows(qtype, "--qtype file")
            if "data_id" in r and "question_type" in r
        }
        if qtype
        else {}
    )
    doc_map = load_doc_map(out, "infoseek")
    norm = Normaliser(normalise)
    w = _Writer(out, split, shard_size, image_size, overwrite, index_pictures(images))
    gold: Counter[str] = Counter()
    kinds: Counter[str] = Counter()
    read = 0
    for n, row in jsonl_rows(questions, "InfoSeek questions file"):
        read += 1
        for k in ("data_id", "image_id", "question"):
            if k not in row:
                raise ConvertError(
                    f"{questions}:{n} has no {k!r} (keys: {', '.join(map(repr, row))})"
                )
        answers = row.get("answer") or []  # InfoSeek's test split has none: skipped
        answers = answers if isinstance(answers, list) else [answers]
        answers = [str(a) for a in answers if str(a).strip()]
        if not answers:
            w.skip("no_answers", row["data_id"])
            continue
        rng = _numeric_range(row.get("answer_eval"))
        evals = [str(a) for a in (row.get("answer_eval") or []) if isinstance(a, str | int | float)]
        kind = qtypes.get(row["data_id"]) or ("numerical" if rng is not None else "string")
        kinds[kind] += 1
        answer = norm(answers[0])
        aliases = list(dict.fromkeys([answer, *norm.many(answers[1:] + evals)]))
        data_split = str(row.get("data_split") or "")
        ent = entity.get(row["data_id"]) or (
            str(row["entity_id"]) if row.get("entity_id") else None
        )
        kvqa = {"source": "infoseek", "aliases": aliases, "qtype": kind, "split": data_split}
        if rng is not None:
            kvqa["range"] = rng
        meta = {
            "answer": answer,
            **_gold(doc_map, ent, gold),
            "heldout": data_split.endswith(UNSEEN_ENTITY),
            "question_id": row["data_id"],
            "image_id": str(row["image_id"]),
            "kvqa": kvqa,
        }
        if ent:
            meta["entity_id"] = ent
        w.write(str(row["image_id"]), str(row["question"]), meta)
    return w.summary(
        "infoseek",
        read,
        norm,
        gold=dict(sorted(gold.items())),
        question_types=dict(sorted(kinds.items())),
    )


# ------------------------------------------------------------------------------ Encyclopedic-VQA
def _image_ids(cell: str) -> list[str]:
    """E-VQA's ``dataset_image_ids``: ``a|b|c`` (or a printed list ``['a', 'b']``)."""
    cell = cell.strip().strip("[]")
    parts = cell.split("|") if "|" in cell else cell.split(",")
    return [p.strip().strip("'\"") for p in parts if p.strip().strip("'\"")]


def evqa_answers(cell: str, norm: Normaliser) -> tuple[str, list[str]]:
    """(training answer, aliases) of an E-VQA ``answer`` cell: ``|`` separates alternatives,
    ``&&`` the parts of one multi-answer (each part normalised; aliases keep ``&&``, the training
    answer joins the parts with " and ", which E-VQA's scorer splits on)."""
    aliases = []
    for alt in (a for a in cell.split("|") if a.strip()):
        parts = [norm(p.strip()) for p in alt.split("&&") if p.strip()]
        if parts:
            aliases.append("&&".join(parts))
    aliases = list(dict.fromkeys(aliases))
    return (aliases[0].replace("&&", " and ") if aliases else ""), aliases


def convert_evqa(
    csv_path: Path,
    images: Path,
    out: Path,
    split: str,
    shard_size: int = 1000,
    image_size: int = 0,
    overwrite: bool = False,
    normalise: bool = True,
) -> dict:
    """Write Encyclopedic-VQA questions (one query per picture) as the query shards of ``split``."""
    if split not in SPLITS:
        raise ConvertError(f"unknown split {split!r} (one of {', '.join(SPLITS)})")
    doc_map = load_doc_map(out, "evqa")
    norm = Normaliser(normalise)
    w = _Writer(out, split, shard_size, image_size, overwrite, index_pictures(images))
    gold: Counter[str] = Counter()
    kinds: Counter[str] = Counter()
    read = rows = 0
    for i, row in enumerate(_checked_rows(csv_path)):
        rows += 1
        answer, aliases = evqa_answers(row["answer"] or "", norm)
        ids = _image_ids(row["dataset_image_ids"] or "")
        read += len(ids)
        if not answer:
            for image_id in ids:
                w.skip("no_answers", f"{i}:{image_id}")
            continue
        key = _evqa_gold(row, f"{csv_path}: row {i + 2}")
        kind = (row.get("question_type") or "").strip() or "templated"
        unseen = str(row.get("wikipedia_url_used_in_train", "True")).strip().lower() in FALSE
        link = _gold(doc_map, key, gold)
        for image_id in ids:
            kinds[kind] += 1
            meta = {
                "answer": answer,
                **link,
                "heldout": unseen,
                "question_id": f"{i}:{image_id}",
                "image_id": image_id,
                "kvqa": {"source": "evqa", "aliases": aliases, "qtype": kind},
            }
            w.write(image_id, row["question"], meta)
    return w.summary(
        "evqa",
        read,
        norm,
        rows=rows,
        gold=dict(sorted(gold.items())),
        question_types=dict(sorted(kinds.items())),
    )


def _evqa_gold(row: dict, where: str) -> str | None:
    """The gold section's key ``<url>#<section>`` of an E-VQA row: the last hop's (two-hop rows
    name two urls and two section ids, split by '|'); the article's lead section where the row
    names no section; None without a url."""
    urls = [u for u in (row.get("wikipedia_url") or "").split("|") if u]
    sections = [s.strip() for s in (row.get("evidence_section_id") or "").split("|") if s.strip()]
    if not urls:
        return None
    if not sections:
        return f"{urls[-1]}#0"
    try:
        return f"{urls[-1]}#{int(float(sections[-1]))}"
    except ValueError:
        why = f"{where}: evidence_section_id {sections[-1]!r} is no section number"
        raise ConvertError(why) from None


def _checked_rows(path: Path) -> Iterator[dict]:
    first = True
    for row in csv_rows(path):
        if first:
            missing = [k for k in ("question", "answer", "dataset_image_ids") if k not in row]
            if missing:
                raise ConvertError(
                    f"{path} has no column {missing[0]!r} (columns: {', '.join(row)}): "
                    "expected Encyclopedic-VQA's CSV"
                )
            first = False
        yield row
