"""Knowledge-VQA scores: InfoSeek's official match and score, Encyclopedic-VQA's exact match, and
pseudo-recall (the answer appears in a retrieved passage).

* InfoSeek (Chen et al. 2023, the ``infoseek_eval.py`` of its release): STRING and TIME answers are
  right when, lowercased with punctuation and articles removed, they equal one of the aliases;
  NUMERICAL answers when the number the prediction holds lies in the answer's range (a single
  number gets +-10%), or, for a predicted range "9-11", when it lies inside the answer's range or
  overlaps it with IoU >= 0.5. The score of a data set is the harmonic mean of the accuracies on
  its unseen-question and unseen-entity splits.
* Encyclopedic-VQA (Mensink et al. 2023, ``evaluation_utils.py``): exact match after its
  preprocessing against any ``|`` alternative; a multi_answer (parts joined by ``&&``) is right when
  the predicted parts (split at ",", " and ", " & ") overlap the reference parts with IoU >= 0.5.
  Its BEM fallback needs a BERT model from the network and is not run: the figure is a lower bound.
* Pseudo-recall (PreFLMR's, Lin et al. 2024): a query counts when one of its answers appears, as
  whole words after lowercasing and punctuation removal, in one of the top-k retrieved passages.
"""

from __future__ import annotations

import re
import string

INFOSEEK_TOLERANCE = 0.1  # a single-number answer's range: +-10% (infoseek_eval.py)
RANGE_IOU = 0.5  # a predicted range must overlap the answer's at least this much (both scripts)
_PUNCT = set(string.punctuation)
_EVQA_PUNCT = set(string.punctuation + "‘’´`_")
_ARTICLES = re.compile(r"\b(a|an|the)\b")
_EVQA_ARTICLES = re.compile(r"\b(the answer is|a|an|the)\b")
_NUMBER = re.compile(r"[-+]?[.]?[\d]+(?:,\d\d\d)*[\.]?\d*(?:[eE][-+]?\d+)?")
# E-VQA's digit and yes/no table (evaluation_utils._DIGIT_MAP)
_EVQA_WORDS = {
    "none": "0",
    "zero": "0",
    "one": "1",
    "two": "2",
    "three": "3",
    "four": "4",
    "five": "5",
    "six": "6",
    "seven": "7",
    "eight": "8",
    "nine": "9",
    "ten": "10",
    "entailment": "yes",
    "true": "yes",
    "contradiction": "no",
    "false": "no",
}


# ------------------------------------------------------------------------------ InfoSeek
def infoseek_normalize(text: str) -> str:
    """InfoSeek's answer normalisation: lower case, punctuation, articles, whitespace."""
    text = "".join(ch for ch in text.lower() if ch not in _PUNCT)
    return " ".join(_ARTICLES.sub(" ", text).split())


def parse_number(text: str) -> float | list[float]:
    """InfoSeek's ``process_numerical_answer``: the number in ``text``, or ``[lo, hi]`` for a range
    ("9-11", "between 9 and 11"); ``[0, 0]`` when it holds none."""
    idx = [i for i, c in enumerate(text) if c == "-" and i >= 1 and text[i - 1].isdigit()]
    text = "".join(" - " if i in idx else c for i, c in enumerate(text))  # "9-10" -> "9 - 10"
    nums = []
    for n in (m.replace(",", "").strip(".") for m in _NUMBER.findall(text)):
        nums.append(float(n.split(".")[0] if n.count(".") > 1 else n))
    nums = nums[:2]
    if len(nums) == 2:
        return [nums[0], nums[1]] if nums[0] <= nums[1] else nums[0]
    return nums[0] if nums else [0.0, 0.0]


def _iou(a: list[float], b: list[float]) -> float:
    lo1, hi1, lo2, hi2 = min(a), max(a), min(b), max(b)
    overlap = max(0.0, min(hi1, hi2) - max(lo1, lo2))
    la, lb = (hi1 - lo1) + 1e-12, (hi2 - lo2) + 1e-12
    union = la + lb - overlap
    return overlap / union if union else 0.0


def numeric_match(prediction: str, answer_range: list[float]) -> bool:
    """InfoSeek's relaxed numeric match of ``prediction`` against ``[lo, hi]``."""
    lo, hi = answer_range
    if lo == hi:  # a single number: +-10%
        lo, hi = sorted((lo * (1 - INFOSEEK_TOLERANCE), lo * (1 + INFOSEEK_TOLERANCE)))
    pred = parse_number(prediction)
    if not isinstance(pred, list):
        return lo <= pred <= hi
    if lo <= pred[0] <= hi and lo <= pred[1] <= hi:
        return True
    return _iou(pred, [lo, hi]) >= RANGE_IOU - 1e-12


def infoseek_correct(prediction: str, kvqa: dict) -> bool:
    if kvqa.get("qtype") == "numerical" and kvqa.get("range"):
        return numeric_match(prediction, kvqa["range"])
    pred = infoseek_normalize(prediction)
    return any(pred == infoseek_normalize(a) for a in kvqa["aliases"])


def harmonic_mean(*values: float) -> float:
    """InfoSeek's final score: the harmonic mean. Its script counts a zero as 1e-12 and rounds the
    result to two decimals of a percentage, so a zero anywhere scores 0."""
    if any(v <= 0 for v in values):
        return 0.0
    return len(values) / sum(1.0 / v for v in values)


# ------------------------------------------------------------------------------ Encyclopedic-VQA
def evqa_normalize(text: str) -> str:
    """E-VQA's ``preprocess_answer``: lower case, punctuation, articles, digits, contractions."""
    from rag_mm.eval.vqa_metric import CONTRACTIONS

    text = "".join(
        "" if c in _EVQA_PUNCT else c
        for c in text.lower().replace("\n", " ").replace("\t", " ").strip()
    )
    words = [_EVQA_WORDS.get(w, w) for w in _EVQA_ARTICLES.sub(" ", text).split()]
    return " ".join(CONTRACTIONS.get(w, w) for w in words)


def evqa_correct(prediction: str, kvqa: dict) -> bool:
    multi = kvqa.get("qtype") == "multi_answer"
    for ref in kvqa["aliases"]:
        if multi:
            refs = {p for p in (evqa_normalize(r) for r in ref.split("&&")) if p}
            cand = prediction.replace(" and ", ",").replace(" & ", ",").split(",")
            preds = {p for p in (evqa_normalize(c) for c in cand) if p}
            if refs and len(refs & preds) / len(refs | preds) >= RANGE_IOU:
                return True
        elif evqa_normalize(ref.replace("&&", " and ")) == evqa_normalize(prediction):
            return True
    return False


_SPLIT_DIGITS = re.compile(r"(?<=\d) (?=\d)")


def rejoin_digits(text: str) -> str:
    """A decoded answer's numbers made whole: CLIP's BPE encodes digits one by one and decodes
    them spaced ("320" comes back as "3 2 0")."""
    return _SPLIT_DIGITS.sub("", text)


def correct(prediction: str, kvqa: dict) -> bool:
    """Whether ``prediction`` answers a knowledge-VQA query (its json's ``kvqa``) by its source's
    rule."""
    prediction = rejoin_digits(prediction)
    return (
        evqa_correct(prediction, kvqa)
        if kvqa.get("source") == "evqa"
        else infoseek_correct(prediction, kvqa)
    )


# ------------------------------------------------------------------------------ pseudo-recall
_TO_SPACE = str.maketrans({c: " " for c in string.punctuation})


def _words(text: str) -> str:
    """``text`` lowercased, punctuation as spaces, single-spaced, padded: whole-word matching."""
    return " " + " ".join(text.lower().translate(_TO_SPACE).split()) + " "


class PassageMatcher:
    """Pseudo-recall: whether an answer appears in a passage; passages are normalised once each."""

    def __init__(self, passages: list[str]) -> None:
        self.passages = passages
        self._norm: dict[int, str] = {}

    @staticmethod
    def needles(answers: list[str]) -> list[str]:
        """The answers as ``contains`` looks for them (normalise once per query)."""
        return [w for w in (_words(a) for a in answers) if w.strip()]

    def contains(self, row: int, needles: list[str]) -> bool:
        if row not in self._norm:
            self._norm[row] = _words(self.passages[row])
        text = self._norm[row]
        return any(w in text for w in needles)


def answer_strings(answer: str, answers: list[str] | None, kvqa: dict | None) -> list[str]:
    """The strings pseudo-recall looks for: the aliases (multi-answer parts each), the human
    answers, the training answer."""
    out = [answer]
    if answers:
        out += answers
    if kvqa:
        out += [p for a in kvqa["aliases"] for p in a.split("&&")]
    return list(dict.fromkeys(a for a in out if a and a.strip()))
