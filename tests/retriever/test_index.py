"""FaissIndex / DocumentIndex: build, search, save, load, mismatches and corruption (CPU)."""

from __future__ import annotations

import logging
import threading

import faiss
import numpy as np
import pytest
import torch

from retriever.errors import CorruptIndexError, IndexMismatchError
from retriever.index import (
    FaissIndex,
    build_index,
    default_factory,
    default_search_params,
    fingerprint,
    read_metadata,
)
from retriever.serve import DocumentIndex

DIM = 32
# One factory per index family; nlist 16 with nprobe 16 probes every list, so IVF-Flat is exact.
FACTORIES = {
    "flat": ("Flat", {}),
    "ivf_flat": ("IVF16,Flat", {"nprobe": 16}),
    "hnsw": ("HNSW16", {"ef_search": 256}),
    "ivf_pq": ("IVF16,PQ8np", {"nprobe": 16}),  # np: skip polysemous training (slow, unused)
    "ivf_pq_refine": ("IVF16,PQ8np,RFlat", {"nprobe": 16, "k_factor": 8}),
    "ivf_hnsw_quantizer": ("IVF16_HNSW8,Flat", {"nprobe": 16}),
}


@pytest.fixture(scope="module")
def data():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2000, DIM)).astype(np.float32)
    q = rng.standard_normal((25, DIM)).astype(np.float32)
    ids = rng.permutation(10_000)[:2000].astype(np.int64)  # sparse, unordered global ids
    return x, q, ids


def brute_force(x, q, ids, k, metric):
    """Exact top-k in numpy with the documented order: score desc, then id asc."""
    scores = q @ x.T if metric == "ip" else -((q[:, None, :] - x[None]) ** 2).sum(-1)
    order = np.lexsort((np.broadcast_to(ids, scores.shape), -scores), axis=-1)[:, :k]
    return ids[order]


@pytest.mark.parametrize("metric", ["ip", "l2"])
@pytest.mark.parametrize("kind", list(FACTORIES))
def test_round_trip_each_factory(kind, metric, data, tmp_path):
    x, q, ids = data
    factory, params = FACTORIES[kind]
    index = build_index(
        x,
        ids,
        factory=factory,
        metric=metric,
        search_params=params,
        encoder_hash="enc1",
        corpus_hash="corp1",
    )
    assert index.ntotal == len(x) and index.is_trained
    scores, got = index.search(q, 10)
    assert scores.shape == got.shape == (len(q), 10)
    assert np.all(np.diff(scores, axis=1) <= 0), "rows must be best-first"
    exact = brute_force(x, q, ids, 10, metric)
    recall = np.mean([len(set(a) & set(b)) / 10 for a, b in zip(got, exact)])
    # Exact families must be exact; PQ (8 bytes for 32 floats) is approximate but far above chance
    # (0.005).
    assert recall >= {"ivf_pq": 0.3}.get(kind, 0.97), f"{kind} recall@10 {recall}"
    if kind in ("flat", "ivf_flat"):
        np.testing.assert_array_equal(got, exact)

    path = index.save(tmp_path / "memory.index")
    loaded = FaissIndex.load(
        path,
        dim=DIM,
        metric=metric,
        factory=factory,
        encoder_hash="enc1",
        corpus_hash="corp1",
        num_docs=len(x),
    )
    s2, i2 = loaded.search(q, 10)
    np.testing.assert_array_equal(i2, got)
    np.testing.assert_array_equal(s2, scores)
    assert loaded.meta.search_params == index.meta.search_params
    assert loaded.meta.faiss_version == faiss.__version__ and loaded.meta.created


def test_torch_in_torch_out_and_l2_scores(data):
    x, q, _ = data
    index = build_index(x, factory="Flat", metric="l2")
    s, i = index.search(torch.from_numpy(q), 3)
    assert isinstance(s, torch.Tensor) and s.dtype == torch.float32 and i.dtype == torch.int64
    expected = -((q[:, None, :] - x[i.numpy()]) ** 2).sum(-1)  # minus squared distance
    np.testing.assert_allclose(s.numpy(), expected, rtol=1e-4, atol=1e-4)


def test_ties_broken_by_id_and_missing_results():
    x = np.eye(4, dtype=np.float32)
    index = FaissIndex(4, "Flat", "ip").add(np.concatenate([x, x]), ids=[7, 1, 2, 3, 0, 5, 6, 4])
    s, i = index.search(x[:1], 10)  # only 8 documents: last two are missing
    assert i[0, :2].tolist() == [0, 7]  # two copies of e0 tie at score 1: lower id first
    assert i[0, 2:8].tolist() == [1, 2, 3, 4, 5, 6]  # ties at score 0, ordered by id
    assert i[0, 8:].tolist() == [-1, -1] and np.isneginf(s[0, 8:]).all()


@pytest.mark.parametrize("factory", ["Flat", "IVF4,Flat", "HNSW8"])
def test_ties_at_the_kth_place_keep_the_lowest_ids(factory):
    # 40 copies of one vector under shuffled ids: which 5 of the tied documents are returned
    # must not depend on faiss's heap order or the insertion order.
    rng = np.random.default_rng(3)
    v = rng.standard_normal((1, 8)).astype(np.float32)
    others = rng.standard_normal((60, 8)).astype(np.float32) * 0.1
    x = np.concatenate([np.repeat(v, 40, 0), others])
    ids = rng.permutation(100)
    index = build_index(
        x, ids, factory=factory, search_params={"nprobe": 4} if "IVF" in factory else None
    )
    _, got = index.search(v, 5)
    assert got[0].tolist() == sorted(ids[:40])[:5]


def test_bad_inputs_give_clear_errors(data):
    x, q, _ = data
    with pytest.raises(ValueError, match="metric must be one of"):
        FaissIndex(DIM, "Flat", "cosine")
    with pytest.raises(RuntimeError, match="must be trained"):
        FaissIndex(DIM, "IVF16,Flat").add(x)
    index = build_index(x, factory="Flat")
    with pytest.raises(ValueError, match="holds 32-d vectors, got 16-d"):
        index.search(q[:, :16], 5)
    with pytest.raises(ValueError, match="nprobe does not apply to index 'Flat'"):
        index.set_search_params(nprobe=4)


@pytest.fixture
def saved(data, tmp_path):
    x, _, ids = data
    index = build_index(x, ids, factory="IVF16,Flat", encoder_hash="enc-A", corpus_hash="corpus-A")
    return index.save(tmp_path / "memory.index")


@pytest.mark.parametrize(
    "expect, field, found",
    [
        ({"dim": 64}, "dim", "32"),
        ({"encoder_hash": "enc-B"}, "encoder_hash", "'enc-A'"),
        ({"corpus_hash": "corpus-B"}, "corpus_hash", "'corpus-A'"),
        ({"metric": "l2"}, "metric", "'ip'"),
        ({"num_docs": 5}, "num_docs", "2000"),
    ],
)
def test_mismatched_metadata_is_named(saved, expect, field, found):
    with pytest.raises(IndexMismatchError) as err:
        FaissIndex.load(saved, **expect)
    msg = str(err.value)
    assert f"{field}: expected {next(iter(expect.values()))!r}, found {found}" in msg
    assert str(saved) in msg
    assert list(err.value.mismatches) == [field]
    if field.endswith("_hash"):
        assert "stale" in msg


def test_several_mismatches_listed_together(saved):
    with pytest.raises(IndexMismatchError) as err:
        FaissIndex.load(saved, encoder_hash="enc-B", corpus_hash="corpus-B")
    assert set(err.value.mismatches) == {"encoder_hash", "corpus_hash"}


def test_truncated_file(saved):
    data = saved.read_bytes()
    for keep in (len(data) - 1, len(data) // 2, 30, 5):
        saved.write_bytes(data[:keep])
        with pytest.raises(CorruptIndexError, match="truncated"):
            FaissIndex.load(saved)


@pytest.mark.parametrize("where", ["payload", "ids", "checksum"])
def test_flipped_bit_is_detected(saved, where):
    data = bytearray(saved.read_bytes())
    pos = {"payload": len(data) // 3, "ids": len(data) - 32 - 100, "checksum": len(data) - 1}[where]
    data[pos] ^= 0x10
    saved.write_bytes(bytes(data))
    with pytest.raises(CorruptIndexError, match="checksum mismatch"):
        FaissIndex.load(saved)


def test_flipped_bit_in_header_is_detected(saved):
    data = bytearray(saved.read_bytes())
    pos = data.index(b'"corpus-A"') + 3  # a character inside the JSON header
    data[pos] ^= 0x01
    saved.write_bytes(bytes(data))
    assert read_metadata(saved).corpus_hash != "corpus-A"  # the header alone cannot tell...
    with pytest.raises(CorruptIndexError, match="checksum mismatch"):  # ...the checksum can
        FaissIndex.load(saved)


def test_foreign_files_are_rejected(tmp_path, data):
    raw = tmp_path / "raw.faiss"
    faiss.write_index(build_index(data[0], factory="Flat").index, str(raw))  # faiss's own format
    with pytest.raises(CorruptIndexError, match="not a rag_mm index file"):
        FaissIndex.load(raw)
    empty = tmp_path / "empty.index"
    empty.write_bytes(b"")
    with pytest.raises(CorruptIndexError, match="too short"):
        FaissIndex.load(empty)


def test_read_metadata_without_loading(saved):
    meta = read_metadata(saved)
    assert (meta.dim, meta.metric, meta.factory, meta.num_docs) == (DIM, "ip", "IVF16,Flat", 2000)
    assert (meta.encoder_hash, meta.corpus_hash) == ("enc-A", "corpus-A")
    assert meta.search_params == {"nprobe": 8}


def test_default_factory_by_size():
    assert default_factory(50_000, 256) == "Flat"
    assert default_factory(1_000_000, 256) == "IVF4096,Flat"
    assert default_search_params("IVF4096,Flat") == {"nprobe": 32}
    assert default_factory(10_000_000, 256).startswith("IVF16384_HNSW32,")
    # Raw vectors over the memory budget: PQ codes of dim/8 bytes.
    assert default_factory(1_000_000, 256, memory_budget_bytes=100 * 2**20) == "IVF4096,PQ32np"
    assert default_search_params("HNSW32") == {"ef_search": 128}
    assert default_search_params("IVF1024,PQ32,RFlat") == {"nprobe": 8, "k_factor": 8}


def test_fingerprint_tracks_content():
    sd = {"w": torch.ones(3, 2), "b": torch.zeros(2)}
    same = {"b": torch.zeros(2), "w": torch.ones(3, 2)}
    assert fingerprint(sd) == fingerprint(same)
    assert fingerprint(sd) != fingerprint({**sd, "b": torch.tensor([0.0, 1e-7])})
    assert fingerprint(["doc-1", "doc-2"]) != fingerprint(["doc-2", "doc-1"])


def test_to_gpu_without_gpu_logs_reason_and_keeps_working(data, caplog):
    if faiss.get_num_gpus() > 0:
        pytest.skip("faiss sees a GPU here; covered by test_to_gpu_matches_cpu")
    x, q, _ = data
    index = build_index(x, factory="Flat")
    with caplog.at_level(logging.INFO, logger="retriever.index"):
        assert index.to_gpu() is index
    assert not index.on_gpu
    assert "stays on CPU" in caplog.text and ("faiss-cpu" in caplog.text or "no GPU" in caplog.text)
    assert index.search(q, 3)[1].shape == (len(q), 3)


@pytest.mark.gpu
def test_to_gpu_matches_cpu(data, tmp_path):
    if faiss.get_num_gpus() == 0:
        pytest.skip("faiss sees no GPU")
    x, q, ids = data
    index = build_index(x, ids, factory="IVF16,Flat", search_params={"nprobe": 16})
    s_cpu, i_cpu = index.search(q, 10)
    index.to_gpu()
    assert index.on_gpu
    s_gpu, i_gpu = index.search(torch.from_numpy(q).cuda(), 10)
    assert s_gpu.is_cuda
    np.testing.assert_array_equal(i_gpu.cpu().numpy(), i_cpu)
    np.testing.assert_allclose(s_gpu.cpu().numpy(), s_cpu, rtol=1e-5, atol=1e-5)
    loaded = FaissIndex.load(index.save(tmp_path / "gpu.index"))  # saved through index_gpu_to_cpu
    np.testing.assert_array_equal(loaded.search(q, 10)[1], i_cpu)


def test_document_index_rebuild_swaps(data):
    x, q, _ = data
    holder = DocumentIndex()
    with pytest.raises(RuntimeError, match="empty"):
        holder.search(q, 5)
    first = holder.rebuild(x, factory="IVF16,Flat", search_params={"nprobe": 16}, encoder_hash="e1")
    assert holder.version == 1 and holder.current is first
    _, before = holder.search(q, 5)
    # A new encoder: one call builds from the new embeddings with the same factory and params.
    second = holder.rebuild(-x, encoder_hash="e2")
    assert holder.version == 2 and holder.current is second
    assert second.meta.factory == "IVF16,Flat" and second.meta.search_params["nprobe"] == 16
    assert second.meta.encoder_hash == "e2"
    _, after = holder.search(q, 5)
    assert not np.array_equal(before, after)
    np.testing.assert_array_equal(after, brute_force(-x, q, np.arange(len(x)), 5, "ip"))


def test_document_index_rebuild_without_retraining_keeps_centroids(data):
    x, q, _ = data
    holder = DocumentIndex(build_index(x, factory="IVF16,Flat"))
    old_centroids = faiss.extract_index_ivf(holder.current.index).quantizer.reconstruct_n(0, 16)
    new = holder.rebuild(x[::-1].copy(), retrain=False)
    np.testing.assert_array_equal(
        faiss.extract_index_ivf(new.index).quantizer.reconstruct_n(0, 16), old_centroids
    )
    assert new.ntotal == len(x)


def test_background_rebuild_serves_old_index_until_swap(data):
    x, q, _ = data
    holder = DocumentIndex(build_index(x, factory="Flat"))
    old = holder.current
    release = threading.Event()
    started = threading.Event()
    real_add = FaissIndex.add

    def slow_add(self, *a, **kw):  # hold the rebuild mid-way, deterministically
        started.set()
        assert release.wait(30)
        return real_add(self, *a, **kw)

    FaissIndex.add = slow_add
    try:
        future = holder.rebuild(2 * x, background=True)
        assert started.wait(30)
        s_mid, _ = holder.search(q, 3)  # the rebuild is blocked: the old index answers
        assert holder.current is old and holder.version == 1
        release.set()
        new = future.result(timeout=60)
    finally:
        FaissIndex.add = real_add
        release.set()
        holder.close()
    assert holder.current is new and holder.version == 2
    s_new, _ = holder.search(q, 3)
    np.testing.assert_allclose(s_new, 2 * s_mid, rtol=1e-5)


def test_background_rebuild_embeds_on_its_thread_and_reports_the_swap(data):
    x, _, _ = data
    holder = DocumentIndex(build_index(x, factory="Flat"))
    seen = {}

    def embed():  # what RetrievalMemory.refresh hands over: the embedding runs off this thread
        seen["thread"] = threading.current_thread()
        return 2 * x

    def on_swap(new, emb):
        seen["served"], seen["emb"] = holder.current is new, emb

    try:
        future = holder.rebuild(embed, background=True, on_swap=on_swap)
        holder.wait()
        assert not holder.rebuilding and future.result() is holder.current and holder.version == 2
        assert seen["thread"] is not threading.current_thread() and seen["served"]
        np.testing.assert_array_equal(seen["emb"], 2 * x)
        holder.rebuild(lambda: 1 / 0, background=True)
        with pytest.raises(
            ZeroDivisionError
        ):  # a failed rebuild surfaces in wait(), the old index serves
            holder.wait()
        assert holder.version == 2
    finally:
        holder.close()
