"""scripts/gpu_check.py on a machine without a GPU: it checks the wheels it would carry."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _module():
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "scripts" / "gpu_check.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = mod
    spec.loader.exec_module(mod)
    return mod


def test_wheel_check_names_missing_and_oversized_wheels(tmp_path):
    gc = _module()
    problems, sizes = gc.wheel_problems(tmp_path / "none")
    assert sizes["wheels"] == 0 and any("make gpu-wheels" in p for p in problems)

    folder = tmp_path / "wheels"
    folder.mkdir()
    for stem in gc.REQUIRED_WHEELS:
        (folder / f"{stem}-1.0-py3-none-any.whl").write_bytes(b"x" * 1000)
    problems, sizes = gc.wheel_problems(folder)
    assert problems == [] and sizes["wheels"] == len(gc.REQUIRED_WHEELS) and sizes["tree_bytes"] > 0

    (folder / "transformers-1.0-py3-none-any.whl").unlink()
    with open(folder / "faiss_cpu-1.0-py3-none-any.whl", "wb") as f:  # sparse: no disk used
        f.truncate(gc.TRANSFER_LIMIT)
    problems, _ = gc.wheel_problems(folder)
    assert any("lacks wheels for transformers" in p for p in problems)
    assert any("exceed the 64 MiB" in p for p in problems)
