"""A normal run prints no third-party warning: every stderr line is one of rag_mm's own log
lines, none of them a warning from a library's logger (torch's "No CUDA runtime is found", DCP's
"assuming the intent is to save in a single process", ...)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from tests.rag_mm.conftest import tiny_overrides
from tests.rag_mm.test_train import REPO, run_module

# rag_mm.train's log format: "<date> <time> | rank R | LEVEL | logger | message"
OWN_LINE = re.compile(r"^\S+ \S+ \| rank \d+ \| (?P<level>[A-Z]+) \| (?P<name>[\w.]+) \| ")
FIRST_PARTY = ("rag_mm", "retriever", "parallel", "__main__")


def foreign_lines(stderr: str) -> list[str]:
    """Lines that are not rag_mm's log lines, and log lines of another package at WARNING or
    above."""
    bad = []
    for line in stderr.splitlines():
        m = OWN_LINE.match(line)
        if m is None:
            bad.append(line)
        elif m["level"] != "INFO" and m["name"].split(".")[0] not in FIRST_PARTY:
            bad.append(line)
    return bad


def quiet_env(tmp_path) -> dict:
    # a CUDA_HOME that exists: torch's cpp_extension notes "No CUDA runtime is found" at import on
    # any machine without a GPU driver then, as on one with a CUDA toolkit installed
    return {"CUDA_HOME": str(tmp_path), "PYTHONWARNINGS": ""}


def test_foreign_lines_are_found():
    assert foreign_lines(
        "W1125 21:15:15.534000 14306 torch/utils/cpp_extension.py:183] No CUDA runtime is found\n"
    )
    assert foreign_lines(
        "x.py:488: UserWarning: torch.distributed is disabled\n  return func(*args)\n"
    )
    assert foreign_lines("2026-11-25 21:15:16,583 | rank 0 | WARNING | torch.distributed | gloo\n")
    assert not foreign_lines(
        "2026-11-25 21:15:16,583 | rank 0 | WARNING | rag_mm.evaluate | below the prior\n"
    )


def test_one_process_run_prints_no_third_party_warning(tiny_world, tmp_path):
    """Training with a data-loader worker, checkpoints, the final evaluation, then a resume (a
    checkpoint load): stderr holds rag_mm's log lines only."""
    run_dir = tmp_path / "run"
    for steps in (2, 4):
        res = run_module(
            [
                "-m",
                "rag_mm.train",
                *tiny_overrides(
                    tiny_world, run_dir, f"max_steps={steps}", "ckpt_every=2", "data.num_workers=1"
                ),
            ],
            env_extra=quiet_env(tmp_path),
        )
        assert res.returncode == 0, res.stderr[-3000:]
        assert not foreign_lines(res.stderr), "\n".join(foreign_lines(res.stderr))
    assert "resumed from" in res.stderr


@pytest.mark.multirank
def test_two_rank_run_prints_no_third_party_warning(tiny_world, tmp_path):
    args = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=2",
        "-m",
        "rag_mm.train",
        *tiny_overrides(tiny_world, tmp_path / "run", "max_steps=2", "ckpt_every=2"),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HYDRA_FULL_ERROR": "0", **quiet_env(tmp_path)}
    res = subprocess.run(args, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    assert not foreign_lines(res.stderr), "\n".join(foreign_lines(res.stderr))
