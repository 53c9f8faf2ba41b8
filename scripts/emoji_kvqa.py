"""A knowledge-VQA set from public data: emoji as entities, in the shape of InfoSeek.

    npm pack emoji-datasource-google@16.0.0 emoji-datasource-apple@16.0.0 \\
             emoji-datasource-twitter@16.0.0 emoji-datasource-facebook@16.0.0
    for f in emoji-datasource-*.tgz; do d=${f%-16.0.0.tgz}; mkdir -p pkgs/$d; \\
        tar xzf $f -C pkgs/$d; done
    python scripts/emoji_kvqa.py --packages pkgs --out data/emoji_kvqa

The npm packages ``emoji-datasource-<vendor>`` carry each vendor's 64-px picture of every emoji
and, in ``emoji.json``, its name, short name, code point, category, subcategory and the Unicode
version it was added in. Nobody on the team made them; this script only reshapes them:

* the entities: emoji written as one code point (sequences such as flags and families, whose
  code is a list of code points, are left out);
* the memory: one document per emoji, the reference vendor's clean picture (``--memory-vendor``)
  and a passage stating its facts;
* the queries: another vendor's picture of the same emoji made photo-like (scaled, turned, on a
  textured background, blurred, JPEG-compressed), with a question about one fact;
* five kinds of question, three of them (name, short name, code point) with an answer that
  belongs to one emoji only, so a reader can answer them for an emoji it never saw in training
  only by copying from the retrieved passage;
* a quarter of the emoji (``--heldout-fraction``) never appear in training queries: only the
  memory knows them. Their queries carry ``heldout: true`` (the unseen-entity split).

``--entities flags`` makes the entities countries instead: each vendor's drawing of a country's
flag (the same packages' ``country-flag`` emoji) and, from the npm package ``world-countries``
(``--countries``: its ``countries.json``), the country's name, capital, three-letter code, calling
code, region and currency. Four of the five kinds of question (country, capital, code, calling
code) have an answer that belongs to one or a few countries; the vendors draw one flag design, so
what separates a query from its document is the photo and the vendor's way of waving a flag, not
another drawing of the thing.

    npm pack world-countries@5.1.0 && mkdir -p pkgs/world-countries && \
        tar xzf world-countries-5.1.0.tgz -C pkgs/world-countries
    python scripts/emoji_kvqa.py --packages pkgs --out data/flags_kvqa --entities flags \
        --countries pkgs/world-countries/package/countries.json --image-size 64

The layout is the knowledge world's (``rag_mm.data.knowledge_world``): ``corpus/``, ``train/``,
``val/``, ``test/`` webdataset shards, query json ``{answer, doc_id, attribute, heldout}`` with the
gold document, and ``world.json`` with the counts and the chance accuracy.
"""

from __future__ import annotations

import argparse
import io
import json
import random
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import webdataset as wds
from PIL import Image, ImageFilter

VENDORS = ("google", "apple", "twitter", "facebook")
# Categories of emoji that are pieces of other emoji (skin tones, hair styles), not things.
SKIP_CATEGORIES = {"Component"}
# The five kinds of question about an emoji, each with three phrasings, and the fact each one asks
# for.
EMOJI_QUESTIONS: dict[str, tuple[str, ...]] = {
    "name": (
        "what is this emoji called?",
        "what is the name of this emoji?",
        "which emoji is this?",
    ),
    "short_name": (
        "what is the short code of this emoji?",
        "which short name does this emoji have?",
        "what do you type to get this emoji?",
    ),
    "code": (
        "what is the code point of this emoji?",
        "which unicode code point is this emoji?",
        "what is the hex code of this emoji?",
    ),
    "category": (
        "which category is this emoji in?",
        "what is the category of this emoji?",
        "in which group of emoji is this one?",
    ),
    "version": (
        "in which unicode version was this emoji added?",
        "since which version does this emoji exist?",
        "when was this emoji added to unicode?",
    ),
}


# The five kinds of question about a country's flag.
FLAG_QUESTIONS: dict[str, tuple[str, ...]] = {
    "country": (
        "which country's flag is this?",
        "what country does this flag belong to?",
        "whose flag is this?",
    ),
    "capital": (
        "what is the capital of this country?",
        "which city is the capital of the country with this flag?",
        "where is the seat of government of this flag's country?",
    ),
    "code": (
        "what is the three letter code of this country?",
        "which abbreviation does this flag's country have?",
        "what is the iso code of this country?",
    ),
    "calling_code": (
        "what is the calling code of this country?",
        "which dialling code does the country with this flag use?",
        "what do you dial before a phone number in this country?",
    ),
    "region": (
        "in which region is this country?",
        "what part of the world is this flag from?",
        "which subregion does this country belong to?",
    ),
}


def facts(entry: dict) -> dict[str, str]:
    """The facts of one ``emoji.json`` entry, lower case (the reader's tokenizer lower-cases)."""
    return {
        "name": entry["name"].lower(),
        "short_name": entry["short_name"].replace("_", " ").lower(),
        "code": entry["unified"].lower(),
        "category": entry["category"].lower(),
        "subcategory": entry["subcategory"].replace("-", " ").lower(),
        "version": entry["added_in"],
    }


def passage(f: dict[str, str]) -> str:
    """The document text: every fact after its label, the labels told apart by their last two
    tokens (a fact's key in the copy head carries the two tokens before it)."""
    return (
        f"name: {f['name']}. short code: {f['short_name']}. code point: {f['code']}. "
        f"category: {f['category']}. group: {f['subcategory']}. unicode version: {f['version']}."
    )


def flag_facts(country: dict) -> dict[str, str]:
    """The facts of one ``world-countries`` entry, lower case. The calling code is the root and
    its one suffix (``+33``), or the root alone where a country has several (``+1``)."""
    idd = country["idd"]
    suffixes = idd.get("suffixes") or []
    currencies = country.get("currencies") or {}
    return {
        "country": country["name"]["common"].lower(),
        "capital": country["capital"][0].lower(),
        "code": country["cca3"].lower(),
        "calling_code": idd["root"] + (suffixes[0] if len(suffixes) == 1 else ""),
        "region": country["subregion"].lower(),
        "currency": ", ".join(c["name"] for c in currencies.values()).lower() or "none",
    }


def flag_passage(f: dict[str, str]) -> str:
    """A country's document text; as in ``passage``, no two labels end in the same two tokens."""
    return (
        f"country: {f['country']}. capital: {f['capital']}. abbreviation: {f['code']}. "
        f"calling code: {f['calling_code']}. region: {f['region']}. currency: {f['currency']}."
    )


def _flag_letters(unified: str) -> str:
    """``1F1EB-1F1F7`` -> ``FR``: a flag emoji is two regional indicator symbols, A = U+1F1E6."""
    return "".join(chr(ord("A") + int(cp, 16) - 0x1F1E6) for cp in unified.split("-"))


def _background(size: int, rng: random.Random) -> Image.Image:
    """A textured background: a colour gradient with blotches and grain, unlike any emoji."""
    nrng = np.random.default_rng(rng.randrange(2**32))
    a, b = nrng.uniform(0, 255, 3), nrng.uniform(0, 255, 3)
    t = (
        np.linspace(0, 1, size)[:, None, None]
        if rng.random() < 0.5
        else np.linspace(0, 1, size)[None, :, None]
    )
    img = a + (b - a) * t  # (size, 1 or size, 3) gradient
    img = np.broadcast_to(img, (size, size, 3)).copy()
    coarse = nrng.normal(0, 40, (4, 4, 3))  # low-frequency blotches
    img += np.kron(coarse, np.ones((size // 4 + 1, size // 4 + 1, 1)))[:size, :size]
    img += nrng.normal(0, 12, (size, size, 3))  # grain
    return Image.fromarray(np.clip(img, 0, 255).astype(np.uint8))


def photo_like(pic: Image.Image, size: int, rng: random.Random) -> Image.Image:
    """A photo-like view of an RGBA emoji: scale 0.55-0.95 of the frame, turned up to 25 degrees,
    off centre, over a textured background, blurred, then JPEG-compressed at quality 30-80."""
    pic = pic.convert("RGBA")
    side = max(8, int(size * rng.uniform(0.55, 0.95)))
    # turned within its own square (emoji keep a transparent margin, so little is cut)
    pic = pic.resize((side, side), Image.BICUBIC).rotate(rng.uniform(-25, 25), Image.BICUBIC)
    canvas = _background(size, rng).convert("RGBA")
    canvas.alpha_composite(pic, (rng.randint(0, size - side), rng.randint(0, size - side)))
    out = canvas.convert("RGB").filter(ImageFilter.GaussianBlur(rng.uniform(0.0, 1.0)))
    buf = io.BytesIO()
    out.save(buf, format="JPEG", quality=rng.randint(30, 80))
    return Image.open(io.BytesIO(buf.getvalue())).convert("RGB")


def clean(pic: Image.Image, size: int) -> Image.Image:
    """The memory's picture: the emoji on white, resized to ``size``."""
    pic = pic.convert("RGBA")
    canvas = Image.new("RGBA", pic.size, (255, 255, 255, 255))
    canvas.alpha_composite(pic)
    return canvas.convert("RGB").resize((size, size), Image.BICUBIC)


def _png(img: Image.Image) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def _package(root: Path, vendor: str) -> Path:
    """The unpacked ``emoji-datasource-<vendor>`` package under ``root`` (npm's or ``npm pack``'s
    layout)."""
    for cand in (
        root / f"emoji-datasource-{vendor}" / "package",
        root / f"emoji-datasource-{vendor}",
        root / "node_modules" / f"emoji-datasource-{vendor}",
        root / vendor / "package",
    ):
        if (cand / "emoji.json").is_file() and (cand / "img" / vendor / "64").is_dir():
            return cand
    raise FileNotFoundError(
        f"no unpacked emoji-datasource-{vendor} package (emoji.json and img/{vendor}/64/) "
        f"under {root}"
    )


def _has_pictures(e: dict, pkgs: dict[str, Path]) -> bool:
    return all(
        e.get(f"has_img_{v}") and (pkgs[v] / "img" / v / "64" / e["image"]).is_file()
        for v in VENDORS
    )


def _emoji_entities(entries: list[dict], pkgs: dict[str, Path]) -> list[tuple[dict, dict]]:
    """Every emoji written as one code point that each vendor draws, with its facts: a sequence's
    code (flags, ZWJ families) is a list of code points, too long an answer."""
    return [
        (e, facts(e))
        for e in entries
        if e["category"] not in SKIP_CATEGORIES
        and e.get("short_name")
        and "-" not in e["unified"]
        and _has_pictures(e, pkgs)
    ]


def _flag_entities(
    entries: list[dict], pkgs: dict[str, Path], countries: Path
) -> list[tuple[dict, dict]]:
    """Every country flag each vendor draws whose country ``countries.json`` gives a capital, a
    subregion and a calling code, with its facts. A flag drawn exactly like another one by any
    vendor (a territory under its country's flag: Saint Martin's is France's) is left out, the
    later by country code: no picture could tell the two apart."""
    try:
        by_code = {c["cca2"]: c for c in json.loads(countries.read_text())}
    except (ValueError, TypeError, KeyError) as exc:
        raise ValueError(
            f"{countries} is not world-countries' countries.json (a list of countries with cca2): "
            f"{type(exc).__name__}: {exc}"
        ) from exc
    flags = sorted(
        (
            (_flag_letters(e["unified"]), e)
            for e in entries
            if e.get("subcategory") == "country-flag" and _has_pictures(e, pkgs)
        ),
        key=lambda t: t[0],
    )
    seen: set[tuple[str, bytes]] = set()
    out = []
    for code, e in flags:
        c = by_code.get(code)
        if c is None or not c.get("capital") or not c.get("subregion") or not c["idd"].get("root"):
            continue
        drawn = {
            (v, Image.open(pkgs[v] / "img" / v / "64" / e["image"]).convert("RGBA").tobytes())
            for v in VENDORS
        }
        if drawn & seen:
            continue
        seen |= drawn
        out.append((e, flag_facts(c)))
    return out


def build(
    packages: Path,
    out: Path,
    num_entities: int | None,
    heldout_fraction: float,
    image_size: int,
    train_per_entity: int,
    val_per_entity: int,
    test_per_entity: int,
    memory_vendor: str,
    seed: int,
    shard_size: int,
    entities: str = "emoji",
    countries: Path | None = None,
) -> dict:
    """Write the set; return the summary also written to ``world.json``. ``num_entities`` None:
    every usable entity, at most 256."""
    pkgs = {v: _package(packages, v) for v in VENDORS}
    entries = json.loads((pkgs[memory_vendor] / "emoji.json").read_text())
    if entities == "flags":
        if countries is None:
            raise ValueError("--entities flags needs --countries (world-countries' countries.json)")
        usable = _flag_entities(entries, pkgs, countries)
        questions, write_passage, title = FLAG_QUESTIONS, flag_passage, "country"
    elif entities == "emoji":
        usable = _emoji_entities(entries, pkgs)
        questions, write_passage, title = EMOJI_QUESTIONS, passage, "name"
    else:
        raise ValueError(f"--entities must be emoji or flags, got {entities!r}")
    rng = random.Random(seed)
    usable.sort(key=lambda t: t[0]["unified"])
    rng.shuffle(usable)
    if num_entities is None:
        num_entities = min(256, len(usable))
    if num_entities > len(usable):
        raise ValueError(
            f"num_entities={num_entities} but only {len(usable)} {entities} have pictures from "
            "every vendor"
        )
    chosen = usable[:num_entities]  # (entry, facts) by doc_id
    n_heldout = int(round(heldout_fraction * num_entities))
    heldout = set(range(n_heldout))  # doc ids 0 .. n_heldout-1 after the shuffle: a random quarter
    query_vendors = [v for v in VENDORS if v != memory_vendor]

    def pic(entry: dict, vendor: str) -> Image.Image:
        return Image.open(pkgs[vendor] / "img" / vendor / "64" / entry["image"])

    out.mkdir(parents=True, exist_ok=True)
    counts: dict[str, int] = {}
    (out / "corpus").mkdir(exist_ok=True)
    with wds.ShardWriter(
        str(out / "corpus" / "corpus-%06d.tar"), maxcount=shard_size, verbose=0
    ) as sink:
        for doc_id, (e, f) in enumerate(chosen):
            sink.write(
                {
                    "__key__": f"doc{doc_id:06d}",
                    "png": _png(clean(pic(e, memory_vendor), image_size)),
                    "txt": write_passage(f),
                    "json": json.dumps({"doc_id": doc_id, "name": f[title]}),
                }
            )
    counts["corpus"] = len(chosen)
    answers: dict[str, Counter] = {k: Counter() for k in questions}
    for split, per_entity in (
        ("train", train_per_entity),
        ("val", val_per_entity),
        ("test", test_per_entity),
    ):
        srng = random.Random(f"{seed}-{split}")
        jobs = [
            d
            for d in range(len(chosen))
            if split != "train" or d not in heldout
            for _ in range(per_entity)
        ]
        srng.shuffle(jobs)
        (out / split).mkdir(exist_ok=True)
        with wds.ShardWriter(
            str(out / split / f"{split}-%06d.tar"), maxcount=shard_size, verbose=0
        ) as sink:
            for i, doc_id in enumerate(jobs):
                e, f = chosen[doc_id]
                kind = srng.choice(list(questions))
                answer = f[kind]
                if split == "train":
                    answers[kind][answer] += 1
                view = photo_like(pic(e, srng.choice(query_vendors)), image_size, srng)
                meta = {
                    "answer": answer,
                    "doc_id": doc_id,
                    "attribute": kind,
                    "heldout": doc_id in heldout,
                }
                sink.write(
                    {
                        "__key__": f"{split}{i:07d}",
                        "png": _png(view),
                        "txt": srng.choice(questions[kind]),
                        "json": json.dumps(meta),
                    }
                )
        counts[split] = len(jobs)
    # guessing each kind's most frequent training answer: the closed-book floor of a reader that
    # cannot tell emoji apart
    chance = sum(
        c.most_common(1)[0][1] / max(1, sum(c.values())) for c in answers.values() if c
    ) / len(questions)
    summary = {
        "source": {
            v: json.loads((pkgs[v] / "package.json").read_text()).get("version") for v in VENDORS
        }
        | ({"countries": str(countries)} if entities == "flags" else {}),
        "config": dict(
            entities=entities,
            num_entities=num_entities,
            heldout_fraction=heldout_fraction,
            image_size=image_size,
            memory_vendor=memory_vendor,
            query_vendors=query_vendors,
            seed=seed,
        ),
        "counts": counts,
        "heldout_doc_ids": sorted(heldout),
        "chance_accuracy": chance,
        "kinds": list(questions),
    }
    (out / "world.json").write_text(json.dumps(summary, indent=1))
    return summary


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--packages", type=Path, required=True, help="folder holding the unpacked npm packages"
    )
    ap.add_argument("--out", type=Path, required=True, help="output root (data.root)")
    ap.add_argument(
        "--entities",
        choices=("emoji", "flags"),
        default="emoji",
        help="the things the set is about: emoji (default) or countries by their flags",
    )
    ap.add_argument(
        "--countries",
        type=Path,
        help="world-countries' countries.json: the countries' facts (--entities flags)",
    )
    ap.add_argument(
        "--num-entities",
        type=int,
        help="entities in the memory (default: every usable one, at most 256)",
    )
    ap.add_argument(
        "--heldout-fraction", type=float, default=0.25, help="entities never in training queries"
    )
    ap.add_argument(
        "--image-size", type=int, default=48, help="pixels per side of every picture (default 48)"
    )
    ap.add_argument(
        "--train-per-entity", type=int, default=24, help="training queries per seen entity"
    )
    ap.add_argument("--val-per-entity", type=int, default=2, help="validation queries per entity")
    ap.add_argument("--test-per-entity", type=int, default=8, help="test queries per entity")
    ap.add_argument(
        "--memory-vendor", choices=VENDORS, default="google", help="whose pictures the memory holds"
    )
    ap.add_argument(
        "--seed", type=int, default=0, help="decides the entities, the split, views and questions"
    )
    ap.add_argument("--shard-size", type=int, default=1024, help="samples per shard")
    a = ap.parse_args(argv)
    try:
        if not 0.0 <= a.heldout_fraction < 1.0:
            raise ValueError(f"--heldout-fraction must be in [0, 1), got {a.heldout_fraction}")
        if min(a.num_entities or 1, a.image_size, a.shard_size) <= 0:
            raise ValueError("--num-entities, --image-size and --shard-size must be positive")
        s = build(
            a.packages,
            a.out,
            a.num_entities,
            a.heldout_fraction,
            a.image_size,
            a.train_per_entity,
            a.val_per_entity,
            a.test_per_entity,
            a.memory_vendor,
            a.seed,
            a.shard_size,
            a.entities,
            a.countries,
        )
    except (OSError, ValueError, KeyError) as exc:
        print(f"emoji_kvqa: error: {exc}", file=sys.stderr)
        return 2
    print(
        json.dumps(
            {"out": str(a.out), **s["counts"], "chance_accuracy": round(s["chance_accuracy"], 4)}
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
