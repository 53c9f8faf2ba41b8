"""Untrusted inputs must not run code: shards with pickle members, crafted checkpoints."""

from __future__ import annotations

import ast
import io
import json
import os
import pickle
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
import webdataset as wds
from PIL import Image

from rag_mm.components import checkpoint
from rag_mm.components.checkpoint_safety import UnsafeCheckpointError
from rag_mm.data.documents import DocumentStore
from rag_mm.data.pipeline import StreamSpec, make_loader

REPO = Path(__file__).resolve().parents[2]


class Payload:
    """Unpickling this runs a shell command that creates ``marker``."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _png() -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (32, 32), (200, 30, 30)).save(buf, format="PNG")
    return buf.getvalue()


def test_pickle_members_in_shards_are_never_unpickled(tmp_path):
    marker = tmp_path / "pwned"
    blob = pickle.dumps(Payload(marker))
    pickle.loads(blob)  # the payload is live: unpickling it does run code
    assert marker.exists()
    marker.unlink()

    meta = json.dumps({"answer": "red", "doc_id": 0, "attribute": "colour", "heldout": False})
    for split in ("q", "corpus"):
        with wds.TarWriter(str(tmp_path / f"{split}.tar")) as sink:
            sink.write(
                {
                    "__key__": "s0",
                    "png": _png(),
                    "txt": "what colour is it?",
                    "json": meta,
                    "pyd": blob,
                    "pkl": blob,
                    "pth": blob,
                }
            )
    spec = StreamSpec(
        urls=[str(tmp_path / "q.tar")],
        image_size=32,
        max_question=24,
        max_answer=8,
        batch_size=4,
        train=False,
    )
    batches = list(make_loader(spec, 0))
    assert batches[0]["question"] == ["what colour is it?"]  # the sample itself was read
    store = DocumentStore.load([str(tmp_path / "corpus.tar")], 32, 40)
    assert len(store) == 1
    assert not marker.exists()


def _ckpt(tmp_path: Path, state: dict) -> Path:
    return checkpoint.save(tmp_path / "ckpts", 1, state, {"step": 1}, keep=2, is_main=True)


def _reseal(ckpt: Path) -> None:
    """What an attacker would do: rewrite the manifest so the checksums match the altered files."""
    files = {
        p.name: {"bytes": p.stat().st_size, "sha256": checkpoint._sha256(p)}
        for p in sorted(ckpt.iterdir())
        if p.is_file() and p.name != checkpoint.MANIFEST
    }
    (ckpt / checkpoint.MANIFEST).write_text(json.dumps({"step": 1, "files": files}))


def test_crafted_checkpoint_metadata_is_refused(tmp_path):
    marker = tmp_path / "pwned"
    ckpt = _ckpt(tmp_path, {"w": torch.ones(3)})
    assert checkpoint.load(ckpt, {"w": torch.zeros(3)})["step"] == 1  # the honest one loads
    (ckpt / ".metadata").write_bytes(pickle.dumps(Payload(marker)))
    _reseal(ckpt)
    assert checkpoint.verify(ckpt) is None  # checksums cannot tell
    with pytest.raises(UnsafeCheckpointError, match="posix.system|os.system"):
        checkpoint.load(ckpt, {"w": torch.zeros(3)})
    assert not marker.exists()


def test_crafted_non_tensor_entry_is_refused(tmp_path):
    marker = tmp_path / "pwned"
    ckpt = _ckpt(tmp_path, {"w": torch.ones(3), "extra": Payload(marker)})
    assert not marker.exists()
    with pytest.raises(UnsafeCheckpointError):
        checkpoint.load(ckpt, {"w": torch.zeros(3), "extra": None})
    assert not marker.exists()
    # DCP's default planner...
    dcp.load({"w": torch.zeros(3), "extra": None}, checkpoint_id=str(ckpt))
    assert marker.exists()  # ...would have run it: the guard is what stops it


def test_every_torch_load_in_the_code_is_weights_only():
    """A static check: each torch.load(...) call passes weights_only=True."""
    offenders = []
    for pkg in ("rag_mm", "retriever", "parallel", "scripts"):
        for path in (REPO / pkg).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if (
                    isinstance(node, ast.Call)
                    and isinstance(node.func, ast.Attribute)
                    and node.func.attr == "load"
                    and isinstance(node.func.value, ast.Name)
                    and node.func.value.id == "torch"
                ):
                    kw = {k.arg: k.value for k in node.keywords}
                    if not (
                        isinstance(kw.get("weights_only"), ast.Constant)
                        and kw["weights_only"].value is True
                    ):
                        offenders.append(f"{path.relative_to(REPO)}:{node.lineno}")
    assert not offenders, f"torch.load without weights_only=True: {offenders}"
