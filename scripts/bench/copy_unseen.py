"""Does the reader copy answers it never saw? Per answer position, on a synthetic task.

    python scripts/bench/copy_unseen.py [--steps 200] [--copy-supervision 1.0]
        [--copy-anonymize 0.25]

The task of tests/rag_mm/test_copy_unseen.py: each query asks for one of three facts, its one
document states all three (``<attr> : <v1> <v2> .``); training values come from one pool of token
ids, test values from a disjoint pool never seen in training. A tiny native reader trains on the
first and is read on both. Per answer position (first token, second token, end of text) the JSON
gives exact-match accuracy, the copy attention's mass on
the gold token and whether the pointer's argmax lands on it: where a copy fails (the pointer, the
span's continuation, the stop) is read off the test rows.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests" / "rag_mm"))
import test_copy_unseen as task  # noqa: E402  the task's data and reader, as the test builds them

from rag_mm.model.copy_head import CopyHead  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--steps", type=int, default=200, help="training steps of batch 32")
    ap.add_argument("--copy-supervision", type=float, default=1.0, help="model.copy_supervision")
    ap.add_argument("--copy-anonymize", type=float, default=0.25, help="model.copy_anonymize")
    a = ap.parse_args()
    torch.set_num_threads(1)
    seen: dict[str, torch.Tensor] = {}
    forward = CopyHead.forward

    def spy(
        self, h_rows, rows_ex, rows_pos, h_all, *rest, **kw
    ):  # keeps the attention and the gate
        logp, attn, aux = forward(self, h_rows, rows_ex, rows_pos, h_all, *rest, **kw)
        seen["attn"], seen["tok"] = attn, rest[0][rows_ex]
        return logp, attn, aux

    CopyHead.forward = spy
    reader = task.tiny_reader(copy_supervision=a.copy_supervision, copy_anonymize=a.copy_anonymize)
    t0 = time.perf_counter()
    task.train(reader, a.steps)
    res: dict = {
        "steps": a.steps,
        "copy_supervision": a.copy_supervision,
        "copy_anonymize": a.copy_anonymize,
        "train_s": round(time.perf_counter() - t0, 1),
    }
    for name, pool in (("train_pool", task.TRAIN_POOL), ("unseen_pool", task.TEST_POOL)):
        with torch.no_grad():
            out = reader(**task.make_batch(256, pool, torch.Generator().manual_seed(1)))
        ok = out.logits.argmax(-1) == out.labels
        first = torch.ones_like(out.example, dtype=torch.bool)
        first[1:] = out.example[1:] != out.example[:-1]
        idx = torch.cumsum(torch.ones_like(out.example), 0) - 1
        start = torch.cummax(torch.where(first, idx, torch.zeros_like(idx)), 0).values
        pos = idx - start  # 0: first answer token, 1: second, 2: end of text
        at = seen["tok"] == out.labels[:, None]
        mass = (seen["attn"] * at).sum(1)
        ptr = seen["tok"].gather(1, seen["attn"].argmax(1, keepdim=True)).squeeze(1) == out.labels
        rows = {}
        for j, what in enumerate(("first_token", "second_token", "end_of_text")):
            m = pos == j
            rows[what] = {
                "acc": round(ok[m].float().mean().item(), 3),
                "copy_mass_on_gold": round(mass[m].mean().item(), 3),
                "pointer_on_gold": round(ptr[m].float().mean().item(), 3),
            }
        res[name] = {
            "exact_match": round(out.correct.float().mean().item(), 3),
            "by_position": rows,
        }
    print(json.dumps(res))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
