"""``python -m rag_mm.evaluate RUN_DIR``: a trained run's checkpoint evaluated without a trainer."""

from __future__ import annotations

import json
import shutil

import pytest

from rag_mm import evaluate
from tests.rag_mm.conftest import tiny_overrides
from tests.rag_mm.test_train import run_module


def _no_nan(constant: str):
    raise AssertionError(f"{constant} in JSON output: must be null")


def test_evaluate_cli_reproduces_the_trainers_final_metrics(tiny_world, tmp_path, capsys):
    run = tmp_path / "run"
    # validation on training queries: no held-out entity, so acc_heldout averages nothing (null)
    res = run_module(["-m", "rag_mm.train", *tiny_overrides(tiny_world, run, "data.val='train/train-{000000..000000}.tar'")])
    assert res.returncode == 0, res.stderr[-3000:]
    summary = json.loads((run / "metrics.json").read_text(), parse_constant=_no_nan)
    assert summary["val"]["n_heldout"] == 0 and summary["val"]["acc_heldout"] is None
    # does the reader use the picture: the blind prior, accuracy by answer type, the ablation
    test = summary["test"]
    assert 0.0 <= test["blind_prior"] <= 1.0 and 0.0 <= test["acc_blank"] <= 1.0
    assert test["image_drop"] == pytest.approx(test["acc"] - test["acc_blank"])
    assert sum(t["n"] for t in test["by_type"].values()) == test["n"]
    assert set(test["by_type"]) == {"other"}  # knowledge-world answers are words
    assert (run / "blind_prior.json").is_file()
    assert "test: accuracy" in res.stderr and "blind prior" in res.stderr  # the split's INFO line

    res = run_module(["-m", "rag_mm.evaluate", str(run), "split=test"])
    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads(res.stdout.strip().splitlines()[-1], parse_constant=_no_nan)
    assert "test: accuracy" in res.stderr  # the split's summary line
    for key in ("blind_prior", "acc_blank", "image_drop"):  # the cached table, the same blanked forward
        assert out[key] == pytest.approx(test[key], abs=1e-6), key
    assert out["by_type"]["other"]["n"] == test["by_type"]["other"]["n"]
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
