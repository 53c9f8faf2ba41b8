"""``scripts/bench/query_gap.py``: each difference between a query and its memory picture alone,
asked of a trained run's retriever."""

import importlib.util
import json
import tarfile
from pathlib import Path

import torch

from tests.rag_mm.test_emoji_kvqa import ENTRIES, _packages

ROOT = Path(__file__).resolve().parents[2]


def _script():
    path = ROOT / "scripts" / "bench" / "query_gap.py"
    spec = importlib.util.spec_from_file_location("query_gap", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_other_vendors_drawings_are_matched_to_their_memory_rows(tmp_path):
    """A memory row is found by the pixels of Google's drawing; every vendor's drawing of that
    emoji comes back for it, and a picture two emoji share (France's flag, St. Martin's) names
    neither."""
    from PIL import Image

    from rag_mm.data.pipeline import image_to_tensor

    script = _script()
    pkgs = _packages(tmp_path / "pkgs")
    google = pkgs / "emoji-datasource-google" / "package" / "img" / "google" / "64"
    order = ["flag-de", "flag-fr", "flag-us"]  # the memory's rows
    by_short = {e["short_name"]: (i, e) for i, e in enumerate(ENTRIES)}
    drawn = [
        image_to_tensor(script.clean(Image.open(google / by_short[s][1]["image"]), 16), 16)
        for s in order
    ]
    rows, pics = script.vendor_pictures(pkgs, torch.stack(drawn), 16)
    assert rows.tolist() == [2, 0]  # the US (entry 2) and Germany (entry 5), in emoji.json order
    # vendor j's drawing of entry i is the grey level 20 i + j
    for j, vendor in enumerate(script.VENDORS):
        grey = (pics[vendor][:, :, 8, 8] * script.STD[:, 0, 0] + script.MEAN[:, 0, 0]) * 255
        want = torch.tensor([20 * 2 + j, 20 * 5 + j], dtype=torch.float32)
        torch.testing.assert_close(grey.mean(1), want, atol=0.6, rtol=0)


def _named_documents(world: Path) -> set[int]:
    named = set()
    for shard in sorted((world / "train").glob("*.tar")):
        with tarfile.open(shard) as tar:
            for m in tar.getmembers():
                if m.name.endswith(".json"):
                    named.add(json.loads(tar.extractfile(m).read())["doc_id"])
    return named


def test_each_view_is_asked_of_a_trained_run(learned_run, tiny_world, capsys):
    """On a trained run: one recall@1 per view, for unseen and seen documents; the unseen ones are
    those no training query names; a run directory without a run is one message and status 2."""
    script = _script()
    assert script.main([str(learned_run), "--repeats", "1"]) == 0
    out = json.loads(capsys.readouterr().out)
    views = out["memory_views"]
    assert set(views) == {
        "clean",
        "photo",
        "photo+jpeg",
        "jpeg",
        "tone0.5",
        "tone1.0",
        "restyle",
        "surface",
        "photo+surface",
    }
    for r in views.values():
        assert 0.0 <= r["unseen"] <= 1.0 and 0.0 <= r["seen"] <= 1.0
    n_docs = 0
    for shard in (tiny_world / "corpus").glob("*.tar"):
        with tarfile.open(shard) as tar:
            n_docs += sum(name.endswith(".json") for name in tar.getnames())
    assert out["documents"] == n_docs
    assert out["unseen_documents"] == n_docs - len(_named_documents(tiny_world))
    assert 0 < out["unseen_documents"] < n_docs

    assert script.main([str(learned_run.parent / "nothing")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("query_gap: ") and "not found" in err[0]
