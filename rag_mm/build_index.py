"""Encode a corpus with the retriever's document tower and build, save and check a faiss index.

    rag_mm build-index corpus='data/knowledge_world/corpus/corpus-{000000..000000}.tar' \
        checkpoint=runs/demo out=runs/demo/memory.index [factory=auto] [queries=<query shards>]
    torchrun --nproc_per_node=2 -m rag_mm.build_index ...     # each rank encodes 1/W of the corpus

``checkpoint`` is a run directory (its newest valid checkpoint and saved config are used), one
checkpoint directory, or empty for a freshly initialised encoder (sizes from ``retriever.*``
overrides). Reports encode and build time, queries/s, recall@k of the index against exact
search, and, when ``queries`` are given, recall@k of each query's gold document. Prints JSON.
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException
from yaml import YAMLError

from rag_mm.checks import paths
from rag_mm.components import checkpoint as ckpt
from rag_mm.data.documents import DocumentStore
from rag_mm.data.pipeline import DataError
from rag_mm.data.urls import expand_urls, missing_local_shards, unusable_local_shards
from retriever.config import RetrieverConfig
from retriever.encoders import DualEncoder
from retriever.index import FaissIndex, build_index, default_factory, fingerprint
from retriever.sharded import embed_sharded


@dataclass
class BuildConfig:
    """What to encode, with which encoder, into which index."""

    # document shards (brace expansion)
    corpus: str = "data/knowledge_world/corpus/corpus-{000000..000000}.tar"
    root: str = ""  # prefix for relative shard paths
    checkpoint: str = ""  # run dir, checkpoint dir, or empty for a fresh encoder
    out: str = "memory.index"  # where the index file goes
    factory: str = "auto"  # faiss index_factory string; auto = Flat up to 100k docs, IVF beyond
    k: int = 10  # recall@k against exact search
    queries: str = ""  # optional query shards: gold-document recall@k with the query tower
    num_queries: int = 1000  # documents reused as queries when no query shards are given
    image_size: int = 32  # pictures are resized to this
    max_text: int = 40  # document tokens kept
    batch_size: int = 256  # documents per forward pass
    threads: int = 0  # torch/faiss threads (0 = default)
    # prefix: write <prefix>docs.npy (and <prefix>queries.npy) for scripts/bench/index.py
    save_embeddings: str = ""
    # tower sizes when no checkpoint config
    retriever: RetrieverConfig = field(default_factory=RetrieverConfig)


def _dist() -> tuple[int, int]:
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not dist.is_initialized():
        dist.init_process_group("gloo")
    return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)


def _fail(message: str) -> SystemExit:
    """Bad input: the message on stderr, exit status 2."""
    print(f"build_index: error: {message}", file=sys.stderr)
    return SystemExit(2)


def _shard_problems(key: str, root: str, pattern: str) -> list[str]:
    urls = expand_urls(root, pattern)
    missing, unusable = missing_local_shards(urls), unusable_local_shards(urls)
    e = (
        [f"{key}: {len(missing)} of {len(urls)} shards not found, e.g. {missing[0]}"]
        if missing
        else []
    )
    return e + (
        [f"{key}: {len(unusable)} of {len(urls)} shards unusable, e.g. {unusable[0]}"]
        if unusable
        else []
    )


def check_args(cfg: BuildConfig) -> list[str]:
    """Every problem with the path arguments, before the process group, the corpus or the
    encoder."""
    e = _shard_problems("corpus", cfg.root, cfg.corpus)
    if cfg.queries:
        e += _shard_problems("queries", cfg.root, cfg.queries)
    if cfg.checkpoint:
        p = Path(cfg.checkpoint)
        if (p / "checkpoints").is_dir():  # a run directory: its saved config and a valid checkpoint
            saved = p / ".hydra" / "config.yaml"
            why = paths.file_problem("checkpoint", saved) if saved.exists() else None
            if why is None and saved.exists():
                try:
                    OmegaConf.merge(
                        OmegaConf.structured(RetrieverConfig), OmegaConf.load(saved).retriever
                    )
                    int(OmegaConf.load(saved).model.image_size)
                except (
                    OmegaConfBaseException,
                    YAMLError,
                    AttributeError,
                    TypeError,
                    ValueError,
                ) as exc:  # damaged or foreign
                    why = (
                        f"checkpoint: the run's saved config {saved} is unusable "
                        f"({paths.short_error(exc)})"
                    )
            e += [why] if why else []
            if ckpt.latest_valid(p / "checkpoints") is None:
                e.append(f"checkpoint: no valid checkpoint under {p / 'checkpoints'}")
        else:
            e += paths.checkpoint_dir_problems("checkpoint", p)
    e += paths.output_file_problems("out", cfg.out, must_be="index")
    if cfg.save_embeddings:
        where = Path(cfg.save_embeddings + "docs.npy").parent  # np.save creates no directory
        why = paths.dir_problem("save_embeddings", where) or paths.writable_dir_problem(
            "save_embeddings", where
        )
        e += [why] if why else []
    return e


def load_encoder(cfg: BuildConfig) -> tuple[DualEncoder, str]:
    """The dual encoder from a run's checkpoint (and its saved config), or a fresh one."""
    rcfg, path = cfg.retriever, None
    if cfg.checkpoint:
        p = Path(cfg.checkpoint)
        if (p / "checkpoints").is_dir():  # a run directory
            saved = p / ".hydra" / "config.yaml"
            if saved.is_file():
                rcfg = OmegaConf.merge(
                    OmegaConf.structured(RetrieverConfig), OmegaConf.load(saved).retriever
                )
                cfg.image_size = int(OmegaConf.load(saved).model.image_size)
            path = ckpt.latest_valid(p / "checkpoints")
            if path is None:
                raise _fail(f"checkpoint: no valid checkpoint under {p / 'checkpoints'}")
        else:
            path = p
    enc = DualEncoder(rcfg, cfg.image_size)  # type: ignore[arg-type]
    if path is not None:
        why = ckpt.verify(path)
        if why:
            raise _fail(f"checkpoint {path} failed verification: {why}")
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.api import CheckpointException

        state = {"model": {f"retriever.{k}": v for k, v in enc.state_dict().items()}}
        try:
            dcp.load(state, checkpoint_id=str(path))
        except (
            CheckpointException
        ) as exc:  # e.g. a run without a learned retriever: no retriever.* entries
            why = "; ".join(f"{type(err).__name__}: {err}" for err, _ in exc.failures.values())
            raise _fail(f"checkpoint {path} holds no retriever this config builds: {why}") from None
        enc.load_state_dict({k[len("retriever.") :]: v for k, v in state["model"].items()})
    return enc.eval(), str(path or "fresh")


@torch.no_grad()
def encode(
    enc: DualEncoder, store: DocumentStore, rows: range, batch: int, progress: bool
) -> torch.Tensor:
    from rich.progress import Progress

    out = []
    with Progress(disable=not progress, transient=True) as bar:
        task = bar.add_task("encoding documents", total=len(rows))
        for s in range(rows.start, rows.stop, batch):
            idx = torch.arange(s, min(rows.stop, s + batch))
            out.append(enc.embed_docs(store.images[idx], store.text_ids[idx], store.text_len[idx]))
            bar.advance(task, len(idx))
    return torch.cat(out) if out else torch.zeros(0, enc.cfg.embed_dim)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        cfg = OmegaConf.to_object(
            OmegaConf.merge(OmegaConf.structured(BuildConfig), OmegaConf.from_dotlist(argv))
        )
    except Exception as exc:
        print(f"build_index: error: {exc}", file=sys.stderr)
        return 2
    problems = check_args(cfg)
    if problems:
        print(
            "build_index: error: invalid arguments:\n  - " + "\n  - ".join(problems),
            file=sys.stderr,
        )
        return 2
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    rank, world = _dist()
    urls = expand_urls(cfg.root, cfg.corpus)
    enc, source = load_encoder(cfg)
    try:
        store = DocumentStore.load(urls, cfg.image_size, cfg.max_text)
    except DataError as exc:
        raise _fail(f"corpus: {exc}") from None
    N = len(store)

    t0 = time.perf_counter()
    progress = rank == 0 and sys.stderr.isatty()
    # each rank encodes a contiguous 1/W; all-gather assembles the whole, which rank 0 indexes
    emb = embed_sharded(
        lambda rows: encode(enc, store, rows, cfg.batch_size, progress), N, enc.cfg.embed_dim
    )
    encode_s = time.perf_counter() - t0
    if rank != 0:
        dist.destroy_process_group()
        return 0

    x = emb.numpy().astype(np.float32)
    ids = store.ids.numpy()
    factory = default_factory(N, x.shape[1]) if cfg.factory == "auto" else cfg.factory
    t0 = time.perf_counter()
    index = build_index(
        x,
        ids,
        factory=factory,
        metric="ip",
        encoder_hash=fingerprint(enc.state_dict()),
        corpus_hash=fingerprint(ids, store.passages),
    )
    build_s = time.perf_counter() - t0
    saved = index.save(cfg.out)
    loaded = FaissIndex.load(
        saved,
        dim=x.shape[1],
        encoder_hash=index.meta.encoder_hash,
        corpus_hash=index.meta.corpus_hash,
    )

    # queries: real query shards through the query tower, or held-out documents' own embeddings
    gold = None
    if cfg.queries:
        from rag_mm.data.pipeline import StreamSpec, make_loader

        spec = StreamSpec(
            urls=expand_urls(cfg.root, cfg.queries),
            image_size=cfg.image_size,
            max_question=24,
            max_answer=8,
            batch_size=cfg.batch_size,
            train=False,
        )
        qs, gold = [], []
        with torch.no_grad():
            try:
                for b in make_loader(spec, 0):
                    qs.append(enc.embed_queries(b["image"], b["q_ids"], b["q_len"]))
                    gold.append(b["doc_id"])
            except DataError as exc:
                raise _fail(f"queries: {exc}") from None
        q, gold = torch.cat(qs).numpy(), torch.cat(gold).numpy()
    else:
        pick = np.random.default_rng(0).choice(N, min(cfg.num_queries, N), replace=False)
        q = x[pick]
    if cfg.save_embeddings:
        np.save(f"{cfg.save_embeddings}docs.npy", x)
        if gold is not None:
            np.save(f"{cfg.save_embeddings}queries.npy", q)
    k = min(cfg.k, N)
    t0 = time.perf_counter()
    _, found = loaded.search(q, k)
    search_s = time.perf_counter() - t0
    exact = build_index(x, ids, factory="Flat")
    _, truth = exact.search(q, k)
    recall_vs_exact = float(np.mean([len(set(f) & set(t)) / k for f, t in zip(found, truth)]))
    report = {
        "index": str(saved),
        "factory": factory,
        "num_docs": N,
        "dim": int(x.shape[1]),
        "encoder": source,
        "world_size": world,
        "encode_s": round(encode_s, 3),
        "build_s": round(build_s, 3),
        "queries": int(len(q)),
        "queries_per_s": round(len(q) / max(search_s, 1e-9), 1),
        f"recall@{k}_vs_exact": recall_vs_exact,
    }
    if gold is not None:
        for r in sorted({1, 5, k}):
            report[f"gold_recall@{r}"] = float(np.mean([g in f[:r] for g, f in zip(gold, found)]))
    if enc.cfg.centre:  # this file holds what the tower gives; the run scores centred vectors
        report["note"] = (
            "raw document embeddings; the run scores them centred (retriever.centre), with its "
            "training queries' mean, as rag_mm.evaluate and rag_mm.ask index them"
        )
    print(json.dumps(report))
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
