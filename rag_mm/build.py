"""The model's parts and data streams from a config: what training and evaluation both build.

Single-device and parallelism-free: the trainer spreads the reader (``rag_mm.distributed.spread``)
and adds the optimizer; evaluation loads a checkpoint into it. Imports neither of them.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from rag_mm.config import ConfigError, TrainConfig, data_splits, reader_tokenizer
from rag_mm.data.balance import answer_balance
from rag_mm.data.documents import DocumentStore
from rag_mm.data.pipeline import DataError, StreamSpec, make_loader
from rag_mm.data.tokenizer import get_tokenizer
from rag_mm.data.urls import expand_urls
from rag_mm.model.factory import build_reader
from rag_mm.model.layout import ReaderBase
from rag_mm.model.rag import RagModel
from retriever.encoders import DualEncoder
from retriever.exact import search_on_device, store_fits
from retriever.memory import RetrievalMemory

log = logging.getLogger(__name__)

# training queries whose mean embedding centres the query side of a centred index
# (retriever.centre): enough for the mean of a 64-512-wide embedding to settle, one forward pass
CALIBRATION_QUERIES = 512

# the query splits a stream can read (data.<split> shard patterns)
SPLITS = (
    "train",
    "val",
    "test",
)


@dataclass
class RagParts:
    """A RagModel and what it is made of; ``retriever`` and ``memory`` are None unless learned."""

    tok: object  # the tokenizer (vocab_size, eot_id, decode)
    store: DocumentStore  # the document memory, host tensors
    reader: ReaderBase  # rag_mm's own (model.family=native) or on a Hugging Face LM (hf)
    retriever: DualEncoder | None
    memory: RetrievalMemory | None  # its faiss index is empty until ``memory.refresh()``
    rag: RagModel


def build_rag(cfg: TrainConfig, device: torch.device, gold_queries: bool = True) -> RagParts:
    """Tokenizer, document store, reader, retriever and memory (learned mode), and the RagModel
    over them, freshly initialised on ``device`` (seed the global RNG first for a given init).
    ``gold_queries``: the training queries name their gold documents (``rag_mm.checks.gold``)."""
    m = cfg.model
    # what the model keys name (a tokenizer, an LM family, a pretrained directory) may not build
    try:
        tok = get_tokenizer(reader_tokenizer(m))
        reader = build_reader(m, tok.vocab_size).to(device)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    if "corpus" in data_splits(cfg):
        store = DocumentStore.load(
            expand_urls(cfg.data.root, cfg.data.corpus),
            m.image_size,
            m.max_doc_text,
            tokenizer=reader_tokenizer(m),
        )
        log.info("document memory: %d documents (%s dropped)", len(store), store.skipped or "none")
    else:  # closed book reads no document
        store = DocumentStore.empty(m.image_size, m.max_doc_text)
    retriever = memory = None
    if cfg.retriever.mode == "learned":
        try:
            retriever = DualEncoder(cfg.retriever, m.image_size).to(device)
        except ValueError as exc:  # a retriever.checkpoint of other towers
            raise ConfigError(str(exc)) from None
        r = cfg.retriever
        try:
            on_device = search_on_device(r.search, r.index_factory, len(store), r.embed_dim, device)
        except ValueError as exc:  # retriever.search=device with an approximate index
            raise ConfigError(str(exc)) from None
        if on_device and store_fits(store.images.nbytes + store.text_ids.nbytes, device):
            store = store.to(device)  # the search's ids index it where they are
        memory = RetrievalMemory(
            retriever,
            store.images,
            store.text_ids,
            store.text_len,
            store.ids,
            factory=cfg.retriever.index_factory,
            batch_size=cfg.retriever.encode_batch_size,
            device=device,
            queries=calibration_queries(cfg) if cfg.retriever.centre else None,
            on_device=on_device,
        )
    rag = RagModel(reader, store, cfg.retriever, retriever, memory, gold_queries)
    return RagParts(tok, store, reader, retriever, memory, rag)


def calibration_queries(cfg: TrainConfig, n: int = CALIBRATION_QUERIES):
    """The first ``n`` training queries in shard order, as evaluation reads them (no augmentation,
    no shuffle), the same on every rank and in every process that builds the run: (image (n, 3,
    H, W), q_ids, q_len) on the host."""
    m = cfg.model
    spec = StreamSpec(
        urls=expand_urls(cfg.data.root, cfg.data.train),
        image_size=m.image_size,
        max_question=m.max_question,
        max_answer=m.max_answer,
        batch_size=min(n, cfg.data.eval_batch_size),
        train=False,
        tokenizer=reader_tokenizer(m),
    )
    parts: dict[str, list[torch.Tensor]] = {"image": [], "q_ids": [], "q_len": []}
    got = 0
    try:
        for batch in make_loader(spec, 0):
            for key, v in parts.items():
                v.append(batch[key])
            got += len(batch["q_len"])
            if got >= n:
                break
    except DataError as exc:  # evaluate and ask read the training split for this alone: say so
        what = f"retriever.centre centres queries with the training queries' mean, but {exc.what}"
        raise DataError(what, exc.urls, exc.counts) from None
    width = max(t.shape[1] for t in parts["q_ids"])  # each batch is padded to its own longest
    ids = [torch.nn.functional.pad(t, (0, width - t.shape[1])) for t in parts["q_ids"]]
    image, q_ids, q_len = (
        torch.cat(parts["image"])[:n],
        torch.cat(ids)[:n],
        torch.cat(parts["q_len"])[:n],
    )
    log.info("retriever.centre: %d training queries calibrate the query side", len(q_len))
    return image, q_ids, q_len


def make_stream(
    cfg,
    split: str,
    train: bool,
    rank: int = 0,
    world_size: int = 1,
    skip_batches: int = 0,
    balance: bool = True,
    device: torch.device | None = None,
):
    """The loader over ``data.<split>``: this rank's share of it, training batches (shuffled,
    augmented when ``data.augment``, answers balanced when ``data.balance_answers`` and
    ``balance``) or evaluation batches, ``skip_batches`` already drawn; in page-locked memory
    when they go to a CUDA ``device``."""
    c = cfg
    seed = c.seed if c.data.seed is None else c.data.seed  # data.seed: the stream's own
    urls = expand_urls(c.data.root, getattr(c.data, split))
    keep = None
    if train and balance and c.data.balance_answers > 0:
        keep = answer_balance(urls, c.data.balance_answers, seed)
    spec = StreamSpec(
        urls=urls,
        image_size=c.model.image_size,
        max_question=c.model.max_question,
        max_answer=c.model.max_answer,
        batch_size=c.data.batch_size if train else c.data.eval_batch_size,
        seed=seed,
        shuffle_buffer=c.data.shuffle_buffer,
        shard_interleave=c.data.shard_interleave,
        augment=train and c.data.augment,
        colour_jitter=c.data.colour_jitter,
        crop_pad=c.data.crop_pad,
        zoom_out=c.data.zoom_out,
        train=train,
        rank=rank,
        world_size=world_size,
        skip_batches=skip_batches,
        tokenizer=reader_tokenizer(c.model),
        keep=keep,
    )
    pin = device is not None and torch.device(device).type == "cuda"
    return make_loader(spec, c.data.num_workers, pin_memory=pin)


def batch_inputs(batch: dict, device) -> dict:
    """A loader batch -> the RagModel's keyword inputs on ``device`` (``gold``: the gold doc
    ids)."""
    x = {
        k: batch[k].to(device, non_blocking=True)
        for k in ("image", "q_ids", "q_len", "a_ids", "a_len")
    }
    x["gold"] = batch["doc_id"].to(device, non_blocking=True)
    return x
