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


def test_steps_cover_every_gpu_check(tmp_path):
    """The GPU run trains the demo through NCCL in one process and measures the MFU of the demo
    reader and of the ~1B HF reader in bf16; the dry run takes the same steps on the CPU."""
    import argparse

    gc = _module()
    args = argparse.Namespace(dry_run=False, quick=False, only=None, compile=True)
    steps = {s.name: s for s in gc.plan(args, tmp_path)}
    assert list(steps) == list(gc.STEPS) == ["pytest", "attention", "mfu_demo", "mfu_1b", "demo"]
    one_b = steps["mfu_1b"].argv
    assert {"--device", "cuda", "bf16", "--checkpointing", "--compile", "model=llama3_2_1b"} <= set(one_b)
    demo = steps["demo"].argv[-1]
    assert "--nproc_per_node=1" in demo and "launch.backend=nccl" in demo and "device=cuda" in demo
    assert str(tmp_path / "demo_metrics.json") in demo
    dry = {s.name: s for s in gc.plan(argparse.Namespace(dry_run=True, quick=False, only=["mfu_1b", "demo"],
                                                         compile=False), tmp_path)}
    assert list(dry) == ["mfu_1b", "demo"]
    assert "cuda" not in dry["mfu_1b"].argv and "model=hf_tiny" in dry["mfu_1b"].argv
    assert "launch.backend=gloo" in dry["demo"].argv[-1] and "max_steps=2" in dry["demo"].argv[-1]
    # every bench with a --device option has a step
    assert set(gc.benches_with_device()) <= set(gc.BENCHES)
