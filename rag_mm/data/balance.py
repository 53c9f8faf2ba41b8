"""Answer balancing: train on each question text's answers more evenly than the data asks them.

A picture-question set often answers one question text mostly one way ("is there a red shape?"
is "no" for four pictures in five). A reader then learns the answer the text usually has before it
learns to look, and the minority answer, the one that needs the picture, stays wrong longest.
``data.balance_answers`` (beta in [0, 1]) draws the training stream so that within each question
text the answers come in proportion to ``count ** (1 - beta)`` instead of ``count``: 0 leaves the
data as it is, 1 gives every answer of a question text equal weight. This is the smoothing
multilingual training applies to its languages' shares (XLM, Conneau & Lample 2019), applied to a
question's answers; done by keeping each sample with probability ``(c_min / c) ** beta`` (``c``
its answer's count under its question text, ``c_min`` that text's rarest answer's), so the
reader's loss and every layout's token count stay as they are. Nothing is weighted: the majority
answers are seen less often. A question text with a long tail of answers seen once would keep
little of its common answers: balancing is for sets with a few answers per question text
(yes/no, colours, counts), not for open-ended VQA.

The keep decision of a sample depends on the seed, the epoch and the sample's key only, so a
resumed stream drops the same samples as the run it continues, whichever worker reads them.
"""

from __future__ import annotations

import logging
import random
import zlib
from collections import Counter
from dataclasses import dataclass

from rag_mm.eval.blind_prior import count_answers, question_key
from rag_mm.eval.vqa_metric import normalize_answer

log = logging.getLogger(__name__)


def keep_probabilities(
    per_question: dict[str, Counter[str]], beta: float
) -> dict[str, dict[str, float]]:
    """question key -> answer -> probability of keeping a sample with it: ``(c_min / c) ** beta``.
    Question texts whose answers are already even (every keep 1) are left out of the table.

    >>> keep_probabilities({"is it red": Counter(no=80, yes=20)}, 1.0)
    {'is it red': {'no': 0.25, 'yes': 1.0}}
    """
    table = {}
    for q, counts in per_question.items():
        rarest = min(counts.values())
        keep = {a: (rarest / c) ** beta for a, c in counts.items()}
        if min(keep.values()) < 1.0:
            table[q] = keep
    return table


@dataclass
class AnswerBalance:
    """The training stream's keep rule (``StreamSpec.keep``): called on a decoded sample, True
    when the stream keeps it. A plain picklable object: the loader's worker processes get a copy."""

    keep: dict[str, dict[str, float]]  # question key -> answer -> probability of keeping
    seed: int  # the run's seed: another run drops other samples
    kept_share: float  # the expected share of the training samples kept, for the log

    def __call__(self, sample: dict) -> bool:
        by_answer = self.keep.get(question_key(sample["question"]))
        if by_answer is None:
            return True
        p = by_answer.get(normalize_answer(sample["answer"]), 1.0)
        if p >= 1.0:
            return True
        # one draw per (seed, epoch, sample): the same on a resumed stream and in any worker
        u = random.Random(
            zlib.crc32(f"{self.seed}-{sample['epoch']}-{sample['key']}-balance".encode())
        ).random()
        return u < p


def answer_balance(urls: list[str], beta: float, seed: int) -> AnswerBalance | None:
    """The keep rule for training shards ``urls`` at strength ``beta``; None when no question text
    of them needs one (every text's answers already even, or no usable sample)."""
    per_question, _, n = count_answers(urls)
    table = keep_probabilities(per_question, beta)
    if not n or not table:
        log.info("answer balancing: no question text of the training set needs it")
        return None
    kept = sum(
        c * table.get(q, {}).get(a, 1.0)
        for q, counts in per_question.items()
        for a, c in counts.items()
    )
    rule = AnswerBalance(table, seed, kept / n)
    log.info(
        "answer balancing (beta %.2f): %d of %d question texts rebalanced, %.1f%% of %d training "
        "samples kept per pass",
        beta,
        len(table),
        len(per_question),
        100 * rule.kept_share,
        n,
    )
    return rule
