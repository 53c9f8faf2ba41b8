"""The document memory: every corpus document decoded once and held as tensors.

The reader fetches documents by id; the retriever (learned mode) embeds them. Holding the
memory in RAM suits corpora up to a few million small documents; larger ones belong in a
sharded store (one shard per rank), which the sharded faiss search already assumes.
"""

from __future__ import annotations

import json
import logging
from collections import Counter
from dataclasses import dataclass, replace

import torch
import webdataset as wds

from rag_mm.data.pipeline import DataError, SkipCounter, decode_image, image_to_tensor
from rag_mm.data.tokenizer import get_tokenizer

log = logging.getLogger(__name__)


@dataclass
class DocumentStore:
    """Documents as tensors, row i holding document ``ids[i]``."""

    ids: torch.Tensor  # (N,) int64 document ids as found in the corpus json (or running numbers)
    images: torch.Tensor  # (N, 3, H, W) normalised pictures
    text_ids: torch.Tensor  # (N, Lt) token ids, right-padded
    text_len: torch.Tensor  # (N,) valid tokens per row
    passages: list[str]  # raw text, for inspection
    skipped: dict[str, int]  # corrupt documents dropped while loading

    def __post_init__(self) -> None:
        # ids in ascending order and the row of each: ids -> rows by a binary search that runs
        # on the store's device, so a fetch of ids found there needs no host round trip
        self._sorted, self._order = self.ids.sort(stable=True)

    def __len__(self) -> int:
        return len(self.passages)

    @property
    def device(self) -> torch.device:
        return self.ids.device

    def to(self, device) -> DocumentStore:
        """The same documents with their tensors on ``device`` (the device search's store)."""
        move = {f: getattr(self, f).to(device) for f in ("ids", "images", "text_ids", "text_len")}
        return replace(self, **move)

    def rows(self, doc_ids: torch.Tensor) -> torch.Tensor:
        """Map document ids (any shape) to row indices, on the store's device; unknown ids raise
        KeyError on the CPU. On a GPU they are not checked, which would cost a sync: the ids
        come from searches of an index built from this store."""
        flat = doc_ids.to(self.device).reshape(-1)
        pos = torch.searchsorted(self._sorted, flat).clamp_(max=max(len(self) - 1, 0))
        if self.device.type == "cpu":
            bad = flat if len(self) == 0 else flat[self._sorted[pos] != flat]
            if len(bad):
                raise KeyError(int(bad[0]))
        return self._order[pos].view(doc_ids.shape)

    def fetch(self, doc_ids: torch.Tensor) -> dict[str, torch.Tensor]:
        """Documents for a (B, k) id tensor: images (B, k, 3, H, W), text (B, k, Lt), lengths (B,
        k), on the store's device."""
        r = self.rows(doc_ids)
        return {
            "doc_image": self.images[r],
            "doc_ids": self.text_ids[r],
            "doc_len": self.text_len[r],
        }

    @classmethod
    def empty(cls, image_size: int, max_text: int) -> DocumentStore:
        """No documents: the memory of a closed-book run, which reads none."""
        return cls(
            torch.zeros(0, dtype=torch.long),
            torch.zeros(0, 3, image_size, image_size),
            torch.zeros(0, max_text, dtype=torch.long),
            torch.zeros(0, dtype=torch.long),
            [],
            {},
        )

    @classmethod
    def load(
        cls, urls: list[str], image_size: int, max_text: int, tokenizer: str | None = None
    ) -> DocumentStore:
        """The documents of ``urls``, their passages tokenized by ``get_tokenizer(tokenizer)``."""
        tok = get_tokenizer(tokenizer)
        counter = SkipCounter()
        ids, images, texts, passages = [], [], [], []
        for sample in wds.DataPipeline(
            wds.SimpleShardList(urls), wds.tarfile_to_samples(handler=counter.tar_error)
        ):
            try:
                img = image_to_tensor(decode_image(sample), image_size)
                text = sample["txt"].decode("utf-8")
                meta = json.loads(sample["json"]) if "json" in sample else {}
                doc_id = int(meta.get("doc_id", len(ids)))
            except Exception as exc:  # a broken picture (PIL raises several types), text or JSON
                counter.counts["bad_document"] += 1
                log.warning("skipping document %s: %s", sample.get("__key__"), exc)
                continue
            ids.append(doc_id)
            images.append(img)
            texts.append(tok.encode(text))
            passages.append(text)
        if not ids:
            raise DataError("no readable document in the corpus", urls, counter.counts)
        if len(set(ids)) != len(ids):
            dup = sorted(d for d, n in Counter(ids).items() if n > 1)
            raise DataError(
                f"duplicate doc_id values in the corpus (e.g. {dup[:5]})", urls, counter.counts
            )
        text_ids, text_len = tok.pad(texts, max_text)
        return cls(
            torch.tensor(ids),
            torch.stack(images),
            text_ids,
            text_len,
            passages,
            dict(counter.counts),
        )
