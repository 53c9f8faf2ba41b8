"""scripts/gpu_check.py on a machine without a GPU: it checks the wheels it would carry."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

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
    assert list(steps) == list(gc.STEPS) == ["cuda_build", "pytest", "attention", "mfu_demo", "mfu_1b", "demo"]
    # the GPU machine compiles the CUDA sources with its own nvcc first; the dry run only plans it
    build = steps["cuda_build"].argv
    assert build[2:4] == ["--cuda-home", "auto"] and "--plan-only" not in build
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
    dry_build = gc.plan(argparse.Namespace(dry_run=True, quick=False, only=["cuda_build"], compile=False), tmp_path)
    assert "--plan-only" in dry_build[0].argv
    # every bench with a --device option has a step
    assert set(gc.benches_with_device()) <= set(gc.BENCHES)


def test_no_step_looks_a_program_up_on_path(tmp_path):
    """Every step runs this interpreter: a venv that is not activated has its scripts (torchrun)
    off PATH, and the GPU machine's PATH is no safer."""
    import argparse

    gc = _module()
    for dry in (False, True):
        args = argparse.Namespace(dry_run=dry, quick=False, only=None, compile=False)
        for step in gc.plan(args, tmp_path):
            assert step.argv[0] == sys.executable, (step.name, step.argv[:3])
        demo = {s.name: s for s in gc.plan(args, tmp_path)}["demo"].argv[-1]
        assert "'torchrun'" not in demo and f"[{sys.executable!r}, '-m', 'torch.distributed.run'" in demo


@pytest.mark.slow
def test_dry_demo_runs_without_the_venv_on_path(tmp_path):
    """The dry check's demo step with a PATH that lacks the venv's bin and whose only torchrun
    records that it was called: it must pass without calling it. Slow (the demo's data and two
    training steps, about a minute); `make test` runs the whole dry check anyway, from make,
    where the venv is not activated either."""
    import os
    import subprocess

    fake = tmp_path / "bin"
    fake.mkdir()
    called = tmp_path / "bare_torchrun_called"
    (fake / "torchrun").write_text(f"#!/bin/sh\ntouch {called}\nexit 127\n")
    (fake / "torchrun").chmod(0o755)
    venv_bin = str(Path(sys.executable).parent)
    path = os.pathsep.join([str(fake)] + [d for d in os.environ.get("PATH", "").split(os.pathsep)
                                          if d and Path(d).resolve() != Path(venv_bin).resolve()])
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_check.py"), "--dry-run", "--only", "demo",
                           "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env=dict(os.environ, PATH=path, OMP_NUM_THREADS="1"))
    assert not called.exists(), "the demo step called a bare `torchrun`"
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    assert (out / "demo_metrics.json").exists()
