"""``python -m rag_mm.evaluate RUN_DIR``: a trained run's checkpoint evaluated without a trainer."""

from __future__ import annotations

import json
import shutil

import pytest

from rag_mm import evaluate
from tests.rag_mm.conftest import tiny_overrides
from tests.rag_mm.test_train import run_module


def test_evaluate_cli_reproduces_the_trainers_final_metrics(tiny_world, tmp_path, capsys):
    run = tmp_path / "run"
    res = run_module(["-m", "rag_mm.train", *tiny_overrides(tiny_world, run)])
    assert res.returncode == 0, res.stderr[-3000:]
    summary = json.loads((run / "metrics.json").read_text())

    res = run_module(["-m", "rag_mm.evaluate", str(run), "split=test"])
    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out["split"] == "test" and out["step"] == summary["step"] == 6
    assert out["n"] == summary["test"]["n"] > 0
    assert out["acc"] == pytest.approx(summary["test"]["acc"], abs=1e-6)
    # a six-step reader answers nothing right: its NLL is what shows the trained weights were loaded
    assert out["nll"] == pytest.approx(summary["test"]["nll"], abs=1e-6)

    # bad input: a message on stderr, exit status 2, no traceback
    res = run_module(["-m", "rag_mm.evaluate", str(tmp_path / "nowhere")])
    assert res.returncode == 2 and "not found" in res.stderr and "Traceback" not in res.stderr, res.stderr
    bare = tmp_path / "bare"  # a run directory whose training never checkpointed
    shutil.copytree(run / ".hydra", bare / ".hydra")
    cases = {
        (str(bare),): "no valid checkpoint",
        (str(run), "split=dev"): "unknown split 'dev'",
        (str(run), "model.widht=3"): "widht",
    }
    for argv, message in cases.items():
        assert evaluate.main(list(argv)) == 2, argv
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err, (argv, err)
