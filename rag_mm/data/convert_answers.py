"""Human answers normalised at conversion, the way the VQA release normalised its annotations.

The official VQA evaluation (``rag_mm.eval.vqa_metric``) always normalises the prediction
(punctuation, number words to digits, articles, contractions, lower case) but processes the human
answers only when annotators disagree, and then only their punctuation: it trusts that the
released answers were normalised already. A user's own answers rarely are ("Seven", "Eiffel
Tower"), and then a prediction the exact match counts right scores 0 in VQA accuracy: "Seven"
predicted is compared as "7" against "Seven". Normalising every human answer (and so the training
answer) at conversion with the same function makes the two metrics agree.

``Normaliser`` does it and counts what it changed, by rule, with a few examples: the converters
put ``Normaliser.report()`` in their summary (``normalised``) and print one line of it.
"""

from __future__ import annotations

from collections import Counter

from rag_mm.eval.vqa_metric import (
    ARTICLES,
    CONTRACTIONS,
    NUMBER_WORDS,
    normalize_answer,
    process_punctuation,
)

EXAMPLES = 5  # (before, after) pairs kept in the report


def _rules(raw: str, norm: str) -> list[str]:
    """Which of the official processing steps changed ``raw`` (its normalised form ``norm``)."""
    text = raw.replace("\n", " ").replace("\t", " ").strip()
    rules = []
    if " ".join(text.split()) != text or text != raw:
        rules.append("whitespace")
    punct = process_punctuation(text)
    if punct.split() != text.split():
        rules.append("punctuation")
    words = punct.split()
    if any(w != w.lower() for w in words):
        rules.append("case")
    lower = [w.lower() for w in words]
    if any(w in NUMBER_WORDS for w in lower):
        rules.append("number_words")
    if any(w in ARTICLES for w in lower):
        rules.append("articles")
    if any(w in CONTRACTIONS for w in lower if w not in ARTICLES):
        rules.append("contractions")
    return rules or (["other"] if norm != raw else [])


class Normaliser:
    """``normalize_answer`` applied to human answers, counting what changed (``enabled`` False:
    answers pass unchanged and the report says so)."""

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        self.seen = 0
        self.changed = 0
        self.by_rule: Counter[str] = Counter()
        self.examples: list[list[str]] = []
        self.emptied = 0  # answers that normalise to nothing ("the", "?"): kept as they were

    def __call__(self, answer: str) -> str:
        self.seen += 1
        if not self.enabled:
            return answer
        norm = normalize_answer(answer)
        if not norm:
            self.emptied += 1
            return answer
        if norm != answer:
            self.changed += 1
            self.by_rule.update(_rules(answer, norm))
            if len(self.examples) < EXAMPLES and [answer, norm] not in self.examples:
                self.examples.append([answer, norm])
        return norm

    def many(self, answers: list[str]) -> list[str]:
        return [self(a) for a in answers]

    def report(self) -> dict:
        """What was normalised: answers seen and changed, changes by rule, a few examples."""
        return {
            "enabled": self.enabled,
            "answers": self.seen,
            "changed": self.changed,
            "by_rule": dict(sorted(self.by_rule.items())),
            "examples": self.examples,
            "kept_empty": self.emptied,
        }

    @staticmethod
    def describe(report: dict) -> str:
        """A ``report()`` in words, for the converter's summary on stderr."""
        if not report["enabled"]:
            return f"answers kept as given ({report['answers']}; --keep-answers)"
        rules = ", ".join(f"{k} {v}" for k, v in report["by_rule"].items()) or "none"
        ex = "; ".join(f"{a!r} -> {b!r}" for a, b in report["examples"][:3])
        return (
            "answers normalised as the VQA release: "
            f"{report['changed']} of {report['answers']} changed "
            f"(by rule: {rules})" + (f", e.g. {ex}" if ex else "")
        )
