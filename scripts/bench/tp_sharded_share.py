"""How much of a vision-language model tensor parallel really shards, and whether it still
computes one process's step: tiny random-initialised transformers models (4 language layers,
4 query heads; LLaVA and Mistral3 with 2 key/value heads, PaliGemma and Gemma 3 with one), each
through ``parallel.parallelize(tp=N)`` on N spawned gloo ranks (one thread each).

Per (family, tp): ``share``, the element share of the 2-D weights outside embeddings that are
sharded DTensors (not ``Replicate``); ``whole``, those left whole; ``loss_rel``, |loss - one
process's| / |loss|; ``grad_err``, the largest max|g - g_ref| / max(max|g_ref|, 1e-3 of the
largest reference gradient) over all parameters (the tests' measure); ``left_replicated``, the
plan's log lines about units it meant to shard and kept whole.

    python scripts/bench/tp_sharded_share.py [--tp 2 4] [--families llava mistral3 paligemma gemma3]
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import pickle
import socket
import sys
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

IMAGE_TOKEN = 500  # placeholder id of an image patch (inside the 512-token vocabulary)
VOCAB = 512
SEQ = 24  # tokens per sample
VISION = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    image_size=16,
    patch_size=4,
)
TEXT = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    vocab_size=VOCAB,
    max_position_embeddings=128,
)


def _ids(b: int, first: int, n_image: int, gen: torch.Generator) -> torch.Tensor:
    ids = torch.randint(0, IMAGE_TOKEN - 1, (b, SEQ), generator=gen)
    ids[:, first : first + n_image] = IMAGE_TOKEN
    return ids


def llava(b: int, gen: torch.Generator):
    from transformers import (
        CLIPVisionConfig,
        LlamaConfig,
        LlavaConfig,
        LlavaForConditionalGeneration,
    )

    cfg = LlavaConfig(
        vision_config=CLIPVisionConfig(**VISION),
        text_config=LlamaConfig(**TEXT, num_key_value_heads=2),
        image_token_index=IMAGE_TOKEN,
        image_seq_length=16,
        vision_feature_layer=-2,
        vision_feature_select_strategy="default",
    )
    return LlavaForConditionalGeneration(cfg), {
        "input_ids": _ids(b, 2, 16, gen),
        "pixel_values": torch.randn(b, 3, 16, 16, generator=gen),
    }


def mistral3(b: int, gen: torch.Generator):
    from transformers import Mistral3Config, Mistral3ForConditionalGeneration

    vision = dict(
        model_type="pixtral",
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        image_size=16,
        patch_size=4,
        head_dim=8,
    )
    text = dict(TEXT, model_type="mistral", num_key_value_heads=2, head_dim=16)
    cfg = Mistral3Config(
        vision_config=vision,
        text_config=text,
        image_token_index=IMAGE_TOKEN,
        spatial_merge_size=2,
        tie_word_embeddings=False,
    )
    # a 16 x 16 picture: 4 x 4 patches, merged 2 x 2 -> 4 image tokens
    return Mistral3ForConditionalGeneration(cfg), {
        "input_ids": _ids(b, 2, 4, gen),
        "pixel_values": torch.randn(b, 3, 16, 16, generator=gen),
        "image_sizes": torch.tensor([[16, 16]] * b),
    }


def paligemma(b: int, gen: torch.Generator):
    from transformers import PaliGemmaConfig, PaliGemmaForConditionalGeneration

    vision = dict(VISION, model_type="siglip_vision_model", vision_use_head=False)
    text = dict(TEXT, model_type="gemma", num_key_value_heads=1, head_dim=16)
    cfg = PaliGemmaConfig(
        vision_config=vision,
        text_config=text,
        image_token_index=IMAGE_TOKEN,
        projection_dim=TEXT["hidden_size"],
    )
    return PaliGemmaForConditionalGeneration(cfg), {
        "input_ids": _ids(b, 0, 16, gen),
        "pixel_values": torch.randn(b, 3, 16, 16, generator=gen),
    }


def gemma3(b: int, gen: torch.Generator):
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    vision = dict(VISION, model_type="siglip_vision_model", vision_use_head=False)
    text = dict(
        TEXT, model_type="gemma3_text", num_key_value_heads=1, head_dim=16, sliding_window=8
    )
    cfg = Gemma3Config(
        vision_config=vision,
        text_config=text,
        image_token_index=IMAGE_TOKEN,
        mm_tokens_per_image=4,
        boi_token_index=IMAGE_TOKEN + 1,
        eoi_token_index=IMAGE_TOKEN + 2,
    )
    ids = _ids(b, 2, 4, gen)
    return Gemma3ForConditionalGeneration(cfg), {
        "input_ids": ids,
        "pixel_values": torch.randn(b, 3, 16, 16, generator=gen),
        "token_type_ids": (ids == IMAGE_TOKEN).long(),
    }


FAMILIES = {"llava": llava, "mistral3": mistral3, "paligemma": paligemma, "gemma3": gemma3}


def _full(t):
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def case(rank: int, world: int, family: str) -> dict:
    import parallel
    from parallel.tp import sharded_share

    torch.manual_seed(0)
    model, inputs = FAMILIES[family](2, torch.Generator().manual_seed(1))
    model.eval()  # dropout off
    target = torch.randint(
        0, IMAGE_TOKEN - 1, inputs["input_ids"].shape, generator=torch.Generator().manual_seed(2)
    )

    def loss_fn(out, tgt):
        return F.cross_entropy(out.logits.float().flatten(0, -2), tgt.flatten())

    ref = copy.deepcopy(model)
    ref_loss = loss_fn(ref(**inputs), target)
    ref_loss.backward()
    pm = parallel.parallelize(model, parallel.ParallelConfig(tp=world), inputs)
    loss = pm.train_step(inputs, target=target, loss_fn=loss_fn)
    refg = {n: p.grad for n, p in ref.named_parameters() if p.grad is not None}
    scale = max(float(g.abs().max()) for g in refg.values())
    err = 0.0
    for n, p in model.named_parameters():
        r = refg.get(n)
        g = None if p.grad is None else _full(p.grad)
        if g is None and r is None:
            continue
        g = torch.zeros_like(r) if g is None else g
        r = torch.zeros_like(g) if r is None else r
        err = max(err, float((g - r).abs().max()) / max(float(r.abs().max()), 1e-3 * scale))
    share, whole = sharded_share(model)
    log = pm.sharded.tp_plan.log
    return dict(
        share=round(share, 4),
        whole=whole,
        loss_rel=abs(float(loss) - float(ref_loss)) / abs(float(ref_loss)),
        grad_err=err,
        left_replicated=[line for line in log if "left replicated" in line],
        replicated_kv=[line for line in log if "replicated K/V" in line],
    )


def _entry(rank: int, world: int, port: int, families: list[str], q) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world)
    )
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=300))
    try:
        q.put((rank, pickle.dumps({f: case(rank, world, f) for f in families})))
    finally:
        dist.destroy_process_group()


def spawn(world: int, families: list[str]) -> list[dict]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    ps = [ctx.Process(target=_entry, args=(r, world, port, families, q)) for r in range(world)]
    for p in ps:
        p.start()
    out = dict(q.get(timeout=900) for _ in ps)
    for p in ps:
        p.join()
    return [pickle.loads(out[r]) for r in range(world)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tp", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--families", nargs="+", default=list(FAMILIES), choices=list(FAMILIES))
    a = ap.parse_args()
    rows = []
    for tp in a.tp:
        per_rank = spawn(tp, a.families)
        for f in a.families:
            r = per_rank[0][f]
            r["loss_rel"] = max(x[f]["loss_rel"] for x in per_rank)  # the worst rank
            r["grad_err"] = max(x[f]["grad_err"] for x in per_rank)
            rows.append(dict(family=f, tp=tp, **r))
    json.dump(rows, sys.stdout, indent=1)
    print()


if __name__ == "__main__":
    main()
