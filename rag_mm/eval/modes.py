"""Closed book, learned retrieval and oracle side by side, on one checkpoint.

    python -m rag_mm.evaluate runs/kvqa modes=all                     # every mode the run can do
    python -m rag_mm.evaluate runs/kvqa modes=closed_book,learned

The reader is evaluated three ways by switching ``retriever.mode`` on the loaded model, nothing
rebuilt: ``closed_book`` (no document), ``learned`` (the retriever's top-k; a run trained with
retrieval), ``oracle`` (each query's gold document; queries must name one). What retrieval adds is
the difference: learned minus closed book is what the retriever and the reader's reading of it
bring, oracle minus learned what a perfect retriever would still add.

``side_by_side`` keeps the headline figures of each mode in one table (metrics.json ``modes``,
one log line per mode); the full metrics of each mode travel beside it.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path

from rag_mm.components.metrics import json_safe

log = logging.getLogger(__name__)

MODES = {"closed_book": "none", "learned": "learned", "oracle": "oracle"}  # name -> retriever.mode
NAMES = {v: k for k, v in MODES.items()}
# the figures the table keeps per mode, where the metrics have them
COLUMNS = (
    "n",
    "acc",
    "acc_seen",
    "acc_heldout",
    "vqa_acc",
    "kvqa_acc",
    "kvqa_acc_seen",
    "kvqa_acc_heldout",
    "infoseek_score",
    "infoseek_unseen_question",
    "infoseek_unseen_entity",
    "recall@1",
    "recall@5",
    "recall@1_heldout",
    "recall@5_heldout",
    "pseudo_recall@1",
    "pseudo_recall@5",
    "pseudo_recall_gold",
)


class ModeError(ValueError):
    """A mode the run or the data cannot do; the message says why."""


def parse(text: str, trained: str, has_corpus: bool, gold_problem: str | None) -> list[str]:
    """The mode names ``text`` asks for ("all", or names separated by commas), checked: learned
    needs a run trained with retrieval (``trained`` its retriever.mode), oracle a corpus and gold
    documents (``gold_problem``: why the split cannot have them, None when it can)."""
    possible = {
        "closed_book": None,
        "learned": None
        if trained == "learned"
        else "the run was not trained with a retriever (retriever.mode=learned)",
        "oracle": gold_problem if has_corpus else "the run has no corpus (data.corpus)",
    }
    if text == "all":
        return [m for m in MODES if possible[m] is None]
    names = [m.strip() for m in text.split(",") if m.strip()]
    for m in names:
        if m not in MODES:
            raise ModeError(
                f"unknown mode {m!r} in modes={text} (all, or some of {', '.join(MODES)})"
            )
        if possible[m] is not None:
            raise ModeError(f"modes={text}: {m} cannot run: {possible[m]}")
    if not names:
        raise ModeError("modes= names no mode (all, or some of closed_book, learned, oracle)")
    return list(dict.fromkeys(names))


@contextmanager
def retrieval_mode(rag, name: str):
    """``rag`` reading as mode ``name`` for the duration (its retriever.mode put back after)."""
    old = rag.rcfg.mode
    rag.rcfg.mode = MODES[name]
    try:
        yield
    finally:
        rag.rcfg.mode = old


def compare(
    rag,
    split: str,
    names: list[str],
    trained: str | None,
    trained_metrics: dict,
    evaluate_mode: Callable[[str], dict],
    summary: Path,
) -> dict:
    """Evaluate ``split`` in each mode of ``names``: the mode the run trained in (``trained``)
    reuses ``trained_metrics``, the others run ``evaluate_mode(name)`` with ``rag`` switched to
    them. Logs the table (``lines``) and puts it into the run's metrics.json (``summary``) under
    ``modes.<split>`` when there is one. Returns {"table": ..., "<mode>": its full metrics}."""
    results = {}
    for name in names:
        if name == trained:
            results[name] = {k: v for k, v in trained_metrics.items() if k != "modes"}
            continue
        with retrieval_mode(rag, name):
            results[name] = evaluate_mode(name)
    table = json_safe(side_by_side(results))
    for line in lines(split, table):
        log.info("%s", line)
    if summary.is_file():
        try:
            data = json.loads(summary.read_text())
            data.setdefault("modes", {})[split] = table
            summary.write_text(json.dumps(data, indent=1, allow_nan=False))
        except (OSError, ValueError) as exc:  # an unreadable or unwritable summary is left as it is
            log.warning("modes not written into %s: %s", summary, exc)
    return {"table": table, **json_safe(results)}


def side_by_side(results: dict[str, dict]) -> dict[str, dict]:
    """{mode: {column: value}} of the COLUMNS each mode's metrics have, plus the gains:
    ``retrieval_gain`` (learned minus closed book) and ``oracle_gap`` (oracle minus learned) of the
    headline accuracy (the knowledge-VQA match where there is one, else VQA accuracy, else exact
    match)."""
    table = {m: {c: r[c] for c in COLUMNS if c in r} for m, r in results.items()}
    head = {m: headline(r) for m, r in results.items()}
    gains = {}
    if "learned" in head and "closed_book" in head:
        gains["retrieval_gain"] = head["learned"] - head["closed_book"]
    if "oracle" in head and "learned" in head:
        gains["oracle_gap"] = head["oracle"] - head["learned"]
    if gains:
        table["gains"] = gains
    return table


def headline(res: dict) -> float:
    for key in ("kvqa_acc", "vqa_acc", "acc"):
        if res.get(key) is not None:
            return res[key]
    return float("nan")


def lines(split: str, table: dict[str, dict]) -> list[str]:
    """One log line per mode, the gains last."""

    def f(x):
        return "n/a" if x is None else f"{x:.3f}"

    out = []
    for m, row in table.items():
        if m == "gains":
            out.append(f"{split}: " + ", ".join(f"{k} {v:+.3f}" for k, v in row.items()))
            continue
        parts = [
            f"acc {f(row.get('acc'))} (seen {f(row.get('acc_seen'))}, "
            f"held out {f(row.get('acc_heldout'))})"
        ]
        for key in (
            "vqa_acc",
            "kvqa_acc",
            "infoseek_score",
            "recall@1",
            "recall@5",
            "pseudo_recall@1",
            "pseudo_recall@5",
            "pseudo_recall_gold",
        ):
            if key in row:
                parts.append(f"{key} {f(row[key])}")
        out.append(f"{split} [{m}]: " + ", ".join(parts))
    return out


# ------------------------------------------------------------------------------ tables of a run
# what the evaluation notebook prints from a run's metrics.json: (column, metrics key)
RETRIEVAL = (
    ("acc seen", "acc_seen"),
    ("acc held out", "acc_heldout"),
    ("answer match", "kvqa_acc"),
    ("InfoSeek", "infoseek_score"),
    ("recall@1", "recall@1"),
    ("recall@5", "recall@5"),
    ("pseudo-recall@1", "pseudo_recall@1"),
    ("pseudo-recall@5", "pseudo_recall@5"),
    ("gold passage", "pseudo_recall_gold"),
)
RETRIEVAL_COLUMNS = ("split", "mode", "n", *(c for c, _ in RETRIEVAL))


def retrieval_rows(summary: dict | None) -> list[dict]:
    """What retrieval adds, from a run's metrics.json: one row per final split (the mode the run
    trained in), then one per split and mode of ``modes`` (``python -m rag_mm.evaluate RUN
    modes=all`` writes them); None where a metric does not apply."""
    summary = summary or {}
    rows = []
    for split in ("val", "test"):
        m = summary.get(split)
        if isinstance(m, dict):
            mode = NAMES.get(summary.get("retrieval"), summary.get("retrieval"))
            rows.append(
                {
                    "split": split,
                    "mode": f"{mode} (trained)",
                    "n": m.get("n"),
                    **{c: m.get(k) for c, k in RETRIEVAL},
                }
            )
    for split, table in (summary.get("modes") or {}).items():
        for mode, m in table.items():
            if mode != "gains":
                rows.append(
                    {
                        "split": split,
                        "mode": mode,
                        "n": m.get("n"),
                        **{c: m.get(k) for c, k in RETRIEVAL},
                    }
                )
    return rows
