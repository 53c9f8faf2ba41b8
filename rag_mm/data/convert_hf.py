"""A Hugging Face data set of questions about pictures as the query shards training reads.

    python scripts/convert.py hf --path data/vqav2_val --split val  # a datasets.save_to_disk folder
    python scripts/convert.py hf --path 'hub/vqav2/data/validation-*.parquet' --split val \\
        --image-column image --question-column question --answers-column answers \\
        --id-column question_id

The input is a ``datasets.save_to_disk`` folder (a Dataset, or a DatasetDict whose split
``--source-split`` names, by default ``--split``, ``val`` also finding ``validation``), one parquet
file, a folder of them, or a glob of them (the Hub's ``data/<split>-*.parquet``). Rows are read as
stored (Arrow), so pictures are not decoded and re-encoded on the way:

* the image column holds ``{"bytes", "path"}`` structs (datasets' ``Image`` feature; a path alone is
  read, relative to the data set's folder), raw bytes, a file path, or a decoded picture (a PIL
  image or an ``(H, W[, C])`` uint8 array, stored as PNG);
* the answers column holds a list of strings, a list of ``{"answer": ...}`` dicts (VQAv2's Hub
  layout), the same as one dict of lists (``Sequence`` of a dict), or one string.

The training answer is the row's ``multiple_choice_answer`` where the data set has that column
(VQAv2), else the most frequent answer; ``answer_type``, ``question_type`` and ``image_id``
columns are kept where present. The question id is ``--id-column``, else a ``question_id``
column, else the row's number. Rows without answers or with a picture that does not open are
skipped and counted. The shards are the ``vqa`` converter's (``rag_mm.data.convert.query_sample``).

``datasets`` (and its ``pyarrow``) is needed for this converter only: ``pip install datasets``.
"""

from __future__ import annotations

import glob
import io
import sys
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

from rag_mm.data.convert import (
    EXAMPLES,
    SPLITS,
    ConvertError,
    Question,
    ShardSink,
    _summary,
    most_frequent,
    normalise_question,
    picture,
    query_sample,
)
from rag_mm.data.convert_answers import Normaliser

BATCH = 256  # rows per Arrow batch read: a few MB of pictures at a time
# kept where present
OPTIONAL = (
    "multiple_choice_answer",
    "answer_type",
    "question_type",
    "image_id",
)


# ------------------------------------------------------------------------------ reading rows
class Rows:
    """The rows of one input (a save_to_disk data set or parquet files), read column-wise by
    Arrow."""

    def __init__(self, path: str, split: str, source_split: str | None = None) -> None:
        try:
            import pyarrow.parquet as pq  # noqa: F401  (comes with datasets)
        except ImportError:
            raise ConvertError(
                "the hf converter needs the datasets package: pip install datasets"
            ) from None
        self.path = path
        p = Path(path)
        self.dataset = None
        self.files: list[Path] = []
        if p.is_dir() and any(
            (p / n).is_file() for n in ("dataset_dict.json", "dataset_info.json", "state.json")
        ):
            self.dataset = _load_from_disk(p, split, source_split)
            self.columns = list(self.dataset.column_names)
            self.base = p
            return
        if p.is_dir():
            self.files = sorted(f for f in p.rglob("*.parquet") if f.is_file())
            what = f"{path} is neither a datasets.save_to_disk folder nor a folder of parquet files"
        elif p.is_file():
            self.files = [p]
            what = ""
        else:
            self.files = sorted(
                Path(f) for f in glob.glob(path, recursive=True) if Path(f).is_file()
            )
            what = f"{path} not found" + (
                " (no file matches the pattern)" if glob.has_magic(path) else ""
            )
        if not self.files:
            raise ConvertError(what)
        self.base = self.files[0].parent
        self.columns = _parquet_columns(self.files[0])

    def batches(self, columns: list[str]) -> Iterator[list[dict]]:
        """Lists of rows (dicts of ``columns``), in the input's order."""
        if self.dataset is not None:
            arrow = self.dataset.select_columns(columns).with_format("arrow")
            for start in range(0, len(arrow), BATCH):
                yield arrow[start : start + BATCH].to_pylist()
            return
        import pyarrow as pa
        import pyarrow.parquet as pq

        for f in self.files:
            try:
                pf = pq.ParquetFile(f)
                missing = [c for c in columns if c not in pf.schema_arrow.names]
                if missing:
                    raise ConvertError(
                        f"{f} has no column {missing[0]!r} (columns: "
                        f"{', '.join(pf.schema_arrow.names)})"
                    )
                for batch in pf.iter_batches(batch_size=BATCH, columns=columns):
                    yield batch.to_pylist()
            except (OSError, pa.ArrowException) as exc:
                raise ConvertError(f"cannot read parquet file {f}: {exc}") from None


def _load_from_disk(p: Path, split: str, source_split: str | None):
    """The Dataset of a save_to_disk folder (of a DatasetDict: the split asked for)."""
    import datasets

    try:
        data = datasets.load_from_disk(str(p))
    except (
        Exception
    ) as exc:  # datasets raises FileNotFoundError, ValueError, Arrow errors, ... for a bad folder
        raise ConvertError(
            f"cannot read the datasets folder {p}: {type(exc).__name__}: {exc}"
        ) from None
    if not isinstance(data, datasets.DatasetDict):
        return data
    wanted = (
        [source_split] if source_split else [split] + (["validation"] if split == "val" else [])
    )
    for name in wanted:
        if name in data:
            return data[name]
    raise ConvertError(
        f"{p} holds the splits {', '.join(data)}, not {' or '.join(wanted)}: pass --source-split"
    )


def _parquet_columns(f: Path) -> list[str]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        return list(pq.ParquetFile(f).schema_arrow.names)
    except (OSError, pa.ArrowException) as exc:
        raise ConvertError(f"cannot read parquet file {f}: {exc}") from None


# ------------------------------------------------------------------------------ one row
def image_bytes(value, base: Path) -> bytes:
    """A picture cell's file bytes; raises ValueError (or OSError) when it holds no picture."""
    import numpy as np
    from PIL import Image

    if isinstance(value, dict):  # datasets' Image storage: {"bytes": ..., "path": ...}
        if value.get("bytes"):
            return bytes(value["bytes"])
        value = value.get("path")
    if isinstance(value, bytes | bytearray):
        return bytes(value)
    if isinstance(value, str) and value:
        path = Path(value)
        return (path if path.is_absolute() or path.exists() else base / path).read_bytes()
    if isinstance(value, Image.Image | np.ndarray | list):  # a decoded picture: stored as PNG
        img = (
            value
            if isinstance(value, Image.Image)
            else Image.fromarray(np.asarray(value, dtype=np.uint8))
        )
        buf = io.BytesIO()
        img.save(buf, format="PNG")
        return buf.getvalue()
    raise ValueError(f"no picture in the image cell ({type(value).__name__})")


def answer_list(value) -> list[str] | None:
    """The human answers of an answers cell, or None when it is of no known layout."""
    if isinstance(value, str):
        return [value] if value.strip() else []
    if isinstance(value, dict) and isinstance(
        value.get("answer"), list
    ):  # a Sequence of dicts: columnar
        value = value["answer"]
    if isinstance(value, list):
        out = [a["answer"] if isinstance(a, dict) else a for a in value]
        if all(isinstance(a, str) for a in out):
            return [a for a in out if a.strip()]
    if value is None:
        return []
    return None


def _question(row: dict, qid, cols: dict[str, str]) -> tuple[Question | None, str]:
    """(the row's Question, '') or (None, why it is skipped)."""
    text = row[cols["question"]]
    if not isinstance(text, str) or not text.strip():
        return None, "bad_question"
    answers = answer_list(row[cols["answers"]])
    if answers is None:
        return None, "bad_answers"
    if not answers:
        return None, "no_answers"
    mc = row.get("multiple_choice_answer")
    mc = mc if isinstance(mc, str) and mc.strip() else None
    image_id = row.get("image_id")
    return Question(
        qid,
        image_id if isinstance(image_id, int) and not isinstance(image_id, bool) else None,
        text,
        mc or most_frequent(answers),
        answers,
        _str(row.get("answer_type")),
        _str(row.get("question_type")),
        mc,
    ), ""


def _str(value) -> str | None:
    return value if isinstance(value, str) and value else None


def _qid(value, n: int):
    """A question id as the results file takes it (an int or a string); the row number without
    one."""
    if value is None:
        return n
    return value if isinstance(value, int | str) and not isinstance(value, bool) else str(value)


# ------------------------------------------------------------------------------ conversion
def convert_hf(
    path: str,
    out: Path,
    split: str,
    image_column: str = "image",
    question_column: str = "question",
    answers_column: str = "answers",
    id_column: str | None = None,
    source_split: str | None = None,
    shard_size: int = 1000,
    image_size: int = 0,
    overwrite: bool = False,
    normalise: bool = True,
) -> dict:
    """Write the rows of a Hugging Face data set (``path``: a save_to_disk folder, parquet file(s)
    or a glob) as the query shards of ``split``; return the summary (as ``convert_vqa``'s, human
    answers normalised unless ``normalise`` is off)."""
    if split not in SPLITS:
        raise ConvertError(f"unknown split {split!r} (one of {', '.join(SPLITS)})")
    rows = Rows(path, split, source_split)
    cols = {"image": image_column, "question": question_column, "answers": answers_column}
    if id_column:
        cols["id"] = id_column
    for flag, name in cols.items():
        if name not in rows.columns:
            raise ConvertError(
                f"--{flag}-column {name!r}: {path} has no such column "
                f"(columns: {', '.join(rows.columns)})"
            )
    id_col = id_column or ("question_id" if "question_id" in rows.columns else None)
    read = [
        *dict.fromkeys(
            [
                *cols.values(),
                *([id_col] if id_col else []),
                *(c for c in OPTIONAL if c in rows.columns),
            ]
        )
    ]
    skipped: Counter[str] = Counter()
    norm = Normaliser(normalise)
    bad: list = []
    sink: ShardSink | None = None  # opened at the first good row: bad input leaves no shard behind
    n = 0
    for batch in rows.batches(read):
        for row in batch:
            qid = _qid(row.get(id_col) if id_col else None, n)
            n += 1
            q, why = _question(row, qid, cols)
            if q is None:
                skipped[why] += 1
                continue
            q = normalise_question(q, norm, q.given)
            try:
                ext, data = picture(image_bytes(row[image_column], rows.base), image_size)
            except (
                Exception
            ) as exc:  # no picture, an unreadable path, bytes PIL cannot open (several types)
                skipped["bad_image"] += 1
                bad.append(qid)
                print(
                    f"convert: skipping question {qid}: {type(exc).__name__}: {exc}",
                    file=sys.stderr,
                )
                continue
            if sink is None:
                sink = ShardSink(out, split, shard_size, overwrite)
            sink.write(query_sample(sink.count, q, ext, data))
    if sink is None:
        raise ConvertError(
            f"no question of {path} was written ({n} rows): skipped {dict(skipped) or 'none'}"
        )
    examples = {"bad_image": bad[:EXAMPLES]} if bad else {}
    return _summary(
        "question", sink, out, split, n, skipped, examples, layout="hf", normalised=norm.report()
    )


def add_parser(sub, common) -> None:
    """The ``hf`` subcommand of ``scripts/convert.py``."""
    h = sub.add_parser(
        "hf",
        parents=[common],
        help="a Hugging Face data set (save_to_disk folder or parquet) -> query shards",
    )
    h.add_argument(
        "--path",
        required=True,
        help="a datasets.save_to_disk folder, a parquet file or folder, or a glob",
    )
    h.add_argument(
        "--split", choices=SPLITS, required=True, help="which query split the shards are"
    )
    h.add_argument(
        "--source-split",
        help="the DatasetDict split to read (default: --split; val also finds validation)",
    )
    h.add_argument("--image-column", default="image", help="the pictures (default: image)")
    h.add_argument(
        "--question-column", default="question", help="the questions (default: question)"
    )
    h.add_argument(
        "--answers-column", default="answers", help="the human answers (default: answers)"
    )
    h.add_argument(
        "--id-column",
        help="the question ids (default: question_id where present, else the row number)",
    )
    h.add_argument(
        "--keep-answers",
        action="store_true",
        help="store the human answers as given (default: normalised as the VQA release)",
    )


def run(args) -> dict:
    """``scripts/convert.py hf`` with parsed ``args``."""
    return convert_hf(
        args.path,
        args.out,
        args.split,
        args.image_column,
        args.question_column,
        args.answers_column,
        args.id_column,
        args.source_split,
        args.shard_size,
        args.image_size,
        args.overwrite,
        not args.keep_answers,
    )
