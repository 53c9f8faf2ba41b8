"""``python -m rag_mm.export RUN OUT`` on a run with a learned retriever: its query tower as an
open_clip state dict (``retriever.pt``) that ``retriever.checkpoint`` loads into a new run's
towers, the overrides that build them, and a clear refusal of a checkpoint of other towers."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

from rag_mm.components import checkpoint
from rag_mm.evaluate import load_config, load_run
from retriever.config import RetrieverConfig
from retriever.encoders import DualEncoder
from tests.rag_mm.conftest import tiny_overrides
from tests.rag_mm.test_train import run_module


@pytest.fixture(scope="module")
def exported(learned_run, tmp_path_factory):
    """A six-step learned-retriever run on the tiny world (the session's) and its export."""
    run, out = learned_run, tmp_path_factory.mktemp("export_retriever") / "out"
    res = run_module(["-m", "rag_mm.export", str(run), str(out)])
    assert res.returncode == 0, res.stderr[-3000:]
    return run, out, json.loads(res.stdout.strip().splitlines()[-1])["overrides"]


def test_export_writes_the_query_tower_and_the_overrides_that_load_it(exported):
    run, out, overrides = exported
    assert json.loads((out / "import.json").read_text())["overrides"] == overrides
    values = dict(o.split("=", 1) for o in overrides)
    assert values["retriever.checkpoint"] == str(out / "retriever.pt")
    assert not (out / "lm").exists()  # the native reader: only the retriever is exported
    cfg = load_config(run, [])
    parts, _, _ = load_run(cfg, checkpoint.latest_valid(run / "checkpoints"))
    try:
        trained = parts.retriever.eval()
        fields = {
            k.removeprefix("retriever."): v
            for k, v in values.items()
            if k.startswith("retriever.") and k != "retriever.checkpoint"
        }
        rc = RetrieverConfig(mode="learned", checkpoint=values["retriever.checkpoint"])
        for k, v in fields.items():  # the override strings, typed as the dataclass's defaults
            rc = replace(rc, **{k: type(getattr(rc, k))(v)})
        torch.manual_seed(7)  # another init: the towers must come from the file
        fresh = DualEncoder(rc, int(values["model.image_size"])).eval()
        size = int(values["model.image_size"])
        image = torch.randn(3, 3, size, size)
        ids, lengths = torch.randint(1, 400, (3, 10)), torch.tensor([10, 4, 7])
        with torch.no_grad():
            want = trained.embed_queries(image, ids, lengths)
            # one file initialises both towers of the new retriever: both embed as the trained
            # query side does
            torch.testing.assert_close(fresh.embed_queries(image, ids, lengths), want)
            torch.testing.assert_close(fresh.embed_docs(image, ids, lengths), want)
            assert not torch.allclose(trained.embed_docs(image, ids, lengths), want)
    finally:
        if parts.memory is not None:
            parts.memory.close()


def test_a_checkpoint_of_other_towers_is_refused_by_name(exported, tiny_world, tmp_path):
    _, out, _ = exported
    res = run_module(
        [
            "-m",
            "rag_mm.train",
            *tiny_overrides(
                tiny_world,
                tmp_path / "run",
                "retriever=learned",
                f"retriever.checkpoint={out / 'retriever.pt'}",
                "retriever.vision_width=32",  # the exported run's towers are 64 wide
            ),
        ]
    )
    assert res.returncode != 0
    assert "does not fit the towers this config builds" in res.stderr, res.stderr[-2000:]
    assert "Traceback" not in res.stderr
    assert not (tmp_path / "run" / "checkpoints").exists() or not any(
        (tmp_path / "run" / "checkpoints").iterdir()
    )
