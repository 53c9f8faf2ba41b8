"""What retrieval adds, summed per batch by ``rag_mm.evaluate.evaluate``: knowledge-VQA scores of
the greedy answers (seen vs unseen entities, InfoSeek's unseen-question / unseen-entity splits) and
pseudo-recall@k of the documents the model read or retrieved.

All sums live in one float64 tensor (``sums``), all-reduced with the evaluation's others;
``results`` turns the reduced tensor into metrics (``rag_mm.eval.kvqa_metric`` defines each score):

* ``kvqa_acc`` / ``kvqa_acc_seen`` / ``kvqa_acc_heldout`` (``n_kvqa``): the source's own match
  (InfoSeek's relaxed numeric match and aliases, E-VQA's multi-answer match) of the greedy answer;
* ``infoseek_score``: the harmonic mean of ``infoseek_unseen_question`` and
  ``infoseek_unseen_entity``, when the queries are InfoSeek's and both splits have some;
* ``pseudo_recall@k``: the share of queries one of whose answers appears in a top-k passage
  (learned retrieval), ``pseudo_recall_gold`` the same for the gold passage (oracle: whether the
  memory holds the answer in words a reader can copy), each with its ``_heldout`` variant.
"""

from __future__ import annotations

import torch

from rag_mm.eval.kvqa_metric import PassageMatcher, answer_strings, correct, harmonic_mean

# columns of the sums: knowledge-VQA queries and correct answers (seen, held out), InfoSeek's
# unseen-question and unseen-entity splits, pseudo-recall queries (all, held out), gold passages
# holding the answer (all, held out), then pseudo-recall hits per k (all, held out)
BASE = (
    "kv_n_seen",
    "kv_c_seen",
    "kv_n_held",
    "kv_c_held",
    "uq_n",
    "uq_c",
    "ue_n",
    "ue_c",
    "pr_n",
    "pr_n_held",
    "pr_gold",
    "pr_gold_held",
)


class KnowledgeSums:
    def __init__(self, recall_at: tuple[int, ...], passages: list[str]) -> None:
        self.recall_at = recall_at
        self.col = {name: i for i, name in enumerate(BASE)}
        for k in recall_at:
            self.col[f"pr@{k}"] = len(self.col)
            self.col[f"pr@{k}_held"] = len(self.col)
        self.sums = torch.zeros(len(self.col), dtype=torch.float64)
        self.matcher = PassageMatcher(passages)

    def _add(self, name: str, value: float = 1.0) -> None:
        self.sums[self.col[name]] += value

    def add_answers(self, batch: dict, rows: list[int], texts: list[str]) -> None:
        """Score the greedy answers ``texts`` of the knowledge-VQA queries ``rows`` of ``batch``."""
        for r, text in zip(rows, texts):
            kv = batch["kvqa"][r]
            ok = float(correct(text, kv))
            held = bool(batch["heldout"][r])
            self._add("kv_n_held" if held else "kv_n_seen")
            self._add("kv_c_held" if held else "kv_c_seen", ok)
            split = str(kv.get("split") or "")
            if kv.get("source") == "infoseek" and split.endswith(
                ("unseen_question", "unseen_entity")
            ):
                part = "ue" if split.endswith("unseen_entity") else "uq"
                self._add(f"{part}_n")
                self._add(f"{part}_c", ok)

    def add_passages(self, batch: dict, doc_ids: torch.Tensor, store, gold: bool) -> None:
        """Pseudo-recall of the documents ``doc_ids`` (B, K) (``gold``: the oracle's gold one)."""
        ids = doc_ids.cpu()
        known = ids >= 0  # faiss pads short result lists with -1
        rows = store.rows(torch.where(known, ids, int(store.ids[0]))).tolist()
        answers = batch.get("answers") or [None] * len(rows)
        kvqas = batch.get("kvqa") or [None] * len(rows)
        for b, (row_ids, ok) in enumerate(zip(rows, known.tolist())):
            strings = self.matcher.needles(answer_strings(batch["answer"][b], answers[b], kvqas[b]))
            if not strings:
                continue
            held = bool(batch["heldout"][b])
            hits = [o and self.matcher.contains(r, strings) for r, o in zip(row_ids, ok)]
            self._add("pr_n")
            self._add("pr_n_held", float(held))
            if gold:
                self._add("pr_gold", float(hits[0]))
                self._add("pr_gold_held", float(hits[0] and held))
                continue
            for k in self.recall_at:
                hit = float(any(hits[:k]))
                self._add(f"pr@{k}", hit)
                self._add(f"pr@{k}_held", hit * held)

    def results(self, sums: torch.Tensor, gold: bool) -> dict:
        """Metrics from the all-reduced ``sums`` (``gold``: the oracle read the gold documents)."""
        s = {name: float(sums[i]) for name, i in self.col.items()}
        res: dict = {}
        n = s["kv_n_seen"] + s["kv_n_held"]
        if n:
            res["n_kvqa"] = int(n)
            res["kvqa_acc"] = (s["kv_c_seen"] + s["kv_c_held"]) / n
            res["kvqa_acc_seen"] = s["kv_c_seen"] / s["kv_n_seen"] if s["kv_n_seen"] else None
            res["kvqa_acc_heldout"] = s["kv_c_held"] / s["kv_n_held"] if s["kv_n_held"] else None
        if s["uq_n"] and s["ue_n"]:
            uq, ue = s["uq_c"] / s["uq_n"], s["ue_c"] / s["ue_n"]
            res.update(
                infoseek_unseen_question=uq,
                infoseek_unseen_entity=ue,
                infoseek_score=harmonic_mean(uq, ue),
            )
        if s["pr_n"]:
            held = s["pr_n_held"]
            if gold:
                res["pseudo_recall_gold"] = s["pr_gold"] / s["pr_n"]
                res["pseudo_recall_gold_heldout"] = s["pr_gold_held"] / held if held else None
            else:
                for k in self.recall_at:
                    res[f"pseudo_recall@{k}"] = s[f"pr@{k}"] / s["pr_n"]
                    res[f"pseudo_recall@{k}_heldout"] = s[f"pr@{k}_held"] / held if held else None
        return res


def _fmt(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.3f}"


def retrieval_line(res: dict, recall_at: tuple[int, ...]) -> str:
    """Seen / held-out accuracy, recall@k against gold, pseudo-recall and the InfoSeek score of a
    split's metrics, in words ('' when it has none of them)."""
    parts = [
        f"exact match seen {_fmt(res.get('acc_seen'))} / held out {_fmt(res.get('acc_heldout'))}"
    ]
    if "kvqa_acc" in res:
        parts.append(
            f"answer match seen {_fmt(res.get('kvqa_acc_seen'))} / held out "
            f"{_fmt(res.get('kvqa_acc_heldout'))}"
        )
    if "infoseek_score" in res:
        parts.append(
            f"InfoSeek score {100 * res['infoseek_score']:.2f} "
            f"(unseen question {100 * res['infoseek_unseen_question']:.2f}, "
            f"unseen entity {100 * res['infoseek_unseen_entity']:.2f})"
        )
    for name in ("recall", "pseudo_recall"):
        ks = [k for k in recall_at if f"{name}@{k}" in res]
        if ks:
            parts.append(
                f"{name.replace('_', '-')}@"
                + "/".join(map(str, ks))
                + " "
                + "/".join(_fmt(res[f"{name}@{k}"]) for k in ks)
                + " (held out "
                + "/".join(_fmt(res.get(f"{name}@{k}_heldout")) for k in ks)
                + ")"
            )
    if "pseudo_recall_gold" in res:
        parts.append(f"answer in the gold passage {_fmt(res['pseudo_recall_gold'])}")
    return "; ".join(parts) if len(parts) > 1 or res.get("n_heldout") else ""
