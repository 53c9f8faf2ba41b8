"""Knowledge-VQA data in: InfoSeek, Encyclopedic-VQA and plain knowledge bases converted from
fixtures in their published schemas, gold documents linked, unseen entities marked, answers
normalised as the VQA release (no registry package ships any of these files: fixtures are written
here)."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
import webdataset as wds
from PIL import Image

from rag_mm.data.convert import convert_vqa
from rag_mm.data.convert_cli import main
from rag_mm.data.convert_kb import DOC_MAP, convert_kb
from rag_mm.data.convert_kvqa import convert_evqa, convert_infoseek
from rag_mm.data.pipeline import QueryStream, StreamSpec, collate
from rag_mm.data.tokenizer import get_tokenizer
from rag_mm.eval.vqa_metric import vqa_accuracy
from tests.rag_mm.test_convert import _picture

COLOURS = [(200, 30, 30), (30, 200, 30), (30, 30, 200), (200, 200, 30)]


def _samples(root: Path, split: str) -> list[dict]:
    urls = sorted(str(p) for p in (root / split).glob("*.tar"))
    return list(wds.DataPipeline(wds.SimpleShardList(urls), wds.tarfile_to_samples()))


def _metas(root: Path, split: str) -> list[dict]:
    return [json.loads(s["json"]) for s in _samples(root, split)]


def _jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


# ------------------------------------------------------------------------------ normalisation
def _own_vqa(root: Path, answer: str) -> tuple[Path, Path, Path]:
    """A user's own VQA-layout data whose ten humans all wrote ``answer`` as people write it."""
    _picture(root / "images" / "COCO_val2014_000000000001.jpg", 0)
    q = {"questions": [{"question_id": 1, "image_id": 1, "question": "What is it?"}]}
    a = {
        "annotations": [
            {"question_id": 1, "answers": [{"answer": answer, "answer_id": j} for j in range(10)]}
        ]
    }
    (root / "q.json").write_text(json.dumps(q))
    (root / "a.json").write_text(json.dumps(a))
    return root / "q.json", root / "a.json", root / "images"


@pytest.mark.parametrize("answer, stored", [("Seven", "7"), ("Eiffel Tower", "eiffel tower")])
def test_normalised_answers_make_exact_match_and_vqa_accuracy_agree(tmp_path, answer, stored):
    tok = get_tokenizer()
    for normalise in (True, False):
        out = tmp_path / f"out{normalise}"
        res = convert_vqa(
            *_own_vqa(tmp_path / f"in{normalise}", answer), out, "val", normalise=normalise
        )
        meta = _metas(out, "val")[0]
        # a reader that reproduces the training answer's tokens: exact match counts it right ...
        pred_ids = tok.encode(meta["answer"])
        exact = pred_ids == tok.encode(meta["answer"])
        # ... and the VQA accuracy scores the same greedy answer, decoded, against the human answers
        vqa = vqa_accuracy(tok.decode(pred_ids), meta["answers"])
        if normalise:
            assert meta["answer"] == stored and meta["answers"] == [stored] * 10
            assert exact and vqa == 1.0
            assert res["normalised"]["changed"] == 10 and res["normalised"]["examples"] == [
                [answer, stored]
            ]
        else:  # as given, the two metrics disagree: the 0.0 against 0.65
            assert meta["answer"] == answer and exact and vqa == 0.0
            assert res["normalised"] == {
                "enabled": False,
                "answers": 10,
                "changed": 0,
                "by_rule": {},
                "examples": [],
                "kept_empty": 0,
            }


def test_hugging_face_answers_are_normalised_unless_kept(tmp_path, capsys):
    import io

    import datasets

    buf = io.BytesIO()
    Image.new("RGB", (8, 8), COLOURS[0]).save(buf, format="PNG")
    rows = {
        "image": [{"bytes": buf.getvalue(), "path": None}],
        "question": ["How many?"],
        "answers": [["Seven"] * 9 + ["seven"]],
    }
    datasets.Dataset.from_dict(rows).cast_column("image", datasets.Image()).to_parquet(
        str(tmp_path / "val.parquet")
    )
    for flags, answer in (([], "7"), (["--keep-answers"], "Seven")):
        out = tmp_path / f"out{len(flags)}"
        argv = ["hf", "--path", str(tmp_path / "val.parquet"), "--split", "val", "--out", str(out)]
        assert main(argv + flags) == 0
        meta = _metas(out, "val")[0]
        assert meta["answer"] == answer and meta["answers"][0] == answer
    err = capsys.readouterr().err
    assert "10 of 10 changed" in err and "answers kept as given (10; --keep-answers)" in err


def test_normalisation_report_names_each_rule(tmp_path):
    from rag_mm.data.convert_answers import Normaliser

    n = Normaliser()
    assert n.many(["Seven", "The cat", "isnt", "t-shirt", "7", "the"]) == [
        "7",
        "cat",
        "isn't",
        "t shirt",
        "7",
        "the",
    ]
    assert n.report()["by_rule"] == {
        "articles": 1,
        "case": 2,
        "contractions": 1,
        "number_words": 1,
        "punctuation": 1,
    }
    # "the" alone is kept as given
    assert n.report()["changed"] == 4 and n.report()["kept_empty"] == 1
    assert "4 of 6 changed" in Normaliser.describe(n.report())


# ------------------------------------------------------------------------- plain knowledge base
def test_plain_kb_jsonl_becomes_a_corpus_and_a_doc_map(tmp_path):
    pics = tmp_path / "pics"
    _picture(pics / "tower.jpg", 0)
    _picture(tmp_path / "kb" / "bridge.png", 1, fmt="PNG")
    kb = _jsonl(
        tmp_path / "kb" / "kb.jsonl",
        [
            {
                "doc_id": "eiffel",
                "title": "Eiffel Tower",
                "text": "Completed in 1889, 330 m tall.",
                "image": "tower.jpg",
            },
            {
                "doc_id": "golden-gate",
                "title": "Golden Gate Bridge",
                "text": "Opened in 1937.",
                "image": "bridge.png",
            },
            {"doc_id": "text-only", "title": "", "text": "A passage with no picture."},
        ],
    )
    res = convert_kb("jsonl", kb, tmp_path / "out", images=pics)
    assert res["written"] == 3 and res["blank_picture"] == 1
    samples = _samples(tmp_path / "out", "corpus")
    texts = [s["txt"].decode() for s in samples]
    # the title first: a name to copy
    assert texts[0] == "Eiffel Tower. Completed in 1889, 330 m tall."
    # the blank picture
    assert Image.open(__import__("io").BytesIO(samples[2]["png"])).size == (
        8,
        8,
    )
    doc_map = json.loads((tmp_path / "out" / "corpus" / DOC_MAP).read_text())
    assert doc_map == {
        "layout": "jsonl",
        "doc_ids": {"eiffel": 0, "golden-gate": 1, "text-only": 2},
    }
    ints = _jsonl(
        tmp_path / "ints.jsonl", [{"doc_id": 40, "text": "a"}, {"doc_id": 7, "text": "b"}]
    )
    convert_kb("jsonl", ints, tmp_path / "out2")
    assert [json.loads(s["json"])["doc_id"] for s in _samples(tmp_path / "out2", "corpus")] == [
        40,
        7,
    ]


def test_okvqa_passage_corpus_and_questions(tmp_path):
    """OK-VQA's Google-Search passages (kid, text; text only) and its VQA-layout questions: no
    gold link in either release, answers normalised."""
    corpus = tmp_path / "okvqa_full_corpus.csv"
    with corpus.open("w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["kid", "text"])
        w.writerow([0, "A fire hydrant is a connection point by which firefighters can tap water."])
        w.writerow([1, 'The Boeing 747 is a wide-body airliner, nicknamed the "Jumbo Jet".'])
    out = tmp_path / "out"
    assert main(["kb", "--okvqa", str(corpus), "--out", str(out)]) == 0
    docs = _samples(out, "corpus")
    assert [s["txt"].decode()[:15] for s in docs] == ["A fire hydrant ", "The Boeing 747 "]
    assert all("png" in s for s in docs)  # text only: the blank picture
    doc_map = json.loads((out / "corpus" / DOC_MAP).read_text())
    assert doc_map == {"layout": "okvqa", "doc_ids": {"0": 0, "1": 1}}
    _picture(tmp_path / "val2014" / "COCO_val2014_000000000042.jpg", 0)
    (tmp_path / "q.json").write_text(
        json.dumps(
            {
                "questions": [
                    {
                        "image_id": 42,
                        "question": "What do firemen use this for?",
                        "question_id": 420,
                    }
                ]
            }
        )
    )
    answers = ["Water"] * 6 + ["put out fires"] * 4
    (tmp_path / "a.json").write_text(
        json.dumps(
            {
                "annotations": [
                    {
                        "question_id": 420,
                        "image_id": 42,
                        "answer_type": "other",
                        "question_type": "other",
                        "answers": [
                            {
                                "answer": a,
                                "raw_answer": a,
                                "answer_confidence": "yes",
                                "answer_id": i,
                            }
                            for i, a in enumerate(answers, 1)
                        ],
                        "confidence": 3,
                    }
                ]
            }
        )
    )
    res = convert_vqa(tmp_path / "q.json", tmp_path / "a.json", tmp_path / "val2014", out, "val")
    meta = _metas(out, "val")[0]
    assert meta["answer"] == "water" and "doc_id" not in meta and res["normalised"]["changed"] == 6


# ------------------------------------------------------------------------------ InfoSeek
def _infoseek(root: Path) -> dict[str, Path]:
    """OVEN's Wiki6M knowledge base, InfoSeek's val questions with their _withkb and qtype files."""
    wiki = _jsonl(
        root / "Wiki6M_ver_1_0.jsonl",
        [
            {
                "wikidata_id": "Q243",
                "wikipedia_title": "Eiffel Tower",
                "wikipedia_url": "https://en.wikipedia.org/wiki/Eiffel_Tower",
                "wikipedia_summary": "A lattice tower in Paris, 330 metres tall.",
                "wikipedia_content": "long",
            },
            {
                "wikidata_id": "Q44440",
                "wikipedia_title": "Golden Gate Bridge",
                "wikipedia_summary": "",
                "wikipedia_content": "A suspension bridge opened in 1937 by Joseph Strauss.",
            },
            {
                "wikidata_id": "Q9999",
                "wikipedia_title": "Unlinked",
                "wikipedia_summary": "Never asked about.",
            },
        ],
    )
    for i, qid in enumerate(("Q243", "Q44440")):
        _picture(root / "wiki_pics" / qid[:4] / f"{qid}.jpg", i)
    for i, image_id in enumerate(("oven_00000001", "oven_05050169", "oven_00000042")):
        _picture(root / "oven" / image_id[5:7] / f"{image_id}.jpg", i + 1)
    questions = [
        {
            "data_id": "infoseek_val_00000000",
            "image_id": "oven_00000001",
            "question": "How tall is this building?",
            "answer": ["330 metres"],
            "answer_eval": [{"wikidata": 330.0, "range": [300.0, 330.0]}],
            "data_split": "val_unseen_question",
        },
        {
            "data_id": "infoseek_val_00000001",
            "image_id": "oven_05050169",
            "question": "Who designed this bridge?",
            "answer": ["Joseph Strauss"],
            "answer_eval": ["Joseph Strauss", "Joseph B. Strauss"],
            "data_split": "val_unseen_entity",
        },
        {
            "data_id": "infoseek_val_00000002",
            "image_id": "oven_00000042",
            "question": "When did it open?",
            "answer": ["1937"],
            "answer_eval": ["1937"],
            "data_split": "val_unseen_entity",
        },
        {
            "data_id": "infoseek_val_00000003",
            "image_id": "oven_00000077",
            "question": "Where is it?",
            "answer": ["Paris"],
            "answer_eval": ["Paris"],
            "data_split": "val_unseen_question",
        },
    ]
    withkb = [
        dict(q, entity_id=e, entity_text=t)
        for q, e, t in zip(
            questions,
            ("Q243", "Q44440", "Q44440", "Q243"),
            ("Eiffel Tower", "Golden Gate Bridge", "Golden Gate Bridge", "Eiffel Tower"),
        )
    ]
    qtypes = [
        {"data_id": q["data_id"], "question_type": t}
        for q, t in zip(questions, ("NUMERICAL", "STRING", "TIME", "STRING"))
    ]
    return {
        "wiki": wiki,
        "questions": _jsonl(root / "infoseek_val.jsonl", questions),
        "withkb": _jsonl(root / "infoseek_val_withkb.jsonl", withkb),
        "qtype": _jsonl(root / "infoseek_val_qtype.jsonl", qtypes),
        "oven": root / "oven",
        "wiki_pics": root / "wiki_pics",
    }


def test_infoseek_questions_carry_their_entity_document_and_unseen_mark(tmp_path):
    f = _infoseek(tmp_path)
    out = tmp_path / "out"
    kb = convert_kb("infoseek", f["wiki"], out, images=f["wiki_pics"], linked=[f["withkb"]])
    # Q9999: not linked
    assert kb["written"] == 2 and kb["blank_picture"] == 0 and kb["linked_missing"] == 0
    passages = [s["txt"].decode() for s in _samples(out, "corpus")]
    # content
    assert (
        passages[1] == "Golden Gate Bridge. A suspension bridge opened in 1937 by Joseph Strauss."
    )
    res = convert_infoseek(
        f["questions"], f["oven"], out, "val", withkb=f["withkb"], qtype=f["qtype"]
    )
    assert res["written"] == 3 and res["skipped"] == {"missing_image": 1}
    assert res["gold"] == {"linked": 4}
    assert res["question_types"] == {"numerical": 1, "string": 2, "time": 1}
    m = {x["question_id"][-1]: x for x in _metas(out, "val")}
    assert [m[k]["doc_id"] for k in "012"] == [0, 1, 1]  # the entity's document
    assert [m[k]["heldout"] for k in "012"] == [False, True, True]  # val_unseen_entity
    assert m["0"]["kvqa"] == {
        "source": "infoseek",
        "aliases": ["330 metres"],
        "qtype": "numerical",
        "split": "val_unseen_question",
        "range": [300.0, 330.0],
    }
    assert m["1"]["answer"] == "joseph strauss"  # normalised as the VQA release
    assert m["1"]["kvqa"]["aliases"] == ["joseph strauss", "joseph b strauss"]
    assert m["1"]["entity_id"] == "Q44440"
    # the pipeline hands gold, mark and scoring fields to evaluation; a malformed kvqa is skipped
    shard = next((out / "val").glob("*.tar"))
    with wds.TarWriter(str(out / "val" / "bad.tar")) as sink:
        sink.write(
            {
                "__key__": "x",
                "jpg": _samples(out, "corpus")[0]["jpg"],
                "txt": "?",
                "json": json.dumps({"answer": "a", "kvqa": ["not", "an", "object"]}),
            }
        )
    spec = StreamSpec(
        [str(shard), str(out / "val" / "bad.tar")],
        image_size=16,
        max_question=16,
        max_answer=8,
        batch_size=8,
        train=False,
    )
    batches = list(QueryStream(spec))
    assert len(batches) == 1 and batches[0]["doc_id"].tolist() == [0, 1, 1]
    assert batches[0]["heldout"].tolist() == [False, True, True]
    assert [kv["qtype"] for kv in batches[0]["kvqa"]] == ["numerical", "string", "time"]
    assert batches[0]["skipped"][1] == {"bad_json": 1}


def test_infoseek_withkb_rows_alone_and_without_a_kb(tmp_path):
    f = _infoseek(tmp_path)
    # entity_id on the rows, no KB
    res = convert_infoseek(f["withkb"], f["oven"], tmp_path / "out", "val")
    assert res["gold"] == {"no_kb": 4} and res["written"] == 3
    m = _metas(tmp_path / "out", "val")
    assert all("doc_id" not in x for x in m) and m[0]["entity_id"] == "Q243"
    # inferred, no qtype file
    assert m[0]["kvqa"]["qtype"] == "numerical" and m[2]["kvqa"]["qtype"] == "string"
    # InfoSeek's test split has no answers: such rows are skipped and counted
    rows = [json.loads(line) for line in f["questions"].read_text().splitlines()]
    del rows[1]["answer"], rows[1]["answer_eval"]
    test = _jsonl(tmp_path / "test.jsonl", rows)
    res = convert_infoseek(test, f["oven"], tmp_path / "o2", "test")
    assert res["skipped"] == {"missing_image": 1, "no_answers": 1} and res["written"] == 2


# ------------------------------------------------------------------------------ Encyclopedic-VQA
EVQA_COLUMNS = [
    "question",
    "answer",
    "dataset_image_ids",
    "dataset_category_id",
    "dataset_name",
    "question_type",
    "wikipedia_url",
    "wikipedia_title",
    "evidence",
    "evidence_section_id",
    "evidence_section_title",
    "encyclopedic_vqa_split",
    "question_original",
    "wikipedia_url_used_in_train",
]


def _evqa(root: Path) -> dict[str, Path]:
    tower, bridge = (
        "http://en.wikipedia.org/wiki/Eiffel_Tower",
        "http://en.wikipedia.org/wiki/Golden_Gate_Bridge",
    )
    kb = {
        tower: {
            "title": "Eiffel Tower",
            "section_titles": ["Eiffel Tower", "History", "Design"],
            "section_texts": [
                "A lattice tower in Paris.",
                "Built from 1887 to 1889.",
                "Designed by Gustave Eiffel.",
            ],
            "image_urls": [
                "https://upload.wikimedia.org/wikipedia/commons/a/a8/Tour_Eiffel.jpg",
                "https://upload.wikimedia.org/wikipedia/commons/1/1c/Eiffel_1888.jpg",
            ],
            "image_reference_descriptions": ["The tower", "Under construction"],
            "image_section_indices": [0, 1],
            "url": tower,
        },
        bridge: {
            "title": "Golden Gate Bridge",
            "section_titles": ["Golden Gate Bridge", "Structure"],
            "section_texts": ["A suspension bridge.", "Its towers are red and white."],
            "image_urls": [],
            "image_reference_descriptions": [],
            "image_section_indices": [],
            "url": bridge,
        },
    }
    (root / "encyclopedic_kb_wiki.json").write_text(json.dumps(kb))
    _picture(root / "kb_pics" / "Tour_Eiffel.jpg", 0)
    _picture(root / "kb_pics" / "Eiffel_1888.jpg", 1)
    for i, image_id in enumerate(("5d3a46f1d6b35bd6", "9c1e2a7f00ab1234", "0a1b2c3d4e5f6789")):
        _picture(root / "gldv2" / image_id[0] / image_id[1] / image_id[2] / f"{image_id}.jpg", i)
    rows = [
        {
            "question": "When was this tower built?",
            "answer": "1889|In 1889",
            "question_type": "templated",
            "dataset_image_ids": "5d3a46f1d6b35bd6|9c1e2a7f00ab1234",
            "wikipedia_url": tower,
            "evidence_section_id": "1",
            "wikipedia_url_used_in_train": "True",
        },
        {
            "question": "What colours are the towers of this bridge?",
            "answer": "Red&&White",
            "question_type": "multi_answer",
            "dataset_image_ids": "0a1b2c3d4e5f6789",
            "wikipedia_url": bridge,
            "evidence_section_id": "1",
            "wikipedia_url_used_in_train": "False",
        },
        {
            "question": "Who designed it?",
            "answer": "Gustave Eiffel",
            "question_type": "automatic",
            "dataset_image_ids": "ffffffffffffffff",
            "wikipedia_url": tower,
            "evidence_section_id": "2",
            "wikipedia_url_used_in_train": "True",
        },
    ]
    with (root / "val.csv").open("w", newline="") as fh:
        w = csv.DictWriter(fh, EVQA_COLUMNS)
        w.writeheader()
        for r in rows:
            w.writerow(
                {
                    **{c: "" for c in EVQA_COLUMNS},
                    "dataset_name": "landmarks",
                    "encyclopedic_vqa_split": "val",
                    **r,
                }
            )
    return {
        "kb": root / "encyclopedic_kb_wiki.json",
        "kb_pics": root / "kb_pics",
        "csv": root / "val.csv",
        "images": root / "gldv2",
    }


def test_evqa_rows_become_one_query_per_picture_linked_to_their_section(tmp_path):
    f = _evqa(tmp_path)
    out = tmp_path / "out"
    kb = convert_kb("evqa", f["kb"], out, images=f["kb_pics"], linked=[f["csv"]])
    assert kb["written"] == 5 and kb["blank_picture"] == 2  # the bridge's article has no picture
    doc_map = json.loads((out / "corpus" / DOC_MAP).read_text())["doc_ids"]
    assert list(doc_map) == [
        f"http://en.wikipedia.org/wiki/{t}#{i}"
        for t, n in (("Eiffel_Tower", 3), ("Golden_Gate_Bridge", 2))
        for i in range(n)
    ]
    corpus = _samples(out, "corpus")
    assert corpus[2]["txt"].decode() == "Eiffel Tower: Design. Designed by Gustave Eiffel."
    assert corpus[1]["jpg"] != corpus[0]["jpg"]  # the History section's own picture
    assert corpus[2]["jpg"] == corpus[0]["jpg"]  # no picture of its own: the article's first
    res = convert_evqa(f["csv"], f["images"], out, "val")
    assert (
        res["rows"] == 3
        and res["read"] == 4
        and res["written"] == 3
        and res["skipped"] == {"missing_image": 1}
    )
    m = _metas(out, "val")
    assert [x["image_id"] for x in m] == [
        "5d3a46f1d6b35bd6",
        "9c1e2a7f00ab1234",
        "0a1b2c3d4e5f6789",
    ]
    assert [x["doc_id"] for x in m] == [
        doc_map["http://en.wikipedia.org/wiki/Eiffel_Tower#1"]
    ] * 2 + [doc_map["http://en.wikipedia.org/wiki/Golden_Gate_Bridge#1"]]
    assert [x["heldout"] for x in m] == [False, False, True]  # wikipedia_url_used_in_train False
    assert m[0]["answer"] == "1889" and m[0]["kvqa"]["aliases"] == ["1889", "in 1889"]
    assert m[2]["answer"] == "red and white" and m[2]["kvqa"] == {
        "source": "evqa",
        "aliases": ["red&&white"],
        "qtype": "multi_answer",
    }
    # the batch evaluation reads: gold, mark and scoring fields
    batch = collate(
        [
            {
                "image": __import__("torch").zeros(3, 2, 2),
                "q_ids": [1],
                "a_ids": [2],
                "doc_id": x.get("doc_id", -1),
                "heldout": x["heldout"],
                "attribute": "",
                "question": "?",
                "answer": x["answer"],
                "answers": None,
                "kvqa": x["kvqa"],
                "key": str(i),
            }
            for i, x in enumerate(m)
        ]
    )
    assert batch["kvqa"][2]["qtype"] == "multi_answer" and batch["heldout"].tolist() == [
        False,
        False,
        True,
    ]


def test_kvqa_commands_and_their_bad_input(tmp_path, capsys):
    f = _evqa(tmp_path)
    out = tmp_path / "out"
    assert (
        main(["kb", "--evqa", str(f["kb"]), "--images", str(f["kb_pics"]), "--out", str(out)]) == 0
    )
    assert (
        main(
            [
                "evqa",
                "--csv",
                str(f["csv"]),
                "--images",
                str(f["images"]),
                "--out",
                str(out),
                "--split",
                "val",
            ]
        )
        == 0
    )
    err = capsys.readouterr().err
    assert (
        "answers normalised as the VQA release: 4 of 5 changed" in err
        and "gold documents: {'linked': 3}" in err
    )
    bad = tmp_path / "bad.csv"
    bad.write_text("q,a\n1,2\n")
    wrong = _jsonl(tmp_path / "wrong.jsonl", [{"id": 1}])
    bad_section = tmp_path / "bad_section.csv"
    bad_section.write_text(f["csv"].read_text().replace(",1,", ",one,", 1))
    cases = {
        (
            "evqa",
            "--csv",
            str(bad_section),
            "--images",
            str(f["images"]),
            "--out",
            str(tmp_path / "o5"),
            "--split",
            "val",
        ): "row 2: evidence_section_id 'one' is no section",
        (
            "evqa",
            "--csv",
            str(bad),
            "--images",
            str(f["images"]),
            "--out",
            str(tmp_path / "o2"),
            "--split",
            "val",
        ): "has no column 'question'",
        (
            "infoseek",
            "--questions",
            str(wrong),
            "--images",
            str(f["images"]),
            "--out",
            str(tmp_path / "o3"),
            "--split",
            "val",
        ): "has no 'data_id'",
        ("kb", "--jsonl", str(tmp_path / "none.jsonl"), "--out", str(tmp_path / "o4")): "not found",
        (
            "infoseek",
            "--questions",
            str(wrong),
            "--images",
            str(f["images"]),
            "--out",
            str(out),
            "--split",
            "val",
        ): "maps a 'evqa' knowledge base, not 'infoseek'",
    }
    for argv, message in cases.items():
        assert main(list(argv)) == 2, argv
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err, (argv, err)
