"""Bad input never ends in a traceback: path-valued keys are checked before any work, and data that
cannot feed the run stops it with a message naming the split (exit status 2)."""

from __future__ import annotations

import copy
import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from rag_mm import evaluate
from rag_mm.checks.paths import path_problems, run_dir_problems
from rag_mm.components import checkpoint
from rag_mm.config import compose
from rag_mm.data.documents import DocumentStore
from rag_mm.data.pipeline import DataError, StreamSpec, make_loader
from rag_mm.data.urls import expand_urls
from rag_mm.trainer import Trainer
from tests.rag_mm.conftest import tiny_overrides
from tests.rag_mm.test_train import REPO, _corrupt_copy, run_module


def _world_view(src: Path, dst: Path, garbage: tuple[str, ...] = ()) -> Path:
    """A world whose splits link to ``src``'s, except those in ``garbage``: copies whose every
    shard is replaced by bytes that are no tar file."""
    dst.mkdir()
    for split in ("corpus", "train", "val", "test"):
        if split in garbage:
            (dst / split).mkdir()
            for shard in (src / split).iterdir():
                (dst / split / shard.name).write_bytes(b"this is not a tar file\n" * 50)
        else:
            (dst / split).symlink_to(src / split)
    return dst


def _bad_files(tmp_path: Path) -> dict[str, Path]:
    """Files and directories of the wrong kind for a checkpoint or a state dict."""
    d = tmp_path / "bad"
    d.mkdir()
    (d / "text.pt").write_text("not weights\n")
    (d / "empty.pt").write_bytes(b"")
    torch.save({"w": torch.zeros(4)}, d / "whole.pt")
    whole = (d / "whole.pt").read_bytes()
    (d / "truncated.pt").write_bytes(whole[: len(whole) // 2])
    torch.save(torch.zeros(4), d / "tensor.pt")  # loads, but is no state dict
    (d / "empty_dir").mkdir()
    (d / "plain_dir").mkdir()
    (d / "plain_dir" / "notes.txt").write_text("hello")
    ckpt = checkpoint.save(d / "ckpts", 1, {"w": torch.zeros(4)}, {"step": 1}, keep=2, is_main=True)
    # altered after the manifest was written
    (ckpt / "trainer_state.json").write_text('{"step": 2}')
    return {
        "text": d / "text.pt",
        "empty": d / "empty.pt",
        "truncated": d / "truncated.pt",
        "tensor": d / "tensor.pt",
        "empty_dir": d / "empty_dir",
        "plain_dir": d / "plain_dir",
        "damaged_ckpt": ckpt,
        "ckpts_root": d / "ckpts",
        "good": d / "whole.pt",
    }


def test_bad_paths_are_rejected_before_work(tiny_world, tmp_path, capsys, monkeypatch):
    bad = _bad_files(tmp_path)
    world = tmp_path / "world"
    _world_view(tiny_world, world)
    (world / "val").unlink()
    (world / "val").mkdir()
    (world / "val" / "val-000000.tar").mkdir()  # a shard path that is a directory

    # run_dir is checked before Hydra creates it (a file stands where its parent should be)
    res = run_module(
        ["-m", "rag_mm.train", "+experiment=demo", f"run_dir={bad['text']}/run"], timeout=120
    )
    assert res.returncode == 2, res.stderr[-2000:]
    assert "run_dir" in res.stderr and "Traceback" not in res.stderr + res.stdout, res.stderr
    # a parent whose permission bits allow it but that refuses new directories (as root, too)
    if Path("/proc").is_dir():
        assert (
            "cannot be created or written" in run_dir_problems("run_dir", "/proc/rag_mm_run/x")[0]
        )

    # every other bad path in one run, each named in one message
    run = tmp_path / "run"
    keys = {
        "resume": f"resume={bad['plain_dir']}",
        "model.vision_checkpoint": f"model.vision_checkpoint={bad['text']}",
        "retriever.checkpoint": f"retriever.checkpoint={bad['truncated']}",
        "data.val": "",
    }
    res = run_module(
        [
            "-m",
            "rag_mm.train",
            "+experiment=demo",
            *tiny_overrides(world, run, *[v for v in keys.values() if v]),
        ],
        timeout=120,
    )
    assert res.returncode == 2, res.stderr[-2000:]
    for key in keys:
        assert key in res.stderr, (key, res.stderr)
    assert "is a directory" in res.stderr and "Traceback" not in res.stderr + res.stdout, res.stderr
    assert not (run / "checkpoints").exists()  # nothing started

    # the same checks in process, over more wrong kinds
    cfg = compose(tiny_overrides(tiny_world, run, "retriever=learned", "retriever.top_k=1"))
    cases = [
        ("run_dir", bad["text"], "is a file"),
        ("resume", bad["text"], "is a file"),
        ("resume", bad["empty_dir"], "the directory is empty"),
        ("resume", bad["ckpts_root"], "pass one of its step_* directories"),
        ("resume", bad["damaged_ckpt"], "checksum mismatch"),
        ("resume", tmp_path / "nowhere", "does not exist"),
        ("model.vision_checkpoint", bad["empty_dir"], "is a directory"),
        ("model.vision_checkpoint", bad["empty"], "not a PyTorch state dict"),
        ("model.vision_checkpoint", bad["tensor"], "not a state dict"),
        ("retriever.checkpoint", bad["text"], "not a PyTorch state dict"),
        ("retriever.checkpoint", tmp_path / "nowhere.pt", "does not exist"),
    ]
    for key, value, message in cases:
        c = copy.deepcopy(cfg)
        OmegaConf.update(c, key, str(value))
        found = [p for p in path_problems(c) if p.startswith(key)]
        assert found and message in found[0], (key, value, found)
    good = copy.deepcopy(cfg)
    OmegaConf.update(good, "model.vision_checkpoint", str(bad["good"]))
    OmegaConf.update(good, "retriever.checkpoint", str(bad["good"]))
    assert path_problems(good) == []

    # the evaluate command line (in process: a subprocess costs seconds of imports): a file for
    # RUN_DIR, a saved config with a bad path, a saved config that is a directory
    saved = tmp_path / "eval_run"
    (saved / ".hydra").mkdir(parents=True)
    OmegaConf.save(
        compose(tiny_overrides(tiny_world, saved, f"model.vision_checkpoint={bad['text']}")),
        saved / ".hydra" / "config.yaml",
    )
    broken = tmp_path / "eval_broken"
    (broken / ".hydra" / "config.yaml").mkdir(parents=True)
    for argv, message in [
        ((str(bad["text"]),), "RUN_DIR"),
        ((str(saved),), "model.vision_checkpoint"),
        ((str(broken),), "is a directory"),
    ]:
        assert evaluate.main(list(argv)) == 2, argv
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err, (argv, err)

    # scripts/build_index.py: every path argument wrong at once, then an output that is no index
    build_index = _build_index_module(monkeypatch)
    (tmp_path / "out_dir").mkdir()
    argv = [
        f"corpus={tmp_path}/none-{{0..1}}.tar",
        f"queries={world}/val/val-000000.tar",
        f"checkpoint={bad['empty_dir']}",
        f"out={tmp_path / 'out_dir'}",
        f"save_embeddings={tmp_path}/no_dir/emb_",
    ]
    assert build_index.main(argv) == 2
    err = capsys.readouterr().err
    for key in ("corpus:", "queries:", "checkpoint:", "out:", "save_embeddings:"):
        assert key in err, (key, err)
    assert build_index.main([f"corpus={world}/corpus/corpus-000000.tar", f"out={bad['text']}"]) == 2
    assert "not a rag_mm index" in capsys.readouterr().err


def _build_index_module(monkeypatch):
    spec = importlib.util.spec_from_file_location(
        "build_index", REPO / "scripts" / "build_index.py"
    )
    module = importlib.util.module_from_spec(spec)
    # its dataclasses look their module up there
    monkeypatch.setitem(sys.modules, "build_index", module)
    spec.loader.exec_module(module)
    return module


def test_unfeedable_data_stops_the_run_with_a_message(tiny_world, tmp_path):
    world = _world_view(tiny_world, tmp_path / "world", garbage=("train",))
    run = tmp_path / "run"
    # two loader workers: the error is raised in a worker process and must reach the main one
    res = run_module(
        ["-m", "rag_mm.train", *tiny_overrides(world, run, "data.num_workers=2")], timeout=180
    )
    assert res.returncode == 2, res.stderr[-3000:]
    assert (
        "data.train" in res.stderr and "no readable sample" in res.stderr and "tar:" in res.stderr
    ), res.stderr
    assert "Traceback" not in res.stderr + res.stdout, res.stderr[-3000:]

    # an all-garbage corpus, and an evaluation split whose every sample is dropped
    bad = _world_view(tiny_world, tmp_path / "bad", garbage=("corpus", "val"))
    with pytest.raises(DataError, match="no readable document in the corpus"):
        DocumentStore.load(expand_urls(str(bad), "corpus/corpus-{000000..000000}.tar"), 32, 40)
    spec = StreamSpec(
        urls=expand_urls(str(bad), "val/val-{000000..000000}.tar"),
        image_size=32,
        max_question=24,
        max_answer=8,
        batch_size=8,
        train=False,
    )
    for workers in (0, 2):
        with pytest.raises(DataError, match="dropped by reason: tar:"):
            list(make_loader(spec, workers))


def test_two_workers_count_skipped_samples_by_reason(tiny_world, tmp_path):
    bad = tmp_path / "bad_world"
    _corrupt_copy(tiny_world, bad)
    t = Trainer(
        compose(
            tiny_overrides(
                bad, tmp_path / "run", "data.num_workers=2", "max_steps=12", "ckpt_every=0"
            )
        )
    )
    try:
        out = t.fit()
    finally:
        t.close()
    assert out["step"] == 12
    # summed over the two workers' counts, carried by their batches
    skipped = out["skipped_samples"]
    assert (
        skipped.get("bad_json", 0) >= 1
        and skipped.get("bad_image", 0) >= 1
        and skipped.get("missing_key", 0) >= 1
    )
    assert any(k.startswith("tar:") for k in skipped), skipped
    assert set(t.skipped) <= {0, 1} and t.skipped
    saved = json.loads((tmp_path / "run" / "metrics.json").read_text())["skipped_samples"]
    assert saved == skipped
