"""What separates a trained retriever's queries from their documents? Each difference alone.

    python scripts/bench/query_gap.py runs/flags64_s1
    python scripts/bench/query_gap.py runs/flags64_s1 --packages PKGS   # + other vendors' drawings

A query about an unseen entity differs from the entity's memory picture in several ways at once
(pose and background, blur, JPEG compression, colours, another artist's drawing). Here each one is
applied alone to the memory's own pictures, and each result asked as a query (the picture alone,
no question text) of the run's newest valid checkpoint and its memory, as ``rag_mm.evaluate``
builds them. Printed: recall@1 of the picture's own document, for the documents no training query
names (``unseen``: the entities only the memory knows) and for the others (``seen``), averaged over
``--repeats`` seeded draws:

* ``clean``: the memory picture itself (the floor of the search, 1.0 for a tower that embeds a
  picture alike on both sides);
* ``photo``: the pseudo-queries' photo view (``retriever.augment.photo_views``: smaller, turned, on
  a textured ground, blurred);
* ``jpeg``, ``photo+jpeg``: saved as a JPEG at quality 30-80 (``random_jpeg``);
* ``tone0.5``, ``tone1.0``: a random tone curve per channel (``random_tone``), colours redrawn off;
* ``restyle``: RandConv (``random_restyle``), another stroke and texture;
* ``surface``, ``photo+surface``: on a waving, unevenly lit surface (``random_surface``).

``--packages DIR``, for a set written by ``scripts/emoji_kvqa.py`` (the memory holds Google's
drawings): each other vendor's drawing of the memory's entities, clean, on white, as the query:
the drawing-style difference alone. A memory row is matched to its emoji by the pixels of Google's
drawing. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import sys
import warnings
from collections import Counter
from pathlib import Path

import torch
from PIL import Image

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from emoji_kvqa import VENDORS, _package, clean  # noqa: E402

from rag_mm.build import make_stream  # noqa: E402
from rag_mm.components import checkpoint  # noqa: E402
from rag_mm.data.pipeline import MEAN, STD, image_to_tensor  # noqa: E402
from rag_mm.evaluate import EvalError, load_config, load_run  # noqa: E402
from retriever.augment import (  # noqa: E402
    VIEW_STYLES,
    photo_views,
    random_jpeg,
    random_restyle,
    random_surface,
    random_tone,
)

# a memory picture and Google's drawing rendered again match to rounding (normalised units)
SAME_PICTURE_MSE = 1e-3


def transforms(g: torch.Generator) -> dict:
    """name -> f(pictures (N, 3, H, W) normalised) -> views, each drawing from ``g``, called in
    order: ``photo+jpeg`` compresses the views ``photo`` drew (a paired comparison)."""
    jpeg = lambda x: random_jpeg(x, 1.0, MEAN, STD, g)  # noqa: E731
    photo: dict[str, torch.Tensor] = {}

    def photo_view(x: torch.Tensor) -> torch.Tensor:  # drawn once: photo+jpeg compresses them
        photo["views"] = photo_views(x, VIEW_STYLES["photo"], g)
        return photo["views"]

    return {
        "clean": lambda x: x,
        "photo": photo_view,
        "photo+jpeg": lambda x: jpeg(photo["views"]),
        "jpeg": jpeg,
        "tone0.5": lambda x: random_tone(x, 0.5, g),
        "tone1.0": lambda x: random_tone(x, 1.0, g),
        "restyle": lambda x: random_restyle(x, 1.0, g),
        "surface": lambda x: random_surface(x, 1.0, g),
        "photo+surface": lambda x: random_surface(photo["views"], 1.0, g),
    }


@torch.no_grad()
def top1(parts, pictures: torch.Tensor) -> torch.Tensor:
    """(N,) the first document id the run's search returns for each picture asked alone."""

    def embed(x: torch.Tensor) -> torch.Tensor:  # an empty question: the picture is the query
        n = len(x)
        return parts.retriever.embed_queries(
            x, torch.zeros(n, 1, dtype=torch.long), torch.zeros(n, dtype=torch.long)
        )

    q = torch.cat([embed(pictures[i : i + 256]) for i in range(0, len(pictures), 256)])
    return parts.memory.search(torch.nn.functional.normalize(q.float(), dim=-1), 1)[1][:, 0]


def split_recall(hit: torch.Tensor, unseen: torch.Tensor) -> dict:
    """Recall of the unseen and the seen documents; None (JSON null) for a side with none."""

    def mean(h: torch.Tensor) -> float | None:
        return round(h.float().mean().item(), 4) if len(h) else None

    return {"unseen": mean(hit[unseen]), "seen": mean(hit[~unseen])}


def vendor_pictures(packages: Path, store_images: torch.Tensor, size: int):
    """(memory rows (M,), {vendor: (M, 3, size, size)}) for every emoji whose Google drawing is a
    memory picture and which every vendor draws."""
    pkgs = {v: _package(packages, v) for v in VENDORS}
    entries = json.loads((pkgs["google"] / "emoji.json").read_text())
    flat = store_images.float().flatten(1)  # (N, 3 * size * size)
    rows, pics = [], {v: [] for v in VENDORS}
    draw = lambda f: image_to_tensor(clean(Image.open(f), size), size)  # noqa: E731
    for e in entries:
        files = {v: pkgs[v] / "img" / v / "64" / e["image"] for v in VENDORS}
        if not all(e.get(f"has_img_{v}") and files[v].is_file() for v in VENDORS):
            continue
        err = (flat - draw(files["google"]).flatten()).pow(2).mean(1)
        row = int(err.argmin())
        if err[row] > SAME_PICTURE_MSE:  # not in the memory: the other vendors are not drawn
            continue
        rows.append(row)
        for v in VENDORS:
            pics[v].append(draw(files[v]))
    # a memory picture two emoji share (a territory under its country's flag) names neither
    shared = Counter(rows)
    keep = [i for i, r in enumerate(rows) if shared[r] == 1]
    return torch.tensor([rows[i] for i in keep], dtype=torch.long), {
        v: torch.stack([p[i] for i in keep]) for v, p in pics.items()
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("run_dir", type=Path)
    ap.add_argument("--packages", type=Path, help="the unpacked emoji-datasource-* packages")
    ap.add_argument("--repeats", type=int, default=8, help="seeded draws of every random view")
    args = ap.parse_args(argv)
    warnings.filterwarnings("ignore")
    try:
        cfg = load_config(args.run_dir, [], queries=False)
    except EvalError as exc:
        print(f"query_gap: {exc}", file=sys.stderr)
        return 2
    ckpt = checkpoint.latest_valid(args.run_dir / "checkpoints")
    if ckpt is None or cfg.retriever.mode != "learned":
        print(
            f"query_gap: {args.run_dir} holds no checkpoint of a learned retriever", file=sys.stderr
        )
        return 2
    parts, step, _ = load_run(cfg, ckpt)
    try:
        parts.rag.eval()
        store = parts.store
        named = set()  # the documents training queries name
        for b in make_stream(cfg, "train", train=False):
            named.update(b["doc_id"].tolist())
        ids = store.ids.cpu()
        unseen = torch.tensor([int(i) not in named for i in ids])
        pictures = store.images.float().cpu()
        out = {
            "run": str(args.run_dir),
            "step": step,
            "documents": len(ids),
            "unseen_documents": int(unseen.sum()),
            "memory_views": {},
        }
        sums: dict[str, torch.Tensor] = {}
        for r in range(args.repeats):
            g = torch.Generator().manual_seed(r)
            for name, f in transforms(g).items():
                hit = (top1(parts, f(pictures)) == ids).float()
                sums[name] = sums.get(name, 0) + hit / args.repeats
        out["memory_views"] = {n: split_recall(h, unseen) for n, h in sums.items()}
        if args.packages:
            rows, pics = vendor_pictures(args.packages, store.images.cpu(), cfg.model.image_size)
            out["vendor_drawings"] = {"matched_documents": len(rows)}
            for v, p in pics.items():
                hit = top1(parts, p) == ids[rows]
                out["vendor_drawings"][v] = split_recall(hit, unseen[rows])
    finally:
        parts.memory.close()
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
