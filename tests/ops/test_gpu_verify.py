"""scripts/gpu_verify.py --dry-run: every step of the GPU verification runs on the CPU at tiny
shapes (hf_tiny, nothing downloaded; the compiled steps in the slow run), the JSON holds each
step's figures, --only reruns one step and keeps the others."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
STEPS = [
    "probe",
    "step_A",
    "step_B",
    "step_C",
    "step_D",
    "step_E",
    "attention",
    "demo",
    "profile",
    "search",
    "learned",
]


def _run(out: Path, *extra: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", OMP_NUM_THREADS="1")
    env.pop("RAG_MM_DISABLE_FUSED_ATTENTION", None)
    return subprocess.run(
        [
            sys.executable,
            str(ROOT / "scripts" / "gpu_verify.py"),
            "--dry-run",
            "--out",
            str(out),
            "--budget",
            "500",
            *extra,
        ],
        capture_output=True,
        text=True,
        timeout=900,
        env=env,
    )


# the steps that compile (D, E, the demo's compiled reader) and the learned-retriever step: the
# slow run; compilation itself is tested in tests/parallel/test_compile_*.py
COMPILED = ["step_D", "step_E", "demo", "learned"]
EAGER = [n for n in STEPS if n not in COMPILED]


def _dry_run(tmp_path, steps: list[str]) -> tuple[dict, dict]:
    proc = _run(tmp_path, "--only", ",".join(steps))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads((tmp_path / "gpu_verify.json").read_text())
    assert list(data["steps"]) == steps
    assert {n: s["status"] for n, s in data["steps"].items()} == dict.fromkeys(steps, "ok")
    return data, {n: s["result"] for n, s in data["steps"].items()}


def test_dry_run_runs_the_eager_steps_and_only_reruns_one(tmp_path):
    data, res = _dry_run(tmp_path, EAGER)
    assert res["probe"]["matmul_bf16_tflops"] > 0 and "flex" in res["probe"]["features"]
    a, b, c = (res[f"step_{n}"] for n in "ABC")
    for r in (a, b, c):
        assert r["model_tflop_per_step"] > 0 and r["step_ms"] > 0 and len(r["loss"]) == 2
        assert r["attention_ran"], r
    assert a["ac"] == "full" and a["hfu"] > a["mfu_measured_peak"]  # recompute counted in HFU only
    assert b["ac"] == "none" and b["hfu"] == b["mfu_measured_peak"]
    assert abs(a["loss"][0] - b["loss"][0]) < 1e-4  # checkpointing changes no math
    assert c["params"] == "bf16" and {x["backend"] for x in c["attention_ran"]} == {"flex"}
    # bf16 weights: the same loss within bf16's reach
    assert abs(c["loss"][0] - a["loss"][0]) < 3e-2
    att = res["attention"]
    for name in ("sdpa", "flex"):
        assert (
            att["backends"][name]["max_rel_err"] < 2e-2
            and att["backends"][name]["padding_rows_zero"]
        )
    assert "not_run" in att["backends"]["fused"]  # not built without --build
    assert 0 < att["block_mask"]["computed"] <= att["block_mask"]["total"]
    assert res["profile"]["config"] == "B" and "host_syncs_per_step" in res["profile"]
    assert "A and B: same first loss" in " ".join(data["verdict"]["passed"])
    se = res["search"]
    assert se["same_ids"] and se["device_ms"] > 0 and se["faiss_host_ms"] > 0, se
    assert "the device search finds faiss's documents" in " ".join(data["verdict"]["passed"])

    # --only reruns one step and leaves the others as they were
    before = data["steps"]["step_A"]
    proc = _run(tmp_path, "--only", "probe")
    assert proc.returncode == 0, proc.stderr[-3000:]
    again = json.loads((tmp_path / "gpu_verify.json").read_text())
    assert again["steps"]["step_A"] == before and again["steps"]["probe"]["status"] == "ok"


@pytest.mark.slow
def test_dry_run_runs_the_compiled_steps(tmp_path):
    data, res = _dry_run(tmp_path, COMPILED)
    d, e = res["step_D"], res["step_E"]
    for r in (d, e):
        assert r["model_tflop_per_step"] > 0 and r["step_ms"] > 0 and len(r["loss"]) == 2
        assert r["attention_ran"], r
    assert d["compile"] and d["compile_backend"] == "aot_eager" and e["batch"] == 2 * d["batch"]
    demo = res["demo"]
    assert [r["config"] for r in demo["rows"]] == ["eager", "compiled_blocks", "compiled_model"]
    assert demo["losses_match_eager"] == {"compiled_blocks": True, "compiled_model": True}, demo
    assert all(r["eval_loss"] > 0 for r in demo["rows"]), demo  # the inference graphs ran
    assert "demo reader: compiled_model trains and evaluates as eager does" in " ".join(
        data["verdict"]["passed"]
    )
    le = res["learned"]  # the learned-retriever step ran, both kinds; its syncs are a GPU's check
    assert le["retriever"]["samples_per_s"] > 0 and le["joint"]["samples_per_s"] > 0, le
    assert "learned joint step: zero host syncs inside the step" in data["verdict"]["not_measured"]


def test_unknown_step_is_refused(tmp_path):
    proc = _run(tmp_path, "--only", "nope")
    assert proc.returncode == 2 and "unknown step" in proc.stderr and "Traceback" not in proc.stderr


def test_a_step_past_its_cap_is_stopped_and_the_rest_run(tmp_path):
    # a cap well under what step_D takes on any CPU (seconds: the model is built inside it)
    proc = _run(tmp_path, "--only", "step_D,probe", "--step-cap", "1")
    data = json.loads((tmp_path / "gpu_verify.json").read_text())
    assert data["steps"]["step_D"]["status"] == "timeout", data["steps"]["step_D"]
    # stopped by the alarm at the cap, or, inside one long native call, killed GRACE_S after it
    assert data["steps"]["step_D"]["wall_s"] < 1 + 20 + 10
    assert data["steps"]["probe"]["status"] == "ok" and proc.returncode == 1


def test_profile_counts_the_host_syncs_inside_the_steps_only():
    """``.item()`` in a step is one host sync a step, a step without one has none (on a GPU the
    profiler's own synchronisations fall outside the steps' ranges and are not counted)."""
    sys.path.insert(0, str(ROOT / "scripts" / "bench"))
    import torch
    from step_profile import profile_steps

    x = torch.randn(64, 64)
    quiet = profile_steps(lambda: (x @ x).sum(), torch.device("cpu"), steps=2)
    syncing = profile_steps(lambda: (x @ x).sum().item(), torch.device("cpu"), steps=2)
    assert quiet["host_syncs_per_step"] == 0, quiet
    assert syncing["host_syncs_per_step"] == 1, syncing


def test_profile_counts_kernels_not_the_annotations_mirrored_on_the_device():
    """On a GPU trace the optimizer's and the steps' record_function ranges appear on the device
    timeline beside the kernels they span; the kernel time counts each kernel once."""
    sys.path.insert(0, str(ROOT / "scripts" / "bench"))
    import torch
    from step_profile import STEP_MARK, device_kernels
    from torch.autograd.profiler_util import FunctionEvent

    cuda, cpu = torch.autograd.DeviceType.CUDA, torch.autograd.DeviceType.CPU

    def ev(i, name, device, a, b, annotation=False):
        return FunctionEvent(i, name, 0, a, b, device_type=device, is_user_annotation=annotation)

    events = [
        ev(0, "Optimizer.step#AdamW.step", cuda, 0, 100, annotation=True),
        ev(1, STEP_MARK, cuda, 0, 300, annotation=True),
        ev(5, "a user's range", cuda, 0, 50, annotation=True),
        ev(2, "multi_tensor_apply_kernel", cuda, 10, 40),
        ev(3, "nvjet_sm90_gemm", cuda, 100, 300),
        ev(4, "aten::mm", cpu, 0, 5),
    ]
    assert [e.name for e in device_kernels(events)] == [
        "multi_tensor_apply_kernel",
        "nvjet_sm90_gemm",
    ]


def test_build_runs_the_fused_kernel_inside_the_first_steps_longer_cap(tmp_path):
    """--build reaches the worker: the extension is built (here the CPU one) inside the first
    step's cap, which allows for the compile, and the attention step measures the fused kernel,
    which refuses mixed dtypes rather than reading bf16 bytes as fp32."""
    proc = _run(tmp_path, "--only", "attention", "--build")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    step = json.loads((tmp_path / "gpu_verify.json").read_text())["steps"]["attention"]
    assert step["status"] == "ok" and step["fused_extension"].startswith("fused kernels"), step
    assert step["cap_s"] > 150 + 100  # the dry run's cap plus the build's allowance
    fused = step["result"]["backends"]["fused"]
    assert "not_run" not in fused and fused["max_rel_err"] < 2e-2, fused
    assert "same dtype" in step["result"]["mixed_dtype"]["fused"]
