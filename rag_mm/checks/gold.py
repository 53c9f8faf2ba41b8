"""Settings that need each query's gold document, checked against the data before any work.

A query names its gold document with ``doc_id`` in its json (the knowledge world does; VQA data
converted by ``scripts/convert.py`` does not). Three settings read it:

* ``retriever.mode=oracle`` hands the reader each query's gold document: every query needs one;
* the retriever's warm-up (``retriever.warmup_steps``) and its in-batch contrastive term
  (``retriever.contrastive_steps`` != 0) match queries with their gold documents. Without gold
  documents they train on pseudo-queries alone (``retriever.pseudo_queries``: random views of the
  memory's own pictures, each querying its own document, self-supervised as Contriever trains);
  without those either they have nothing to learn from.

recall@k needs gold documents too, but is no setting: evaluation reports it over the queries that
name one, and leaves it out when none does.

``peek`` reads the json of the first samples of a split's first readable shard (no picture is
decoded); ``check`` raises one ``ConfigError`` naming every setting the data cannot feed.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from itertools import islice

from rag_mm.config import ConfigError, TrainConfig

log = logging.getLogger(__name__)
PEEK = 64  # samples read: a converted data set names a doc_id in every query or in none
# shards tried when the first ones are unreadable (the pipeline reports those itself)
MAX_SHARDS = 4


@dataclass
class Peek:
    """What the first samples of a split say about gold documents."""

    shard: str  # the first shard read
    read: int  # samples whose json could be read
    with_gold: int  # of them, samples naming a doc_id

    @property
    def none(self) -> bool:
        return self.with_gold == 0

    @property
    def all(self) -> bool:
        return self.with_gold == self.read


def peek(urls: list[str], n: int = PEEK) -> Peek | None:
    """The gold documents named by the first ``n`` samples of ``urls`` (shards in order); None when
    no sample's json could be read (the data pipeline then names the unusable shards)."""
    import webdataset as wds

    read = with_gold = 0
    first = ""
    for url in urls[:MAX_SHARDS]:
        pipe = wds.DataPipeline(
            wds.SimpleShardList([url]), wds.tarfile_to_samples(handler=wds.ignore_and_continue)
        )
        try:
            for sample in islice(pipe, n - read):
                try:
                    meta = json.loads(sample["json"]) if "json" in sample else {}
                except (ValueError, TypeError):
                    continue
                if not isinstance(meta, dict):
                    continue
                first = first or url
                read += 1
                with_gold += meta.get("doc_id") is not None
        except OSError:  # an unreadable shard: the next one
            continue
        if read >= n:
            break
    return Peek(first, read, with_gold) if read else None


def needs(cfg: TrainConfig) -> list[str]:
    """The settings of ``cfg`` that cannot run on queries naming no gold document."""
    r, out = cfg.retriever, []
    if r.mode == "oracle":
        out.append("retriever.mode=oracle (the reader reads each query's gold document)")
    if r.mode == "learned" and r.pseudo_queries == 0:
        if r.warmup_steps > 0:
            out.append(
                f"retriever.warmup_steps={r.warmup_steps} (the warm-up matches queries with their "
                "gold documents)"
            )
        if r.contrastive_steps != 0 and r.contrastive_weight > 0:
            out.append(
                f"retriever.contrastive_steps={r.contrastive_steps} (the in-batch contrastive "
                "term matches queries with their gold documents)"
            )
    return out


def check(cfg: TrainConfig) -> bool:
    """Whether the training queries name their gold documents; raises a ConfigError, before any
    work, when a setting needs gold documents the data does not name. Evaluation splits are read
    too under ``retriever.mode=oracle``, which needs a gold document for every query."""
    from rag_mm.data.urls import expand_urls

    need = needs(cfg)
    train = peek(expand_urls(cfg.data.root, cfg.data.train))
    if train is None:  # nothing readable: the data pipeline's own error names the shards
        return True
    problems = []
    learned = [n for n in need if not n.startswith("retriever.mode=oracle")]
    if train.none and learned:
        problems.append(
            "data.train: the queries name no gold document (no doc_id in the json of the first "
            f"{train.read} samples of {train.shard}), and "
            f"{'these settings need' if len(learned) > 1 else 'this setting needs'} one: "
            f"{'; '.join(learned)}"
        )
    if (
        cfg.retriever.mode == "oracle"
    ):  # the reader reads every query's gold document, in evaluation too
        problems += [
            p
            for split in ("train", "val", "test")
            if (p := oracle_problem(cfg, split, train if split == "train" else None)) is not None
        ]
    if problems:
        raise ConfigError("\n  - ".join(["gold documents:", *problems]) + "\n" + HINT)
    if train.none and cfg.retriever.mode == "learned":
        log.info(
            "the training queries name no gold document: the retriever's contrastive terms train "
            "on %d pseudo-queries per step (random views of the memory's pictures)",
            cfg.retriever.pseudo_queries,
        )
    return not train.none


def oracle_problem(cfg: TrainConfig, split: str, seen: Peek | None = None) -> str | None:
    """Why ``retriever.mode=oracle`` cannot read ``data.<split>`` (None when its first samples all
    name their gold document); ``seen``: the split's peek, when already taken."""
    from rag_mm.data.urls import expand_urls

    got = seen or peek(expand_urls(cfg.data.root, getattr(cfg.data, split)))
    if got is None or got.all:
        return None
    return (
        f"data.{split}: {got.read - got.with_gold} of the first {got.read} samples of {got.shard} "
        "name no doc_id, and retriever.mode=oracle reads every query's gold document"
    )


HINT = (
    "  without gold documents: retriever=none (closed book), or retriever=learned with "
    "retriever.pseudo_queries=32 (the warm-up and the contrastive term then train on random views "
    "of the memory's own pictures), or retriever.warmup_steps=0 retriever.contrastive_steps=0 "
    "(the reader-driven loss alone)"
)
