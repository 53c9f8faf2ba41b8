"""Every JSON a run writes is strict: an undefined figure is ``null``, never NaN or Infinity, which
jq, JavaScript and Go refuse. The run's data has no held-out entity, so every held-out figure is
a mean over no queries."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from rag_mm import evaluate
from rag_mm.components.metrics import strict_dumps
from rag_mm.config import compose
from rag_mm.trainer import Trainer
from tests.rag_mm.conftest import rewrite_queries, tiny_overrides
from tests.rag_mm.test_train import WARMUP


def _refuse(constant: str):
    raise ValueError(f"non-standard JSON constant {constant}")


def strict_loads(text: str):
    """``json.loads`` that refuses NaN, Infinity and -Infinity, as a strict parser does."""
    return json.loads(text, parse_constant=_refuse)


def test_strict_loads_refuses_what_python_writes_by_default():
    with pytest.raises(ValueError, match="NaN"):
        strict_loads(json.dumps({"acc": float("nan")}))
    assert strict_loads(strict_dumps({"acc": float("nan"), "x": [float("inf")]})) == {
        "acc": None,
        "x": [None],
    }


def test_every_json_of_a_run_is_strict(tiny_world, tmp_path, caplog, capsys):
    root = rewrite_queries(
        tiny_world, tmp_path / "seen_only", lambda meta: {**meta, "heldout": False}
    )
    run_dir = tmp_path / "run"
    # learned retrieval (retrieved_examples.json), a validation pass (metrics.jsonl), checkpoints
    cfg = compose(
        tiny_overrides(root, run_dir, *WARMUP, "max_steps=4", "eval_every=2", "ckpt_every=2")
    )
    caplog.set_level(logging.INFO, logger="rag_mm.trainer")
    t = Trainer(cfg)
    try:
        t.fit()
    finally:
        t.close()
    assert "no held-out entities" in caplog.text and "held-out nan" not in caplog.text
    (run_dir / ".hydra").mkdir()  # as python -m rag_mm.train leaves it: the evaluation reads it
    OmegaConf.save(cfg, run_dir / ".hydra" / "config.yaml")
    predictions = tmp_path / "predictions.json"
    capsys.readouterr()
    assert evaluate.main([str(run_dir), "split=val", f"predictions={predictions}"]) == 0
    stdout = capsys.readouterr().out

    written = sorted(p for p in run_dir.rglob("*.json") if ".hydra" not in p.parts)
    names = {p.name for p in written}
    assert {
        "metrics.json",
        "blind_prior.json",
        "retrieved_examples.json",
        "manifest.json",
        "trainer_state.json",
    } <= names, names
    for path in [*written, predictions]:
        strict_loads(path.read_text())
    records = [strict_loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["acc_heldout"] for r in records if r["kind"] == "val"] == [None]
    # evaluate's JSON line
    assert strict_loads(stdout.strip().splitlines()[-1])["acc_heldout"] is None
    summary = strict_loads((run_dir / "metrics.json").read_text())
    assert summary["val"]["acc_heldout"] is None and summary["test"]["n_heldout"] == 0
    assert len(strict_loads(predictions.read_text())) == summary["val"]["n"]
    assert Path(run_dir / "checkpoints" / "step_00000004" / "manifest.json").is_file()
