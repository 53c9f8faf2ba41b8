"""``python -m rag_mm.evaluate RUN_DIR``: a trained run's checkpoint evaluated without a trainer."""

from __future__ import annotations

import json
import shutil

import pytest
import webdataset as wds

from rag_mm import evaluate
from rag_mm.data.convert import convert_vqa
from rag_mm.eval.predictions import PredictionError, write_predictions
from rag_mm.eval.vqa_metric import vqa_accuracy
from tests.rag_mm.conftest import TINY_MODEL, tiny_overrides
from tests.rag_mm.test_convert import _vqa_v2
from tests.rag_mm.test_train import run_module


def _no_nan(constant: str):
    raise AssertionError(f"{constant} in JSON output: must be null")


def test_evaluate_cli_reproduces_the_trainers_final_metrics(tiny_world, tmp_path, capsys):
    run = tmp_path / "run"
    # validation on training queries: no held-out entity, so acc_heldout averages nothing (null)
    res = run_module(
        [
            "-m",
            "rag_mm.train",
            *tiny_overrides(tiny_world, run, "data.val='train/train-{000000..000000}.tar'"),
        ]
    )
    assert res.returncode == 0, res.stderr[-3000:]
    summary = json.loads((run / "metrics.json").read_text(), parse_constant=_no_nan)
    assert summary["val"]["n_heldout"] == 0 and summary["val"]["acc_heldout"] is None
    # does the reader use the picture: the blind prior, accuracy by answer type, the ablation
    test = summary["test"]
    assert 0.0 <= test["blind_prior"] <= 1.0 and 0.0 <= test["acc_blank"] <= 1.0
    assert test["image_drop"] == pytest.approx(test["acc"] - test["acc_blank"])
    assert sum(t["n"] for t in test["by_type"].values()) == test["n"]
    assert set(test["by_type"]) == {"other"}  # knowledge-world answers are words
    # by kind of question (json attribute): every query counted once, seen and held-out apart
    kinds = test["by_attribute"]
    assert set(kinds) <= {"habitat", "diet", "season", "region", "name"} and len(kinds) >= 2
    assert sum(r["n_seen"] + r["n_heldout"] for r in kinds.values()) == test["n"]
    assert sum(r["n_heldout"] for r in kinds.values()) == test["n_heldout"]
    assert "by kind of question" in res.stderr
    assert (run / "blind_prior.json").is_file()
    assert "test: accuracy" in res.stderr and "blind prior" in res.stderr  # the split's INFO line

    res = run_module(["-m", "rag_mm.evaluate", str(run), "split=test"])
    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads(res.stdout.strip().splitlines()[-1], parse_constant=_no_nan)
    assert "test: accuracy" in res.stderr  # the split's summary line
    for key in (
        "blind_prior",
        "acc_blank",
        "image_drop",
    ):  # the cached table, the same blanked forward
        assert out[key] == pytest.approx(test[key], abs=1e-6), key
    assert out["by_type"]["other"]["n"] == test["by_type"]["other"]["n"]
    assert out["split"] == "test" and out["step"] == summary["step"] == 6
    assert out["n"] == summary["test"]["n"] > 0
    assert out["acc"] == pytest.approx(summary["test"]["acc"], abs=1e-6)
    # a six-step reader answers nothing right: its NLL is what shows the trained weights were loaded
    assert out["nll"] == pytest.approx(summary["test"]["nll"], abs=1e-6)

    # bad input: a message on stderr, exit status 2, no traceback
    res = run_module(["-m", "rag_mm.evaluate", str(tmp_path / "nowhere")])
    assert res.returncode == 2 and "not found" in res.stderr and "Traceback" not in res.stderr, (
        res.stderr
    )
    bare = tmp_path / "bare"  # a run directory whose training never checkpointed
    shutil.copytree(run / ".hydra", bare / ".hydra")
    cases = {
        (str(bare),): "no valid checkpoint",
        (str(run), "split=dev"): "unknown split 'dev'",
        (str(run), "model.widht=3"): "widht",
        # a linear projector's checkpoint read with the MLP: the key that builds it again
        (str(run), "model.projector=mlp2x_gelu"): "with model.projector=linear",
    }
    for argv, message in cases.items():
        assert evaluate.main(list(argv)) == 2, argv
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err, (argv, err)


# ------------------------------------------------------------------------------ predictions out
def test_predictions_name_each_answer_by_its_shards_question_id(tmp_path):
    """question ids come from the shards' json; a query without one is named by its sample key, and
    a key two samples share with different ids is refused rather than guessed."""
    shard = tmp_path / "q-000000.tar"
    with wds.TarWriter(str(shard)) as sink:
        for key, meta in [
            ("q0", {"answer": "a", "question_id": 7}),
            ("q1", {"answer": "b", "question_id": "x9"}),
            ("q2", {"answer": "c"}),
        ]:
            sink.write({"__key__": key, "txt": "?", "json": json.dumps(meta)})
    out = tmp_path / "preds" / "test.json"
    assert write_predictions(out, [("q1", "blue"), ("q0", "2"), ("q2", "no")], [str(shard)]) == 3
    assert json.loads(out.read_text()) == [
        {"question_id": "x9", "answer": "blue"},
        {"question_id": 7, "answer": "2"},
        {"question_id": "q2", "answer": "no"},
    ]
    other = tmp_path / "q-000001.tar"  # a second conversion's shard: its keys restart at q0
    with wds.TarWriter(str(other)) as sink:
        sink.write(
            {"__key__": "q0", "txt": "?", "json": json.dumps({"answer": "a", "question_id": 8})}
        )
    with pytest.raises(PredictionError, match="the key 'q0' and different question ids"):
        write_predictions(out, [("q0", "2")], [str(shard), str(other)])


def test_evaluate_writes_the_vqa_results_file_it_scored(tmp_path, capsys):
    q, a, images = _vqa_v2(tmp_path)
    data = tmp_path / "data"
    overrides = [f"data.root={data}"]
    for split in ("train", "val", "test"):  # the six answered questions in each split, 4 per shard
        overrides += convert_vqa(q, a, images, data, split, shard_size=4)["overrides"][1:]
    run = tmp_path / "run"
    res = run_module(
        [
            "-m",
            "rag_mm.train",
            *overrides,
            f"run_dir={run}",
            "retriever=none",
            "data.batch_size=4",
            "data.eval_batch_size=4",
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

    out = tmp_path / "results" / "test.json"  # its folder is created
    res = run_module(["-m", "rag_mm.evaluate", str(run), "split=test", f"predictions={out}"])
    assert res.returncode == 0, res.stderr[-3000:]
    metrics = json.loads(res.stdout.strip().splitlines()[-1])
    preds = json.loads(out.read_text())
    assert all(set(p) == {"question_id", "answer"} and isinstance(p["answer"], str) for p in preds)
    # every test question once, under the VQA question id its shard carries (two batches of 4 and 2)
    assert sorted(p["question_id"] for p in preds) == [101, 102, 201, 202, 301, 302]
    # the answers are the greedy answers evaluation scored: their VQA accuracy is the reported one
    human = {
        json.loads(s["json"])["question_id"]: json.loads(s["json"])["answers"]
        for s in wds.DataPipeline(
            wds.SimpleShardList([str(p) for p in sorted((data / "test").glob("*.tar"))]),
            wds.tarfile_to_samples(),
        )
    }
    scores = [vqa_accuracy(p["answer"], human[p["question_id"]]) for p in preds]
    assert metrics["n_vqa"] == 6 and sum(scores) / 6 == pytest.approx(metrics["vqa_acc"], abs=1e-9)

    # bad input: a message, status 2, nothing evaluated
    (tmp_path / "adir").mkdir()
    assert evaluate.main([str(run), f"predictions={tmp_path / 'adir'}"]) == 2
    err = capsys.readouterr().err
    assert f"predictions: {tmp_path / 'adir'} is a directory" in err and "Traceback" not in err, err


def test_greedy_answers_decode_only_the_queries_the_teacher_forced_pass_got_wrong(monkeypatch):
    """Evaluation's greedy answers: a query whose every teacher-forced argmax was its target takes
    the target, and only the others are decoded token by token; the answers equal full decoding."""
    from types import SimpleNamespace

    import torch

    from tests.rag_mm.test_reader import EOT, batch, tiny_reader

    def pad(targets):  # token lists -> (a_ids, a_len)
        L = max(map(len, targets))
        ids = torch.tensor([t + [0] * (L - len(t)) for t in targets])
        return ids, torch.tensor([len(t) for t in targets])

    reader = tiny_reader().train()
    b = batch(B=3)
    q = (b["image"], b["q_ids"], b["q_len"])
    # a reader that says "5", "7 8" and "9" to the three queries, EOT after each
    taught = pad([[5, EOT], [7, 8, EOT], [9, EOT]])
    opt = torch.optim.Adam(reader.parameters(), lr=1e-2)
    for _ in range(60):
        opt.zero_grad()
        reader(*q, *taught).loss.backward()
        opt.step()
    reader.eval()
    greedy = reader.generate(*q, eot_id=EOT)  # every query decoded token by token
    assert greedy == [[5], [7, 8], [9]]
    # the evaluated targets: queries 0 and 2 the reader's answers, query 1 another one
    a_ids, a_len = pad([[5, EOT], [11, EOT], [9, EOT]])
    out = reader(*q, a_ids, a_len)
    assert out.correct.tolist() == [True, False, True]

    decoded = []
    generate = reader.generate

    def spy(image, *args, **kw):
        decoded.append(image.shape[0])
        return generate(image, *args, **kw)

    monkeypatch.setattr(reader, "generate", spy)
    rag = SimpleNamespace(reader=reader, rcfg=SimpleNamespace(reader_prior=False, top_k=0))
    loader_batch = dict(zip(("image", "q_ids", "q_len"), q), a_ids=a_ids, a_len=a_len)
    loader_batch["doc_id"] = torch.zeros(3, dtype=torch.long)
    tok = SimpleNamespace(eot_id=EOT)
    rows = torch.tensor([2, 1, 0])
    evaluated = SimpleNamespace(reader=out, doc_ids=None, scores=None)
    assert evaluate.greedy_answers(rag, loader_batch, evaluated, "cpu", rows, tok) == [
        [9],
        [7, 8],
        [5],
    ]
    assert decoded == [1]  # query 1 alone was decoded
    # a spread reader's forward hands over per-query targets (``SpreadRag.__call__``)
    decoded.clear()
    per_query = SimpleNamespace(correct=out.correct, targets=out.targets)
    spread = SimpleNamespace(reader=per_query, doc_ids=None, scores=None)
    assert evaluate.greedy_answers(rag, loader_batch, spread, "cpu", rows, tok)[1] == [7, 8]
    assert decoded == [1]
    # without a teacher-forced pass (rag_mm.ask) every query is decoded
    decoded.clear()
    asked = SimpleNamespace(doc_ids=None, scores=None)
    assert evaluate.greedy_answers(rag, loader_batch, asked, "cpu", rows, tok) == greedy[::-1]
    assert decoded == [3]


def test_a_spread_readers_evaluation_forward_hands_over_each_querys_targets():
    """The trainer evaluates through ``SpreadRag``: its forward keeps each query's answer targets,
    so its greedy answers, like the CLI's, decode only the queries the forward got wrong."""
    import torch

    from rag_mm.data.documents import DocumentStore
    from rag_mm.distributed.spread import SpreadRag
    from rag_mm.model.factory import build_reader
    from rag_mm.model.rag import RagModel
    from tests.rag_mm.test_token_mean import VOCAB, _cfg, _global_batch

    cfg = _cfg(8)
    m = cfg.model
    rag = RagModel(
        build_reader(m, VOCAB), DocumentStore.empty(m.image_size, m.max_doc_text), cfg.retriever
    )
    x = _global_batch(m)
    out = SpreadRag(rag, cfg, torch.device("cpu"))(**x)
    assert out.reader.targets == [a[:n].tolist() for a, n in zip(x["a_ids"], x["a_len"])]
