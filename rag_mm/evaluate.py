"""Evaluation: exact-match answer accuracy and answer NLL, for seen and held-out entities.

    python -m rag_mm.evaluate runs/demo            # the newest valid checkpoint of a run, test split

Exact match is computed in one teacher-forced pass: greedy decoding reproduces the gold answer
exactly when every gold token (EOT included) is the argmax given the gold prefix.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from rag_mm.distributed import all_reduce_sum


@torch.no_grad()
def evaluate(model, loader, fetch_docs, device, max_batches: int = 0) -> dict:
    """Run ``model`` over ``loader``; ``fetch_docs(batch)`` returns the documents for a batch."""
    was_training = model.training
    model.eval()
    # [n_seen, correct_seen, nll_seen, n_heldout, correct_heldout, nll_heldout]
    acc = torch.zeros(6, dtype=torch.float64)
    for i, batch in enumerate(loader):
        if max_batches and i >= max_batches:
            break
        docs = fetch_docs(batch)
        out = model(**_inputs(batch, docs, device))
        held = batch["heldout"].to(device)
        for j, mask in enumerate((~held, held)):
            acc[3 * j] += float(mask.sum())
            acc[3 * j + 1] += float((out.correct & mask).sum())
            acc[3 * j + 2] += float((out.nll * mask).sum())
    acc = all_reduce_sum(acc)
    model.train(was_training)
    n_s, c_s, l_s, n_h, c_h, l_h = acc.tolist()
    n = n_s + n_h
    return {
        "n": int(n),
        "acc": (c_s + c_h) / max(n, 1),
        "acc_seen": c_s / n_s if n_s else float("nan"),
        "acc_heldout": c_h / n_h if n_h else float("nan"),
        "nll": (l_s + l_h) / max(n, 1),
        "n_seen": int(n_s),
        "n_heldout": int(n_h),
    }


def _inputs(batch: dict, docs: dict | None, device) -> dict:
    x = {k: batch[k].to(device, non_blocking=True) for k in ("image", "q_ids", "q_len", "a_ids", "a_len")}
    if docs:
        x.update({k: v.to(device, non_blocking=True) for k, v in docs.items()})
    return x


def main(argv: list[str] | None = None) -> int:
    """Evaluate a finished or running run directory with its saved config."""
    argv = sys.argv[1:] if argv is None else argv
    if not argv:
        print("usage: python -m rag_mm.evaluate RUN_DIR [split=test] [key=value ...]", file=sys.stderr)
        return 2
    from omegaconf import OmegaConf

    from rag_mm.trainer import Trainer

    run_dir = Path(argv[0])
    cfg_path = run_dir / ".hydra" / "config.yaml"
    if not cfg_path.is_file():
        print(f"evaluate: error: {cfg_path} not found (is {run_dir} a run directory?)", file=sys.stderr)
        return 2
    overrides = [a for a in argv[1:] if not a.startswith("split=")]
    split = next((a.split("=", 1)[1] for a in argv[1:] if a.startswith("split=")), "test")
    cfg = OmegaConf.merge(OmegaConf.load(cfg_path), OmegaConf.from_dotlist(overrides))
    cfg.resume = "auto"
    trainer = Trainer(cfg, log_metrics=False)
    try:
        trainer.restore()
        metrics = trainer.evaluate_split(split)
    finally:
        trainer.close()
    print(json.dumps({"split": split, "step": trainer.step, **metrics}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
