"""The index file: one file holding a faiss index, its document ids and its metadata, checksummed.

Layout (one file, so an index and its metadata can never be separated):

    b"RAGMMIDX" | u32 format version | u64 header length | header JSON (utf-8)
    | faiss bytes (faiss.serialize_index) | document ids (int64 LE, absent when ids are 0..N-1)
    | sha256 of everything before it (32 bytes)

The header holds ``IndexMetadata`` and the two payload lengths. ``read_index_file`` checks the
length (truncation) and the checksum (bit flips); ``check_metadata`` then compares the metadata
with what the caller expects. ``fingerprint`` makes the encoder and corpus hashes the metadata
carries. Turning the faiss bytes into an index is ``FaissIndex.load``'s part (retriever/index.py).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import faiss
import numpy as np
import torch

from retriever.errors import CorruptIndexError, IndexMismatchError

MAGIC = b"RAGMMIDX"
FORMAT_VERSION = 1
_PREFIX = struct.Struct("<8sIQ")  # magic, format version, header length
_DIGEST_BYTES = 32  # sha256


@dataclass
class IndexMetadata:
    """What an index was built from; saved in the file header and checked on load."""

    dim: int  # embedding width; queries must match it
    metric: str  # "ip" or "l2"
    factory: str  # faiss index_factory string
    num_docs: int = 0  # vectors in the index
    encoder_hash: str = ""  # fingerprint of the document-encoder checkpoint that made the vectors
    corpus_hash: str = ""  # fingerprint of the documents (and their order, which fixes the ids)
    search_params: dict = field(default_factory=dict)  # nprobe / ef_search / k_factor in force
    faiss_version: str = faiss.__version__  # the faiss that wrote the file
    created: str = ""  # UTC time of save, ISO 8601
    format_version: int = FORMAT_VERSION  # layout of the file


def fingerprint(*parts: Any) -> str:
    """A sha256 hex digest of strings, bytes, numpy arrays, torch tensors or state dicts.

    Use it for ``encoder_hash`` (pass the encoder's ``state_dict()``) and ``corpus_hash`` (pass
    the document keys in memory order). Tensors are hashed by dtype, shape and bytes.
    """
    h = hashlib.sha256()

    def feed(p: Any) -> None:
        if isinstance(p, dict):
            for k in sorted(p):
                feed(str(k))
                feed(p[k])
        elif isinstance(p, (list, tuple)):
            for q in p:
                feed(q)
        elif isinstance(p, torch.Tensor):
            t = p.detach().cpu().contiguous()
            h.update(f"{t.dtype}{tuple(t.shape)}".encode())
            # 0-d tensors too
            h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
        elif isinstance(p, np.ndarray):
            h.update(f"{p.dtype}{p.shape}".encode())
            h.update(np.ascontiguousarray(p).tobytes())
        elif isinstance(p, (bytes, bytearray, memoryview)):
            h.update(bytes(p))
        else:
            h.update(str(p).encode())
        h.update(b"\x00")

    for p in parts:
        feed(p)
    return h.hexdigest()


def write_index_file(path: Path, meta: IndexMetadata, faiss_bytes: np.ndarray, ids: bytes) -> Path:
    """Write header + ``faiss_bytes`` (uint8) + ``ids`` + sha256 to ``path`` atomically (temp file +
    rename)."""
    header = json.dumps(
        {
            "metadata": dataclasses.asdict(meta),
            "faiss_bytes": int(faiss_bytes.nbytes),
            "ids_bytes": len(ids),
        },
        sort_keys=True,
    ).encode()
    h = hashlib.sha256()
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(tmp, "wb") as f:
        for part in (
            _PREFIX.pack(MAGIC, FORMAT_VERSION, len(header)),
            header,
            memoryview(faiss_bytes),
            ids,
        ):
            h.update(part)
            f.write(part)
        f.write(h.digest())
    os.replace(tmp, path)
    return path


def read_index_file(path: Path) -> tuple[IndexMetadata, np.ndarray, np.ndarray | None]:
    """``(metadata, faiss bytes (uint8), document ids (int64) or None)`` of a verified file.

    Raises ``CorruptIndexError`` for a truncated, altered or foreign file.
    """
    data = path.read_bytes()
    size = len(data)
    header, header_end = _parse_prefix(path, data, size)
    try:
        faiss_n, ids_n = int(header["faiss_bytes"]), int(header["ids_bytes"])
    except (KeyError, TypeError, ValueError) as e:
        raise CorruptIndexError(f"{path}: index header lacks payload sizes ({e})") from e
    expected_size = header_end + faiss_n + ids_n + _DIGEST_BYTES
    if size != expected_size:
        raise CorruptIndexError(
            f"{path}: file is {size} bytes, its header says {expected_size} (truncated or "
            "appended to)"
        )
    body = memoryview(data)[: size - _DIGEST_BYTES]
    if hashlib.sha256(body).digest() != data[size - _DIGEST_BYTES :]:
        raise CorruptIndexError(
            f"{path}: sha256 checksum mismatch; the file was altered or damaged after it was "
            "written"
        )
    meta = _metadata_from(path, header)
    blob = np.frombuffer(data, dtype=np.uint8, count=faiss_n, offset=header_end)
    ids = None
    if ids_n:
        ids = np.frombuffer(
            data, dtype="<i8", count=ids_n // 8, offset=header_end + faiss_n
        ).astype(np.int64)
    return meta, blob, ids


def read_metadata(path: str | os.PathLike) -> IndexMetadata:
    """The metadata of a saved index, reading only the header (``load`` verifies the checksum)."""
    path = Path(path)
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(_PREFIX.size)
        if len(head) == _PREFIX.size:
            head += f.read(_PREFIX.unpack_from(head)[2])
    header, _ = _parse_prefix(path, head, size)
    return _metadata_from(path, header)


def check_metadata(
    meta: IndexMetadata, path: str | os.PathLike = "<index>", **expected: Any
) -> None:
    """Raise ``IndexMismatchError`` naming each field whose expected value (not None) differs."""
    bad = {
        k: (v, getattr(meta, k))
        for k, v in expected.items()
        if v is not None and getattr(meta, k) != v
    }
    if bad:
        raise IndexMismatchError(str(path), bad)


def _parse_prefix(path: Path, head: bytes, size: int) -> tuple[dict, int]:
    if len(head) < _PREFIX.size:
        raise CorruptIndexError(
            f"{path}: file is {size} bytes, too short to be a rag_mm index (truncated?)"
        )
    magic, version, header_len = _PREFIX.unpack_from(head)
    if magic != MAGIC:
        raise CorruptIndexError(
            f"{path}: not a rag_mm index file (starts with {magic!r}, expected {MAGIC!r})"
        )
    if version != FORMAT_VERSION:
        raise CorruptIndexError(
            f"{path}: index format version {version}, this code reads version {FORMAT_VERSION}"
        )
    header_end = _PREFIX.size + header_len
    if header_end + _DIGEST_BYTES > size:
        raise CorruptIndexError(
            f"{path}: file is {size} bytes but its header alone claims {header_end} (truncated?)"
        )
    try:
        header = json.loads(head[_PREFIX.size : header_end].decode())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CorruptIndexError(
            f"{path}: index header is not valid JSON ({e}); the file is damaged"
        ) from e
    return header, header_end


def _metadata_from(path: Path, header: dict) -> IndexMetadata:
    try:
        known = {f.name for f in dataclasses.fields(IndexMetadata)}
        return IndexMetadata(**{k: v for k, v in header["metadata"].items() if k in known})
    except (KeyError, TypeError) as e:
        raise CorruptIndexError(f"{path}: index header lacks metadata ({e})") from e
