"""The ``rag_mm`` command: one entry for every program, each subcommand the program it names."""

from __future__ import annotations

import importlib
import json
import tomllib
from pathlib import Path

import pytest

from rag_mm import cli
from tests.rag_mm.conftest import tiny_overrides
from tests.rag_mm.test_train import run_module

REPO = Path(__file__).resolve().parents[2]


def test_the_console_script_is_the_dispatcher():
    """pyproject installs ``rag_mm`` as ``rag_mm.cli:main``, and every command's program has a
    ``main(argv)``."""
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    module, _, func = scripts["rag_mm"].partition(":")
    assert getattr(importlib.import_module(module), func) is cli.main
    for name, (mod, _) in cli.COMMANDS.items():
        assert callable(importlib.import_module(mod).main), name


def test_help_lists_every_command_and_a_wrong_one_is_named(capsys):
    assert cli.main(["--help"]) == 0
    out = capsys.readouterr().out
    assert all(f"  {name} " in out for name in cli.COMMANDS)
    assert cli.main(["trian"]) == 2
    err = capsys.readouterr().err
    assert "unknown command 'trian'" in err and "Traceback" not in err
    assert cli.main([]) == 2


@pytest.mark.parametrize("name", ["evaluate", "ask", "plan", "export", "build-index", "convert"])
def test_each_command_hands_its_arguments_to_its_program(name, tmp_path, capsys):
    """A wrong argument reaches the named program, which names it in its own message with exit
    status 2 (never the dispatcher's, never a traceback)."""
    missing = tmp_path / "no_such_run"
    argv = {
        "evaluate": [str(missing)],
        "ask": [str(missing), "--question", "what?", "--image", str(tmp_path / "none.png")],
        "plan": ["model=no_such_model"],
        "export": [str(missing), str(tmp_path / "out")],
        "build-index": [f"corpus={tmp_path}/none.tar", f"out={tmp_path}/i.index"],
        "convert": ["corpus", "--docs", str(tmp_path / "none"), "--out", str(tmp_path / "o")],
    }[name]
    try:
        code = cli.main([name, *argv])
    except SystemExit as exc:  # argparse's own exit
        code = exc.code
    err = capsys.readouterr().err
    assert code == 2, err
    named = {"ask": "none.png", "plan": "no_such_model", "build-index": "none.tar"}
    assert named.get(name, str(tmp_path / ("none" if name == "convert" else "no_such_run"))) in err
    assert "Traceback" not in err and "unknown command" not in err


def test_train_through_the_command_is_the_main_job(tiny_world, tmp_path):
    """``python -m rag_mm train OVERRIDES`` runs the Hydra job ``python -m rag_mm.train`` runs."""
    run = tmp_path / "run"
    overrides = tiny_overrides(tiny_world, run, "max_steps=2", "ckpt_every=0")
    res = run_module(["-m", "rag_mm", "train", *overrides, f"hydra.run.dir={run}"])
    assert res.returncode == 0, res.stderr[-3000:]
    assert json.loads((run / "metrics.json").read_text())["step"] == 2
    assert (run / ".hydra" / "config.yaml").is_file() and (run / "metrics.jsonl").is_file()
