"""How mixed are the training batches? Distinct answers per batch of the training stream at several
``data.shard_interleave`` values, against batches drawn from a full random permutation of the split.

    python scripts/bench/stream_mix.py data/fashion_sorted "train/train-{000000..000020}.tar"
    python scripts/bench/stream_mix.py DATA "train/train-{000000..000005}.tar" --interleave 1 4 16

Shards written in label order (one class each) give batches of few answers when read one after
another; the interleave draws each next sample from one of several open shards. The stream is the
one ``rag_mm.train`` reads (``rag_mm.data.pipeline.QueryStream``, one rank, no loader worker,
``--shuffle-buffer`` as ``data.shuffle_buffer``). Counted per batch: distinct answers other than
yes / no (on a picture-class set, the classes the batch asks for). Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tarfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from rag_mm.data.pipeline import StreamSpec, make_loader  # noqa: E402
from rag_mm.data.urls import expand_urls  # noqa: E402

YES_NO = {"yes", "no"}


def _distinct(answers: list[str]) -> int:
    return len({a for a in answers if a not in YES_NO})


def _summary(counts: list[int]) -> dict:
    return {"mean": round(statistics.mean(counts), 3), "min": min(counts), "max": max(counts)}


def _split_answers(urls: list[str]) -> list[str]:
    """Every sample's answer, read from the shards' json members (no picture decoded)."""
    out = []
    for url in urls:
        with tarfile.open(url) as tar:
            for member in tar:
                if member.name.endswith(".json"):
                    out.append(str(json.load(tar.extractfile(member))["answer"]))
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("root", help="data root (data.root)")
    ap.add_argument("pattern", help="training shards under it, brace-expanded (data.train)")
    ap.add_argument("--interleave", type=int, nargs="+", default=[1, 4, 8, 16])
    ap.add_argument("--batches", type=int, default=300, help="batches read per setting")
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--shuffle-buffer", type=int, default=1000)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    urls = expand_urls(a.root, a.pattern)
    answers = _split_answers(urls)
    rng = random.Random(a.seed)
    permuted = [_distinct(rng.sample(answers, a.batch_size)) for _ in range(a.batches)]
    result = {
        "shards": len(urls),
        "samples": len(answers),
        "batch_size": a.batch_size,
        "batches": a.batches,
        "shuffle_buffer": a.shuffle_buffer,
        "distinct_answers_per_batch": {"full_permutation": _summary(permuted)},
    }
    for k in a.interleave:
        spec = StreamSpec(
            urls=urls,
            image_size=8,  # the pictures are decoded but not looked at
            max_question=24,
            max_answer=8,
            batch_size=a.batch_size,
            seed=a.seed,
            shuffle_buffer=a.shuffle_buffer,
            shard_interleave=k,
        )
        it = iter(make_loader(spec, 0))
        counts = [_distinct(next(it)["answer"]) for _ in range(a.batches)]
        result["distinct_answers_per_batch"][f"interleave_{k}"] = _summary(counts)
    print(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
