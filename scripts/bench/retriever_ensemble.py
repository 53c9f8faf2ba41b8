"""How much do several independently trained retriever towers find together that each misses?

Reads the score files that ``retriever_unseen.py --save-scores`` writes (each run's cosines of
every val query against the memory) and ranks the memory by their mean: the score of one index
whose rows are the towers' unit embeddings side by side, scaled by 1/sqrt(K). Prints one JSON line
per run and one for every subset of two or more runs, each for the plain query and, where the runs
saved it, the test-time-augmented one.

    python scripts/bench/retriever_ensemble.py RUN0.pt RUN1.pt RUN2.pt
"""

from __future__ import annotations

import argparse
import itertools
import json
from pathlib import Path

import torch


def recall(cos: torch.Tensor, gold: torch.Tensor, unseen: torch.Tensor) -> dict[str, float]:
    """Recall@1 and @5 of the cosines ``cos`` (Q, N_docs) against the gold rows ``gold`` (Q,),
    over the unseen entities' queries (``unseen`` (Q,) bool) and the seen ones'."""
    hits = cos.topk(5, 1).indices == gold[:, None]  # (Q, 5)
    r1, r5 = hits[:, :1].any(1).float(), hits.any(1).float()
    return {
        "recall@1_unseen": round(r1[unseen].mean().item(), 4),
        "recall@5_unseen": round(r5[unseen].mean().item(), 4),
        "recall@1_seen": round(r1[~unseen].mean().item(), 4),
        "recall@5_seen": round(r5[~unseen].mean().item(), 4),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("scores", type=Path, nargs="+", help="retriever_unseen.py --save-scores files")
    a = ap.parse_args()
    runs = []
    for path in a.scores:
        try:
            runs.append(torch.load(path, weights_only=True))
        except (OSError, RuntimeError) as exc:
            raise SystemExit(f"retriever_ensemble: cannot read {path}: {exc}") from None
    gold, unseen = runs[0]["gold"], runs[0]["unseen"]
    for path, run in zip(a.scores, runs, strict=True):
        if not (torch.equal(run["gold"], gold) and torch.equal(run["unseen"], unseen)):
            raise SystemExit(f"retriever_ensemble: {path} scores other queries than {a.scores[0]}")
    for k in range(1, len(runs) + 1):
        for subset in itertools.combinations(range(len(runs)), k):
            names = [a.scores[i].name for i in subset]
            # each query as itself, and (where every run saved it) test-time augmented
            for key in ("cos", "cos_tta"):
                if all(key in runs[i] for i in subset):
                    cos = torch.stack([runs[i][key] for i in subset]).mean(0)  # (Q, N_docs)
                    rec = {"towers": names, "query": "tta" if key == "cos_tta" else "plain"}
                    print(json.dumps(rec | recall(cos, gold, unseen)))


if __name__ == "__main__":
    main()
