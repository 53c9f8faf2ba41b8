"""The VQA soft accuracy, as the official evaluation computes it.

An answer is right to the degree that humans gave it: ``acc = min(#humans that said it / 3, 1)``
(Antol et al., "VQA: Visual Question Answering", ICCV 2015), averaged over the ten subsets of nine
of the ten annotators (each annotator left out in turn) as the official script does
(github.com/GT-Vision-Lab/VQA, ``PythonEvaluationTools/vqaEvaluation/vqaEval.py``, used for VQAv2,
OK-VQA and A-OKVQA's direct answers). The normalisation below follows that script line by line,
its quirks included: the prediction is always normalised (punctuation, then number words, articles
and contractions), the human answers only have their punctuation processed and only when they
disagree (the released annotations are already normalised otherwise).
"""

from __future__ import annotations

import re

# The official tables, verbatim: contractions without apostrophe -> with (so "isnt" -> "isn't");
# the capitalised keys can never match (words are lowercased first), as in the original.
CONTRACTIONS = {
    "aint": "ain't",
    "arent": "aren't",
    "cant": "can't",
    "couldve": "could've",
    "couldnt": "couldn't",
    "couldn'tve": "couldn't've",
    "couldnt've": "couldn't've",
    "didnt": "didn't",
    "doesnt": "doesn't",
    "dont": "don't",
    "hadnt": "hadn't",
    "hadnt've": "hadn't've",
    "hadn'tve": "hadn't've",
    "hasnt": "hasn't",
    "havent": "haven't",
    "hed": "he'd",
    "hed've": "he'd've",
    "he'dve": "he'd've",
    "hes": "he's",
    "howd": "how'd",
    "howll": "how'll",
    "hows": "how's",
    "Id've": "I'd've",
    "I'dve": "I'd've",
    "Im": "I'm",
    "Ive": "I've",
    "isnt": "isn't",
    "itd": "it'd",
    "itd've": "it'd've",
    "it'dve": "it'd've",
    "itll": "it'll",
    "let's": "let's",
    "maam": "ma'am",
    "mightnt": "mightn't",
    "mightnt've": "mightn't've",
    "mightn'tve": "mightn't've",
    "mightve": "might've",
    "mustnt": "mustn't",
    "mustve": "must've",
    "neednt": "needn't",
    "notve": "not've",
    "oclock": "o'clock",
    "oughtnt": "oughtn't",
    "ow's'at": "'ow's'at",
    "'ows'at": "'ow's'at",
    "'ow'sat": "'ow's'at",
    "shant": "shan't",
    "shed've": "she'd've",
    "she'dve": "she'd've",
    "she's": "she's",
    "shouldve": "should've",
    "shouldnt": "shouldn't",
    "shouldnt've": "shouldn't've",
    "shouldn'tve": "shouldn't've",
    "somebody'd": "somebodyd",
    "somebodyd've": "somebody'd've",
    "somebody'dve": "somebody'd've",
    "somebodyll": "somebody'll",
    "somebodys": "somebody's",
    "someoned": "someone'd",
    "someoned've": "someone'd've",
    "someone'dve": "someone'd've",
    "someonell": "someone'll",
    "someones": "someone's",
    "somethingd": "something'd",
    "somethingd've": "something'd've",
    "something'dve": "something'd've",
    "somethingll": "something'll",
    "thats": "that's",
    "thered": "there'd",
    "thered've": "there'd've",
    "there'dve": "there'd've",
    "therere": "there're",
    "theres": "there's",
    "theyd": "they'd",
    "theyd've": "they'd've",
    "they'dve": "they'd've",
    "theyll": "they'll",
    "theyre": "they're",
    "theyve": "they've",
    "twas": "'twas",
    "wasnt": "wasn't",
    "wed've": "we'd've",
    "we'dve": "we'd've",
    "weve": "we've",
    "werent": "weren't",
    "whatll": "what'll",
    "whatre": "what're",
    "whats": "what's",
    "whatve": "what've",
    "whens": "when's",
    "whered": "where'd",
    "wheres": "where's",
    "whereve": "where've",
    "whod": "who'd",
    "whod've": "who'd've",
    "who'dve": "who'd've",
    "wholl": "who'll",
    "whos": "who's",
    "whove": "who've",
    "whyll": "why'll",
    "whyre": "why're",
    "whys": "why's",
    "wont": "won't",
    "wouldve": "would've",
    "wouldnt": "wouldn't",
    "wouldnt've": "wouldn't've",
    "wouldn'tve": "wouldn't've",
    "yall": "y'all",
    "yall'll": "y'all'll",
    "y'allll": "y'all'll",
    "yall'd've": "y'all'd've",
    "y'alld've": "y'all'd've",
    "y'all'dve": "y'all'd've",
    "youd": "you'd",
    "youd've": "you'd've",
    "you'dve": "you'd've",
    "youll": "you'll",
    "youre": "you're",
    "youve": "you've",
}
NUMBER_WORDS = {
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
}
ARTICLES = ("a", "an", "the")
PUNCT = (
    ";",
    "/",
    "[",
    "]",
    '"',
    "{",
    "}",
    "(",
    ")",
    "=",
    "+",
    "\\",
    "_",
    "-",
    ">",
    "<",
    "@",
    "`",
    ",",
    "?",
    "!",
)
# "(?!<=\d)" is the official script's (broken) look-behind: in effect a period not followed by a
# digit goes, so "dogs." loses it and "2.5" keeps it.
PERIOD_STRIP = re.compile(r"(?!<=\d)(\.)(?!\d)")
COMMA_STRIP = re.compile(r"(\d)(,)(\d)")
# The script calls periodStrip.sub("", text, re.UNICODE): re.UNICODE (32) lands in sub's count.
PERIOD_COUNT = int(re.UNICODE)
HUMANS_FOR_FULL_CREDIT = 3  # an answer three annotators gave is fully right


def process_punctuation(text: str) -> str:
    """The official ``processPunctuation``: each mark in ``PUNCT`` is deleted where it touches a
    space (or the text holds a digit-comma-digit, as in "1,000"), else replaced by a space; then
    periods not followed by a digit are deleted."""
    out = text
    for p in PUNCT:
        if (p + " " in text or " " + p in text) or COMMA_STRIP.search(text) is not None:
            out = out.replace(p, "")
        else:
            out = out.replace(p, " ")
    return PERIOD_STRIP.sub("", out, PERIOD_COUNT)


def process_digit_article(text: str) -> str:
    """The official ``processDigitArticle``: lowercase, number words zero..ten to digits ("none"
    counts as 0), articles a/an/the dropped, apostrophe-less contractions restored, single
    spaces."""
    words = [NUMBER_WORDS.get(w, w) for w in text.lower().split()]
    words = [CONTRACTIONS.get(w, w) for w in words if w not in ARTICLES]
    return " ".join(words)


def normalize_answer(text: str) -> str:
    """A predicted answer as the official evaluation compares it: newlines and tabs to spaces,
    stripped, punctuation processed, then numbers, articles and contractions.

    >>> normalize_answer("Two dogs."), normalize_answer("isnt"), normalize_answer("The T-shirt")
    ('2 dogs', "isn't", 't shirt')
    """
    text = text.replace("\n", " ").replace("\t", " ").strip()
    return process_digit_article(process_punctuation(text))


def vqa_accuracy(prediction: str, answers: list[str]) -> float:
    """VQA accuracy of ``prediction`` against the human ``answers`` (ten in VQAv2, OK-VQA and
    A-OKVQA): the mean over each annotator left out of ``min(matches among the others / 3, 1)``.

    Two of ten humans agreeing gives (2 * 1/3 + 8 * 2/3) / 10 = 0.6; three or more of ten, 0.9 and
    1.
    """
    if not answers:
        raise ValueError("vqa_accuracy needs at least one human answer")
    pred = normalize_answer(prediction)
    gts = list(answers)
    if (
        len(set(gts)) > 1
    ):  # as the official script: human answers are only processed when they disagree
        gts = [process_punctuation(a) for a in gts]
    same = [a == pred for a in gts]
    total = sum(same)
    # leave annotator i out: the others that gave the prediction are total minus i's own match
    return sum(min(1.0, (total - s) / HUMANS_FOR_FULL_CREDIT) for s in same) / len(gts)


# VQA's answer types (the ``answer_type`` of VQAv2's annotations), in the order reports list them.
ANSWER_TYPES = ("yes/no", "number", "other")
DIGITS = re.compile(r"[0-9]+")


def answer_type(given: str | None, gold: str) -> str:
    """The VQA answer type of a query: ``given`` (the annotation's ``answer_type``) when it is one
    of ``ANSWER_TYPES``, else inferred from the normalised gold answer as VQAv2's annotators' types
    mostly fall: "yes/no" for yes or no, "number" for digits only (number words count: "two" is
    normalised to "2"), "other" for the rest.

    >>> (answer_type(None, "Two"), answer_type(None, "No."), answer_type("other", "yes"),
    ...  answer_type(None, "red"))
    ('number', 'yes/no', 'other', 'other')
    """
    if given in ANSWER_TYPES:
        return given
    norm = normalize_answer(gold)
    if norm in ("yes", "no"):
        return "yes/no"
    return "number" if DIGITS.fullmatch(norm) else "other"
