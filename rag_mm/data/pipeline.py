"""Query streams over webdataset shards: split, shuffle, decode, augment, tokenise, batch.

Training streams are infinite and deterministic: shard order, the interleave of the shards read
at once and the sample shuffle are seeded by (seed, epoch), augmentation by (seed, epoch, sample
key). A rank that resumes after ``n`` batches replays its stream and drops what it had consumed,
so no sample is seen twice or skipped. Corrupt input (a truncated tar, an undecodable picture, bad
JSON, a missing key) is dropped and counted, never slept on (webdataset's ``warn_and_continue``
sleeps 0.5 s per error).
A full pass that yields no usable sample stops the stream with a ``DataError`` (naming the shards
and the drop counts by reason) instead of spinning over them forever. Loader workers are other
processes: batches carry their drop counts, and a worker's error travels as a record that
``Loader`` raises in the iterating process.
"""

from __future__ import annotations

import atexit
import io
import json
import logging
import random
import signal
import weakref
import zlib
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np
import torch
import webdataset as wds
from PIL import Image

from rag_mm.config import ConfigError
from rag_mm.data.tokenizer import get_tokenizer

log = logging.getLogger(__name__)

# CLIP's normalisation constants (open_clip.constants.OPENAI_DATASET_MEAN / STD).
MEAN = torch.tensor([0.48145466, 0.4578275, 0.40821073]).view(3, 1, 1)
STD = torch.tensor([0.26862954, 0.26130258, 0.27577711]).view(3, 1, 1)
IMAGE_KEYS = ("png", "jpg", "jpeg", "webp")


def image_to_tensor(img: Image.Image, size: int) -> torch.Tensor:
    """PIL picture -> normalised float tensor (3, size, size)."""
    img = img.convert("RGB")
    if img.size != (size, size):
        img = img.resize((size, size), Image.BICUBIC)
    x = torch.from_numpy(np.asarray(img, dtype=np.uint8).copy()).permute(2, 0, 1).float() / 255.0
    return (x - MEAN) / STD


def decode_image(sample: dict) -> Image.Image:
    for key in IMAGE_KEYS:
        if key in sample:
            img = Image.open(io.BytesIO(sample[key]))
            img.load()  # force the decode here, where errors are caught and counted
            return img
    raise KeyError(f"no image member ({'/'.join(IMAGE_KEYS)})")


class DataError(ConfigError):
    """Shards a config key names cannot feed the run: a full pass over them yielded no usable
    sample. It is bad input, as a bad config value is (``rag_mm.train`` prints it and exits 2);
    ``urls`` are the shards read, ``counts`` the dropped input by reason."""

    def __init__(self, what: str, urls: list[str], counts: dict[str, int]) -> None:
        self.what, self.urls, self.counts = what, list(urls), dict(counts)
        shown = ", ".join(self.urls[:3]) + (
            f", ... ({len(self.urls)} shards)" if len(self.urls) > 3 else ""
        )
        dropped = (
            ", ".join(f"{k}={v}" for k, v in sorted(self.counts.items()))
            or "nothing (the shards hold no samples)"
        )
        super().__init__(f"{what}: {shown}; dropped by reason: {dropped}")

    def fields(self) -> dict:
        """Plain data to rebuild the error in another process."""
        return {"what": self.what, "urls": self.urls, "counts": self.counts}


class SkipCounter:
    """Counts dropped input by reason. One per stream (per loader worker)."""

    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()

    def tar_error(self, exn: Exception) -> bool:
        """webdataset handler: count and go on with the next member or shard (no sleep)."""
        self.counts[f"tar:{type(exn).__name__}"] += 1
        log.warning("skipping unreadable tar data: %s", exn)
        return True


def _augment(
    x: torch.Tensor,
    rng: random.Random,
    colour_jitter: float = 0.1,
    crop_pad: int = 2,
    zoom_out: float = 1.0,
) -> torch.Tensor:
    """Random crop and a per-channel brightness shift on a (3, H, W) tensor.

    The picture is padded by ``crop_pad`` px of replicated edge on every side; a square of side
    uniform in [H, min(H * zoom_out, H + 2 * crop_pad)] is cropped at a random place and resized
    back to H. Side H is a plain shift of up to ``crop_pad`` px; a larger side also shrinks the
    content (zoom out), so neither where a thing sits nor how big it is identifies a training
    picture. The brightness shift is uniform in +-``colour_jitter`` (0: colours kept exact)."""
    H, W = x.shape[1:]
    pad = crop_pad
    if pad > 0:
        # (3, H+2p, W+2p)
        xp = torch.nn.functional.pad(x[None], (pad, pad, pad, pad), mode="replicate")[0]
        side = H if zoom_out <= 1.0 else rng.randint(H, min(int(H * zoom_out), H + 2 * pad))
        i, j = rng.randint(0, H + 2 * pad - side), rng.randint(0, W + 2 * pad - side)
        x = xp[:, i : i + side, j : j + side]
        if side != H:
            x = torch.nn.functional.interpolate(
                x[None], size=(H, W), mode="bilinear", antialias=True, align_corners=False
            )[0]
    if colour_jitter <= 0:
        return x
    return x + torch.tensor([rng.uniform(-colour_jitter, colour_jitter) for _ in range(3)]).view(
        3, 1, 1
    )


@dataclass
class StreamSpec:
    """What one query stream reads and how."""

    urls: list[str]
    image_size: int
    max_question: int
    max_answer: int
    batch_size: int
    seed: int = 0
    shuffle_buffer: int = 1000
    # training only: shards a loader worker reads at once, each next sample drawn from one of them
    # at random (DataConfig.shard_interleave); 1 reads them one after another
    shard_interleave: int = 16
    augment: bool = False
    colour_jitter: float = 0.1  # per-channel shift of augmented pictures (DataConfig.colour_jitter)
    crop_pad: int = 2  # replicated border of the random crop, px (DataConfig.crop_pad)
    zoom_out: float = 1.0  # largest crop side over the picture's (DataConfig.zoom_out)
    train: bool = True  # infinite, shuffled, split by node and worker; else one ordered pass
    rank: int = 0
    world_size: int = 1
    skip_batches: int = 0  # batches this rank already consumed (resume)
    # local Hugging Face tokenizer directory; None: the bundled CLIP BPE
    tokenizer: str | None = None
    # training only: called on each decoded sample, False drops it (rag_mm.data.balance); None
    # keeps every sample
    keep: Callable[[dict], bool] | None = None


class QueryStream(torch.utils.data.IterableDataset):
    """Batches of queries; see the module docstring for the guarantees."""

    def __init__(self, spec: StreamSpec) -> None:
        super().__init__()
        if not spec.urls:
            raise ValueError("no shard URLs")
        self.spec = spec

    # -- stages -------------------------------------------------------------------------------
    def _shards(self, epoch: int) -> list[str]:
        s = self.spec
        urls = list(s.urls)
        if s.train:
            random.Random(f"{s.seed}-shards-{epoch}").shuffle(urls)
            if len(urls) >= s.world_size:
                urls = urls[s.rank :: s.world_size]
        return urls

    def _raw_samples(
        self, urls: list[str], counter: SkipCounter, rng: random.Random | None = None
    ) -> Iterator[dict]:
        """The samples of ``urls``: one shard after another, or with ``rng`` (training) the
        interleave of ``shard_interleave`` shards open at once."""
        k = min(self.spec.shard_interleave, len(urls)) if rng is not None else 1
        if k <= 1:
            yield from _shard_samples(urls, counter)
            return
        yield from _interleave([_shard_samples([u], counter) for u in urls], k, rng)

    def _decode(self, sample: dict, counter: SkipCounter) -> dict | None:
        s = self.spec
        tok = get_tokenizer(s.tokenizer)
        key = sample.get("__key__")
        try:
            img = decode_image(sample)
        except KeyError as exc:
            counter.counts["missing_key"] += 1
            log.warning("skipping sample %s: %s", key, exc)
            return None
        except Exception as exc:  # PIL raises several types for broken pictures
            counter.counts["bad_image"] += 1
            log.warning("skipping sample %s: undecodable image: %s", key, exc)
            return None
        try:
            if "txt" not in sample:
                raise KeyError("no txt member (the question)")
            meta = json.loads(sample["json"]) if "json" in sample else {}
            if not isinstance(meta, dict):
                raise ValueError(f"json is a {type(meta).__name__}, not an object")
            if "answer" not in meta:
                raise KeyError("json has no 'answer'")
            doc_id = int(meta.get("doc_id", -1))
            # optional human answers (VQA data), for rag_mm.eval.vqa_metric
            answers = meta.get("answers")
            if answers is not None and not (
                isinstance(answers, list) and all(isinstance(a, str) for a in answers)
            ):
                raise ValueError("json 'answers' is not a list of strings")
            kvqa = meta.get("kvqa")  # optional knowledge-VQA scoring fields (eval.kvqa_metric)
            if kvqa is not None and not (
                isinstance(kvqa, dict) and isinstance(kvqa.get("aliases"), list)
            ):
                raise ValueError("json 'kvqa' is not an object with an 'aliases' list")
            # optional VQA answer type ("yes/no", "number", "other")
            answer_type = meta.get("answer_type")
            if answer_type is not None and not isinstance(answer_type, str):
                raise ValueError("json 'answer_type' is not a string")
            question = (
                sample["txt"].decode("utf-8") if isinstance(sample["txt"], bytes) else sample["txt"]
            )
        except KeyError as exc:
            counter.counts["missing_key"] += 1
            log.warning("skipping sample %s: %s", key, exc)
            return None
        except (
            ValueError,
            TypeError,
        ) as exc:  # bad JSON, text that is not UTF-8, a doc_id that is no integer
            counter.counts["bad_json"] += 1
            log.warning("skipping sample %s: bad JSON/text: %s", key, exc)
            return None
        answer = str(meta["answer"])
        return {
            "key": sample["__key__"],
            "image": image_to_tensor(img, s.image_size),
            "question": question,
            "answer": answer,
            "q_ids": tok.encode(question)[: s.max_question],
            "a_ids": (tok.encode(answer)[: s.max_answer - 1]) + [tok.eot_id],
            "doc_id": doc_id,
            "heldout": bool(meta.get("heldout", False)),
            "attribute": str(meta.get("attribute", "")),
            "answers": answers or None,
            "answer_type": answer_type,
            "kvqa": kvqa,
        }

    def _samples(self, counter: SkipCounter, worker: int, num_workers: int) -> Iterator[dict]:
        s = self.spec
        epoch = 0
        while True:
            urls = self._shards(epoch)
            if s.train:
                urls = urls[worker::num_workers] if len(urls) >= num_workers else urls
            mix = random.Random(f"{s.seed}-interleave-{epoch}-{s.rank}-{worker}")
            raw = self._raw_samples(urls, counter, mix if s.train else None)
            if s.train:
                raw = _seeded_shuffle(
                    raw, s.shuffle_buffer, random.Random(f"{s.seed}-{epoch}-{s.rank}-{worker}")
                )
            n_raw = n_share = n_seen = 0
            for i, sample in enumerate(raw):
                n_raw += 1
                if not s.train and (
                    i % s.world_size != s.rank or (i // s.world_size) % num_workers != worker
                ):
                    continue  # evaluation: every rank reads all shards and keeps its share
                n_share += 1
                out = self._decode(sample, counter)
                if out is None:
                    continue
                n_seen += 1
                out["epoch"] = epoch
                if s.train and s.keep is not None and not s.keep(out):
                    continue
                yield out
            # Training: this worker's shards gave nothing in a whole pass, and every later pass
            # would too. Evaluation reads every shard in each worker: no sample at all means the
            # split has none; a share with samples none of which decoded means (all but) the whole
            # split is bad.
            if n_seen == 0 and (s.train or n_raw == 0 or n_share > 0):
                where = (
                    f" (rank {s.rank}, loader worker {worker} of {num_workers})"
                    if s.world_size * num_workers > 1
                    else ""
                )
                what = (
                    f"no usable sample in a full pass over {len(urls)} shard(s){where}"
                    if n_raw
                    else f"no readable sample at all in {len(urls)} shard(s){where}"
                )
                raise DataError(what, urls, counter.counts)
            if not s.train:
                return
            epoch += 1

    def __iter__(self) -> Iterator[dict]:
        s = self.spec
        info = torch.utils.data.get_worker_info()
        worker, num_workers = (info.id, info.num_workers) if info else (0, 1)
        counter = SkipCounter()
        # The DataLoader deals batches round-robin from worker 0, so batch g of this rank's
        # stream comes from worker g % W. After a resume at batch n, loader worker w must play
        # the part of stream worker (w + n) % W, which had produced every W-th of the n batches.
        if s.train:
            worker = (worker + s.skip_batches) % num_workers
        skip = len(range(worker, s.skip_batches, num_workers)) if s.train else 0
        batch: list[dict] = []
        try:
            for sample in self._samples(counter, worker, num_workers):
                if skip:
                    batch.append(sample)
                    if len(batch) == s.batch_size:
                        batch, skip = [], skip - 1
                    continue
                if s.train and s.augment:
                    rng = random.Random(
                        zlib.crc32(f"{s.seed}-{sample['epoch']}-{sample['key']}".encode())
                    )
                    sample["image"] = _augment(
                        sample["image"], rng, s.colour_jitter, s.crop_pad, s.zoom_out
                    )
                batch.append(sample)
                if len(batch) == s.batch_size:
                    yield collate(batch, counter)
                    batch = []
        except DataError as exc:
            if info is None:
                raise
            # a worker's exception reaches the main process as a formatted traceback: send the
            # error's fields instead, for Loader to raise there
            yield {"error": exc.fields(), "skipped": (info.id, dict(counter.counts))}
            return
        if batch:  # evaluation keeps the partial last batch
            yield collate(batch, counter)


def _shard_samples(urls: list[str], counter: SkipCounter) -> Iterator[dict]:
    """The samples of ``urls`` in order, unreadable tar data counted and skipped."""
    yield from wds.DataPipeline(
        wds.SimpleShardList(urls), wds.tarfile_to_samples(handler=counter.tar_error)
    )


def _interleave(shards: list[Iterator[dict]], k: int, rng: random.Random) -> Iterator[dict]:
    """Samples drawn from ``k`` of ``shards`` open at once, each next one from an open shard
    chosen at random; a shard that ends is replaced by the next in the list.

    A converter that writes its source in label order leaves one label per shard; read one after
    another, such shards fill the whole shuffle buffer with one label and every batch holds one
    or two. webdataset's ``RandomMix`` draws from every source at once with the global RNG; this
    is tf.data's ``interleave(cycle_length=k)``: at most ``k`` tar files open (a shard's generator
    opens its file on first draw) and a private seeded RNG, so a resumed stream replays.
    """
    pending = iter(shards)
    open_ = [it for _, it in zip(range(k), pending)]
    while open_:
        i = rng.randrange(len(open_))
        sample = next(open_[i], None)
        if sample is None:
            nxt = next(pending, None)
            if nxt is None:
                open_.pop(i)
            else:
                open_[i] = nxt
            continue
        yield sample


def _seeded_shuffle(it: Iterator[dict], bufsize: int, rng: random.Random) -> Iterator[dict]:
    """Reservoir-style shuffle with a private RNG (webdataset's uses global state per worker)."""
    buf: list[dict] = []
    for sample in it:
        if len(buf) < bufsize:
            buf.append(sample)
            continue
        j = rng.randrange(len(buf))
        yield buf[j]
        buf[j] = sample
    rng.shuffle(buf)
    yield from buf


def collate(samples: list[dict], counter: SkipCounter | None = None) -> dict:
    """Stack samples into a batch of tensors (padding text) plus their metadata."""
    tok = get_tokenizer()
    q_ids, q_len = tok.pad([s["q_ids"] for s in samples], max(len(s["q_ids"]) for s in samples))
    a_ids, a_len = tok.pad([s["a_ids"] for s in samples], max(len(s["a_ids"]) for s in samples))
    info = torch.utils.data.get_worker_info()
    return {
        "image": torch.stack([s["image"] for s in samples]),  # (B, 3, H, W)
        "q_ids": q_ids,
        "q_len": q_len,  # (B, Lq), (B,)
        "a_ids": a_ids,
        "a_len": a_len,  # (B, La), (B,) with EOT
        # (B,) gold, -1 unknown
        "doc_id": torch.tensor([s["doc_id"] for s in samples], dtype=torch.long),
        "heldout": torch.tensor([s["heldout"] for s in samples], dtype=torch.bool),
        "attribute": [s["attribute"] for s in samples],
        "question": [s["question"] for s in samples],
        "answer": [s["answer"] for s in samples],
        # per query: its human answers (list[str]) or None
        "answers": [s["answers"] for s in samples],
        # per query: its json's answer_type (str) or None
        "answer_type": [s.get("answer_type") for s in samples],
        "kvqa": [s.get("kvqa") for s in samples],  # per query: its json's kvqa (dict) or None
        "key": [s["key"] for s in samples],
        # cumulative drop counts of the worker that built this batch (the trainer keeps the latest
        # per worker)
        "skipped": (info.id if info else 0, dict(counter.counts) if counter else {}),
    }


class Loader:
    """Batches of a QueryStream through a DataLoader (batching happens in the stream).

    A worker's ``DataError`` is raised here, in the process that iterates. ``skipped`` holds the
    latest cumulative drop counts of each loader worker (every batch carries its worker's), and
    the end of a finite pass logs what was dropped.
    """

    def __init__(self, spec: StreamSpec, num_workers: int, pin_memory: bool = False) -> None:
        self.spec = spec
        self.loader = torch.utils.data.DataLoader(
            QueryStream(spec),
            batch_size=None,
            num_workers=num_workers,
            # batches in page-locked memory (a thread of the DataLoader's): a copy from pageable
            # memory to a GPU first waits for every kernel queued on its stream
            pin_memory=pin_memory,
            persistent_workers=False,
            prefetch_factor=4 if num_workers > 0 else None,
            worker_init_fn=_ignore_sigterm if num_workers > 0 else None,
        )
        self.skipped: dict[int, dict[str, int]] = {}

    def __iter__(self) -> Iterator[dict]:
        self.skipped = {}
        it = iter(self.loader)
        _live_iterators.add(it)
        try:
            for batch in it:
                wid, counts = batch["skipped"]
                self.skipped[wid] = counts
                if "error" in batch:
                    raise DataError(**batch["error"])
                yield batch
        # an abandoned pass (a training stream, an evaluation cut short) stops its workers now
        finally:
            _shutdown(it)
        dropped = self.skipped_total()
        if dropped:
            log.warning(
                "dropped %d samples in a pass over %s%s: %s",
                sum(dropped.values()),
                self.spec.urls[0],
                f" and {len(self.spec.urls) - 1} more shards" if len(self.spec.urls) > 1 else "",
                dropped,
            )

    def skipped_total(self) -> dict[str, int]:
        """Drop counts by reason, summed over the loader workers."""
        total: Counter[str] = Counter()
        for counts in self.skipped.values():
            total.update(counts)
        return dict(total)


def make_loader(spec: StreamSpec, num_workers: int, pin_memory: bool = False) -> Loader:
    """The batches of ``spec``'s stream, read by ``num_workers`` loader processes (0: this one),
    in page-locked memory when ``pin_memory`` (for a CUDA device: its copies then do not wait)."""
    return Loader(spec, num_workers, pin_memory)


# DataLoader iterators whose workers may still run. At interpreter exit multiprocessing
# terminates its daemon children and joins them; our workers ignore SIGTERM (below), so a pass
# still open then (its generator never closed) would make the join wait forever. The handler
# registered here runs first (atexit is last-in, first-out; multiprocessing registered its own
# at import) and asks those workers to stop, as DataLoader does when an iterator is deleted.
_live_iterators: weakref.WeakSet = weakref.WeakSet()


def _shutdown(it) -> None:
    # DataLoader's own clean stop (multi-process iterators)
    stop = getattr(it, "_shutdown_workers", None)
    if stop is not None:
        stop()


@atexit.register
def _shutdown_live_iterators() -> None:
    for it in list(_live_iterators):
        _shutdown(it)


def _ignore_sigterm(_worker_id: int) -> None:
    """SLURM and container runtimes send SIGTERM to every process of the job: the main process
    checkpoints and then shuts its loader down; a worker dying on the signal first would crash the
    step instead. (Workers still exit when the main process goes away.)"""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
