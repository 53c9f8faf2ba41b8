"""The reader learns from the picture: on a task only the picture can answer, the readers of the
``+experiment=vqa`` recipe (native and ``hf_tiny``) learn it within a few dozen steps, and lose it
when the picture is blanked.

The task is easy-VQA in miniature: a white picture with one coloured square somewhere in it, and
the question "what color is the shape?". The question is always the same, so the blind prior is
one colour (accuracy 1/4); anything above it comes from the picture. If the picture stops reaching
the transformer (blanked patch tokens, a detached projector, a mask that hides the query's patches)
accuracy stays at the prior and the test fails.
"""

from __future__ import annotations

import pytest
import torch

from rag_mm.build import build_rag
from rag_mm.config import compose
from rag_mm.data.pipeline import MEAN, STD
from rag_mm.data.tokenizer import get_tokenizer

COLOURS = {
    "red": (1.0, 0.0, 0.0),
    "green": (0.0, 0.6, 0.0),
    "blue": (0.0, 0.0, 1.0),
    "yellow": (1.0, 0.9, 0.0),
}
SIZE = 32  # the recipe's picture size
STEPS = 60  # optimizer steps of batch 32: the native reader passes 0.9 from about step 40
BATCH = 32


def pictures(colours: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    """(B,) colour indices -> (B, 3, SIZE, SIZE) normalised pictures: white, with a square of side
    8..14 px of that colour at a random place (it never fills a patch-aligned cell exactly)."""
    rgb = torch.tensor(list(COLOURS.values()))  # (4, 3)
    img = torch.ones(len(colours), 3, SIZE, SIZE)
    for i, c in enumerate(colours.tolist()):
        side = int(torch.randint(8, 15, (1,), generator=g))
        y, x = (int(v) for v in torch.randint(0, SIZE - side + 1, (2,), generator=g))
        img[i, :, y : y + side, x : x + side] = rgb[c][:, None, None]
    return (img - MEAN) / STD


def task_batch(tok, g: torch.Generator, B: int = BATCH) -> tuple[dict, torch.Tensor]:
    colours = torch.randint(0, len(COLOURS), (B,), generator=g)
    q = tok.encode("what color is the shape?")
    answers = [tok.encode(name)[:1] + [tok.eot_id] for name in COLOURS]  # one token + EOT each
    return {
        "image": pictures(colours, g),
        "q_ids": torch.tensor([q] * B),
        "q_len": torch.full((B,), len(q)),
        "a_ids": torch.tensor([answers[c] for c in colours.tolist()]),
        "a_len": torch.full((B,), 2),
    }, colours


@pytest.mark.parametrize(
    "model",
    [
        # the default run reads pictures through the native recipe against a pixel classifier
        # (test_reader_vs_pixels.py)
        pytest.param("native", marks=pytest.mark.slow),
        "hf_tiny",
    ],
)
def test_recipe_reader_learns_from_the_picture(model, tmp_path):
    extra = ["model=hf_tiny"] if model == "hf_tiny" else []
    cfg = compose(
        [
            "+experiment=vqa",
            f"data.root={tmp_path}",
            f"run_dir={tmp_path}/run",
            "model.attention_backend=reference",
            *extra,
        ]
    )
    torch.manual_seed(0)
    reader = build_rag(cfg, torch.device("cpu")).reader
    tok = get_tokenizer()
    opt = torch.optim.AdamW(
        reader.parameters(),
        lr=cfg.optim.lr,
        weight_decay=cfg.optim.weight_decay,
        betas=(cfg.optim.beta1, cfg.optim.beta2),
    )
    g = torch.Generator().manual_seed(0)
    reader.train()
    for step in range(STEPS):
        for group in opt.param_groups:  # the recipe's linear warm-up, shortened to the run
            group["lr"] = cfg.optim.lr * min(1.0, (step + 1) / 10)
        x, _ = task_batch(tok, g)
        loss = reader(**x).loss
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(reader.parameters(), cfg.optim.grad_clip)
        opt.step()

    reader.eval()
    with torch.no_grad():
        x, _ = task_batch(tok, torch.Generator().manual_seed(1), B=256)
        acc = float(reader(**x).correct.float().mean())
        blank = dict(x, image=x["image"].mean(dim=(0, 2, 3), keepdim=True).expand_as(x["image"]))
        acc_blank = float(reader(**blank).correct.float().mean())
    # the blind prior is 1/4: one colour for the one question
    assert acc >= 0.9, f"{model}: accuracy {acc:.3f} after {STEPS} steps: the picture is not read"
    assert acc_blank <= 0.4, (
        f"{model}: accuracy {acc_blank:.3f} with a blank picture: the answer does not come from it"
    )
