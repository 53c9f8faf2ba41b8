"""A user's own data: VQA / A-OKVQA / document folders / img2dataset shards converted to shards that
train, and the VQA accuracy against hand-computed values."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import webdataset as wds
from PIL import Image

from rag_mm.build import make_stream
from rag_mm.config import compose
from rag_mm.data.convert import convert_corpus, convert_vqa
from rag_mm.data.convert_cli import main
from rag_mm.data.convert_hf import convert_hf
from rag_mm.data.tokenizer import get_tokenizer
from rag_mm.eval.vqa_metric import normalize_answer, vqa_accuracy
from rag_mm.evaluate import _answer_text, evaluate
from rag_mm.trainer import Trainer
from tests.rag_mm.conftest import TINY_MODEL

REPO = Path(__file__).resolve().parents[2]
COLOURS = [
    (200, 30, 30),
    (30, 200, 30),
    (30, 30, 200),
    (200, 200, 30),
    (200, 30, 200),
    (30, 200, 200),
]


# ------------------------------------------------------------------------------ the metric
def test_vqa_accuracy_averages_over_the_ten_leave_one_out_subsets():
    other = ["cat"] * 10
    for agree, expected in [(0, 0.0), (1, 0.3), (2, 0.6), (3, 0.9), (4, 1.0), (10, 1.0)]:
        answers = ["2"] * agree + other[agree:]
        # leave out one of the `agree` annotators: agree - 1 of the other nine match, else agree
        # match
        hand = (
            (agree * min(1, (agree - 1) / 3) + (10 - agree) * min(1, agree / 3)) / 10
            if agree
            else 0.0
        )
        assert hand == pytest.approx(expected)
        assert vqa_accuracy("2", answers) == pytest.approx(expected), agree
    # the prediction is normalised: number words, articles, punctuation, case
    assert vqa_accuracy("Two.", ["2", "2"] + ["3"] * 8) == pytest.approx(0.6)
    assert vqa_accuracy("the Dog", ["dog"] * 3 + ["cat"] * 7) == pytest.approx(0.9)
    # disagreeing human answers have their punctuation processed, as in the official script
    assert vqa_accuracy("t shirt", ["t-shirt"] * 2 + ["shirt"] * 8) == pytest.approx(0.6)
    with pytest.raises(ValueError):
        vqa_accuracy("yes", [])


@pytest.mark.parametrize(
    "raw, normalised",
    [
        ("Two dogs.", "2 dogs"),
        ("2 dogs", "2 dogs"),
        ("none", "0"),
        ("Ten", "10"),
        ("isnt", "isn't"),
        ("isn't", "isn't"),
        ("dont", "don't"),  # the table adds apostrophes
        ("The cat", "cat"),
        ("an apple", "apple"),
        ("A  red   car ", "red car"),
        ("1,000", "1000"),
        ("3.5", "3.5"),
        ("yes!", "yes"),
        ("left/right", "left right"),
        ("t-shirt", "t shirt"),
        ("hot - dog", "hot dog"),
        ("  Yes\n", "yes"),
        ("what?", "what"),
    ],
)
def test_normalize_answer_follows_the_official_tables(raw, normalised):
    assert normalize_answer(raw) == normalised


def test_answer_text_maps_reproduced_tokens_back_to_the_human_answer():
    tok = get_tokenizer()
    ids = tok.encode("t-shirt")
    assert tok.decode(ids) != "t-shirt"  # the BPE decoding respaces the hyphen
    assert _answer_text(ids, ["shirt", "t-shirt"], tok, 8, []) == "t-shirt"
    assert _answer_text(tok.encode("blue"), ["shirt"], tok, 8, []) == "blue"
    # no human answer reproduced: as a text read writes it, else decoded
    assert _answer_text(ids, ["shirt"], tok, 8, ["a red T-shirt"]) == "T-shirt"
    assert _answer_text(ids, ["shirt"], tok, 8, []) == "t - shirt"


class _FixedReader:
    """A reader whose greedy answer is always the tokens of ``text``."""

    def __init__(self, text: str) -> None:
        self.ids = get_tokenizer().encode(text)
        self.cfg = SimpleNamespace(max_answer=8)

    def generate(self, image, *args, **kwargs):
        return [list(self.ids) for _ in range(image.shape[0])]


class _FixedRag:
    training = False
    whole_reader = True  # as a RagModel: the whole reader in this process
    rcfg = SimpleNamespace(mode="none", top_k=0, reader_prior=False)

    def __init__(self, text: str) -> None:
        self.reader = _FixedReader(text)

    def eval(self):
        return self

    def train(self, mode=True):
        return self

    def __call__(self, image, **kw):
        B = image.shape[0]
        reader = SimpleNamespace(correct=torch.zeros(B, dtype=torch.bool), nll=torch.ones(B))
        return SimpleNamespace(reader=reader, doc_ids=None, scores=None)


def _batch(answers):
    B = len(answers)
    return {
        "image": torch.zeros(B, 3, 4, 4),
        "q_ids": torch.ones(B, 2, dtype=torch.long),
        "q_len": torch.full((B,), 2),
        "a_ids": torch.ones(B, 2, dtype=torch.long),
        "a_len": torch.full((B,), 2),
        "doc_id": torch.full((B,), -1),
        "heldout": torch.zeros(B, dtype=torch.bool),
        "answers": answers,
    }


def test_evaluate_reports_vqa_accuracy_only_for_queries_with_human_answers():
    rag = _FixedRag("Two")
    batches = [_batch([["2", "2"] + ["3"] * 8, ["yes"] * 10]), _batch([None, None])]
    res = evaluate(rag, batches, torch.device("cpu"))
    assert res["n"] == 4 and res["n_vqa"] == 2
    assert res["vqa_acc"] == pytest.approx((0.6 + 0.0) / 2)
    res = evaluate(rag, [_batch([None, None])], torch.device("cpu"))  # knowledge-world queries
    assert "vqa_acc" not in res and "n_vqa" not in res


# --------------------------------------------------------------------- inputs in the public layouts
def _picture(path: Path, i: int, fmt: str = "JPEG", size=(40, 30)) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", size, COLOURS[i % len(COLOURS)]).save(path, format=fmt)


def _answers(counts: dict[str, int]) -> list[str]:
    return [a for a, n in counts.items() for _ in range(n)]


def _vqa_v2(root: Path) -> tuple[Path, Path, Path]:
    """VQAv2-layout questions and annotations over COCO-2014-named pictures; image 9 has no file."""
    images = root / "images" / "train2014"
    for image_id in (1, 2, 3):
        _picture(images / f"COCO_train2014_{image_id:012d}.jpg", image_id)
    rows = [
        (101, 1, "What colour is it?", {"red": 7, "dark red": 2, "orange": 1}),
        (102, 1, "How many shapes?", {"2": 2, "two": 1, "3": 7}),
        (201, 2, "Is it green?", {"yes": 10}),
        (202, 2, "What is it?", {"square": 5, "box": 5}),
        (301, 3, "Which colour?", {"blue": 9, "navy": 1}),
        (302, 3, "Is this a shape?", {"yes": 8, "no": 2}),
        (901, 9, "Where is the picture?", {"gone": 10}),
    ]
    questions = {
        "info": {},
        "task_type": "Open-Ended",
        "data_type": "mscoco",
        "data_subtype": "train2014",
        "questions": [
            {"image_id": im, "question": q, "question_id": qid} for qid, im, q, _ in rows
        ],
    }
    annotations = {"info": {}, "annotations": []}
    for qid, im, q, counts in rows:
        answers = [
            {"answer": a, "answer_confidence": "yes", "answer_id": j + 1}
            for j, a in enumerate(_answers(counts))
        ]
        a_type = "yes/no" if qid in (201, 302) else "number" if qid == 102 else "other"
        ann = {
            "question_id": qid,
            "image_id": im,
            "answers": answers,
            "answer_type": a_type,
            "question_type": q.split()[0].lower(),
        }
        if (
            qid != 202
        ):  # OK-VQA annotations have no multiple_choice_answer: the most frequent answer is used
            ann["multiple_choice_answer"] = max(counts, key=counts.get)
        annotations["annotations"].append(ann)
    q, a = root / "v2_questions.json", root / "v2_annotations.json"
    q.write_text(json.dumps(questions))
    a.write_text(json.dumps(annotations))
    return q, a, root / "images"


def _aokvqa(root: Path) -> tuple[Path, Path]:
    """A-OKVQA's single list over COCO-2017-named pictures; one entry (a test question) has no
    answers."""
    images = root / "coco2017" / "val2017"
    for image_id in (4, 5):
        _picture(images / f"{image_id:012d}.jpg", image_id)
    entries = []
    for qid, im, q, counts in [
        ("aB3x", 4, "What is the yellow thing for?", {"sitting": 6, "rest": 4}),
        ("cD4y", 5, "Why is it pink?", {"paint": 3, "dye": 3, "light": 4}),
        ("eF5z", 4, "What could go here?", {}),
    ]:
        e = {
            "split": "val",
            "image_id": im,
            "question_id": qid,
            "question": q,
            "choices": ["a", "b", "c", "d"],
            "correct_choice_idx": 0,
            "difficult_direct_answer": False,
            "rationales": ["because"] * 3,
        }
        if counts:
            e["direct_answers"] = _answers(counts)
        entries.append(e)
    path = root / "aokvqa_v1p0_val.json"
    path.write_text(json.dumps(entries))
    return path, root / "coco2017"


def _documents(root: Path) -> Path:
    """name.<picture> + name.txt pairs (jpg, png, webp, in a subfolder too), and one picture without
    text."""
    docs = root / "docs"
    for i, (name, fmt, ext) in enumerate(
        [
            ("red_square", "JPEG", "jpg"),
            ("green_box", "PNG", "png"),
            ("sub/blue_disc", "WEBP", "webp"),
            ("yellow.star", "JPEG", "jpeg"),
        ]
    ):
        _picture(docs / f"{name}.{ext}", i, fmt, size=(48, 32))
        (docs / f"{name}.txt").write_text(f"The {name.split('/')[-1]} is a shape.")
    _picture(docs / "orphan.jpg", 5)
    return docs


def _read(pattern_root: Path, pattern: str) -> list[dict]:
    urls = sorted(str(p) for p in pattern_root.glob(pattern))
    return list(wds.DataPipeline(wds.SimpleShardList(urls), wds.tarfile_to_samples()))


def test_vqa_v2_questions_become_query_shards(tmp_path):
    q, a, images = _vqa_v2(tmp_path)
    res = convert_vqa(q, a, images, tmp_path / "out", "train", shard_size=4)
    assert res["layout"] == "vqa" and res["read"] == 7
    assert res["written"] == 6 and res["shards"] == 2
    assert res["skipped"] == {"missing_image": 1} and res["skipped_examples"] == {
        "missing_image": [901]
    }
    assert res["overrides"] == [
        f"data.root={tmp_path / 'out'}",
        "data.train='train/train-{000000..000001}.tar'",
    ]
    samples = _read(tmp_path / "out", "train/train-*.tar")
    assert len(samples) == 6
    metas = {json.loads(s["json"])["question_id"]: (s, json.loads(s["json"])) for s in samples}
    s, m = metas[101]
    assert (
        s["txt"].decode() == "What colour is it?"
        and m["answer"] == "red"
        and len(m["answers"]) == 10
    )
    # stored as it was: the pipeline resizes
    assert Image.open(io.BytesIO(s["jpg"])).size == (
        40,
        30,
    )
    # no multiple_choice_answer: most frequent, first on a tie
    assert metas[202][1]["answer"] == "square"
    assert metas[102][1]["answer"] == "3"
    assert "doc_id" not in m  # no gold document
    # VQAv2's answer and question types are kept: the evaluation reports accuracy per answer type
    assert {qid: (m["answer_type"], m["question_type"]) for qid, (_, m) in metas.items()} == {
        101: ("other", "what"),
        102: ("number", "how"),
        201: ("yes/no", "is"),
        202: ("other", "what"),
        301: ("other", "which"),
        302: ("yes/no", "is"),
    }

    again = convert_vqa(
        q, a, images, tmp_path / "out", "train", shard_size=10, image_size=16, overwrite=True
    )
    assert again["shards"] == 1 and not (tmp_path / "out" / "train" / "train-000001.tar").exists()
    s = _read(tmp_path / "out", "train/train-*.tar")[0]
    assert Image.open(io.BytesIO(s["jpg"])).size == (16, 16)


def test_a_source_sorted_by_class_is_written_with_its_pictures_mixed_over_the_shards(tmp_path):
    """A file in label order (a folder per class, a dump sorted by class) would give each shard one
    class, and the training stream, which shuffles shards and then samples within a buffer, would
    train on one class at a time: the converter writes the pictures in a seeded random order, each
    picture's questions together."""
    images = tmp_path / "images"
    questions, annotations = [], []
    for image_id in range(40):  # four classes of ten pictures, in class order
        _picture(images / f"{image_id:012d}.png", image_id, "PNG")
        for n, (text, answer) in enumerate(
            (("what is this?", f"class{image_id // 10}"), ("is it bright?", "yes"))
        ):
            qid = image_id * 10 + n
            questions.append({"image_id": image_id, "question": text, "question_id": qid})
            annotations.append(
                {"image_id": image_id, "question_id": qid, "multiple_choice_answer": answer}
                | {"answers": [{"answer": answer, "answer_id": 1}]}
            )
    q, a = tmp_path / "q.json", tmp_path / "a.json"
    q.write_text(json.dumps({"questions": questions}))
    a.write_text(json.dumps({"annotations": annotations}))
    assert convert_vqa(q, a, images, tmp_path / "out", "train", shard_size=20)["shards"] == 4

    def written(pattern: str) -> list[list[int]]:  # question ids, shard by shard
        return [
            [json.loads(s["json"])["question_id"] for s in _read(url.parent, url.name)]
            for url in sorted((tmp_path / "out").glob(pattern))
        ]

    shards = written("train/train-*.tar")
    assert sorted(qid for shard in shards for qid in shard) == sorted(
        x["question_id"] for x in questions
    )
    for shard in shards:
        assert len({qid // 100 for qid in shard}) >= 3, shards  # classes mixed in every shard
        # a picture's two questions together and in their order
        assert [qid % 10 for qid in shard] == [0, 1] * (len(shard) // 2), shard
    convert_vqa(q, a, images, tmp_path / "out", "train", shard_size=20, overwrite=True)
    assert written("train/train-*.tar") == shards  # the order is seeded


def test_aokvqa_list_becomes_query_shards(tmp_path):
    path, images = _aokvqa(tmp_path)
    res = convert_vqa(path, None, images, tmp_path / "out", "val")
    assert res["layout"] == "a-okvqa" and res["read"] == 3 and res["written"] == 2
    assert res["skipped"] == {"no_answers": 1}
    metas = {
        m["question_id"]: m
        for m in (json.loads(s["json"]) for s in _read(tmp_path / "out", "val/*.tar"))
    }
    assert metas["aB3x"]["answer"] == "sitting" and metas["cD4y"]["answer"] == "light"
    assert len(metas["cD4y"]["answers"]) == 10 and metas["cD4y"]["image_id"] == 5
    assert "answer_type" not in metas["cD4y"]  # A-OKVQA has none: the evaluation infers it


def test_document_folder_and_img2dataset_shards_become_a_corpus(tmp_path):
    res = convert_corpus(tmp_path / "out", docs=_documents(tmp_path), shard_size=3)
    assert res["written"] == 4 and res["shards"] == 2 and res["skipped"] == {"no_text": 1}
    docs = _read(tmp_path / "out", "corpus/*.tar")
    metas = [json.loads(s["json"]) for s in docs]
    assert [m["doc_id"] for m in metas] == [0, 1, 2, 3]
    assert {m["source"] for m in metas} == {
        "green_box",
        "red_square",
        "yellow.star",
        "sub/blue_disc",
    }
    assert {k for s in docs for k in s if k in ("jpg", "png", "webp")} == {"jpg", "png", "webp"}
    assert all("." not in s["__key__"] for s in docs)

    # img2dataset output: <key>.jpg + <key>.txt + <key>.json per sample; one sample lacks its
    # caption
    web = tmp_path / "web"
    web.mkdir()
    for n in range(2):
        with wds.TarWriter(str(web / f"{n:05d}.tar")) as sink:
            for j in range(3):
                key = f"{n:05d}{j:04d}"
                buf = io.BytesIO()
                Image.new("RGB", (20, 20), COLOURS[j]).save(buf, format="JPEG")
                sample = {
                    "__key__": key,
                    "jpg": buf.getvalue(),
                    "json": json.dumps(
                        {"url": f"http://x/{key}.jpg", "key": key, "status": "success"}
                    ),
                }
                if (n, j) != (1, 2):
                    sample["txt"] = f"caption {key}"
                sink.write(sample)
    res = convert_corpus(tmp_path / "out2", shards=str(web / "{00000..00001}.tar"), image_size=8)
    assert res["written"] == 5 and res["skipped"] == {"no_text": 1}
    docs = _read(tmp_path / "out2", "corpus/*.tar")
    assert json.loads(docs[0]["json"]) == {"doc_id": 0, "source": "http://x/000000000.jpg"}
    assert docs[0]["txt"].decode() == "caption 000000000"
    assert Image.open(io.BytesIO(docs[0]["jpg"])).size == (8, 8)


# ------------------------------------------------------------------------------ shards that train
def test_converted_shards_train_and_report_vqa_accuracy(tiny_world, tmp_path, capsys):
    q, a, images = _vqa_v2(tmp_path)
    out = tmp_path / "data"
    # the overrides each conversion reports are what the trainer is given
    overrides = convert_vqa(q, a, images, out, "train", shard_size=4)["overrides"]
    overrides += convert_corpus(out, docs=_documents(tmp_path))["overrides"][1:]
    for split in ("val", "test"):
        assert (
            main(
                [
                    "vqa",
                    "--questions",
                    str(q),
                    "--annotations",
                    str(a),
                    "--images",
                    str(images),
                    "--out",
                    str(out),
                    "--split",
                    split,
                    "--shard-size",
                    "4",
                ]
            )
            == 0
        )
        overrides += json.loads(capsys.readouterr().out)["overrides"][1:]
    cfg = compose(
        [
            *overrides,
            f"run_dir={tmp_path / 'run'}",
            "retriever=learned",
            "retriever.top_k=2",
            "retriever.contrastive_steps=0",  # the questions have no gold document
            "data.batch_size=4",
            "data.eval_batch_size=8",
            "data.num_workers=0",
            "data.shuffle_buffer=4",
            "max_steps=3",
            "log_every=1",
            "eval_every=0",
            "ckpt_every=0",
            "progress=false",
            "optim.warmup_steps=1",
            *TINY_MODEL,
        ]
    )
    t = Trainer(cfg)
    try:
        summary = t.fit()
        assert summary["step"] == 3 and torch.isfinite(torch.tensor(summary["final_train_loss"]))
        for split in ("val", "test"):
            assert summary[split]["n"] == summary[split]["n_vqa"] == 6
            assert 0.0 <= summary[split]["vqa_acc"] <= 1.0
            # the same six questions as training, each asked once: the blind prior answers every one
            # with its training answer, which three or more annotators gave
            assert summary[split]["blind_prior"] == pytest.approx(1.0)
            assert {k: t["n"] for k, t in summary[split]["by_type"].items()} == {
                "yes/no": 2,
                "number": 1,
                "other": 3,
            }
            assert 0.0 <= summary[split]["vqa_acc_blank"] <= 1.0
            assert summary[split]["image_drop"] == pytest.approx(
                summary[split]["vqa_acc"] - summary[split]["vqa_acc_blank"]
            )
            # no query names a gold document, and faiss pads a 4-document search with id -1: no
            # recall
            assert not any(k.startswith("recall@") for k in summary[split]), summary[split]
        examples = json.loads((tmp_path / "run" / "retrieved_examples.json").read_text())
        assert (
            len(examples) == 6
            and len(examples[0]["retrieved"]) == 2
            and "prediction" in examples[0]
        )
        # knowledge-world queries carry no human answers: no vqa_acc (the stream from another root)
        kw = compose(
            [
                f"data.root={tiny_world}",
                "data.test='test/test-{000000..000000}.tar'",
                "data.num_workers=0",
                *TINY_MODEL,
            ]
        )
        res = evaluate(t.spread, make_stream(kw, "test", train=False), t.device, max_batches=1)
        assert res["n"] > 0 and "vqa_acc" not in res
    finally:
        t.close()


# ------------------------------------------------------------------------------ bad input
def test_bad_input_exits_2_with_a_message_naming_the_file(tmp_path, capsys):
    q, a, images = _vqa_v2(tmp_path)
    # a real process: the annotations file given as the questions -> exit 2, a message, no traceback
    res = subprocess.run(
        [
            sys.executable,
            "scripts/convert.py",
            "vqa",
            "--questions",
            str(a),
            "--images",
            str(images),
            "--out",
            str(tmp_path / "o"),
            "--split",
            "train",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        timeout=120,
    )
    assert res.returncode == 2, res.stderr
    assert (
        str(a) in res.stderr
        and "is an annotations file" in res.stderr
        and "Traceback" not in res.stderr
    )

    broken = tmp_path / "broken.json"
    broken.write_text('{"questions": [')
    listed = tmp_path / "list_of_numbers.json"
    listed.write_text("[1, 2, 3]")
    aok, _ = _aokvqa(tmp_path)
    (tmp_path / "exists" / "train").mkdir(parents=True)
    (tmp_path / "exists" / "train" / "train-000000.tar").write_bytes(b"")
    vqa = ["vqa", "--images", str(images), "--split", "train", "--out"]
    cases = {
        (
            *vqa,
            str(tmp_path / "o"),
            "--questions",
            str(broken),
            "--annotations",
            str(a),
        ): f"{broken} is not valid JSON",
        (
            *vqa,
            str(tmp_path / "o"),
            "--questions",
            str(tmp_path / "nope.json"),
            "--annotations",
            str(a),
        ): f"{tmp_path / 'nope.json'} not found",
        (*vqa, str(tmp_path / "o"), "--questions", str(q)): "their answers come from --annotations",
        (
            *vqa,
            str(tmp_path / "o"),
            "--questions",
            str(q),
            "--annotations",
            str(q),
        ): f"{q} is an object",
        (
            *vqa,
            str(tmp_path / "o"),
            "--questions",
            str(listed),
        ): f"{listed}: entry [0] is a number, not an object",
        (
            *vqa,
            str(tmp_path / "o"),
            "--questions",
            str(aok),
            "--annotations",
            str(a),
        ): "drop --annotations",
        (
            *vqa,
            str(tmp_path / "exists"),
            "--questions",
            str(q),
            "--annotations",
            str(a),
        ): "pass --overwrite",
        (
            "vqa",
            "--images",
            str(tmp_path / "nowhere"),
            "--split",
            "val",
            "--out",
            str(tmp_path / "o"),
            "--questions",
            str(q),
            "--annotations",
            str(a),
        ): f"images folder {tmp_path / 'nowhere'} not found",
        (
            "corpus",
            "--docs",
            str(tmp_path / "nodocs"),
            "--out",
            str(tmp_path / "o"),
        ): f"documents folder {tmp_path / 'nodocs'} not found",
        (
            "corpus",
            "--shards",
            str(tmp_path / "web-{0..1}.tar"),
            "--out",
            str(tmp_path / "o"),
        ): f"input shard {tmp_path / 'web-0.tar'} not found",
    }
    for argv, message in cases.items():
        assert main(list(argv)) == 2, argv
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err, (argv, err)
    assert not (tmp_path / "o").exists()  # nothing was written for any of them


# --------------------------------------------------------------------------- Hugging Face data sets
def _hf_rows() -> dict:
    """A VQAv2-Hub-layout data set: PIL pictures, answers as {"answer", ...} dicts, the answer and
    question types; row 2 has no answers (a test question), row 3 a picture whose bytes are no
    picture."""
    pictures = [Image.new("RGB", (40 + i, 30), COLOURS[i]) for i in range(4)]
    pictures[3] = {"bytes": b"not a picture", "path": None}
    # row 1's multiple_choice_answer ("3") is not its most frequent answer ("two", first of a tie)
    counts = [{"red": 7, "dark red": 2, "orange": 1}, {"two": 4, "3": 4, "2": 2}, {}, {"yes": 10}]
    return {
        "image": pictures,
        "question": ["What colour is it?", "How many shapes?", "Is it big?", "Is it green?"],
        "answers": [
            [
                {"answer": a, "answer_confidence": "yes", "answer_id": j + 1}
                for j, a in enumerate(_answers(c))
            ]
            for c in counts
        ],
        "multiple_choice_answer": ["red", "3", "", "yes"],
        "answer_type": ["other", "number", "yes/no", "yes/no"],
        "question_type": ["what", "how many", "is", "is"],
        "question_id": [101, 102, 103, 201],
        "image_id": [1, 1, 2, 3],
    }


def test_hugging_face_dataset_becomes_the_vqa_converters_shards(tmp_path, capsys):
    import datasets

    ds = datasets.Dataset.from_dict(
        _hf_rows(),
        features=datasets.Features(
            {
                "image": datasets.Image(),
                "question": datasets.Value("string"),
                "answers": [
                    {
                        "answer": datasets.Value("string"),
                        "answer_confidence": datasets.Value("string"),
                        "answer_id": datasets.Value("int64"),
                    }
                ],
                "multiple_choice_answer": datasets.Value("string"),
                "answer_type": datasets.Value("string"),
                "question_type": datasets.Value("string"),
                "question_id": datasets.Value("int64"),
                "image_id": datasets.Value("int64"),
            }
        ),
    )
    ds.save_to_disk(str(tmp_path / "saved"))
    (tmp_path / "hub" / "data").mkdir(parents=True)
    ds.to_parquet(str(tmp_path / "hub" / "data" / "train-00000-of-00001.parquet"))

    res = convert_hf(str(tmp_path / "saved"), tmp_path / "out", "train", shard_size=2)
    assert res["layout"] == "hf" and res["read"] == 4 and res["written"] == 2 and res["shards"] == 1
    assert res["skipped"] == {"bad_image": 1, "no_answers": 1} and res["skipped_examples"] == {
        "bad_image": [201]
    }
    assert res["overrides"] == [
        f"data.root={tmp_path / 'out'}",
        "data.train='train/train-{000000..000000}.tar'",
    ]
    samples = _read(tmp_path / "out", "train/*.tar")
    metas = [json.loads(s["json"]) for s in samples]
    # the vqa converter's json: the training answer is multiple_choice_answer, every human answer
    # kept
    assert metas[0] == {
        "answer": "red",
        "answers": _answers({"red": 7, "dark red": 2, "orange": 1}),
        "question_id": 101,
        "image_id": 1,
        "answer_type": "other",
        "question_type": "what",
    }
    assert (
        metas[1]["answer"] == "3"
        and metas[1]["answer_type"] == "number"
        and len(metas[1]["answers"]) == 10
    )
    assert [s["txt"].decode() for s in samples] == ["What colour is it?", "How many shapes?"]
    assert [s["__key__"] for s in samples] == ["q000000000", "q000000001"]
    # the stored bytes, as they came
    assert Image.open(io.BytesIO(samples[1]["png"])).size == (
        41,
        30,
    )

    # the same rows from parquet (a glob, through the command line): the same shards and the
    # overrides line
    argv = [
        "hf",
        "--path",
        str(tmp_path / "hub" / "data" / "train-*.parquet"),
        "--split",
        "val",
        "--out",
        str(tmp_path / "out"),
        "--image-column",
        "image",
        "--question-column",
        "question",
        "--answers-column",
        "answers",
        "--id-column",
        "question_id",
    ]
    assert main(argv) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["written"] == 2
    assert (
        "convert: read them with data.root=" in captured.err
        and "data.val='val/val-{000000..000000}.tar'" in captured.err
    )
    again = _read(tmp_path / "out", "val/*.tar")
    assert [json.loads(s["json"]) for s in again] == metas and [s["png"] for s in again] == [
        s["png"] for s in samples
    ]


def test_hugging_face_answers_and_pictures_in_other_layouts(tmp_path):
    import datasets
    import numpy as np

    from rag_mm.data.convert_hf import answer_list, image_bytes

    # answers: a list of strings, one string, VQAv2's dicts, a Sequence of dicts (columnar); or
    # unknown
    assert answer_list(["a", "b"]) == ["a", "b"] and answer_list("yes") == ["yes"]
    assert answer_list([{"answer": "x", "answer_id": 1}]) == ["x"] and answer_list(
        {"answer": ["x", "y"]}
    ) == ["x", "y"]
    assert answer_list(None) == [] and answer_list([3]) is None
    # pictures: decoded (PIL, arrays) are stored as PNG; a path is read (relative to the data set)
    Image.new("RGB", (5, 4), COLOURS[0]).save(tmp_path / "pic.jpg")
    for cell in (
        Image.new("RGB", (5, 4)),
        np.zeros((4, 5, 3), dtype=np.uint8),
        {"bytes": None, "path": "pic.jpg"},
        "pic.jpg",
        (tmp_path / "pic.jpg").read_bytes(),
    ):
        assert Image.open(io.BytesIO(image_bytes(cell, tmp_path))).size == (5, 4), type(cell)
    with pytest.raises(ValueError):
        image_bytes(None, tmp_path)

    # a DatasetDict (--split val finds "validation"), pictures as file paths, answers as lists of
    # strings in one split and one string in the other, the ids in a column of another name
    pics = [str(tmp_path / "pic.jpg")] * 2
    datasets.DatasetDict(
        {
            "validation": datasets.Dataset.from_dict(
                {
                    "img": pics,
                    "q": ["What is it?", "Is it red?"],
                    "ans": [["box", "box", "cube"], ["no", "yes", "yes"]],
                    "qid": ["a1", "a2"],
                }
            ),
            "test": datasets.Dataset.from_dict(
                {
                    "img": pics,
                    "q": ["What is it?", "Is it red?"],
                    "ans": ["box", ""],
                    "qid": ["b1", "b2"],
                }
            ),
        }
    ).save_to_disk(str(tmp_path / "dd"))
    columns = dict(image_column="img", question_column="q", answers_column="ans", id_column="qid")
    res = convert_hf(str(tmp_path / "dd"), tmp_path / "out", "val", **columns)
    metas = [json.loads(s["json"]) for s in _read(tmp_path / "out", "val/*.tar")]
    assert res["written"] == 2 and metas == [
        {"answer": "box", "answers": ["box", "box", "cube"], "question_id": "a1"},
        {"answer": "yes", "answers": ["no", "yes", "yes"], "question_id": "a2"},
    ]
    res = convert_hf(str(tmp_path / "dd"), tmp_path / "out", "test", **columns)
    assert res["written"] == 1 and res["skipped"] == {"no_answers": 1}
    assert [json.loads(s["json"]) for s in _read(tmp_path / "out", "test/*.tar")] == [
        {"answer": "box", "answers": ["box"], "question_id": "b1"}
    ]


def test_hugging_face_bad_input_exits_2_with_one_message(tmp_path, capsys):
    import datasets

    datasets.Dataset.from_dict(
        {"image": [Image.new("RGB", (4, 4))], "question": ["q?"], "answers": [["a"]]}
    ).save_to_disk(str(tmp_path / "saved"))
    (tmp_path / "junk.parquet").write_text("not parquet")
    (tmp_path / "plain").mkdir()
    (tmp_path / "plain" / "notes.txt").write_text("no data set here")
    capsys.readouterr()  # the progress bar of save_to_disk
    hf = ["hf", "--split", "train", "--out", str(tmp_path / "o"), "--path"]
    cases = {
        (
            *hf,
            str(tmp_path / "saved"),
            "--answers-column",
            "answer",
        ): (
            f"--answers-column 'answer': {tmp_path / 'saved'} has no such column (columns: "
            "image, question, answers)"
        ),
        (*hf, str(tmp_path / "saved"), "--id-column", "question_id"): "--id-column 'question_id'",
        (*hf, str(tmp_path / "nowhere")): f"{tmp_path / 'nowhere'} not found",
        (*hf, str(tmp_path / "none-*.parquet")): "no file matches the pattern",
        (
            *hf,
            str(tmp_path / "junk.parquet"),
        ): f"cannot read parquet file {tmp_path / 'junk.parquet'}",
        (
            *hf,
            str(tmp_path / "plain"),
        ): "neither a datasets.save_to_disk folder nor a folder of parquet files",
    }
    for argv, message in cases.items():
        assert main(list(argv)) == 2, argv
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err and len(err.strip().splitlines()) == 1, (
            argv,
            err,
        )
    assert not (tmp_path / "o").exists()  # nothing was written for any of them
    # a real process: the message, status 2, no traceback
    res = subprocess.run(
        [
            sys.executable,
            "scripts/convert.py",
            *hf,
            str(tmp_path / "saved"),
            "--image-column",
            "picture",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        timeout=120,
    )
    assert (
        res.returncode == 2
        and "--image-column 'picture'" in res.stderr
        and "Traceback" not in res.stderr
    ), res.stderr
