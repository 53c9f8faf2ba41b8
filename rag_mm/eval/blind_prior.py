"""The blind prior: how well a reader could answer without looking at the picture.

VQA data is known for questions that answer themselves ("what colour is the banana?", "is there a
...?" -> yes): a reader can score well by learning the answer each question text usually has. So a
reader's accuracy means little until it is set beside this baseline: answer every evaluated question
with the most frequent training answer of that question text, and fall back to the most frequent
training answer of all for a text never seen in training. ``rag_mm.evaluate`` scores it as it
scores the reader (the VQA accuracy against the human answers where a query has them, else exact
match of normalised answers) and warns when the reader does not beat it.

The table is built from the training split (``data.train``) once per run: only each sample's txt
(the question) and json (the answer) members are read, and a picture member is only checked to be
there (as the pipeline needs one), never decoded; local uncompressed shards are read by seeking past
the pictures, so the cost is the text, not the shards' size. Shards are untrusted input: they are
parsed as tar and JSON, never unpickled. The table is cached in the run directory
(``blind_prior.json``) under a fingerprint of the shard list with each shard's size and mtime, so a
changed training set is read again; the cache is written to a temporary file and renamed over the
old one, so a crash never leaves half a table.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import string
import tarfile
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from webdataset import gopen
from webdataset.tariterators import base_plus_ext

from rag_mm.components.metrics import strict_dumps
from rag_mm.data.pipeline import IMAGE_KEYS
from rag_mm.data.urls import REMOTE
from rag_mm.eval.vqa_metric import normalize_answer, vqa_accuracy

log = logging.getLogger(__name__)

CACHE_NAME = "blind_prior.json"  # in the run directory
# Bumped when the question key, the answer normalisation or the file layout changes: an older cache
# then no longer matches and is rebuilt.
VERSION = 1
SPACES = re.compile(r"\s+")
TRAILING_PUNCT = re.compile(f"[\\s{re.escape(string.punctuation)}]+$")
META = re.compile(r"__[^/]*__($|/)")  # members webdataset skips (its ``skip_meta``)


def question_key(text: str) -> str:
    """A question text as the table looks it up: lowercased, whitespace collapsed, trailing
    punctuation stripped, so "What colour is it ?" and "what colour  is it" are one question.

    >>> question_key("  What colour is it ?\\n")
    'what colour is it'
    """
    return TRAILING_PUNCT.sub("", SPACES.sub(" ", text.lower()).strip())


def _most_frequent(counts: Counter[str]) -> str:
    """The most frequent answer; a tie goes to the alphabetically first, so the table does not
    depend on the order the shards were read in."""
    return min(counts.items(), key=lambda kv: (-kv[1], kv[0]))[0]


@dataclass
class BlindPrior:
    """The most frequent (normalised) training answer per question key, and of all questions."""

    answers: dict[str, str]  # question_key -> its most frequent training answer
    fallback: (
        str  # the most frequent training answer of all (for question texts training never asked)
    )
    n_train: int  # training queries counted

    def answer(self, question: str) -> str:
        """What the blind prior answers to ``question`` (a normalised answer)."""
        return self.answers.get(question_key(question), self.fallback)

    def score(self, question: str, gold: str, human: list[str] | None) -> float:
        """The prior's score on one query, as the reader is scored: the VQA accuracy against the
        ``human`` answers where the query has them, else 1 if the normalised answers match."""
        pred = self.answer(question)
        if human:
            return vqa_accuracy(pred, human)
        return float(pred == normalize_answer(gold))

    def to_json(self, fingerprint: str) -> dict:
        return {
            "version": VERSION,
            "fingerprint": fingerprint,
            "n_train": self.n_train,
            "n_questions": len(self.answers),
            "fallback": self.fallback,
            "answers": self.answers,
        }

    @classmethod
    def from_json(cls, data) -> BlindPrior | None:
        """The table of a cache file's parsed JSON; None when it is not one this version wrote."""
        if not isinstance(data, dict) or data.get("version") != VERSION:
            return None
        answers, fallback, n = data.get("answers"), data.get("fallback"), data.get("n_train")
        if not (
            isinstance(answers, dict)
            and isinstance(fallback, str)
            and isinstance(n, int)
            and all(isinstance(k, str) and isinstance(v, str) for k, v in answers.items())
        ):
            return None
        return cls(answers, fallback, n)


# ------------------------------------------------------------------------------ reading the shards
@contextlib.contextmanager
def _open_tar(url: str) -> Iterator[tarfile.TarFile]:
    """A local shard opened seekable (members it does not read are skipped by seeking); a remote
    one (``pipe:``, ``http:``, ...) as a stream through webdataset's ``gopen``, closed (its
    process waited for) on the way out, which tarfile leaves to the caller."""
    if not url.startswith(REMOTE):
        with tarfile.open(url, mode="r:*") as tf:
            yield tf
        return
    stream = gopen(url)
    try:
        with tarfile.open(fileobj=stream, mode="r|*") as tf:
            yield tf
    finally:
        stream.close()


def _shard_samples(url: str) -> Iterator[dict[str, bytes | bool]]:
    """The samples of one shard as webdataset groups them (consecutive members sharing a key),
    holding the txt and json bytes and ``image`` = whether a picture member is there."""
    current: dict | None = None
    key = None
    with _open_tar(url) as tf:
        for m in tf:
            if not m.isreg():
                continue
            prefix, ext = base_plus_ext(m.name)
            if prefix is None or META.match(m.name):
                continue
            ext = ext.lower()
            if prefix != key:
                if current is not None:
                    yield current
                current, key = {}, prefix
            if ext in ("txt", "json"):
                f = tf.extractfile(m)
                current[ext] = f.read() if f is not None else b""
            elif ext in IMAGE_KEYS:
                current["image"] = True
            tf.members = []  # as webdataset does: a shard's member list is not kept
    if current is not None:
        yield current


def _pair(sample: dict) -> tuple[str, str] | None:
    """(question, answer) of a sample the training pipeline would keep, else None."""
    if not sample.get("image") or "txt" not in sample or "json" not in sample:
        return None
    try:
        meta = json.loads(sample["json"])
        question = sample["txt"].decode("utf-8")
    except (ValueError, UnicodeDecodeError):
        return None
    if not isinstance(meta, dict) or "answer" not in meta:
        return None
    return question, str(meta["answer"])


def count_answers(
    urls: list[str], stop: Callable[[], bool] | None = None
) -> tuple[dict[str, Counter[str]], Counter[str], int]:
    """The (normalised) answers of the training shards ``urls``: (per question key, of all
    questions, samples counted). An unreadable shard is skipped with a warning, as the training
    stream skips it. ``stop()`` is asked before each shard: when True,
    ``rag_mm.ft.preemption.Stopped`` ends the read."""
    per_question: dict[str, Counter[str]] = {}
    overall: Counter[str] = Counter()
    n = skipped = 0
    for i, url in enumerate(urls):
        if stop is not None and stop():
            from rag_mm.ft.preemption import Stopped

            raise Stopped(
                f"the blind prior's table stopped after {i} of {len(urls)} training shards"
            )
        try:
            for sample in _shard_samples(url):
                pair = _pair(sample)
                if pair is None:
                    skipped += 1
                    continue
                answer = normalize_answer(pair[1])
                per_question.setdefault(question_key(pair[0]), Counter())[answer] += 1
                overall[answer] += 1
                n += 1
        except (tarfile.TarError, OSError, EOFError) as exc:
            log.warning("blind prior: skipping unreadable shard %s: %s", url, exc)
    if skipped:
        log.warning(
            "blind prior: %d training samples without a picture, question or answer skipped",
            skipped,
        )
    return per_question, overall, n


def build(urls: list[str], stop: Callable[[], bool] | None = None) -> BlindPrior | None:
    """The table of the training shards ``urls`` (``count_answers``); None when no usable sample
    was read."""
    per_question, overall, n = count_answers(urls, stop)
    if not n:
        return None
    return BlindPrior(
        {q: _most_frequent(c) for q, c in per_question.items()}, _most_frequent(overall), n
    )


# ------------------------------------------------------------------------------ the cache
def fingerprint(urls: list[str]) -> str:
    """A digest of the shard list and each local shard's size and mtime: what the cache is valid
    for. A remote shard contributes its URL only (it cannot be stat'ed cheaply)."""
    parts: list = [VERSION]
    for url in urls:
        if url.startswith(REMOTE):
            parts.append([url])
            continue
        try:
            st = os.stat(url)
            parts.append([url, st.st_size, st.st_mtime_ns])
        except OSError:
            parts.append([url, None, None])
    return hashlib.sha256(json.dumps(parts).encode()).hexdigest()


def _write_atomic(path: Path, text: str) -> None:
    """``text`` into ``path`` through a temporary file in the same folder and ``os.replace``: a
    reader sees the old file or the new one, never a part."""
    # unique: two writers never share it
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        with open(tmp, "x") as f:  # created with the umask's permissions, as the run's other files
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def load_or_build(
    urls: list[str], cache: Path | None, stop: Callable[[], bool] | None = None
) -> BlindPrior | None:
    """The table of the training shards ``urls``: from ``cache`` when it was built from these
    shards (same list, sizes and mtimes), else built and written there (a folder that cannot be
    written only costs the cache). None when the shards hold no usable sample. ``stop``: as
    ``build``'s."""
    fp = fingerprint(urls)
    if cache is not None and cache.is_file():
        try:
            data = json.loads(cache.read_text())
        except (OSError, ValueError) as exc:
            log.warning("blind prior: ignoring unreadable cache %s: %s", cache, exc)
            data = None
        if isinstance(data, dict) and data.get("fingerprint") == fp:
            prior = BlindPrior.from_json(data)
            if prior is not None:
                return prior
        log.info("blind prior: %s is stale (the training shards changed): rebuilding", cache)
    prior = build(urls, stop)
    if prior is None:
        log.warning(
            "blind prior: no usable training sample in %d shard(s): not reported", len(urls)
        )
        return None
    log.info(
        "blind prior: %d training queries, %d question texts; fallback answer %r",
        prior.n_train,
        len(prior.answers),
        prior.fallback,
    )
    if cache is not None:
        try:
            _write_atomic(cache, strict_dumps(prior.to_json(fp)))
        except OSError as exc:
            log.warning("blind prior: cannot cache the table in %s: %s", cache, exc)
    return prior
