"""Where does the picture's signal die inside the reader? Measured on one question of a VQA split.

    # a trained run's newest checkpoint
    python scripts/bench/picture_signal.py runs/vqa split=val
    # the same config, freshly initialised
    python scripts/bench/picture_signal.py runs/vqa split=val --init
    # another reader, same data
    python scripts/bench/picture_signal.py runs/vqa --init model.patch_size=8

The question is ``--question``, else the split's most frequent question text whose answers take at
least three values (on easy-VQA: "what color is the shape?"), so its answer is decided by the
picture alone. For its queries (up to ``--queries``) it reports, as JSON:

* ``probe``: how well a linear read-out (ridge regression to the answer's one-hot, fit on 70% of the
  queries, scored on the rest) recovers the answer from each stage: the vision tower's patch tokens
  (mean and max over patches), the projected image tokens, and the answer position's hidden state
  before the first block and after each block. A stage where it falls to the majority answer's share
  is where the picture's signal dies.
* ``reader_acc``: the reader's own exact match on those queries, and ``majority``: the share of the
  most frequent answer (what answering from the question alone gets).
* ``image_attention``: per block, the attention mass of the answer position on the query picture's
  tokens, averaged over heads, against ``uniform_share`` (what attending evenly would give).
* ``grad_to_param``: on one batch of the split, the gradient norm over the parameter norm of each
  part of the reader (vision tower, projector, embeddings, blocks, head): a part whose ratio is
  orders of magnitude below the others learns little.

Native readers only (``model.family=native``): the probes hook its blocks.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections import Counter
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from rag_mm.build import batch_inputs, build_rag, make_stream  # noqa: E402
from rag_mm.components import checkpoint  # noqa: E402
from rag_mm.components.metrics import strict_dumps  # noqa: E402  (null, never NaN, in the report)
from rag_mm.evaluate import load_config, load_model_state  # noqa: E402
from rag_mm.model.layout import IGNORE, QUERY_IMAGE  # noqa: E402

TRAIN_SHARE = 0.7  # queries the probe is fitted on; the rest score it
# ridge penalty per feature over 100 queries: enough to keep 256-wide probes from interpolating
RIDGE = 1.0


def probe(x: torch.Tensor, y: torch.Tensor) -> float:
    """Held-out accuracy of a ridge read-out of ``y`` (N,) from features ``x`` (N, F)."""
    x = x.reshape(len(y), -1).double()
    n = int(TRAIN_SHARE * len(y))
    mu, sd = x[:n].mean(0), x[:n].std(0) + 1e-6
    x = (x - mu) / sd
    onehot = torch.nn.functional.one_hot(y, int(y.max()) + 1).double()
    lam = RIDGE * x.shape[1] * n / 100
    w = torch.linalg.solve(
        x[:n].T @ x[:n] + lam * torch.eye(x.shape[1], dtype=torch.double), x[:n].T @ onehot[:n]
    )
    return float(((x[n:] @ w).argmax(1) == y[n:]).double().mean())


def pick_question(
    cfg, split: str, limit: int, question: str | None = None
) -> tuple[str, list[dict]]:
    """``question``, or else the most frequent question text with at least three distinct answers,
    and its queries (up to ``limit``)."""
    by_text: dict[str, list[dict]] = {}
    for batch in make_stream(cfg, split, train=False):
        for i, q in enumerate(batch["question"]):
            by_text.setdefault(q, []).append(
                {k: batch[k][i] for k in ("image", "q_ids", "q_len", "a_ids", "a_len")}
                | {"answer": batch["answer"][i]}
            )
    texts = [
        t
        for t, qs in by_text.items()
        if len({q["answer"] for q in qs}) >= 3 and question in (None, t)
    ]
    if not texts:
        sys.exit(
            f"picture_signal: no question {'' if question is None else repr(question) + ' '}in "
            "the split has three or more distinct answers"
        )
    text = max(texts, key=lambda t: len(by_text[t]))
    return text, by_text[text][:limit]


def stack(queries: list[dict]) -> dict:
    """Queries of one question text -> a batch (their token rows have equal lengths up to
    padding)."""
    out = {
        "image": torch.stack([q["image"] for q in queries]),
        "q_len": torch.stack([q["q_len"] for q in queries]),
        "a_len": torch.stack([q["a_len"] for q in queries]),
    }
    for key, n in (
        ("q_ids", "q_len"),
        ("a_ids", "a_len"),
    ):  # batches pad to their own longest: re-pad
        width = int(out[n].max())
        out[key] = torch.stack(
            [
                torch.nn.functional.pad(q[key], (0, max(width - len(q[key]), 0)))[:width]
                for q in queries
            ]
        )
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "run",
        type=Path,
        help="run directory (its saved config; its newest checkpoint unless --init)",
    )
    p.add_argument(
        "overrides", nargs="*", help="split=val (default) and config overrides key=value"
    )
    p.add_argument(
        "--init", action="store_true", help="measure the freshly initialised reader instead"
    )
    p.add_argument(
        "--queries",
        type=int,
        default=600,
        help="queries of the chosen question measured (default 600)",
    )
    p.add_argument(
        "--question",
        help="the question text to measure (default: the most frequent with 3+ answers)",
    )
    args = p.parse_intermixed_args(argv)
    split = next((o.split("=", 1)[1] for o in args.overrides if o.startswith("split=")), "val")
    overrides = [o for o in args.overrides if not o.startswith("split=")]
    torch.manual_seed(0)
    cfg = load_config(args.run, overrides)
    if cfg.model.family != "native":
        sys.exit("picture_signal: native readers only (model.family=native)")
    parts = build_rag(cfg, torch.device("cpu"))
    reader = parts.reader
    step = 0
    if not args.init:
        ckpt = checkpoint.latest_valid(args.run / "checkpoints")
        if ckpt is None:
            sys.exit(
                f"picture_signal: no valid checkpoint in {args.run / 'checkpoints'} (or pass "
                "--init)"
            )
        step = load_model_state(parts.rag, ckpt)["step"]
    reader.eval()

    text, queries = pick_question(cfg, split, args.queries, args.question)
    names = sorted({q["answer"] for q in queries})
    y = torch.tensor([names.index(q["answer"]) for q in queries])
    x = stack(queries)
    res: dict = {
        "run": str(args.run),
        "step": step,
        "split": split,
        "question": text,
        "queries": len(queries),
        "answers": len(names),
        "majority": Counter(y.tolist()).most_common(1)[0][1] / len(y),
        "model": {
            k: cfg.model[k] for k in ("image_size", "patch_size", "dim", "layers", "vision_layers")
        },
    }

    attn: list[
        torch.Tensor
    ] = []  # per block: (B, H, S, S) attention probabilities (dense causal over the query)

    def keep_attention(mod, inputs, _out):
        h = inputs[0]
        # 3 x (B, H, S, hd)
        q, k, _ = mod.qkv(h).unflatten(-1, (3, mod.heads, -1)).permute(2, 0, 3, 1, 4)
        s = (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
        causal = torch.ones(
            s.shape[-1], s.shape[-1], dtype=torch.bool
        ).tril()  # no documents: one causal segment
        attn.append(s.masked_fill(~causal, float("-inf")).softmax(-1))

    with torch.no_grad():
        _, tokens = reader.vision(x["image"])  # (B, P, Wv)
        projected = reader.encode_images(x["image"])  # (B, P, D)
        a = reader.assemble(**x)
        anchor = (a.labels != IGNORE).int().argmax(1)  # (B,) first answer-predicting position
        rows = torch.arange(len(y))
        h = a.x + reader.pos_emb(a.pos) + reader.type_emb(a.typ.clamp_min(0))  # (B, S, D)
        probes = {
            "vision_tokens": probe(torch.cat([tokens.mean(1), tokens.amax(1)], -1), y),
            "image_tokens": probe(torch.cat([projected.mean(1), projected.amax(1)], -1), y),
            "answer_position_input": probe(h[rows, anchor], y),
        }
        hooks = [b.attn.register_forward_hook(keep_attention) for b in reader.blocks]
        for i, block in enumerate(reader.blocks):
            h = block(h, a.seg_offsets)
            probes[f"answer_position_block{i + 1}"] = probe(h[rows, anchor], y)
        for hook in hooks:
            hook.remove()
        res["probe"] = probes
        res["reader_acc"] = float(reader(**x).correct.double().mean())
        image = (a.typ == QUERY_IMAGE)[rows]  # (B, S)
        res["uniform_share"] = float((image.sum(1) / (anchor + 1)).mean())
        res["image_attention"] = [
            float((p[rows, :, anchor] * image[:, None]).sum(-1).mean()) for p in attn
        ]

    reader.train()
    batch = next(iter(make_stream(cfg, split, train=False)))
    inputs = batch_inputs(batch, "cpu")
    inputs.pop("gold")
    reader(**inputs).loss.backward()
    sums: dict[str, list[float]] = {}
    for name, prm in reader.named_parameters():
        if prm.grad is not None:
            s = sums.setdefault(name.split(".")[0], [0.0, 0.0])
            s[0] += float(prm.grad.pow(2).sum())
            s[1] += float(prm.detach().pow(2).sum())
    res["grad_to_param"] = {
        part: float(f"{math.sqrt(g) / max(math.sqrt(w), 1e-12):.3g}")
        for part, (g, w) in sums.items()
    }
    print(strict_dumps(res))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
