"""Data whose queries name no gold document (converted VQA data): the settings that need one are
refused before any work, the retriever's warm-up trains on pseudo-queries alone, and a missing
shard's hint names the converter that writes it."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from rag_mm.config import ConfigError, compose, shard_problems
from rag_mm.trainer import Trainer
from tests.rag_mm.conftest import rewrite_queries, tiny_overrides
from tests.rag_mm.test_train import WARMUP, run_module


@pytest.fixture(scope="module")
def no_gold_world(tiny_world, tmp_path_factory):
    """The tiny world with every query's ``doc_id`` removed, as ``scripts/convert.py vqa`` writes
    them."""
    return rewrite_queries(
        tiny_world,
        tmp_path_factory.mktemp("no_gold") / "world",
        lambda meta: {k: v for k, v in meta.items() if k != "doc_id"},
    )


def test_oracle_on_queries_without_gold_documents_is_refused_before_work(no_gold_world, tmp_path):
    res = run_module(
        ["-m", "rag_mm.train", *tiny_overrides(no_gold_world, tmp_path / "run", "retriever=oracle")]
    )
    assert res.returncode == 2 and "Traceback" not in res.stderr
    assert (
        "data.train: 64 of the first 64 samples" in res.stderr
        and "retriever.mode=oracle" in res.stderr
    )
    assert "retriever.pseudo_queries" in res.stderr  # the way out is named
    assert res.stderr.count("rag_mm.train:") == 1  # one message
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_contrastive_settings_without_pseudo_queries_are_refused(no_gold_world, tmp_path):
    overrides = [o for o in WARMUP if not o.startswith("retriever.pseudo_queries")]
    with pytest.raises(ConfigError) as err:
        Trainer(compose(tiny_overrides(no_gold_world, tmp_path / "run", *overrides)))
    assert "retriever.warmup_steps=3" in str(err.value) and "retriever.contrastive_steps=-1" in str(
        err.value
    )
    # the reader-driven loss alone needs no gold document
    t = Trainer(
        compose(
            tiny_overrides(
                no_gold_world,
                tmp_path / "run2",
                *overrides,
                "retriever.warmup_steps=0",
                "retriever.contrastive_steps=0",
            )
        )
    )
    t.close()


def test_warmup_trains_on_pseudo_queries_alone_without_gold_documents(no_gold_world, tmp_path):
    """No query names its gold document: the warm-up and the contrastive term train the retriever on
    random views of the memory's pictures (and read no training batch during the warm-up)."""
    cfg = compose(tiny_overrides(no_gold_world, tmp_path / "run", *WARMUP))
    t = Trainer(cfg)
    assert t.rag.gold_queries is False
    before = {n: p.detach().clone() for n, p in t.rag.retriever.named_parameters()}
    try:
        out = t.fit()
    finally:
        t.close()
    changed = [n for n, p in t.rag.retriever.named_parameters() if not torch.equal(before[n], p)]
    assert changed
    records = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    warm = [r for r in records if r["kind"] == "warmup"]
    assert [r["step"] for r in warm] == [2, 3] and all(np.isfinite(r["loss"]) for r in warm)
    assert all(r["train_recall@2"] is None for r in warm)  # no gold document: no recall, not a 0
    train = [r for r in records if r["kind"] == "train"]
    assert train and all(
        np.isfinite(r["retriever_loss"]) and r["train_recall@2"] is None for r in train
    )
    assert out["step"] == 2 and "recall@1" not in out["test"]


def test_missing_shards_of_custom_data_name_the_converter_that_writes_them(tmp_path):
    cfg = compose(
        ["data=custom", f"data.root={tmp_path}", f"run_dir={tmp_path}/run", "retriever=learned"]
    )
    problems = {p.split(":")[0]: p for p in shard_problems(cfg)}
    assert (
        "scripts/convert.py corpus" in problems["data.corpus"]
        and "data.corpus=null" in problems["data.corpus"]
    )
    for split in ("train", "val", "test"):
        assert f"scripts/convert.py vqa|hf ... --split {split}" in problems[f"data.{split}"]
    assert "knowledge_world" not in " ".join(problems.values())


def test_oracle_evaluation_of_a_split_without_gold_documents_is_refused(
    no_gold_world, tiny_world, tmp_path
):
    """An oracle run trained on labelled data, evaluated on a split that names no gold document."""
    from omegaconf import OmegaConf

    from rag_mm import evaluate

    run_dir = tmp_path / "run"
    cfg = compose(tiny_overrides(tiny_world, run_dir, "max_steps=2", "ckpt_every=2"))
    t = Trainer(cfg)
    try:
        t.fit()
    finally:
        t.close()
    (run_dir / ".hydra").mkdir()
    OmegaConf.save(cfg, run_dir / ".hydra" / "config.yaml")
    with pytest.raises(
        evaluate.EvalError, match="data.test: 24 of the first 24 samples .* name no doc_id"
    ):
        evaluate.run(run_dir, "test", [f"data.root={no_gold_world}"])
