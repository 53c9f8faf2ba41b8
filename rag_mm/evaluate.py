"""Evaluation: exact-match answer accuracy and answer NLL, for seen and held-out entities.

    python -m rag_mm.evaluate runs/demo            # the newest valid checkpoint of a run, test split

Exact match is computed in one teacher-forced pass: greedy decoding reproduces the gold answer
exactly when every gold token (EOT included) is the argmax given the gold prefix.
"""

from __future__ import annotations

import base64
import io
import json
import sys
from pathlib import Path

import torch

from rag_mm.distributed import all_reduce_sum

RECALL_AT = (1, 5, 10)  # recall@k reported for the gold document


@torch.no_grad()
def evaluate(rag, loader, device, max_batches: int = 0, examples_path: Path | None = None,
             n_examples: int = 0, tokenizer=None, replicas: int = 1) -> dict:
    """Run the RagModel over ``loader``: answer accuracy and NLL, and recall@k when it retrieves.

    Every rank evaluates its share of the split; the sums are all-reduced (and divided by
    ``replicas``, the ranks that see each batch: the stages of a pipeline). ``examples_path``
    (main rank only) receives a few queries with their retrieved documents for inspection.
    """
    was_training = rag.training
    rag.eval()
    learned = rag.rcfg.mode == "learned"
    # per group (seen, held-out): n, correct, nll, then recall hits for each k in RECALL_AT
    width = 3 + len(RECALL_AT)
    acc = torch.zeros(2 * width, dtype=torch.float64)
    examples: list[dict] = []
    for i, batch in enumerate(loader):
        if max_batches and i >= max_batches:
            break
        out = rag(**_inputs(batch, device), retriever_loss=False, search_k=max(RECALL_AT) if learned else 0)
        held = batch["heldout"]
        correct, nll = out.reader.correct.cpu(), out.reader.nll.cpu()
        hits = []
        if learned:
            gold = batch["doc_id"][:, None]
            hits = [(out.doc_ids[:, :k] == gold).any(1) for k in RECALL_AT]
        for j, mask in enumerate((~held, held)):
            base = j * width
            acc[base] += float(mask.sum())
            acc[base + 1] += float((correct & mask).sum())
            acc[base + 2] += float((nll * mask).sum())
            for h, hit in enumerate(hits):
                acc[base + 3 + h] += float((hit & mask).sum())
        if examples_path is not None and len(examples) < n_examples:
            examples += _examples(rag, batch, out, device, tokenizer, n_examples - len(examples))
    acc = all_reduce_sum(acc) / replicas
    rag.train(was_training)
    seen, held = acc[:width].tolist(), acc[width:].tolist()
    n = seen[0] + held[0]
    res = {
        "n": int(n),
        "acc": (seen[1] + held[1]) / max(n, 1),
        "acc_seen": seen[1] / seen[0] if seen[0] else float("nan"),
        "acc_heldout": held[1] / held[0] if held[0] else float("nan"),
        "nll": (seen[2] + held[2]) / max(n, 1),
        "n_seen": int(seen[0]),
        "n_heldout": int(held[0]),
    }
    if learned:
        for h, k in enumerate(RECALL_AT):
            res[f"recall@{k}"] = (seen[3 + h] + held[3 + h]) / max(n, 1)
            res[f"recall@{k}_heldout"] = held[3 + h] / held[0] if held[0] else float("nan")
    if examples_path is not None and examples:
        examples_path.parent.mkdir(parents=True, exist_ok=True)
        examples_path.write_text(json.dumps(examples, indent=1))
    return res


def _png_b64(img: torch.Tensor) -> str:
    """Normalised (3, H, W) picture -> base64 PNG (for the notebooks' gallery)."""
    from PIL import Image

    from rag_mm.data.pipeline import MEAN, STD

    x = ((img.cpu() * STD + MEAN).clamp(0, 1) * 255).round().byte().permute(1, 2, 0).numpy()
    buf = io.BytesIO()
    Image.fromarray(x).save(buf, format="PNG")
    return base64.b64encode(buf.getvalue()).decode()


def _examples(rag, batch, out, device, tokenizer, n: int) -> list[dict]:
    """A few queries with what the reader answered and which documents it was given."""
    n = min(n, len(batch["key"]))
    if n <= 0 or out.doc_ids is None:
        return []
    k = rag.rcfg.top_k
    ids = out.doc_ids[:n, :k]
    docs = {name: t.to(device) for name, t in rag.store.fetch(ids).items()}
    x = _inputs(batch, device)
    prior = None
    if rag.rcfg.reader_prior and out.scores is not None:  # as the evaluated forward read them
        prior = torch.log_softmax(out.scores[:n].to(device), -1)
    pred = rag.reader.generate(x["image"][:n], x["q_ids"][:n], x["q_len"][:n], docs["doc_image"], docs["doc_ids"],
                               docs["doc_len"], eot_id=tokenizer.eot_id, doc_prior=prior)
    rows = rag.store.rows(ids)
    res = []
    for i in range(n):
        res.append({
            "key": batch["key"][i], "question": batch["question"][i], "answer": batch["answer"][i],
            "prediction": tokenizer.decode(pred[i]), "heldout": bool(batch["heldout"][i]),
            "gold_doc_id": int(batch["doc_id"][i]), "query_image": _png_b64(batch["image"][i]),
            "retrieved": [{"doc_id": int(ids[i, j]), "passage": rag.store.passages[int(rows[i, j])],
                           "image": _png_b64(rag.store.images[int(rows[i, j])])} for j in range(ids.shape[1])],
        })
    return res


def _inputs(batch: dict, device) -> dict:
    x = {k: batch[k].to(device, non_blocking=True) for k in ("image", "q_ids", "q_len", "a_ids", "a_len")}
    x["gold"] = batch["doc_id"].to(device, non_blocking=True)
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
