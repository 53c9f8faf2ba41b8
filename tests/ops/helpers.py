"""Running the real job (python -m rag_mm.train, torchrun) on the tiny world from the tests."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from rag_mm.components import checkpoint
from rag_mm.config import compose
from rag_mm.trainer import Trainer
from tests.rag_mm.conftest import tiny_overrides

REPO = Path(__file__).resolve().parents[2]
# 8 steps, a checkpoint every 2: the kill tests have 4 checkpoints to fall back to
FT_ARGS = ("max_steps=8", "ckpt_every=2", "keep_checkpoints=3", "deterministic=true")


def env(**extra: str) -> dict:
    out = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONHASHSEED": "0", "HYDRA_FULL_ERROR": "1"}
    out.pop("RAG_MM_FAULT", None)
    out.update(extra)
    return out


def torchrun(
    root,
    run_dir,
    *extra: str,
    nproc: int = 2,
    launcher: tuple = ("--standalone",),
    fault: str = "",
    timeout: int = 600,
) -> subprocess.CompletedProcess:
    args = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        *launcher,
        f"--nproc_per_node={nproc}",
        "-m",
        "rag_mm.train",
        *tiny_overrides(root, run_dir, *FT_ARGS, *extra),
    ]
    return subprocess.run(
        args,
        cwd=REPO,
        env=env(**({"RAG_MM_FAULT": fault} if fault else {})),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def final_state(root, run_dir) -> tuple[int, dict[str, torch.Tensor]]:
    """Step and model parameters of the newest valid checkpoint of a run (loaded in this
    process)."""
    cfg = compose(tiny_overrides(root, run_dir, *FT_ARGS))
    t = Trainer(cfg, log_metrics=False)
    try:
        t.restore()
        return t.step, {k: v.detach().clone() for k, v in t.model.state_dict().items()}
    finally:
        t.close()


def train_losses(run_dir) -> dict[int, float]:
    """step -> logged training loss; a replayed step (after a restart) keeps its last record."""
    out = {}
    for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if rec.get("kind") == "train":
            out[rec["step"]] = rec["loss"]
    return out


def valid_checkpoints(run_dir) -> list[Path]:
    ckpts = sorted(
        p for p in (Path(run_dir) / "checkpoints").glob("step_*") if not p.name.endswith(".tmp")
    )
    return [p for p in ckpts if checkpoint.verify(p) is None]


def assert_same_params(a: dict, b: dict, what: str) -> None:
    assert a.keys() == b.keys()
    diff = [k for k in a if not torch.equal(a[k], b[k])]
    assert not diff, (
        f"{what}: {len(diff)} tensors differ from the uninterrupted run, e.g. {diff[:3]}"
    )
