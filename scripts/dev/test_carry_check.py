"""scripts/dev/carry_check.py: the wheels carried to a lent GPU machine are all there and fit the
transfer limit together with the working tree. Run by `make -f scripts/dev/Makefile test`."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def _module():
    spec = importlib.util.spec_from_file_location("carry_check", HERE / "carry_check.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["carry_check"] = mod
    spec.loader.exec_module(mod)
    return mod


def test_wheel_check_names_missing_and_oversized_wheels(tmp_path):
    cc = _module()
    problems, sizes = cc.wheel_problems(tmp_path / "none")
    assert sizes["wheels"] == 0 and any("gpu-wheels" in p for p in problems)

    folder = tmp_path / "wheels"
    folder.mkdir()
    for stem in cc.REQUIRED_WHEELS:
        (folder / f"{stem}-1.0-py3-none-any.whl").write_bytes(b"x" * 1000)
    problems, sizes = cc.wheel_problems(folder)
    assert problems == [] and sizes["wheels"] == len(cc.REQUIRED_WHEELS)
    assert sizes["tree_bytes"] > 0

    (folder / "transformers-1.0-py3-none-any.whl").unlink()
    with open(folder / "faiss_cpu-1.0-py3-none-any.whl", "wb") as f:  # sparse: no disk used
        f.truncate(cc.TRANSFER_LIMIT)
    problems, _ = cc.wheel_problems(folder)
    assert any("lacks wheels for transformers" in p for p in problems)
    assert any("exceed the 64 MiB" in p for p in problems)
