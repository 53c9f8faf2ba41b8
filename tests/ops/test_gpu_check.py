"""scripts/gpu_check.py's plumbing, on a machine without a GPU: the steps it plans, how it runs
one (figures read back, a step past its timeout killed), and the refusal when there is no GPU."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _module():
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "scripts" / "gpu_check.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = mod
    spec.loader.exec_module(mod)
    return mod


def test_run_step_reads_figures_and_kills_a_step_past_its_timeout(tmp_path):
    """A step's figures come from the file it wrote; a step that outlives its timeout is killed
    (its whole process group) and reported, so no step can hang the check."""
    gc = _module()
    log = open(tmp_path / "log", "w")
    write = (
        "import json, sys; print('hello'); "
        f"json.dump({{'x': 3}}, open({str(tmp_path / 'a.json')!r}, 'w'))"
    )
    step = gc.Step(
        "a", [sys.executable, "-c", write], "a.json", gc.json_figures, lambda f: f"x={f['x']}"
    )
    res = gc.run_step(step, dict(os.environ), 60, tmp_path, log)
    assert res["ok"] and res["figures"] == {"x": 3} and res["headline"] == "x=3", res
    sleeper = (
        "import subprocess, sys; "
        "subprocess.run([sys.executable, '-c', 'import time; time.sleep(120)'])"
    )
    step = gc.Step("b", [sys.executable, "-c", sleeper], "b.json", gc.json_figures, str)
    t0 = time.monotonic()
    res = gc.run_step(step, dict(os.environ), 2, tmp_path, log)
    log.close()
    assert res["timed_out"] and not res["ok"] and res["figures"] is None, res
    # the sleeping grandchild holds the output pipe: only a group kill ends the step this soon
    assert res["rc"] is not None and time.monotonic() - t0 < 9
    assert "hello" in (tmp_path / "log").read_text()


def test_without_a_gpu_it_says_so_and_runs_nothing(tmp_path):
    """With no CUDA device and no --dry-run: one message, exit status 2, no traceback."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    cmd = [sys.executable, str(ROOT / "scripts" / "gpu_check.py"), "--out", str(tmp_path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "no CUDA device" in proc.stderr and "--dry-run" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "gpu_check.log").exists()


def test_steps_cover_every_gpu_check(tmp_path):
    """The GPU run trains the demo through NCCL in one process and measures the MFU of the demo
    reader and of the ~1B HF reader in bf16; the dry run takes the same steps on the CPU."""
    import argparse

    gc = _module()
    args = argparse.Namespace(dry_run=False, quick=False, only=None, compile=True)
    steps = {s.name: s for s in gc.plan(args, tmp_path)}
    assert (
        list(steps)
        == list(gc.STEPS)
        == ["cuda_build", "pytest", "attention", "mfu_demo", "mfu_1b", "demo"]
    )
    # the GPU machine compiles the CUDA sources with its own nvcc first; the dry run only plans it
    build = steps["cuda_build"].argv
    assert build[2:4] == ["--cuda-home", "auto"] and "--plan-only" not in build
    one_b = steps["mfu_1b"].argv
    assert {"--device", "cuda", "bf16", "--checkpointing", "--compile", "model=llama3_2_1b"} <= set(
        one_b
    )
    demo = steps["demo"].argv[-1]
    assert "--nproc_per_node=1" in demo and "launch.backend=nccl" in demo and "device=cuda" in demo
    assert str(tmp_path / "demo_metrics.json") in demo
    dry = {
        s.name: s
        for s in gc.plan(
            argparse.Namespace(dry_run=True, quick=False, only=["mfu_1b", "demo"], compile=False),
            tmp_path,
        )
    }
    assert list(dry) == ["mfu_1b", "demo"]
    assert "cuda" not in dry["mfu_1b"].argv and "model=hf_tiny" in dry["mfu_1b"].argv
    assert "launch.backend=gloo" in dry["demo"].argv[-1] and "max_steps=2" in dry["demo"].argv[-1]
    dry_build = gc.plan(
        argparse.Namespace(dry_run=True, quick=False, only=["cuda_build"], compile=False), tmp_path
    )
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
        assert (
            "'torchrun'" not in demo
            and f"[{sys.executable!r}, '-m', 'torch.distributed.run'" in demo
        )


@pytest.mark.slow
def test_dry_demo_runs_without_the_venv_on_path(tmp_path):
    """The dry check's demo step with a PATH that lacks the venv's bin and whose only torchrun
    records that it was called: it must pass without calling it. Slow (the demo's data and two
    training steps, about a minute); `make gpu-check-dry` runs the whole dry check, from make,
    where the venv is not activated either."""
    fake = tmp_path / "bin"
    fake.mkdir()
    called = tmp_path / "bare_torchrun_called"
    (fake / "torchrun").write_text(f"#!/bin/sh\ntouch {called}\nexit 127\n")
    (fake / "torchrun").chmod(0o755)
    venv_bin = str(Path(sys.executable).parent)
    path = os.pathsep.join(
        [str(fake)]
        + [
            d
            for d in os.environ.get("PATH", "").split(os.pathsep)
            if d and Path(d).resolve() != Path(venv_bin).resolve()
        ]
    )
    out = tmp_path / "out"
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "scripts" / "gpu_check.py"),
            "--dry-run",
            "--only",
            "demo",
            "--out",
            str(out),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        env=dict(os.environ, PATH=path, OMP_NUM_THREADS="1"),
    )
    assert not called.exists(), "the demo step called a bare `torchrun`"
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    assert (out / "demo_metrics.json").exists()
