"""Does the reader use the picture? The blind prior (question text -> most frequent training answer)
on hand-made shards, its cache, the VQA answer types, and the image ablation with stub readers whose
answers do or do not depend on the picture."""

from __future__ import annotations

import io
import json
import logging
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import webdataset as wds
from PIL import Image

from rag_mm.components.metrics import json_safe
from rag_mm.data.pipeline import StreamSpec, collate, make_loader
from rag_mm.data.tokenizer import get_tokenizer
from rag_mm.eval import blind_prior
from rag_mm.eval.blind_prior import BlindPrior, load_or_build, question_key
from rag_mm.eval.vqa_metric import answer_type
from rag_mm.evaluate import evaluate

CPU = torch.device("cpu")


def _png(colour=(120, 30, 200)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (8, 8), colour).save(buf, format="PNG")
    return buf.getvalue()


def _shard(path: Path, rows: list[tuple]) -> Path:
    """A query shard: per row (question, json meta or raw json text, with a picture?)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with wds.TarWriter(str(path)) as sink:
        for i, (question, meta, picture) in enumerate(rows):
            sample = {
                "__key__": f"q{i:06d}",
                "txt": question,
                "json": meta if isinstance(meta, str) else json.dumps(meta),
            }
            if picture:
                sample["png"] = _png()
            sink.write(sample)
    return path


# Two training shards. Normalised answers per question key:
#   "what colour is it": red x3 ("red", "red", "Red."), blue x1            -> red
#   "is it round":       yes x2, no x1                                       -> yes
#   "how many":          2 x2 ("two", "2"), 3 x1                             -> 2
# Overall: red 3, yes 2, 2 2, blue 1, no 1, 3 1                              -> fallback red
# Not counted: a sample without a picture ("square"), one with bad JSON, one without an answer.
TRAIN = [
    [
        ("What colour is it?", {"answer": "red"}, True),
        ("what colour  is it", {"answer": "Red."}, True),
        ("Is it round?", {"answer": "yes"}, True),
        ("How many?", {"answer": "two"}, True),
        ("How many?", {"answer": "square"}, False),
        ("How many?", {"answer": "3"}, True),
    ],
    [
        ("What colour is it ?", {"answer": "red"}, True),
        ("What colour is it?", {"answer": "blue"}, True),
        ("Is it round?", {"answer": "yes"}, True),
        ("Is it round?", {"answer": "no"}, True),
        ("How many?", {"answer": "2"}, True),
        ("How many?", '{"answer": ', True),
        ("Is it round?", {"doc_id": 3}, True),
    ],
]


def _train_shards(root: Path) -> list[str]:
    return [
        str(_shard(root / "train" / f"train-{i:06d}.tar", rows)) for i, rows in enumerate(TRAIN)
    ]


def test_question_key_and_answer_types():
    assert (
        question_key("  What colour\tis it ?!\n")
        == question_key("what colour is it")
        == "what colour is it"
    )
    assert question_key("What is 2.5") == "what is 2.5"  # only trailing punctuation goes
    # inferred from the normalised gold answer ...
    assert [answer_type(None, a) for a in ("Yes", "no.", "Two", "12", "1.5", "red", "")] == [
        "yes/no",
        "yes/no",
        "number",
        "number",
        "other",
        "other",
        "other",
    ]
    # ... unless the annotation says (VQAv2 types "yes" questions as "other" at times); an unknown
    # annotation value is inferred past
    assert answer_type("other", "yes") == "other" and answer_type("number", "many") == "number"
    assert answer_type("colour", "yes") == "yes/no"


def test_blind_prior_table_from_shards(tmp_path):
    prior = blind_prior.build(_train_shards(tmp_path))
    assert prior.answers == {"what colour is it": "red", "is it round": "yes", "how many": "2"}
    assert prior.fallback == "red" and prior.n_train == 10
    assert prior.answer("WHAT colour is it") == "red" and prior.answer("Never asked?") == "red"
    # scored as the reader: exact match of normalised answers, or the VQA accuracy of human answers
    assert prior.score("Is it round?", "No", None) == 0.0
    assert prior.score("How many", "3", ["2", "2"] + ["3"] * 8) == pytest.approx(0.6)
    assert prior.score("What colour is it?", "The red.", None) == 1.0
    # an unreadable shard is skipped, the readable ones still count
    bad = tmp_path / "garbage.tar"
    bad.write_bytes(b"not a tar file" * 100)
    assert blind_prior.build([str(bad), *_train_shards(tmp_path)]).n_train == 10
    assert blind_prior.build([str(bad)]) is None


def test_blind_prior_cache_is_reused_and_rebuilt_when_the_shards_change(tmp_path, monkeypatch):
    urls = _train_shards(tmp_path / "data")
    cache = tmp_path / "run" / "blind_prior.json"
    cache.parent.mkdir()
    first = load_or_build(urls, cache)
    saved = json.loads(cache.read_text())
    assert (
        saved["fingerprint"] == blind_prior.fingerprint(urls)
        and saved["answers"]["is it round"] == "yes"
    )
    # the temporary file was renamed, none left
    assert os.listdir(cache.parent) == ["blind_prior.json"]

    built = []
    real_build = blind_prior.build
    monkeypatch.setattr(
        blind_prior, "build", lambda u, *rest: built.append(u) or real_build(u, *rest)
    )
    assert load_or_build(urls, cache) == first and built == []  # same shards: the cache, no read

    # the training set changes: "is it round" now mostly "no" -> rebuilt, and the cache follows
    _shard(Path(urls[1]), TRAIN[1] + [("Is it round?", {"answer": "no"}, True)] * 3)
    again = load_or_build(urls, cache)
    assert len(built) == 1 and again.answers["is it round"] == "no"
    assert (
        json.loads(cache.read_text())["fingerprint"]
        == blind_prior.fingerprint(urls)
        != saved["fingerprint"]
    )
    assert load_or_build(urls, cache) == again and len(built) == 1
    # fewer shards is another training set too; a damaged cache file is rebuilt, not trusted
    assert load_or_build(urls[:1], cache).answers["is it round"] == "yes" and len(built) == 2
    cache.write_text(
        '{"version": 1, "fingerprint": "' + blind_prior.fingerprint(urls) + '", "answers": ['
    )
    assert load_or_build(urls, cache) == again and len(built) == 3


def test_the_pipeline_passes_answer_types_through(tmp_path):
    # not a string: dropped
    shard = _shard(
        tmp_path / "q.tar",
        [
            ("Is it round?", {"answer": "yes", "answer_type": "yes/no"}, True),
            ("What colour?", {"answer": "red"}, True),
            ("How many?", {"answer": "2", "answer_type": 7}, True),
        ],
    )
    loader = make_loader(
        StreamSpec(
            urls=[str(shard)], image_size=8, max_question=8, max_answer=4, batch_size=8, train=False
        ),
        0,
    )
    batches = list(loader)
    assert len(batches) == 1 and batches[0]["answer_type"] == ["yes/no", None]
    assert loader.skipped_total() == {"bad_json": 1}


# ------------------------------------------------------------------------------ the ablation
class _Reader:
    """Answers "yes" when the picture is red (channel 0's mean > 0, normalised) if it ``looks``,
    else always "yes"."""

    def __init__(self, looks: bool) -> None:
        self.looks = looks
        self.cfg = SimpleNamespace(max_answer=4)
        self.tok = get_tokenizer()

    def answers(self, image: torch.Tensor) -> list[str]:
        if not self.looks:
            return ["yes"] * image.shape[0]
        # the red channel
        return ["yes" if m > 0 else "no" for m in image[:, 0].mean((1, 2)).tolist()]

    def generate(self, image, *args, **kwargs) -> list[list[int]]:
        return [self.tok.encode(a) for a in self.answers(image)]


class _Rag:
    """A stub RagModel (closed book) over ``_Reader``: correct where its answer's tokens are the
    gold's."""

    training = False
    whole_reader = True  # as a RagModel: the whole reader in this process
    rcfg = SimpleNamespace(mode="none", top_k=0, reader_prior=False)

    def __init__(self, looks: bool) -> None:
        self.reader = _Reader(looks)
        self.seen: list[torch.Tensor] = []  # the pictures of every forward

    def eval(self):
        return self

    def train(self, mode=True):
        return self

    def __call__(self, image, a_ids, a_len, **kw):
        self.seen.append(image)
        tok = self.reader.tok
        pred = [tok.encode(a) + [tok.eot_id] for a in self.reader.answers(image)]
        correct = torch.tensor(
            [p == a_ids[i, : int(a_len[i])].tolist() for i, p in enumerate(pred)]
        )
        return SimpleNamespace(
            reader=SimpleNamespace(correct=correct, nll=torch.ones(len(pred))),
            doc_ids=None,
            scores=None,
        )


def _batches(vqa: bool, types: tuple = (None,) * 4) -> list[dict]:
    """Two batches of four "is it bright?" queries: bright pictures (+1) answer yes, dark ones (-1)
    no, half each; the gold answer is the only human answer (ten times) when ``vqa``; ``types``: the
    queries' json answer_type."""
    tok = get_tokenizer()
    out = []
    for b in range(2):
        samples = []
        for i, gold in enumerate(["yes", "no", "yes", "no"]):
            image = torch.full((3, 4, 4), 1.0 if gold == "yes" else -1.0)
            image[1] = 0.3  # channels differ: the blank keeps each channel's mean, (0, 0.3, 0) here
            samples.append(
                {
                    "key": f"{b}-{i}",
                    "image": image,
                    "question": "Is it bright?",
                    "answer": gold,
                    "q_ids": tok.encode("Is it bright?"),
                    "a_ids": tok.encode(gold) + [tok.eot_id],
                    "doc_id": -1,
                    "heldout": False,
                    "attribute": "",
                    "answers": [gold] * 10 if vqa else None,
                    "answer_type": types[i],
                }
            )
        out.append(collate(samples))
    return out


@pytest.mark.parametrize("vqa", [False, True])
def test_blanking_the_picture_costs_a_reader_that_looks_and_not_one_that_does_not(vqa, caplog):
    prior = BlindPrior({"is it bright": "yes"}, "yes", 8)  # answering "yes" is right half the time
    looks, blind = _Rag(looks=True), _Rag(looks=False)
    with caplog.at_level(logging.INFO, logger="rag_mm.evaluate"):
        res = evaluate(looks, _batches(vqa), CPU, prior=prior, split="test")
    key = "vqa_acc" if vqa else "acc"
    assert res["acc"] == res[key] == 1.0 and res["blind_prior"] == 0.5
    # blanked: every picture is the batch's mean pixel (0, 0.3, 0): dark on average, the reader says
    # "no"
    assert res["acc_blank"] == 0.5 and res["image_drop"] == pytest.approx(0.5)
    assert ("vqa_acc_blank" in res) == vqa and res.get("vqa_acc_blank", 0.5) == 0.5
    blank = looks.seen[1]
    assert torch.equal(blank, looks.seen[0].mean((0, 2, 3), keepdim=True).expand_as(blank))
    assert res["by_type"] == {
        "yes/no": {
            "n": 8,
            "acc": 1.0,
            **({"vqa_acc": 1.0} if vqa else {}),
            "blind_prior": 0.5,
            "acc_blank": 0.5,
            **({"vqa_acc_blank": 0.5} if vqa else {}),
            "image_drop": 0.5,
        }
    }
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == []
    assert any(
        r.levelno == logging.INFO
        and r.getMessage().startswith("test: accuracy 1.000, blind prior 0.500")
        for r in caplog.records
    )

    caplog.clear()
    with caplog.at_level(logging.INFO, logger="rag_mm.evaluate"):
        res = evaluate(blind, _batches(vqa), CPU, prior=prior, split="test")
    assert (
        res[key] == res.get("vqa_acc_blank", res["acc_blank"]) == 0.5 and res["image_drop"] == 0.0
    )
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and warnings[0].startswith(
        "test: accuracy 0.500 is within 2 points of the blind prior 0.500 (answering from the "
        "question alone) / the picture is barely used: blanking it costs 0.000; "
        "scripts/bench/picture_signal.py"
    )


def test_accuracy_by_answer_type_takes_the_annotated_type_first():
    # the first query of each batch is annotated "other" (VQAv2 does that to some yes/no answers)
    res = evaluate(
        _Rag(looks=True),
        _batches(vqa=False, types=("other", None, "yes/no", None)),
        CPU,
        ablation=False,
    )
    assert {k: t["n"] for k, t in res["by_type"].items()} == {"yes/no": 6, "other": 2}
    assert res["by_type"]["other"] == {"n": 2, "acc": 1.0, "blind_prior": None}


def test_ablation_off_is_one_forward_per_batch_and_results_are_strict_json():
    rag = _Rag(looks=True)
    res = evaluate(rag, _batches(vqa=False), CPU, ablation=False)
    assert len(rag.seen) == 2  # no blanked forward
    assert (
        not {"acc_blank", "vqa_acc_blank", "image_drop"} & set(res) and res["blind_prior"] is None
    )
    # no held-out query: acc_heldout averages nothing; written as null, never NaN
    text = json.dumps(json_safe(res), allow_nan=False)
    assert json.loads(text)["acc_heldout"] is None
