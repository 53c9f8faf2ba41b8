"""``python -m rag_mm.ask RUN_DIR``: a user's picture and question answered as evaluation answers
them."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import webdataset as wds

from rag_mm import ask
from rag_mm.build import batch_inputs, make_stream
from rag_mm.components import checkpoint
from rag_mm.evaluate import greedy_answers, load_config, load_run, read_texts
from tests.rag_mm.conftest import tiny_overrides
from tests.rag_mm.test_train import run_module

SHOWN = 3  # documents ask shows: more than the two the learned reader reads
CLOSED_RUN = ("retriever=none",)


@pytest.fixture(scope="module")
def closed_run(tiny_world, tmp_path_factory) -> Path:
    """A six-step closed-book run on the tiny world (the learned one is the session's
    ``learned_run``)."""
    root = tmp_path_factory.mktemp("ask_runs")
    res = run_module(
        ["-m", "rag_mm.train", *tiny_overrides(tiny_world, root / "closed", *CLOSED_RUN)]
    )
    assert res.returncode == 0, res.stderr[-3000:]
    return root / "closed"


def _evaluation(run: Path) -> tuple[dict, object, list[str], float]:
    """The first test batch as ``python -m rag_mm.evaluate`` reads it: (batch, the forward's output,
    the greedy answers, the retriever's logit scale)."""
    cfg = load_config(run, [])
    parts, _, device = load_run(cfg, checkpoint.latest_valid(run / "checkpoints"))
    try:
        rag = parts.rag.eval()
        batch = next(iter(make_stream(cfg, "test", train=False)))
        learned = rag.rcfg.mode == "learned"
        with torch.no_grad():
            out = rag(
                **batch_inputs(batch, device),
                retriever_loss=False,
                search_k=SHOWN if learned else 0,
            )
            preds = greedy_answers(
                rag, batch, out, device, torch.arange(len(batch["key"])), parts.tok
            )
        scale = float(rag.retriever.scale().detach()) if learned else 1.0
    finally:
        if parts.memory is not None:
            parts.memory.close()
    # spelled as evaluation's predictions are: as written in the passages read, else decoded
    texts = read_texts(rag, out, batch["question"], range(len(preds)))
    return batch, out, [parts.tok.spell(p, t) for p, t in zip(preds, texts)], scale


def _query_files(world: Path, keys: list[str], questions: list[str], folder: Path) -> Path:
    """The test queries' pictures as files (pics/<key>.png) and a jsonl naming them relatively."""
    pics = {
        s["__key__"]: s["png"]
        for s in wds.DataPipeline(
            wds.SimpleShardList([str(world / "test" / "test-000000.tar")]), wds.tarfile_to_samples()
        )
    }
    (folder / "pics").mkdir(parents=True)
    lines = []
    for key, question in zip(keys, questions):
        (folder / "pics" / f"{key}.png").write_bytes(pics[key])
        lines.append(
            json.dumps({"image": f"pics/{key}.png", "question": question, "question_id": key})
        )
    path = folder / "queries.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.mark.parametrize(
    "name",
    # closed book: the same path less the documents, in the slow run
    ["learned", pytest.param("closed", marks=pytest.mark.slow)],
)
def test_ask_answers_and_retrieves_as_evaluation_does(request, tiny_world, tmp_path, name):
    run = request.getfixturevalue(f"{name}_run")
    batch, out, answers, scale = _evaluation(run)
    queries = _query_files(tiny_world, batch["key"], batch["question"], tmp_path)

    # preprocessing: the picture and question tensors are the evaluation batch's, bit for bit
    asker = ask.Asker(run)
    try:
        for i, key in enumerate(batch["key"][:4]):
            s = asker.sample(ask.Query(tmp_path / "pics" / f"{key}.png", batch["question"][i]))
            assert torch.equal(s["image"], batch["image"][i]), key
            assert s["q_ids"] == batch["q_ids"][i, : int(batch["q_len"][i])].tolist(), key
    finally:
        asker.close()

    res = run_module(
        ["-m", "rag_mm.ask", str(run), "--questions", str(queries), "--top-k", str(SHOWN)]
    )
    assert res.returncode == 0, res.stderr[-3000:]
    rows = [json.loads(line) for line in res.stdout.splitlines()]
    assert [r["question_id"] for r in rows] == batch["key"]
    assert all(r["checkpoint"].endswith("step_00000006") and r["step"] == 6 for r in rows)
    # the answer is evaluation's greedy answer to the same picture and question
    assert [r["answer"] for r in rows] == answers
    if name == "closed":
        assert all(r["documents"] == [] for r in rows)
    else:  # the same documents, nearest first, with the index's similarities
        for i, r in enumerate(rows):
            docs = r["documents"]
            assert [d["doc_id"] for d in docs] == out.doc_ids[i, :SHOWN].tolist()
            # the two the reader read, scaled as evaluated
            read = torch.tensor([d["score"] for d in docs[:2]]) * scale
            torch.testing.assert_close(read, out.scores[i].float(), atol=1e-5, rtol=1e-5)
            assert [d["score"] for d in docs] == sorted((d["score"] for d in docs), reverse=True)
            for d in docs:  # knowledge-world documents: one passage line, key doc<6-digit id>
                assert d["source"].endswith(f"corpus-000000.tar#doc{d['doc_id']:06d}"), d
                assert d["text"].startswith("habitat: ") and "\n" not in d["text"]

    # one picture and question on the command line: the same answer, as one JSON object and as text
    first = tmp_path / "pics" / f"{batch['key'][0]}.png"
    res = run_module(
        [
            "-m",
            "rag_mm.ask",
            str(run),
            "--image",
            str(first),
            "--question",
            batch["question"][0],
            "--json",
            "--top-k",
            str(SHOWN),
        ]
    )
    assert res.returncode == 0, res.stderr[-3000:]
    one = json.loads(res.stdout)
    assert set(one) == {"answer", "documents", "checkpoint", "step", "image", "question"}
    assert one["answer"] == rows[0]["answer"]
    assert [d["doc_id"] for d in one["documents"]] == [d["doc_id"] for d in rows[0]["documents"]]
    # one question alone, or padded in a batch of 24: the similarities agree to float rounding
    assert [d["score"] for d in one["documents"]] == pytest.approx(
        [d["score"] for d in rows[0]["documents"]], abs=1e-5
    )
    if name == "learned":
        res = run_module(
            [
                "-m",
                "rag_mm.ask",
                str(run),
                "--image",
                str(first),
                "--question",
                batch["question"][0],
            ]
        )
        assert res.returncode == 0 and f"answer: {one['answer']}\n" in res.stdout, res.stderr[
            -3000:
        ]
        assert res.stdout.count("corpus-000000.tar#doc") == 2  # the reader's top_k by default


def test_ask_bad_input_exits_2_with_one_line(learned_run, tmp_path, capsys):
    run = learned_run
    picture = tmp_path / "fox.png"
    from PIL import Image

    Image.new("RGB", (20, 20), (200, 40, 40)).save(picture)
    text = tmp_path / "notes.png"
    text.write_text("not a picture")
    bare = tmp_path / "bare"  # a run directory whose training never checkpointed
    shutil.copytree(run / ".hydra", bare / ".hydra")
    oracle = tmp_path / "oracle"
    shutil.copytree(run / ".hydra", oracle / ".hydra")
    cfg = oracle / ".hydra" / "config.yaml"
    cfg.write_text(cfg.read_text().replace("mode: learned\n  top_k: 2", "mode: oracle\n  top_k: 1"))
    lines = tmp_path / "bad.jsonl"
    lines.write_text(json.dumps({"image": str(picture), "question": "what?"}) + "\n{not json\n")
    keys = tmp_path / "keys.jsonl"
    keys.write_text(json.dumps({"picture": str(picture), "question": "what?"}) + "\n")
    q = ["--image", str(picture), "--question", "What does it eat?"]
    cases = {
        (
            str(run),
            "--image",
            str(tmp_path / "nope.png"),
            "--question",
            "what?",
        ): f"{tmp_path / 'nope.png'} does not exist",
        (str(run), "--image", str(text), "--question", "what?"): f"{text} is not a picture",
        (str(run), "--image", str(picture), "--question", "  "): "--question is empty",
        (str(bare), *q): "no valid checkpoint",
        (str(tmp_path / "nowhere"), *q): "not found",
        (str(run), *q, "--checkpoint", "99"): "steps there: 3, 6",
        (str(oracle), *q): "retriever.mode=oracle",
        (str(run), "--questions", str(lines)): f"{lines} line 2 is not JSON",
        (
            str(run),
            "--questions",
            str(keys),
        ): f'{keys} line 1: expected {{"image": path, "question": text}}',
        (str(run), "--questions", str(tmp_path / "none.jsonl")): "does not exist",
        (str(run), *q, "--top-k", "0"): "--top-k must be positive",
    }
    for argv, message in cases.items():
        assert ask.main(list(argv)) == 2, argv
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err, (argv, err)
        assert len(err.strip().splitlines()) == 1, (argv, err)
    # a real process: no traceback, status 2
    res = run_module(["-m", "rag_mm.ask", str(run), "--image", str(text), "--question", "what?"])
    assert res.returncode == 2 and "Traceback" not in res.stderr
    errors = [line for line in res.stderr.splitlines() if line.startswith("ask: ")]
    assert len(errors) == 1 and f"{text} is not a picture" in errors[0], res.stderr
