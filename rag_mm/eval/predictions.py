"""Greedy answers as a VQA results file: ``[{"question_id": ..., "answer": ...}]``.

The official VQA evaluation (and the EvalAI servers) read this format. ``rag_mm.evaluate`` collects
each query's answer under its sample key, in loader order; the question ids come from the split's
shards, whose json carries ``question_id`` when ``scripts/convert.py`` wrote them. A query whose
json has no ``question_id`` (knowledge-world shards) is listed under its sample key.

The ids are read in a second pass over the shards, json members only, rather than carried through
the training pipeline's batches, which need them nowhere else.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import webdataset as wds

from rag_mm.components.metrics import strict_dumps

QuestionId = int | str


class PredictionError(Exception):
    """The results file cannot be written as asked (the caller names the key)."""


def question_ids(urls: list[str]) -> dict[str, QuestionId | None]:
    """Sample key -> its json's ``question_id`` for every query of the shards ``urls``; None for a
    key that two samples share with different ids (the results file cannot tell them apart).
    Unreadable tar data and bad json are passed over: evaluation dropped those samples too."""
    found: dict[str, QuestionId | None] = {}
    pipe = wds.DataPipeline(
        wds.SimpleShardList(urls), wds.tarfile_to_samples(handler=wds.ignore_and_continue)
    )
    for sample in pipe:
        key = sample.get("__key__")
        try:
            meta = json.loads(sample["json"]) if "json" in sample else {}
        except ValueError:  # not JSON, not UTF-8
            continue
        qid = meta.get("question_id") if isinstance(meta, dict) else None
        if key is None or not isinstance(qid, int | str) or isinstance(qid, bool):
            continue
        if key in found and found[key] != qid:
            found[key] = None
        else:
            found.setdefault(key, qid)
    return found


def results(answered: list[tuple[str, str]], ids: dict[str, QuestionId | None]) -> list[dict]:
    """(sample key, answer) pairs -> the VQA results list, each key replaced by its question id."""
    out = []
    for key, answer in answered:
        if key in ids and ids[key] is None:
            raise PredictionError(
                f"two samples of the split have the key {key!r} and different question ids: "
                "convert the questions into one set of shards (keys are per conversion)"
            )
        out.append({"question_id": ids.get(key, key), "answer": answer})
    return out


def write_predictions(path: Path, answered: list[tuple[str, str]], urls: list[str]) -> int:
    """Write the results file of ``answered`` for the queries of ``urls`` to ``path`` atomically
    (a temporary file renamed); return the number of answers."""
    rows = results(answered, question_ids(urls))
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            f.write(strict_dumps(rows))
        os.replace(tmp, path)
    except OSError as exc:
        raise PredictionError(f"cannot write {path}: {exc}") from None
    return len(rows)
