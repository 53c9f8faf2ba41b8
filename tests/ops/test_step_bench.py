"""scripts/bench/stepbench.py and train_throughput.py: FLOPs counted once on the meta device and
equal to a count of the real step, recomputation counted for HFU, parts told apart by name."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts" / "bench"))

import stepbench as sb  # noqa: E402

HF_TINY = ["model=hf_tiny", "retriever.top_k=2"]


def test_meta_count_equals_the_real_step_count():
    """The count on meta (no kernel, no tuning) agrees with FlopCounterMode over a real CPU step of
    the same reader and batch, and the recomputed FLOPs are the blocks' forward."""
    from parallel.spmd import find_blocks

    cfg, m, vocab = sb.compose_run(HF_TINY)
    meta = sb.meta_flops(m, cfg, vocab, batch=2, checkpointed_blocks=True)
    model = sb.build_model(m, vocab, "cpu").train()
    names = sb.block_names(model, find_blocks(model))
    real = sb.count_flops(model, sb.synthetic_batch(cfg, 2, vocab, "cpu"), names)
    assert meta.model == pytest.approx(real.model, rel=0.01)
    assert meta.recompute == pytest.approx(real.recompute, rel=0.01)
    # 4 LM layers and the tower's blocks, each with a forward worth counting; the recompute is the
    # forward of all of them, well under the forward + backward total
    assert len(names) >= 4 and all(v > 0 for v in meta.by_block.values())
    assert 0.1 * meta.model < meta.recompute < 0.5 * meta.model
    assert sb.meta_flops(m, cfg, vocab, batch=4, checkpointed_blocks=False).model > 1.9 * meta.model


def test_bench_reports_the_meta_count(tmp_path):
    """The bench's step runs ``auto`` attention (tuned in warm-up) and reports the meta count, MFU
    against the measured peak, HFU >= MFU with checkpointing, the backend that ran, the losses."""
    out = tmp_path / "tt.json"
    cmd = [
        sys.executable,
        str(ROOT / "scripts" / "bench" / "train_throughput.py"),
        "--threads",
        "1",
        "--batch",
        "2",
        "--warmup",
        "1",
        "--steps",
        "1",
        "--checkpointing",
        "--out",
        str(out),
        *HF_TINY,
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    r = json.loads(out.read_text())
    cfg, m, vocab = sb.compose_run(HF_TINY)
    meta = sb.meta_flops(m, cfg, vocab, batch=2, checkpointed_blocks=True)
    assert r["model_tflop_per_step"] == pytest.approx(meta.model / 1e12, rel=0.01, abs=1e-4)
    assert r["hardware_tflop_per_step"] == pytest.approx(meta.hardware / 1e12, rel=0.01, abs=1e-4)
    assert r["mfu"] is None and 0 < r["mfu_measured_peak"] < r["hfu"]
    assert r["attention_ran"] and all(a["layout"] == "retrieval" for a in r["attention_ran"])
    assert len(r["loss"]) == 2 and all(x > 0 for x in r["loss"])


@pytest.mark.parametrize(
    "name, part, bf16",
    [
        ("NVIDIA H100 80GB HBM3", "H100 SXM", 989.4e12),
        ("NVIDIA H100 PCIe", "H100 PCIe", 756e12),
        ("NVIDIA H100 NVL", "H100 NVL", 835e12),
        ("NVIDIA H200", "H200", 989.4e12),
        ("NVIDIA A100-SXM4-80GB", "A100", 312e12),
        ("NVIDIA GeForce RTX 4090", None, None),
    ],
)
def test_datasheet_peak_tells_parts_apart(name, part, bf16):
    assert sb.datasheet_peak(name, "bf16") == (part, bf16)


def test_time_steps_reads_losses_after_timing():
    calls = []
    t = sb.time_steps(
        lambda: (calls.append(1), torch.tensor(float(len(calls))))[1], torch.device("cpu"), 2, 3
    )
    assert t.losses == [1.0, 2.0, 3.0, 4.0, 5.0] and t.step_s >= 0


def test_native_reader_materializes_like_a_fresh_one():
    """The demo reader built on meta and materialised has its norms at their defaults and its head
    tied again (to_empty left norms as uninitialised memory, NaN losses, and an untied head)."""
    from rag_mm.model.factory import build_reader, count_parameters, materialize

    cfg, m, vocab = sb.compose_run([])
    fresh = build_reader(m, vocab)
    made = materialize(build_reader(m, vocab, meta=True), "cpu")
    assert count_parameters(made) == count_parameters(fresh)
    assert made.lm_head.weight is made.tok_emb.weight
    for (n, p), (_, q) in zip(made.named_parameters(), fresh.named_parameters()):
        if "ln" in n or "norm" in n:
            torch.testing.assert_close(p, q, msg=n)
    loss = made(**sb.synthetic_batch(cfg, 2, vocab, "cpu")).loss
    assert torch.isfinite(loss)
