"""The training job with the reader pipelined (parallel.pp=2) against one process."""

from __future__ import annotations

import json

import pytest

from rag_mm.config import ConfigError, compose, validate
from tests.distributed import free_port
from tests.rag_mm.conftest import tiny_overrides
from tests.rag_mm.test_train import run_module

STEPS = 4
# oracle retrieval, deterministic kernels, no clipping surprises: the pipeline must reproduce the
# single-process losses up to float reassociation (microbatch sums, token-weighted)
COMMON = ["retriever=oracle", "deterministic=true", f"max_steps={STEPS}", "log_every=1", "ckpt_every=2"]


def _losses(run_dir) -> list[float]:
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows if "loss" in r and "step" in r and not any(k.startswith(("val", "test")) for k in r)]


def test_pipeline_config_rejections(tiny_world, tmp_path):
    """Unsupported combinations are named before any work."""
    cfg = compose(tiny_overrides(tiny_world, tmp_path, "parallel.pp=2", "retriever.mode=learned",
                                 "retriever.top_k=2", "retriever.loss=pdist"))
    with pytest.raises(ConfigError, match="retriever.loss=contrastive"):
        validate(cfg, world_size=2)
    cfg = compose(tiny_overrides(tiny_world, tmp_path, "parallel.pp=2", "parallel.microbatches=3"))
    with pytest.raises(ConfigError, match=r"parallel.microbatches \(3\) must divide data.batch_size"):
        validate(cfg, world_size=2)
    validate(compose(tiny_overrides(tiny_world, tmp_path, "parallel.pp=2", "parallel.microbatches=2")), world_size=2)


@pytest.mark.multirank
def test_torchrun_pipeline_matches_one_process(tiny_world, tmp_path):
    single, pipe = tmp_path / "single", tmp_path / "pp2"
    res = run_module(["-m", "rag_mm.train", *tiny_overrides(tiny_world, single, *COMMON)], timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    args = ["-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={free_port()}",
            "-m", "rag_mm.train", *tiny_overrides(tiny_world, pipe, *COMMON, "parallel.pp=2",
                                                  "parallel.microbatches=2")]
    res = run_module(args, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    summary = json.loads((pipe / "metrics.json").read_text())
    assert summary["world_size"] == 2 and summary["step"] == STEPS
    assert summary["test"]["n"] == 24  # each test query counted once, not once per stage
    assert (pipe / "checkpoints" / f"step_{STEPS:08d}" / "manifest.json").is_file()
    a, b = _losses(single), _losses(pipe)
    assert len(a) == len(b) == STEPS
    assert b == pytest.approx(a, rel=2e-4, abs=2e-5), (a, b)
    ref = json.loads((single / "metrics.json").read_text())
    assert summary["test"]["nll"] == pytest.approx(ref["test"]["nll"], rel=1e-3, abs=1e-4)


# the learned retriever as +experiment=demo trains it but for the loss: the top 2 read with the
# retrieval prior, contrastive with the retrieved documents as hard negatives; no pseudo-queries /
# bank negatives (random draws), so both runs see the same losses
LEARNED = ["retriever=learned", "retriever.top_k=2", "retriever.loss=contrastive", "retriever.reader_prior=true",
           "retriever.embed_dim=16", "retriever.vision_width=32", "retriever.vision_layers=1",
           "retriever.text_width=32", "retriever.pseudo_queries=0", "retriever.bank_negatives=0",
           "retriever.refresh_every=2", "deterministic=true", f"max_steps={STEPS}", "log_every=1", "ckpt_every=0"]


def _retriever_losses(run_dir) -> list[float]:
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["retriever_loss"] for r in rows if r.get("kind") == "train"]


@pytest.mark.multirank
@pytest.mark.parametrize("split", [("parallel.pp=2", "parallel.microbatches=2"), ("parallel.tp=2",)],
                         ids=["pp2", "tp2"])
def test_torchrun_pipeline_learned_matches_one_process(tiny_world, tmp_path, split):
    """The spread reader with the learned retriever: every rank of a replica runs the same search,
    the reader reads the retrieval prior, and the retriever loss is RagModel's own; losses as one
    process."""
    single, pipe = tmp_path / "single", tmp_path / "spread"
    res = run_module(["-m", "rag_mm.train", *tiny_overrides(tiny_world, single, *LEARNED)], timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    args = ["-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={free_port()}",
            "-m", "rag_mm.train", *tiny_overrides(tiny_world, pipe, *LEARNED, *split)]
    res = run_module(args, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    a, b = _losses(single), _losses(pipe)
    assert len(a) == len(b) == STEPS
    assert b == pytest.approx(a, rel=1e-3, abs=1e-4), (a, b)
    ra, rb = _retriever_losses(single), _retriever_losses(pipe)
    assert len(ra) == STEPS and all(x > 0 for x in ra)
    assert rb == pytest.approx(ra, rel=1e-3, abs=1e-4), (ra, rb)
