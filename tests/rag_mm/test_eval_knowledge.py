"""What retrieval adds: InfoSeek's and E-VQA's answer matching, pseudo-recall, the InfoSeek score,
and closed book / learned / oracle side by side on one checkpoint."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from rag_mm.data.convert_kb import convert_kb
from rag_mm.data.convert_kvqa import convert_infoseek
from rag_mm.data.tokenizer import get_tokenizer
from rag_mm.eval.kvqa_metric import correct, harmonic_mean, numeric_match, parse_number
from rag_mm.eval.modes import ModeError, parse, side_by_side
from rag_mm.evaluate import evaluate
from tests.rag_mm.conftest import TINY_MODEL
from tests.rag_mm.test_convert import _picture
from tests.rag_mm.test_convert_kvqa import _jsonl
from tests.rag_mm.test_train import run_module


def _infoseek(aliases, qtype="string", rng=None, split="val_unseen_question"):
    kv = {"source": "infoseek", "aliases": aliases, "qtype": qtype, "split": split}
    return {**kv, "range": rng} if rng else kv


def test_infoseek_matching_follows_its_official_script():
    # strings: lower case, punctuation and articles dropped, any alias
    assert correct("The Joseph B. Strauss", _infoseek(["joseph strauss", "joseph b strauss"]))
    assert not correct("Strauss", _infoseek(["joseph strauss"]))
    # numbers: within the range, a single number +-10%, a predicted range by IoU >= 0.5
    assert parse_number("1,234.5 m") == 1234.5 and parse_number("9-11") == [9.0, 11.0]
    assert parse_number("no number") == [0.0, 0.0]
    assert numeric_match("about 320 metres", [300.0, 330.0]) and not numeric_match(
        "340", [300.0, 330.0]
    )
    assert numeric_match("108", [100.0, 100.0]) and not numeric_match("111", [100.0, 100.0])
    assert numeric_match("305-335", [300.0, 330.0]) and not numeric_match("320-400", [300.0, 330.0])
    assert correct("330", _infoseek(["330 metres"], "numerical", [300.0, 330.0]))
    # CLIP's BPE decodes digits spaced
    assert correct("3 2 0", _infoseek(["330"], "numerical", [300.0, 330.0]))
    assert harmonic_mean(0.5, 0.25) == pytest.approx(1 / 3) and harmonic_mean(0.0, 1.0) == 0.0


def test_evqa_matching_follows_its_official_exact_match():
    single = {"source": "evqa", "aliases": ["1889", "in 1889"], "qtype": "templated"}
    assert correct("In 1889.", single) and not correct("1887", single)
    multi = {"source": "evqa", "aliases": ["red&&white"], "qtype": "multi_answer"}
    assert correct("white and red", multi) and correct("red, white", multi)
    assert correct("red", multi)  # IoU 1/2: E-VQA's threshold
    assert not correct("red, blue, green", multi)


class _Store:
    """A document memory of passages (ids 10, 11, 12)."""

    def __init__(self, passages):
        self.passages = passages
        self.ids = torch.tensor([10, 11, 12])

    def __len__(self):
        return len(self.passages)

    def rows(self, ids):
        return ids - 10

    def fetch(self, ids):
        B, k = ids.shape
        return {
            "doc_image": torch.zeros(B, k, 3, 4, 4),
            "doc_ids": torch.ones(B, k, 2, dtype=torch.long),
            "doc_len": torch.full((B, k), 2),
        }


class _Reader:
    def __init__(self, texts):
        tok = get_tokenizer()
        self.ids = [tok.encode(t) for t in texts]
        self.cfg = SimpleNamespace(max_answer=8)

    def generate(self, image, *a, **kw):
        return [list(self.ids[i]) for i in range(image.shape[0])]


class _Rag:
    """The answers ``texts`` for every batch, the documents ``retrieved`` (B, K) read."""

    training = False
    whole_reader = True  # as a RagModel: the whole reader in this process

    def __init__(self, texts, retrieved, mode="learned"):
        self.reader = _Reader(texts)
        self.retrieved = torch.tensor(retrieved)
        self.store = _Store(
            [
                "Joseph Strauss designed the Golden Gate Bridge.",
                "The tower is 330 m tall.",
                "Gustave Eiffel, engineer.",
            ]
        )
        self.rcfg = SimpleNamespace(mode=mode, top_k=1, reader_prior=False)

    def eval(self):
        return self

    def train(self, mode=True):
        return self

    def __call__(self, image, **kw):
        B = image.shape[0]
        out = SimpleNamespace(
            correct=torch.tensor([True, False, False, True][:B]), nll=torch.ones(B)
        )
        ids = self.retrieved if self.rcfg.mode == "learned" else kw["gold"][:, None]
        return SimpleNamespace(reader=out, doc_ids=ids, scores=None)


def _batch():
    kv = [
        _infoseek(["joseph strauss"], split="val_unseen_entity"),
        _infoseek(["330"], "numerical", [300.0, 330.0]),
        _infoseek(["gustave eiffel"], split="val_unseen_entity"),
        _infoseek(["paris"]),
    ]
    B = 4
    return {
        "image": torch.zeros(B, 3, 4, 4),
        "q_ids": torch.ones(B, 2, dtype=torch.long),
        "q_len": torch.full((B,), 2),
        "a_ids": torch.ones(B, 2, dtype=torch.long),
        "a_len": torch.full((B,), 2),
        "doc_id": torch.tensor([10, 11, 12, 11]),
        "heldout": torch.tensor([True, False, True, False]),
        "answer": ["joseph strauss", "330", "gustave eiffel", "paris"],
        "answers": [None] * B,
        "kvqa": kv,
        "question": ["?"] * B,
    }


def test_evaluate_reports_answer_match_infoseek_score_and_pseudo_recall():
    # answers: right (held out), 320 inside the range (seen), wrong (held out), right (seen)
    rag = _Rag(
        ["joseph strauss", "320", "eiffel", "Paris"],
        [[10, 11, 12], [12, 10, 11], [10, 11, 12], [11, 10, 12]],
    )
    res = evaluate(rag, [_batch()], torch.device("cpu"), ablation=False)
    assert res["n_kvqa"] == 4 and res["kvqa_acc"] == 0.75
    assert res["kvqa_acc_seen"] == 1.0 and res["kvqa_acc_heldout"] == 0.5
    assert res["infoseek_unseen_question"] == 1.0 and res["infoseek_unseen_entity"] == 0.5
    assert res["infoseek_score"] == pytest.approx(2 / 3)  # the harmonic mean, not 0.75
    # recall against gold beside it: gold 10, 11, 12, 11 at ranks 1, 3, 3, 1
    assert res["recall@1"] == 0.5 and res["recall@5"] == 1.0
    # pseudo-recall: the answer in a passage, whatever its document (query 3's "gustave eiffel"
    # is in doc 12 at rank 3; "paris" is nowhere)
    assert res["pseudo_recall@1"] == 0.25 and res["pseudo_recall@5"] == 0.75
    assert res["pseudo_recall@1_heldout"] == 0.5 and res["pseudo_recall@5_heldout"] == 1.0
    res = evaluate(
        _Rag(["x"] * 4, [[10]] * 4, mode="oracle"), [_batch()], torch.device("cpu"), ablation=False
    )
    assert (
        res["pseudo_recall_gold"] == 0.75 and "pseudo_recall@1" not in res and "recall@1" not in res
    )


def test_modes_are_checked_and_tabled():
    assert parse("all", "learned", True, None) == ["closed_book", "learned", "oracle"]
    assert parse("all", "none", True, "no doc_id") == ["closed_book"]
    with pytest.raises(ModeError, match="not trained with a retriever"):
        parse("learned", "none", True, None)
    with pytest.raises(ModeError, match="unknown mode 'closedbook'"):
        parse("closedbook", "learned", True, None)
    table = side_by_side(
        {
            "closed_book": {"acc": 0.1, "n": 4},
            "learned": {"acc": 0.6, "recall@1": 0.5},
            "oracle": {"acc": 0.9},
        }
    )
    assert table["gains"] == {
        "retrieval_gain": pytest.approx(0.5),
        "oracle_gap": pytest.approx(0.3),
    }
    assert table["learned"] == {"acc": 0.6, "recall@1": 0.5}


def _infoseek_data(root: Path) -> list[str]:
    """Six entities in InfoSeek's schema (Wiki6M KB, train and val questions with _withkb and
    qtype files), converted; returns the data overrides. Entities 5 and 6 are asked about in
    val only (val_unseen_entity)."""
    wiki, pics = [], root / "wiki_pics"
    questions = {"train": [], "val": []}
    for k in range(1, 7):
        qid = f"Q{k}0{k}"
        wiki.append(
            {
                "wikidata_id": qid,
                "wikipedia_title": f"Entity {k}",
                "wikipedia_summary": f"Entity {k} was built in 18{k}0 by Person {k}.",
            }
        )
        _picture(pics / f"{qid}.jpg", k - 1)
        splits = ["train", "train", "val"] if k <= 4 else ["val", "val"]
        for j, split in enumerate(splits):
            image_id = f"oven_{k:04d}{j:04d}"
            _picture(root / "oven" / f"{image_id}.jpg", k - 1)
            data_split = (
                "train"
                if split == "train"
                else ("val_unseen_question" if k <= 4 else "val_unseen_entity")
            )
            row = {
                "data_id": f"infoseek_{split}_{k}{j}",
                "image_id": image_id,
                "entity_id": qid,
                "data_split": data_split,
            }
            if j % 2:
                row.update(
                    question="Who built this?",
                    answer=[f"Person {k}"],
                    answer_eval=[f"Person {k}"],
                    question_type="STRING",
                )
            else:
                year = 1800 + 10 * k
                row.update(
                    question="When was this built?",
                    answer=[str(year)],
                    answer_eval=[{"wikidata": year, "range": [year, year]}],
                    question_type="NUMERICAL",
                )
            questions[split].append(row)
    _jsonl(root / "Wiki6M_ver_1_0.jsonl", wiki)
    withkb = {s: _jsonl(root / f"infoseek_{s}_withkb.jsonl", q) for s, q in questions.items()}
    for s, q in questions.items():
        _jsonl(
            root / f"infoseek_{s}_qtype.jsonl",
            [{"data_id": r["data_id"], "question_type": r["question_type"]} for r in q],
        )
    data = root / "data"
    overrides = convert_kb(
        "infoseek", root / "Wiki6M_ver_1_0.jsonl", data, images=pics, linked=list(withkb.values())
    )["overrides"]
    for split, source in (("train", "train"), ("val", "val"), ("test", "val")):
        res = convert_infoseek(
            withkb[source],
            root / "oven",
            data,
            split,
            qtype=root / f"infoseek_{source}_qtype.jsonl",
            shard_size=4,
        )
        overrides.append(res["overrides"][1])
    return overrides


def test_infoseek_converted_trains_and_evaluates_closed_book_learned_and_oracle(tmp_path):
    """Converted InfoSeek data trains with its gold links (warm-up, recall), and one checkpoint is
    evaluated three ways: the table in the JSON line, the log and the run's metrics.json."""
    overrides = _infoseek_data(tmp_path)
    run = tmp_path / "run"
    res = run_module(
        [
            "-m",
            "rag_mm.train",
            *overrides,
            f"run_dir={run}",
            "retriever=learned",
            "retriever.top_k=2",
            "data.batch_size=4",
            "data.eval_batch_size=8",
            "data.num_workers=0",
            "data.shuffle_buffer=4",
            "max_steps=2",
            "log_every=1",
            "eval_every=0",
            "ckpt_every=2",
            "progress=false",
            "optim.warmup_steps=1",
            *TINY_MODEL,
        ]
    )
    assert res.returncode == 0, res.stderr[-3000:]
    summary = json.loads((run / "metrics.json").read_text())
    # beside every score of the trainer's final evaluation
    assert summary["val"]["n_kvqa"] == 8 and "infoseek_score" in summary["val"]
    assert "recall@1" in summary["val"] and "pseudo_recall@1" in summary["val"]
    res = run_module(["-m", "rag_mm.evaluate", str(run), "split=val", "modes=all"])
    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    # the trainer's final evaluation searched an index of its last step's document encoder, as
    # the command line indexes the checkpoint: the same retrievals, the same answers' likelihood
    for key in ("nll", "recall@1", "recall@5", "pseudo_recall@1"):
        assert out[key] == pytest.approx(summary["val"][key], abs=1e-6), key
    assert summary["eval_refresh_time_s"] > 0  # that refresh, counted apart from training's
    table = out["modes"]["table"]
    assert list(table) == ["closed_book", "learned", "oracle", "gains"]
    assert out["modes"]["learned"]["acc"] == out["acc"]  # the trained mode: the main evaluation
    for mode in ("closed_book", "learned", "oracle"):
        assert table[mode]["n"] == 8 and "infoseek_score" in table[mode], mode
    assert "recall@1" in table["learned"] and "recall@1" not in table["closed_book"]
    assert table["oracle"]["pseudo_recall_gold"] == 1.0  # every answer is in its entity's passage
    gain = table["learned"]["kvqa_acc"] - table["closed_book"]["kvqa_acc"]
    assert table["gains"]["retrieval_gain"] == pytest.approx(gain)
    assert "val [oracle]: acc" in res.stderr and "retrieval_gain" in res.stderr
    assert "InfoSeek score" in res.stderr
    summary = json.loads((run / "metrics.json").read_text())
    assert summary["modes"]["val"] == table and "test" in summary  # beside the trainer's figures
