"""A user's own data as the shards training reads: VQA questions with their pictures, and a corpus.

    python scripts/convert.py vqa --questions Q.json --annotations A.json --images DIR --out OUT \\
        --split train
    python scripts/convert.py vqa --questions aokvqa_v1p0_val.json --images DIR --out OUT \\
        --split val
    # name.jpg + name.txt pairs
    python scripts/convert.py corpus --docs DIR --out OUT
    # img2dataset output
    python scripts/convert.py corpus --shards 'web/{00000..00009}.tar' --out OUT
    python scripts/convert.py hf --path DIR_OR_PARQUET_GLOB --split train [--image-column image ...]

Hugging Face data sets (a ``save_to_disk`` folder or parquet files) are read by
``rag_mm.data.convert_hf`` into the same query shards as the VQA layouts below.

Question layouts, told apart by the questions file's shape:

* VQA (VQAv2, OK-VQA): ``{"questions": [{"question_id", "image_id", "question"}]}`` plus an
  annotations file ``{"annotations": [{"question_id", "answers": [{"answer", ...}] (10), ...}]}``.
  The training answer is ``multiple_choice_answer`` where the annotation has one (VQAv2), else the
  most frequent human answer (OK-VQA).
* A-OKVQA: one list ``[{"question_id", "image_id", "question", "direct_answers" (10), "choices",
  "correct_choice_idx", "rationales", ...}]``; the training answer is the most frequent direct
  answer.

Human answers, and so the training answer, are normalised as the VQA release normalised its
annotations (``rag_mm.data.convert_answers``: "Seven" -> "7", "Eiffel Tower" -> "eiffel tower"),
so that exact match and the VQA accuracy agree; ``--keep-answers`` stores them as given.

Questions without answers (a test split) are skipped, as are those whose picture is not under
``--images``, which is searched recursively for COCO's names: ``COCO_train2014_000000000042.jpg``
(2014/2015) or ``000000000042.jpg`` (2017; A-OKVQA's images), any of jpg/jpeg/png/webp. Both
are counted and reported at the end.

Shards (webdataset, ``OUT/<split>/<split>-000000.tar`` ..., ``OUT/corpus/corpus-000000.tar`` ...):

* query: ``<key>.jpg|png|webp`` the picture, ``<key>.txt`` the question, ``<key>.json``
  ``{"answer", "answers" (every human answer, for the VQA accuracy), "question_id", "image_id"}``,
  plus ``answer_type`` and ``question_type`` where the VQA annotation has them (VQAv2);
  no ``doc_id``, so no gold document: train with ``retriever=none``, or ``retriever=learned`` with
  ``retriever.pseudo_queries`` > 0 (its warm-up and contrastive term on random views of the
  memory's pictures) or ``retriever.contrastive_steps=0`` (the reader-driven loss alone);
* corpus: ``<key>.<picture>``, ``<key>.txt`` the passage, ``<key>.json`` ``{"doc_id", "source"}``,
  doc ids numbering the documents from 0 in input order (``rag_mm.data.documents`` loads them).

Pictures are stored as they come (their bytes, after a check that they open): the pipeline resizes
to ``model.image_size`` when it decodes. ``--image-size N`` center-crops and resizes them here once
instead: every query sample holds its own picture (VQAv2 asks ~5 questions per COCO picture), so
this keeps the shards small and the decoding cheap.

Bad input (a missing file or folder, malformed JSON, a JSON of another layout) is a
``ConvertError``: the command line (``rag_mm.data.convert_cli``) prints its message, which names the
file, and returns 2.
"""

from __future__ import annotations

import io
import json
import os
import random
import re
import sys
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import webdataset as wds
from PIL import Image, ImageOps

from rag_mm.data.convert_answers import Normaliser
from rag_mm.data.picture_recipe import recipe_overrides
from rag_mm.data.urls import expand_urls, missing_local_shards
from rag_mm.eval.vqa_metric import normalize_answer

SPLITS = ("train", "val", "test")
IMAGE_EXTS = ("jpg", "jpeg", "png", "webp")  # what rag_mm.data.pipeline decodes
COCO_NAME = re.compile(r"(?:COCO_[A-Za-z]+\d*_)?(\d{12})\.(?:jpe?g|png|webp)", re.IGNORECASE)
STORED_FORMATS = {"JPEG": "jpg", "PNG": "png", "WEBP": "webp"}  # PIL format -> member kept as is
# re-encoded JPEG pictures (--image-size): high, so that the one extra encoding costs little detail
JPEG_QUALITY = 95
EXAMPLES = 5  # skipped question ids listed in the summary
SIDES_SAMPLED = 200  # pictures whose size picks the recipe's picture size (a set's are alike)
PROGRESS_EVERY = 10000  # samples between progress lines on stderr


class ConvertError(Exception):
    """Bad input: ``main`` prints the message (which names the file) and returns 2."""


@dataclass
class Question:
    """One question, its human answers and the one answer training targets."""

    question_id: int | str
    # COCO's image id (None: a Hugging Face data set without an image id column)
    image_id: int | None
    question: str
    answer: str  # the training target
    answers: list[str]  # every human answer, in the file's order
    # VQAv2's "yes/no" | "number" | "other", where the annotation has one
    answer_type: str | None = None
    # VQAv2's question prefix class ("what color is the", ...), likewise
    question_type: str | None = None
    given: str | None = None  # the annotation's multiple_choice_answer (VQAv2), which ``answer`` is


# ------------------------------------------------------------------------------ reading questions
def load_json(path: Path, what: str):
    """The parsed JSON of ``path``; a missing or malformed file is a ConvertError naming it."""
    if not path.exists():
        raise ConvertError(f"{what} {path} not found")
    if not path.is_file():
        raise ConvertError(f"{what} {path} is not a file")
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ConvertError(f"{what} {path} is not valid JSON: {exc}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConvertError(f"cannot read {what} {path}: {exc}") from None


def _shape(obj) -> str:
    """A short description of a JSON value's top level, for error messages."""
    if isinstance(obj, dict):
        keys = ", ".join(repr(k) for k in list(obj)[:5])
        return (
            f"an object with keys {keys}" + (", ..." if len(obj) > 5 else "")
            if obj
            else "an empty object"
        )
    if isinstance(obj, list):
        return f"a list of {len(obj)}"
    if isinstance(obj, bool) or obj is None:
        return json.dumps(obj)
    return "a string" if isinstance(obj, str) else "a number"


def _entry(path: Path, where: str, entry, fields: dict[str, type | tuple]) -> dict:
    """``entry`` checked to be an object holding ``fields`` of the given types."""
    if not isinstance(entry, dict):
        raise ConvertError(f"{path}: {where} is {_shape(entry)}, not an object")
    for key, types in fields.items():
        if key not in entry:
            raise ConvertError(
                f"{path}: {where} has no {key!r} (keys: {', '.join(map(repr, entry))})"
            )
        if not isinstance(entry[key], types) or isinstance(entry[key], bool):
            raise ConvertError(f"{path}: {where}[{key!r}] is {_shape(entry[key])}")
    return entry


def most_frequent(answers: list[str]) -> str:
    """The answer most annotators gave; a tie goes to the one given first."""
    return Counter(answers).most_common(1)[0][0]


def _answer_list(path: Path, where: str, answers) -> list[str]:
    if not isinstance(answers, list) or not all(isinstance(a, str) for a in answers):
        raise ConvertError(f"{path}: {where} is not a list of answer strings")
    return answers


def _optional_str(value) -> str | None:
    """An optional annotation field (VQAv2's ``answer_type``, ``question_type``): kept when it is a
    non-empty string."""
    return value if isinstance(value, str) and value else None


def read_questions(
    questions: Path, annotations: Path | None
) -> tuple[str, list[Question], Counter]:
    """(layout, questions with answers, skipped counts) from a VQA or A-OKVQA question file."""
    data = load_json(questions, "questions file")
    skipped: Counter[str] = Counter()
    out: list[Question] = []
    if isinstance(data, list):  # A-OKVQA
        if annotations is not None:
            raise ConvertError(
                f"{questions} is an A-OKVQA list, which holds its own answers: drop --annotations"
            )
        for i, e in enumerate(data):
            e = _entry(
                questions,
                f"entry [{i}]",
                e,
                {"question_id": (int, str), "image_id": int, "question": str},
            )
            answers = _answer_list(
                questions, f"entry [{i}]['direct_answers']", e.get("direct_answers", [])
            )
            if not answers:
                skipped["no_answers"] += 1
                continue
            out.append(
                Question(
                    e["question_id"], e["image_id"], e["question"], most_frequent(answers), answers
                )
            )
        return "a-okvqa", out, skipped
    if not isinstance(data, dict) or not isinstance(data.get("questions"), list):
        if isinstance(data, dict) and "annotations" in data:
            raise ConvertError(
                f"{questions} is an annotations file (it has 'annotations', no 'questions'): "
                "pass it as --annotations and the questions file as --questions"
            )
        raise ConvertError(
            f"{questions} is {_shape(data)}: expected VQA questions {{'questions': [...]}} "
            "or an A-OKVQA list [{'question_id', 'question', 'direct_answers', ...}]"
        )
    if annotations is None:
        raise ConvertError(
            f"{questions} holds VQA questions: their answers come from --annotations"
        )
    ann = load_json(annotations, "annotations file")
    if not isinstance(ann, dict) or not isinstance(ann.get("annotations"), list):
        hint = " (that is a questions file)" if isinstance(ann, dict) and "questions" in ann else ""
        raise ConvertError(
            f"{annotations} is {_shape(ann)}{hint}: expected VQA annotations {{'annotations': "
            f"[...]}}"
        )
    by_id: dict = {}
    for i, a in enumerate(ann["annotations"]):
        a = _entry(
            annotations, f"annotations[{i}]", a, {"question_id": (int, str), "answers": list}
        )
        answers = []
        for j, d in enumerate(a["answers"]):
            answers.append(
                _entry(annotations, f"annotations[{i}]['answers'][{j}]", d, {"answer": str})[
                    "answer"
                ]
            )
        mc = a.get("multiple_choice_answer")
        by_id[a["question_id"]] = (
            mc if isinstance(mc, str) and mc else None,
            answers,
            _optional_str(a.get("answer_type")),
            _optional_str(a.get("question_type")),
        )
    for i, q in enumerate(data["questions"]):
        q = _entry(
            questions,
            f"questions[{i}]",
            q,
            {"question_id": (int, str), "image_id": int, "question": str},
        )
        mc, answers, a_type, q_type = by_id.get(q["question_id"], (None, [], None, None))
        if not answers:
            skipped["no_answers"] += 1
            continue
        out.append(
            Question(
                q["question_id"],
                q["image_id"],
                q["question"],
                mc or most_frequent(answers),
                answers,
                a_type,
                q_type,
                mc,
            )
        )
    return "vqa", out, skipped


def normalise_question(q: Question, norm: Normaliser, given: str | None = None) -> Question:
    """``q`` with its human answers normalised by ``norm``; the training answer is ``given`` (an
    annotation's ``multiple_choice_answer``) normalised, else the most frequent normalised answer
    (so "2" twice and "two" once make "2" three times)."""
    q.answers = norm.many(q.answers)  # counted, and passed through unchanged when norm is off
    if not norm.enabled:
        return q
    q.answer = (normalize_answer(given) or given) if given else most_frequent(q.answers)
    return q


def index_images(folder: Path) -> dict[int, Path]:
    """image_id -> picture path for every file under ``folder`` named as COCO names them (the first
    in sorted order where two names give one id)."""
    if not folder.is_dir():
        raise ConvertError(
            f"images folder {folder} " + ("is not a directory" if folder.exists() else "not found")
        )
    found: dict[int, Path] = {}
    for root, dirs, files in os.walk(folder):
        dirs.sort()
        for name in sorted(files):
            m = COCO_NAME.fullmatch(name)
            if m:
                found.setdefault(int(m.group(1)), Path(root) / name)
    return found


# ------------------------------------------------------------------------------ writing shards
def picture(data: bytes, image_size: int = 0) -> tuple[str, bytes]:
    """(member extension, bytes) to store for a picture's file bytes. ``image_size`` 0 keeps JPEG,
    PNG and WebP bytes as they are (other formats become PNG); else the picture is center-cropped
    to a square, resized to ``image_size`` and re-encoded (JPEG stays JPEG, the rest PNG). Raises
    what PIL raises for bytes that are no picture."""
    with Image.open(io.BytesIO(data)) as img:
        fmt = img.format
        if not image_size and fmt in STORED_FORMATS:
            img.verify()  # the structure, without a full decode
            return STORED_FORMATS[fmt], data
        img = img.convert("RGB")
    if image_size:
        img = ImageOps.fit(img, (image_size, image_size), Image.BICUBIC)  # center crop + resize
    buf = io.BytesIO()
    if image_size and fmt == "JPEG":
        img.save(buf, format="JPEG", quality=JPEG_QUALITY)
        return "jpg", buf.getvalue()
    img.save(buf, format="PNG")
    return "png", buf.getvalue()


class ShardSink:
    """Samples into ``OUT/<name>/<name>-%06d.tar``, ``shard_size`` per shard. Existing shards of
    that name are an error unless ``overwrite`` (then they are deleted first)."""

    def __init__(self, out: Path, name: str, shard_size: int, overwrite: bool) -> None:
        self.name, self.dir = name, out / name
        old = sorted(self.dir.glob(f"{name}-*.tar")) if self.dir.is_dir() else []
        if old and not overwrite:
            raise ConvertError(
                f"{self.dir} already holds shards ({old[0].name}, ... {len(old)} in all): "
                "pass --overwrite to replace them, or another --out"
            )
        try:
            for p in old:
                p.unlink()
            self.dir.mkdir(parents=True, exist_ok=True)
            self.writer = wds.ShardWriter(
                str(self.dir / f"{name}-%06d.tar"), maxcount=shard_size, verbose=0
            )
        except OSError as exc:
            raise ConvertError(f"cannot write shards to {self.dir}: {exc}") from None
        self.count = 0

    def write(self, sample: dict) -> None:
        try:
            self.writer.write(sample)
        except OSError as exc:
            raise ConvertError(f"cannot write {self.writer.fname}: {exc}") from None
        self.count += 1
        if self.count % PROGRESS_EVERY == 0:
            print(
                f"convert: {self.count} samples written to {self.dir}", file=sys.stderr, flush=True
            )

    def close(self) -> int:
        """Close the last shard; the number of shards written."""
        shards = self.writer.shard  # shards opened so far (close() deletes the counter)
        try:
            self.writer.close()
        except OSError as exc:
            raise ConvertError(f"cannot write {self.writer.fname}: {exc}") from None
        return shards

    def pattern(self, shards: int) -> str:
        """The brace pattern of the shards, relative to OUT (what ``data.<split>`` takes)."""
        return f"{self.name}/{self.name}-{{000000..{shards - 1:06d}}}.tar"


def _summary(
    kind: str,
    sink: ShardSink,
    out: Path,
    key: str,
    read: int,
    skipped: Counter,
    examples: dict | None = None,
    **extra,
) -> dict:
    """What a conversion wrote and skipped (``examples``: a few skipped ids by reason), and the
    Hydra overrides that read it (as ``rag_mm.config.compose`` takes them; the brace pattern is
    quoted because Hydra's grammar reserves braces)."""
    shards = sink.close()
    if sink.count == 0:  # every candidate failed to decode: no empty shard is left behind
        for p in sink.dir.glob(f"{sink.name}-*.tar"):
            p.unlink()
        raise ConvertError(f"no {kind} was written to {sink.dir}: skipped {dict(skipped)}")
    pattern = sink.pattern(shards)
    return {
        "kind": kind,
        **extra,
        "read": read,
        "written": sink.count,
        "shards": shards,
        "skipped": dict(sorted(skipped.items())),
        "skipped_examples": examples or {},
        "out": str(sink.dir),
        "pattern": pattern,
        "overrides": [f"data.root={out}", f"data.{key}='{pattern}'"],
    }


def query_sample(n: int, q: Question, ext: str, data: bytes) -> dict:
    """The ``n``-th query sample of a conversion: ``q``'s picture (member ``ext``), question and
    json."""
    meta = {"answer": q.answer, "answers": q.answers, "question_id": q.question_id}
    # the evaluation reports accuracy per VQA answer type (rag_mm.eval.vqa_metric.answer_type)
    meta.update(
        {
            k: v
            for k, v in (
                ("image_id", q.image_id),
                ("answer_type", q.answer_type),
                ("question_type", q.question_type),
            )
            if v is not None
        }
    )
    return {"__key__": f"q{n:09d}", ext: data, "txt": q.question, "json": json.dumps(meta)}


def shuffled_by_picture(qs: list[Question], seed: int = 0) -> list[Question]:
    """``qs`` with their pictures in a seeded random order, each picture's questions together and
    in their order. A source sorted by class or by topic (a folder per class, a dump in label order)
    would otherwise give each shard one class; the training stream reads ``data.shard_interleave``
    shards at once, but a split of fewer shards than classes would still train on a few classes
    at a time."""
    by_picture: dict[int, list[Question]] = {}
    for q in qs:
        by_picture.setdefault(q.image_id, []).append(q)
    pictures = list(by_picture)
    random.Random(seed).shuffle(pictures)
    return [q for p in pictures for q in by_picture[p]]


def convert_vqa(
    questions: Path,
    annotations: Path | None,
    images: Path,
    out: Path,
    split: str,
    shard_size: int = 1000,
    image_size: int = 0,
    overwrite: bool = False,
    normalise: bool = True,
) -> dict:
    """Write the questions of a VQA / A-OKVQA file whose pictures are under ``images`` as the query
    shards of ``split``, their pictures in a seeded random order (``shuffled_by_picture``); return
    the summary (counts, skipped by reason, the data overrides, and ``normalised``: what the answer
    normalisation changed, ``rag_mm.data.convert_answers``)."""
    if split not in SPLITS:
        raise ConvertError(f"unknown split {split!r} (one of {', '.join(SPLITS)})")
    layout, qs, skipped = read_questions(questions, annotations)
    norm = Normaliser(normalise)
    qs = [normalise_question(q, norm, q.given) for q in qs]
    if not qs:
        raise ConvertError(
            f"no question in {questions} has answers ({skipped['no_answers']} without): "
            "a test split without answers cannot train or be scored"
        )
    found = index_images(images)
    todo = [q for q in qs if q.image_id in found]
    missing = [q.question_id for q in qs if q.image_id not in found]
    if missing:
        skipped["missing_image"] += len(missing)
    if not todo:
        named = (
            ""
            if found
            else (
                " (no file there is named like COCO_train2014_000000000042.jpg or 000000000042.jpg)"
            )
        )
        raise ConvertError(
            f"none of the {len(qs)} answered questions in {questions} has its picture under "
            f"{images}{named}"
        )

    todo = shuffled_by_picture(todo)

    @lru_cache(maxsize=64)  # a picture's questions come together (``shuffled_by_picture``)
    def load(image_id: int) -> tuple[str, bytes]:
        return picture(found[image_id].read_bytes(), image_size)

    sink = ShardSink(out, split, shard_size, overwrite)
    bad: list = []
    sides: dict[int, int] = {}  # the first pictures' shorter sides: the recipe's picture size
    for n, q in enumerate(todo):
        try:
            ext, data = load(q.image_id)
            if len(sides) < SIDES_SAMPLED and q.image_id not in sides:
                with Image.open(io.BytesIO(data)) as img:
                    sides[q.image_id] = min(img.size)
        except (
            Exception
        ) as exc:  # an unreadable file, or bytes PIL cannot open (it raises several types)
            skipped["bad_image"] += 1
            bad.append(q.question_id)
            print(
                f"convert: skipping question {q.question_id}: picture {found[q.image_id]}: {exc}",
                file=sys.stderr,
            )
            continue
        sink.write(query_sample(n, q, ext, data))
    examples = {k: v[:EXAMPLES] for k, v in (("missing_image", missing), ("bad_image", bad)) if v}
    read = len(qs) + skipped["no_answers"]
    res = _summary(
        "question",
        sink,
        out,
        split,
        read,
        skipped,
        examples,
        layout=layout,
        normalised=norm.report(),
    )
    res["recipe"] = recipe_overrides(list(sides.values()), [q.question for q in todo])
    return res


def _folder_documents(folder: Path, skipped: Counter) -> Iterator[tuple[str, bytes, bytes]]:
    """(name, picture bytes, text bytes) of each ``name.<picture>`` + ``name.txt`` pair under
    ``folder``."""
    if not folder.is_dir():
        raise ConvertError(
            f"documents folder {folder} "
            + ("is not a directory" if folder.exists() else "not found")
        )
    for root, dirs, files in os.walk(folder):
        dirs.sort()
        stems: dict[str, dict[str, str]] = {}
        for name in files:
            stem, _, ext = name.rpartition(".")
            if stem and ext.lower() in (*IMAGE_EXTS, "txt"):
                stems.setdefault(stem, {}).setdefault(ext.lower(), name)
        for stem in sorted(stems):
            exts = stems[stem]
            image = next((exts[e] for e in IMAGE_EXTS if e in exts), None)
            rel = str((Path(root) / stem).relative_to(folder))
            if image is None or "txt" not in exts:
                skipped["no_picture" if image is None else "no_text"] += 1
                print(
                    f"convert: skipping document {rel}: no "
                    f"{'picture' if image is None else 'text'} file",
                    file=sys.stderr,
                )
                continue
            try:
                yield (
                    rel,
                    (Path(root) / image).read_bytes(),
                    (Path(root) / exts["txt"]).read_bytes(),
                )
            except OSError as exc:
                raise ConvertError(f"cannot read document {Path(root) / stem}: {exc}") from None


def _shard_documents(pattern: str, skipped: Counter) -> Iterator[tuple[str, bytes, bytes]]:
    """(source, picture bytes, text bytes) of each sample of img2dataset-style shards."""
    urls = expand_urls("", pattern)
    missing = missing_local_shards(urls)
    if missing:
        raise ConvertError(
            f"input shard {missing[0]} not found"
            + (f" ({len(missing)} missing)" if len(missing) > 1 else "")
        )

    def tar_error(exn: Exception) -> bool:
        skipped[f"tar:{type(exn).__name__}"] += 1
        print(f"convert: skipping unreadable tar data: {exn}", file=sys.stderr)
        return True

    for s in wds.DataPipeline(wds.SimpleShardList(urls), wds.tarfile_to_samples(handler=tar_error)):
        key = s.get("__key__", "?")
        image = next((s[e] for e in IMAGE_EXTS if e in s), None)
        if image is None or "txt" not in s:
            skipped["no_picture" if image is None else "no_text"] += 1
            continue
        source = key
        if "json" in s:  # img2dataset records where each picture came from
            try:
                meta = json.loads(s["json"])
                source = (
                    str(meta.get("url") or meta.get("key") or key)
                    if isinstance(meta, dict)
                    else key
                )
            except ValueError:
                pass
        yield source, image, s["txt"]


def convert_corpus(
    out: Path,
    docs: Path | None = None,
    shards: str | None = None,
    shard_size: int = 1000,
    image_size: int = 0,
    overwrite: bool = False,
) -> dict:
    """Write the documents of a picture+text folder (``docs``) or of img2dataset shards (``shards``,
    a brace pattern) as corpus shards, doc ids 0, 1, ... in input order; return the summary."""
    if (docs is None) == (shards is None):
        raise ConvertError("give one source of documents: --docs FOLDER or --shards PATTERN")
    skipped: Counter[str] = Counter()
    source = (
        _folder_documents(docs, skipped) if docs is not None else _shard_documents(shards, skipped)
    )
    first = next(source, None)  # bad input is reported before any shard is created
    if first is None:
        raise ConvertError(
            f"no document (a picture and a .txt with one name) in {docs or shards}: skipped "
            f"{dict(skipped)}"
        )
    sink = ShardSink(out, "corpus", shard_size, overwrite)
    read = 0
    for name, image, text in _chain(first, source):
        read += 1
        try:
            passage = text.decode("utf-8").strip()
        except UnicodeDecodeError as exc:
            skipped["bad_text"] += 1
            print(f"convert: skipping document {name}: text is not UTF-8: {exc}", file=sys.stderr)
            continue
        try:
            ext, data = picture(image, image_size)
        except Exception as exc:  # PIL raises several types for bytes that are no picture
            skipped["bad_image"] += 1
            print(f"convert: skipping document {name}: {exc}", file=sys.stderr)
            continue
        doc_id = sink.count
        sink.write(
            {
                "__key__": f"doc{doc_id:08d}",
                ext: data,
                "txt": passage,
                "json": json.dumps({"doc_id": doc_id, "source": name}),
            }
        )
    return _summary(
        "document",
        sink,
        out,
        "corpus",
        read + sum(v for k, v in skipped.items() if k.startswith("no_")),
        skipped,
    )


def _chain(first, rest: Iterator) -> Iterator:
    yield first
    yield from rest
