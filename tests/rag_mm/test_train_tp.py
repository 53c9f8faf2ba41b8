"""The training job with the reader tensor-parallel (parallel.tp=2) against one process, and the
layouts the trainer refuses before any work."""

from __future__ import annotations

import json

import pytest

from rag_mm.config import ConfigError, compose, validate
from tests.distributed import free_port
from tests.rag_mm.conftest import tiny_overrides
from tests.rag_mm.test_train import run_module
from tests.rag_mm.test_train_pipeline import COMMON, STEPS, _evaluate, _losses


def test_tp_config_rejections(tiny_world, tmp_path):
    def bad(world, *over, match):
        with pytest.raises(ConfigError, match=match):
            validate(compose(tiny_overrides(tiny_world, tmp_path, *over)), world_size=world)

    bad(2, "parallel.tp=4", match=r"world size 2 is not divisible by pp\*dp_shard\*tp = 4")
    bad(
        3,
        "parallel.tp=3",
        "model.heads=3",
        "model.dim=48",
        match=r"parallel.tp \(3\) must divide the vision heads",
    )
    bad(2, "parallel.schedule=bogus", match=r"parallel.schedule must be one of")
    bad(2, "parallel.dp_shard=4", match=r"world size 2 is not divisible by pp\*dp_shard\*tp = 4")
    for ok in (["parallel.tp=2"], ["parallel.dp_shard=2"]):
        validate(compose(tiny_overrides(tiny_world, tmp_path, *ok)), world_size=2)
    validate(
        compose(
            tiny_overrides(
                tiny_world, tmp_path, "parallel.pp=2", "parallel.tp=2", "parallel.microbatches=2"
            )
        ),
        world_size=4,
    )
    for ok, world in (
        (["parallel.pp=2", "parallel.dp_shard=2"], 4),
        (["parallel.pp=2", "parallel.tp=2", "parallel.dp_shard=2"], 8),
        (["parallel.pp=2", "parallel.tp=2"], 8),
    ):  # pp x tp with 2 replicas
        validate(compose(tiny_overrides(tiny_world, tmp_path, *ok)), world_size=world)


@pytest.mark.multirank
def test_torchrun_tp_matches_one_process(tiny_world, tmp_path):
    single, tp = tmp_path / "single", tmp_path / "tp2"
    res = run_module(
        ["-m", "rag_mm.train", *tiny_overrides(tiny_world, single, *COMMON)], timeout=600
    )
    assert res.returncode == 0, res.stderr[-3000:]
    args = [
        "-m",
        "torch.distributed.run",
        "--nproc_per_node=2",
        f"--master_port={free_port()}",
        "-m",
        "rag_mm.train",
        *tiny_overrides(tiny_world, tp, *COMMON, "parallel.tp=2"),
    ]
    res = run_module(args, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    summary = json.loads((tp / "metrics.json").read_text())
    assert summary["world_size"] == 2 and summary["step"] == STEPS
    assert summary["test"]["n"] == 24  # each test query counted once, not once per tp rank
    assert (tp / "checkpoints" / f"step_{STEPS:08d}" / "manifest.json").is_file()
    a, b = _losses(single), _losses(tp)
    assert len(a) == len(b) == STEPS
    # the two tp ranks train on the whole batch (not half each): the losses follow one process
    assert b == pytest.approx(a, rel=2e-4, abs=2e-5), (a, b)
    ref = json.loads((single / "metrics.json").read_text())
    assert summary["test"]["nll"] == pytest.approx(ref["test"]["nll"], rel=1e-3, abs=1e-4)


@pytest.mark.multirank
def test_torchrun_fsdp_matches_ddp(tiny_world, tmp_path):
    """parallel.dp_shard=2 (FSDP2: each rank holds half of the reader's parameters, gradients and
    Adam state) trains like data parallel on the same two ranks, whose gradients are averaged
    through shared memory (parallel.grad_reduce=shm); the FSDP checkpoint (DTensor shards written
    by DCP), evaluated in one process, reads as the data-parallel run's."""
    runs = {}
    for name, extra in (("ddp", ["parallel.grad_reduce=shm"]), ("fsdp", ["parallel.dp_shard=2"])):
        d = tmp_path / name
        args = [
            "-m",
            "torch.distributed.run",
            "--nproc_per_node=2",
            f"--master_port={free_port()}",
            "-m",
            "rag_mm.train",
            *tiny_overrides(tiny_world, d, *COMMON, *extra),
        ]
        res = run_module(args, timeout=600)
        assert res.returncode == 0, res.stderr[-3000:]
        runs[name] = d
        if name == "ddp":
            # the shared-memory path, no fallback to gloo
            assert "intra=shm" in res.stderr, res.stderr[-3000:]
    assert (runs["fsdp"] / "checkpoints" / f"step_{STEPS:08d}" / "manifest.json").is_file()
    a, b = _losses(runs["ddp"]), _losses(runs["fsdp"])
    assert len(a) == len(b) == STEPS
    assert b == pytest.approx(a, rel=2e-4, abs=2e-5), (a, b)
    ea, eb = _evaluate(runs["ddp"]), _evaluate(runs["fsdp"])
    assert eb["step"] == ea["step"] == STEPS and eb["n"] == ea["n"]
    assert eb["nll"] == pytest.approx(ea["nll"], rel=2e-4), (ea, eb)
