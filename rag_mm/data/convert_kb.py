"""Knowledge bases as the corpus shards retrieval reads, with the map query converters link gold by.

    python scripts/convert.py kb --jsonl kb.jsonl --out OUT             # a plain knowledge base
    python scripts/convert.py kb --infoseek Wiki6M_ver_1_0.jsonl --images WIKI_PICS --out OUT \\
        --linked infoseek_train_withkb.jsonl infoseek_val_withkb.jsonl
    python scripts/convert.py kb --evqa encyclopedic_kb_wiki.json --images KB_PICS --out OUT \\
        --linked train.csv val.csv test.csv
    python scripts/convert.py kb --okvqa okvqa_full_corpus.csv --out OUT   # OK-VQA's passages

Layouts:

* plain JSONL, one document a line: ``{"doc_id", "title", "text", "image"}`` (``picture`` is taken
  for ``image``; a relative path is looked up beside the JSONL, then under ``--images``). Integer
  doc ids are kept; other ids (strings) are numbered 0, 1, ... in input order.
* InfoSeek's knowledge base (OVEN's ``Wiki6M_ver_1_0.jsonl``): ``{"wikidata_id", "wikipedia_title",
  "wikipedia_summary", "wikipedia_content", ...}``, one entity a document, its passage the summary
  (the content where the summary is empty). Its picture is a file named ``<wikidata_id>.<ext>``
  anywhere under ``--images`` (the KB only has the picture's URL).
* Encyclopedic-VQA's knowledge base (``encyclopedic_kb_wiki.json``): ``{wikipedia_url: {"title",
  "section_titles", "section_texts", "image_urls", "image_section_indices", ...}}``, one document
  per section (the granularity the E-VQA retrievers read at), key ``<url>#<section index>``. Its
  picture is the first of the section's images found under ``--images`` by file name (the last
  part of its URL), else the article's first found picture.
* OK-VQA's Google-Search passage corpus (Luo et al. 2021, ``okvqa_full_corpus.csv``, used by
  RA-VQA and FLMR): a CSV (comma or tab separated) with a ``kid`` (or ``id``) and a ``text``
  column, one text-only passage a row (``title`` is taken where there is one). OK-VQA links no
  question to a passage: retrieval is measured by pseudo-recall there.

``--linked FILE ...`` keeps only the entities the question files name (InfoSeek ``_withkb``
files: ``entity_id``; E-VQA CSVs: ``wikipedia_url``, every section of each article), so a 6M-entity
knowledge base becomes the memory of one data set. A document without a picture gets a blank one
(mid-grey: the pipeline decodes every document's picture) and is counted as ``blank_picture``.

Writes ``OUT/corpus/corpus-*.tar`` (``<key>.<picture>``, ``.txt`` the passage, ``.json``
``{"doc_id", "source", "title"}``) and ``OUT/corpus/doc_ids.json`` ``{"layout", "doc_ids": {source
key: doc_id}}``: the ``infoseek`` and ``evqa`` query converters read it to give each query its gold
``doc_id``, so convert the knowledge base first.
"""

from __future__ import annotations

import csv
import io
import json
import os
import sys
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote

from PIL import Image

from rag_mm.data.convert import ConvertError, ShardSink, _summary, load_json, picture

DOC_MAP = "doc_ids.json"  # in OUT/corpus/: source key -> doc_id, for the query converters
LAYOUTS = ("jsonl", "infoseek", "evqa", "okvqa")
BLANK_SIZE = 8  # pixels of the blank picture; the pipeline resizes it like any other
BLANK_GREY = (128, 128, 128)  # mid-grey: close to the mean pixel the pipeline normalises around


@dataclass
class KbDoc:
    """One document before it is written."""

    key: str  # the source's id (doc_id, wikidata id, url#section): what questions link to
    title: str
    text: str
    picture: Path | None  # None: a blank picture is stored
    doc_id: int | None = None  # a plain KB's own integer id, kept


def passage(title: str, text: str) -> str:
    """The document text: the title first (the name a reader may have to copy), then the text."""
    title, text = title.strip(), " ".join(text.split())
    if title and not text.lower().startswith(title.lower()):
        return f"{title}. {text}" if text else title
    return text or title


def index_pictures(folder: Path | None, by: str = "stem") -> dict[str, Path]:
    """File stem (or full name, ``by="name"``) -> path for every picture under ``folder``."""
    if folder is None:
        return {}
    if not folder.is_dir():
        raise ConvertError(
            f"images folder {folder} " + ("is not a directory" if folder.exists() else "not found")
        )
    found: dict[str, Path] = {}
    for root, dirs, files in os.walk(folder):
        dirs.sort()
        for name in sorted(files):
            stem, _, ext = name.rpartition(".")
            if stem and ext.lower() in ("jpg", "jpeg", "png", "webp"):
                found.setdefault(stem if by == "stem" else name, Path(root) / name)
    return found


def jsonl_rows(path: Path, what: str) -> Iterator[tuple[int, dict]]:
    """(line number, object) of each non-empty line of a JSONL file; bad lines are ConvertErrors."""
    if not path.is_file():
        raise ConvertError(f"{what} {path} " + ("is not a file" if path.exists() else "not found"))
    try:
        with path.open(encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise ConvertError(f"{path}:{n} is not valid JSON: {exc}") from None
                if not isinstance(row, dict):
                    raise ConvertError(f"{path}:{n} is not a JSON object")
                yield n, row
    except (OSError, UnicodeDecodeError) as exc:
        raise ConvertError(f"cannot read {what} {path}: {exc}") from None


def _need(path: Path, n: int, row: dict, *keys: str) -> None:
    for k in keys:
        if k not in row:
            raise ConvertError(f"{path}:{n} has no {k!r} (keys: {', '.join(map(repr, row))})")


# ------------------------------------------------------------------------------ the layouts
def plain_docs(path: Path, images: dict[str, Path], image_root: Path | None) -> Iterator[KbDoc]:
    for n, row in jsonl_rows(path, "knowledge base"):
        _need(path, n, row, "doc_id", "text")
        rel = row.get("image", row.get("picture"))
        pic = None
        if isinstance(rel, str) and rel:
            for cand in (Path(rel), path.parent / rel, *([image_root / rel] if image_root else [])):
                if cand.is_file():
                    pic = cand
                    break
            else:
                pic = images.get(Path(rel).stem)
        raw = row["doc_id"]
        own = raw if isinstance(raw, int) and not isinstance(raw, bool) and raw >= 0 else None
        yield KbDoc(str(raw), str(row.get("title") or ""), str(row["text"]), pic, own)


def infoseek_docs(path: Path, images: dict[str, Path], keep: set[str] | None) -> Iterator[KbDoc]:
    for n, row in jsonl_rows(path, "InfoSeek knowledge base"):
        _need(path, n, row, "wikidata_id", "wikipedia_title")
        qid = str(row["wikidata_id"])
        if keep is not None and qid not in keep:
            continue
        text = row.get("wikipedia_summary") or row.get("wikipedia_content") or ""
        yield KbDoc(qid, str(row["wikipedia_title"]), str(text), images.get(qid))


def _url_name(url: str) -> str:
    """The file name an image URL ends in ("File:Eiffel_Tower.jpg" -> "Eiffel_Tower.jpg")."""
    name = unquote(url.rstrip("/").rsplit("/", 1)[-1])
    return name.split(":", 1)[1] if name.lower().startswith("file:") else name


def evqa_docs(path: Path, images: dict[str, Path], keep: set[str] | None) -> Iterator[KbDoc]:
    kb = load_json(path, "Encyclopedic-VQA knowledge base")
    if not isinstance(kb, dict):
        raise ConvertError(
            f"{path} is not an object {{wikipedia_url: article}} (the E-VQA knowledge base)"
        )
    for url, art in kb.items():
        if keep is not None and url not in keep:
            continue
        if not isinstance(art, dict) or not isinstance(art.get("section_texts"), list):
            raise ConvertError(f"{path}: article {url!r} has no 'section_texts' list")
        titles = art.get("section_titles") or []
        urls, where = art.get("image_urls") or [], art.get("image_section_indices") or []
        found = [(int(s), images.get(_url_name(u))) for u, s in zip(urls, where)]
        first = next((p for _, p in found if p is not None), None)
        title = str(art.get("title") or (titles[0] if titles else url))
        for i, text in enumerate(art["section_texts"]):
            sec = str(titles[i]) if i < len(titles) else ""
            head = title if i == 0 or not sec or sec == title else f"{title}: {sec}"
            pic = next((p for s, p in found if s == i and p is not None), first)
            yield KbDoc(f"{url}#{i}", head, str(text or ""), pic)


def okvqa_docs(path: Path) -> Iterator[KbDoc]:
    """OK-VQA's passage corpus: ``kid`` (or ``id``) and ``text`` columns, no picture."""
    for n, row in enumerate(csv_rows(path), 2):
        key = row.get("kid", row.get("id"))
        if key is None or "text" not in row:
            raise ConvertError(
                f"{path} has no 'kid' (or 'id') and 'text' columns "
                f"(columns: {', '.join(map(str, row))})"
            )
        if not (row["text"] or "").strip():
            raise ConvertError(f"{path}:{n}: passage {key!r} has no text")
        yield KbDoc(str(key), str(row.get("title") or ""), row["text"], None)


def linked_keys(files: list[Path]) -> set[str]:
    """The entities question files link to: ``entity_id`` of InfoSeek JSONL rows, every
    ``wikipedia_url`` of E-VQA CSV rows (two-hop rows name two, split by '|')."""
    keys: set[str] = set()
    for f in files:
        if f.suffix.lower() == ".csv":
            for row in csv_rows(f):
                keys.update(u for u in (row.get("wikipedia_url") or "").split("|") if u)
        else:
            keys.update(
                str(row["entity_id"])
                for _, row in jsonl_rows(f, "linked questions file")
                if row.get("entity_id")
            )
    if not keys:
        raise ConvertError(
            f"--linked: no entity_id / wikipedia_url in {', '.join(map(str, files))}"
        )
    return keys


def csv_rows(path: Path) -> Iterator[dict]:
    """The rows of a CSV with a header line, comma or tab separated (the header tells)."""
    if not path.is_file():
        raise ConvertError(f"CSV {path} " + ("is not a file" if path.exists() else "not found"))
    csv.field_size_limit(1 << 30)  # E-VQA's evidence cells are long
    try:
        with path.open(encoding="utf-8", newline="") as f:
            tab = "\t" in f.readline()
            f.seek(0)
            yield from csv.DictReader(f, delimiter="\t" if tab else ",")
    except (OSError, UnicodeDecodeError, csv.Error) as exc:
        raise ConvertError(f"cannot read CSV {path}: {exc}") from None


# ------------------------------------------------------------------------------ writing
def blank_picture() -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (BLANK_SIZE, BLANK_SIZE), BLANK_GREY).save(buf, format="PNG")
    return buf.getvalue()


def convert_kb(
    layout: str,
    source: Path,
    out: Path,
    images: Path | None = None,
    linked: list[Path] | None = None,
    shard_size: int = 1000,
    image_size: int = 0,
    overwrite: bool = False,
) -> dict:
    """Write the knowledge base ``source`` (``layout`` one of LAYOUTS) as corpus shards and the
    doc-id map; return the summary."""
    if layout not in LAYOUTS:
        raise ConvertError(
            f"unknown knowledge base layout {layout!r} (one of {', '.join(LAYOUTS)})"
        )
    keep = linked_keys(linked) if linked else None
    if layout == "jsonl":
        docs = plain_docs(source, index_pictures(images), images)
    elif layout == "infoseek":
        docs = infoseek_docs(source, index_pictures(images), keep)
    elif layout == "okvqa":
        docs = okvqa_docs(source)
    else:
        docs = evqa_docs(source, index_pictures(images, by="name"), keep)
    skipped: Counter[str] = Counter()
    first = next(docs, None)  # bad input is reported before any shard is created
    if first is None:
        raise ConvertError(
            f"no document in {source}" + (" is linked by --linked" if keep is not None else "")
        )
    sink = ShardSink(out, "corpus", shard_size, overwrite)
    blank = blank_picture()
    doc_ids: dict[str, int] = {}
    used: set[int] = set()
    read = 0
    for d in _chain(first, docs):
        read += 1
        if d.key in doc_ids:
            raise ConvertError(f"{source}: document {d.key!r} appears twice")
        data = None
        if d.picture is not None:
            try:
                ext, data = picture(d.picture.read_bytes(), image_size)
            except Exception as exc:  # an unreadable file, or bytes PIL cannot open (several types)
                skipped["bad_picture"] += 1
                print(
                    f"convert: document {d.key}: picture {d.picture}: {exc}; a blank one is stored",
                    file=sys.stderr,
                )
        if data is None:
            skipped["blank_picture"] += 1
            ext, data = picture(blank, image_size)
        doc_id = d.doc_id if d.doc_id is not None and d.doc_id not in used else len(doc_ids)
        while doc_id in used:  # running numbers skip a plain KB's own integer ids
            doc_id += 1
        used.add(doc_id)
        doc_ids[d.key] = doc_id
        sink.write(
            {
                "__key__": f"doc{doc_id:08d}",
                ext: data,
                "txt": passage(d.title, d.text),
                "json": json.dumps({"doc_id": doc_id, "source": d.key, "title": d.title}),
            }
        )
    blank_n = skipped.pop("blank_picture", 0)  # written, not skipped: reported apart
    res = _summary(
        "document", sink, out, "corpus", read, skipped, layout=layout, blank_picture=blank_n
    )
    try:
        (sink.dir / DOC_MAP).write_text(json.dumps({"layout": layout, "doc_ids": doc_ids}))
    except OSError as exc:
        raise ConvertError(f"cannot write {sink.dir / DOC_MAP}: {exc}") from None
    if keep is not None:
        # entities questions name that the KB lacks
        res["linked_missing"] = len(keep - set(doc_ids))
    return res


def load_doc_map(out: Path, layout: str) -> dict[str, int] | None:
    """The doc-id map ``convert_kb`` wrote under ``out`` for ``layout``; None when there is none."""
    path = out / "corpus" / DOC_MAP
    if not path.is_file():
        return None
    data = load_json(path, "doc-id map")
    if not isinstance(data, dict) or not isinstance(data.get("doc_ids"), dict):
        raise ConvertError(f"{path} is not a doc-id map written by 'convert.py kb'")
    if data.get("layout") != layout:
        raise ConvertError(
            f"{path} maps a {data.get('layout')!r} knowledge base, not {layout!r}: "
            f"convert the {layout} knowledge base into this --out first"
        )
    return data["doc_ids"]


def _chain(first, rest: Iterator) -> Iterator:
    yield first
    yield from rest
