"""A tiny generated world and a tiny reader, shared by the rag_mm tests."""

from __future__ import annotations

import io
import json
import shutil
import tarfile
from collections.abc import Callable
from pathlib import Path

import pytest

from rag_mm.data.knowledge_world import WorldConfig, generate

TINY_MODEL = [
    "model.dim=32",
    "model.layers=2",
    "model.heads=2",
    "model.vision_width=32",
    "model.vision_layers=1",
    "model.vision_head_width=16",
]


def tiny_overrides(root, run_dir, *extra: str) -> list[str]:
    return [
        f"data.root={root}",
        f"run_dir={run_dir}",
        # brace patterns are quoted: Hydra's override grammar reserves { }
        "data.corpus='corpus/corpus-{000000..000000}.tar'",
        "data.train='train/train-{000000..000002}.tar'",
        "data.val='val/val-{000000..000000}.tar'",
        "data.test='test/test-{000000..000000}.tar'",
        "data.batch_size=8",
        "data.eval_batch_size=32",
        "data.num_workers=0",
        "data.shuffle_buffer=16",
        "max_steps=6",
        "log_every=2",
        "eval_every=0",
        "ckpt_every=3",
        "progress=false",
        "optim.warmup_steps=2",
        *TINY_MODEL,
        *extra,
    ]


@pytest.fixture(scope="session")
def tiny_world(tmp_path_factory):
    root = tmp_path_factory.mktemp("world")
    generate(
        WorldConfig(
            out=str(root),
            num_entities=24,
            train_queries_per_entity=4,
            val_queries_per_entity=1,
            test_queries_per_entity=1,
            shard_size=32,
        )
    )
    return root


# the six-step learned-retriever run that ``learned_run`` trains once for the session
LEARNED_RUN = ("retriever=learned", "retriever.top_k=2")


@pytest.fixture(scope="session")
def learned_run(tiny_world, tmp_path_factory) -> Path:
    """A six-step learned-retriever run on the tiny world, trained once by ``python -m
    rag_mm.train`` and read by the tests of what reads a finished run (ask, export): read it,
    never write into it."""
    from tests.rag_mm.test_train import run_module

    run = tmp_path_factory.mktemp("learned_run") / "run"
    res = run_module(["-m", "rag_mm.train", *tiny_overrides(tiny_world, run, *LEARNED_RUN)])
    assert res.returncode == 0, res.stderr[-3000:]
    return run


def rewrite_queries(src: Path, dst: Path, edit: Callable[[dict], dict]) -> Path:
    """A copy of the world ``src`` at ``dst`` with every query's json (train, val, test) passed
    through ``edit``: the tiny world as other data sets look (no doc_id, no held-out entities)."""
    shutil.copytree(src, dst)
    for split in ("train", "val", "test"):
        for shard in (dst / split).glob("*.tar"):
            out = io.BytesIO()
            with tarfile.open(shard) as old, tarfile.open(fileobj=out, mode="w") as new:
                for m in old:
                    data = old.extractfile(m).read()
                    if m.name.endswith(".json"):
                        data = json.dumps(edit(json.loads(data))).encode()
                    m.size = len(data)
                    new.addfile(m, io.BytesIO(data))
            shard.write_bytes(out.getvalue())
    return dst
