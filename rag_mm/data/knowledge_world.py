"""Write the knowledge-world demo data as webdataset tar shards.

    python -m rag_mm.data.knowledge_world out=data/knowledge_world [num_entities=256 seed=0 ...]

Layout under ``out``::

    corpus/corpus-000000.tar ...   one document per entity: png (canonical picture), txt (passage),
                                   json
    train/train-000000.tar ...     queries about seen entities only
    val/, test/                    queries about seen and held-out entities
    world.json                     the config, sample counts and chance accuracy

Query samples: png (a new rendering), txt (the question), json {answer, doc_id, attribute,
heldout}; ``attribute`` is one of the four facts or ``name`` (the creature's own name, never a
training answer for a held-out creature). The same keys a user's own shards need (``jpg`` is
accepted in place of ``png``).
"""

from __future__ import annotations

import io
import json
import random
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import webdataset as wds
from omegaconf import OmegaConf

from rag_mm.data.render import render
from rag_mm.data.world import (
    ATTRIBUTES,
    KINDS,
    QUESTIONS,
    Entity,
    answer,
    chance_accuracy,
    make_entities,
)


@dataclass
class WorldConfig:
    """Sizes and seed of the generated world; the defaults are what `make demo` uses."""

    out: str = "data/knowledge_world"  # output directory (created)
    seed: int = 0  # one seed decides entities, facts, renderings and splits
    num_entities: int = 256  # documents in the memory
    heldout_fraction: float = 0.25  # entities never asked about in training queries
    train_queries_per_entity: int = 32  # enough to see each (entity, attribute) pair several times
    val_queries_per_entity: int = 2  # small: periodic evaluation must be cheap
    test_queries_per_entity: int = 4  # final evaluation, over seen and held-out entities
    # also ask for each creature's name (multi-token, never a training answer for a held-out
    # creature, so only a reader that copies it from the retrieved passage gets it right)
    name_questions: bool = True
    image_size: int = 32  # pixels per side; 4x4 patches of 8 px for the default towers
    shard_size: int = 1024  # samples per tar shard; several shards let ranks and workers split


def _png(img) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def _query(
    entity: Entity, heldout: bool, rng: random.Random, size: int, key: str, kinds=KINDS
) -> dict:
    attribute = rng.choice(kinds)
    question = rng.choice(QUESTIONS[attribute])
    meta = {
        "answer": answer(entity, attribute),
        "doc_id": entity.doc_id,
        "attribute": attribute,
        "heldout": heldout,
    }
    return {
        "__key__": key,
        "png": _png(render(entity, size, rng)),
        "txt": question,
        "json": json.dumps(meta),
    }


def _write(samples, pattern: str, shard_size: int) -> int:
    n = 0
    with wds.ShardWriter(pattern, maxcount=shard_size, verbose=0) as sink:
        for s in samples:
            sink.write(s)
            n += 1
    return n


def generate(cfg: WorldConfig) -> dict:
    """Generate every split; return the summary also written to ``world.json``."""
    for name, value in (
        ("num_entities", cfg.num_entities),
        ("image_size", cfg.image_size),
        ("shard_size", cfg.shard_size),
    ):
        if value <= 0:
            raise ValueError(f"{name} must be positive, got {value}")
    if not 0.0 <= cfg.heldout_fraction < 1.0:
        raise ValueError(f"heldout_fraction must be in [0, 1), got {cfg.heldout_fraction}")
    out = Path(cfg.out)
    entities = make_entities(cfg.num_entities, cfg.seed)
    rng = random.Random(cfg.seed + 1)
    order = list(range(cfg.num_entities))
    rng.shuffle(order)
    n_heldout = int(round(cfg.heldout_fraction * cfg.num_entities))
    heldout = set(order[:n_heldout])

    counts = {}
    (out / "corpus").mkdir(parents=True, exist_ok=True)
    corpus = (
        {
            "__key__": f"doc{e.doc_id:06d}",
            "png": _png(render(e, cfg.image_size)),
            "txt": e.passage(),
            "json": json.dumps({"doc_id": e.doc_id, "name": e.name}),
        }
        for e in entities
    )
    counts["corpus"] = _write(corpus, str(out / "corpus" / "corpus-%06d.tar"), cfg.shard_size)

    splits = {
        "train": ([e for e in entities if e.doc_id not in heldout], cfg.train_queries_per_entity),
        "val": (entities, cfg.val_queries_per_entity),
        "test": (entities, cfg.test_queries_per_entity),
    }
    for split, (pool, per_entity) in splits.items():
        split_rng = random.Random(f"{cfg.seed}-{split}")
        jobs = [e for e in pool for _ in range(per_entity)]
        split_rng.shuffle(jobs)  # shards hold a mix of entities, so sequential reads are not sorted
        (out / split).mkdir(parents=True, exist_ok=True)
        samples = (
            _query(
                e,
                e.doc_id in heldout,
                split_rng,
                cfg.image_size,
                f"{split}{i:07d}",
                KINDS if cfg.name_questions else tuple(ATTRIBUTES),
            )
            for i, e in enumerate(jobs)
        )
        counts[split] = _write(samples, str(out / split / f"{split}-%06d.tar"), cfg.shard_size)

    summary = {
        "config": asdict(cfg),
        "counts": counts,
        "heldout_doc_ids": sorted(heldout),
        "chance_accuracy": chance_accuracy(cfg.name_questions),
        "attributes": {k: list(v) for k, v in ATTRIBUTES.items()},
    }
    (out / "world.json").write_text(json.dumps(summary, indent=1))
    return summary


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        cfg = OmegaConf.merge(OmegaConf.structured(WorldConfig), OmegaConf.from_dotlist(argv))
        cfg = WorldConfig(**OmegaConf.to_container(cfg))  # type: ignore[arg-type]
        summary = generate(cfg)
    except Exception as exc:  # config errors: one clear line, no traceback
        print(f"knowledge_world: error: {exc}", file=sys.stderr)
        return 2
    print(
        json.dumps(
            {"out": cfg.out, **summary["counts"], "chance_accuracy": summary["chance_accuracy"]}
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
