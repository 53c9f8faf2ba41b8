"""Tiny random-initialised vision-language models and the per-rank bodies of their tests
(module level: ``run_ranks`` spawns them). Nothing is downloaded: configs only.

- ``llava``: CLIP vision tower + Llama (``LlavaForConditionalGeneration``); it reads the tower's
  hidden states (``output_hidden_states=True``, ``vision_feature_layer=-2``).
- ``paligemma``: SigLIP vision tower + Gemma (``PaliGemmaForConditionalGeneration``), one linear
  projector; it reads the tower's last hidden state.
- ``qwen2vl``: Qwen2-VL's own vision transformer (patches flattened, 2 x 2 merger) + Qwen2 with
  multimodal rotary positions; it replaces ``pooler_output`` of the tower's output with per-image
  splits after the call.

Each factory takes the batch size and the seed of the inputs' generator.
"""

from __future__ import annotations

import copy
import logging

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from parallel.tp import sharded_share

IMAGE_TOKEN = 500  # placeholder id of an image patch in input_ids (inside the 512-token vocabulary)
VOCAB = 512
SEQ = 24  # tokens per sample: 16 image patches (16 x 16 picture, 4 x 4 patches) + 8 text tokens
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
    num_key_value_heads=2,
    vocab_size=VOCAB,
    max_position_embeddings=128,
)


def _inputs(b: int, first: int, seed: int) -> dict[str, torch.Tensor]:
    """A batch of ``b``: random text ids with 16 image placeholders from ``first``, and pictures."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, IMAGE_TOKEN - 1, (b, SEQ), generator=gen)
    ids[:, first : first + 16] = IMAGE_TOKEN
    return {"input_ids": ids, "pixel_values": torch.randn(b, 3, 16, 16, generator=gen)}


def llava(b: int = 2, seed: int = 1) -> tuple[nn.Module, dict[str, torch.Tensor]]:
    from transformers import (
        CLIPVisionConfig,
        LlamaConfig,
        LlavaConfig,
        LlavaForConditionalGeneration,
    )

    # "default": the CLS token dropped
    cfg = LlavaConfig(
        vision_config=CLIPVisionConfig(**VISION),
        text_config=LlamaConfig(**TEXT),
        image_token_index=IMAGE_TOKEN,
        image_seq_length=16,
        vision_feature_layer=-2,
        vision_feature_select_strategy="default",
    )
    return LlavaForConditionalGeneration(cfg), _inputs(b, 2, seed)


def paligemma(b: int = 2, seed: int = 1) -> tuple[nn.Module, dict[str, torch.Tensor]]:
    from transformers import PaliGemmaConfig, PaliGemmaForConditionalGeneration

    # as PaliGemma's own
    vision = dict(VISION, model_type="siglip_vision_model", vision_use_head=False)
    text = dict(TEXT, model_type="gemma", head_dim=16)
    cfg = PaliGemmaConfig(
        vision_config=vision,
        text_config=text,
        image_token_index=IMAGE_TOKEN,
        projection_dim=TEXT["hidden_size"],
    )
    return PaliGemmaForConditionalGeneration(cfg), _inputs(b, 0, seed)


def qwen2vl(b: int = 2, seed: int = 1) -> tuple[nn.Module, dict[str, torch.Tensor]]:
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    # vision start / end markers around the image tokens
    start, end = (
        IMAGE_TOKEN + 1,
        IMAGE_TOKEN + 2,
    )
    vision = dict(
        depth=2,
        embed_dim=32,
        hidden_size=TEXT["hidden_size"],
        num_heads=4,
        mlp_ratio=2,
        patch_size=4,
        spatial_merge_size=2,
        temporal_patch_size=2,
    )
    # the defaults lie outside the tiny vocabulary
    text = dict(
        TEXT,
        rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]},  # 2 + 3 + 3 = head_dim / 2
        bos_token_id=None,
        eos_token_id=None,
    )
    cfg = Qwen2VLConfig(
        vision_config=vision,
        text_config=text,
        image_token_id=IMAGE_TOKEN,
        vision_start_token_id=start,
        vision_end_token_id=end,
    )
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, IMAGE_TOKEN - 1, (b, SEQ), generator=gen)
    # one 16 x 16 picture per sample: 4 x 4 patches of 4 px over 2 frames, merged 2 x 2 -> 4 tokens
    ids[:, 1], ids[:, 2:6], ids[:, 6] = start, IMAGE_TOKEN, end
    inputs = {
        "input_ids": ids,
        "pixel_values": torch.randn(b * 16, 3 * 2 * 4 * 4, generator=gen),  # (patches, C*T*P*P)
        "image_grid_thw": torch.tensor([[1, 4, 4]] * b),
        "mm_token_type_ids": (ids == IMAGE_TOKEN).long(),
    }
    return Qwen2VLForConditionalGeneration(cfg), inputs


def paligemma_mqa(b: int = 2, seed: int = 1) -> tuple[nn.Module, dict[str, torch.Tensor]]:
    """PaliGemma with one key/value head (multi-query attention, as PaliGemma-3B's Gemma-2B)."""
    from transformers import PaliGemmaConfig, PaliGemmaForConditionalGeneration

    vision = dict(VISION, model_type="siglip_vision_model", vision_use_head=False)
    text = dict(TEXT, model_type="gemma", head_dim=16, num_key_value_heads=1)
    cfg = PaliGemmaConfig(
        vision_config=vision,
        text_config=text,
        image_token_index=IMAGE_TOKEN,
        projection_dim=TEXT["hidden_size"],
    )
    return PaliGemmaForConditionalGeneration(cfg), _inputs(b, 0, seed)


def gemma3(b: int = 2, seed: int = 1) -> tuple[nn.Module, dict[str, torch.Tensor]]:
    """Gemma 3 (SigLIP + Gemma 3 text, one key/value head, per-head q_norm / k_norm); the 16
    patches pooled to 4 image tokens."""
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
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, IMAGE_TOKEN - 1, (b, SEQ), generator=gen)
    ids[:, 2:6] = IMAGE_TOKEN
    inputs = {
        "input_ids": ids,
        "pixel_values": torch.randn(b, 3, 16, 16, generator=gen),
        "token_type_ids": (ids == IMAGE_TOKEN).long(),
    }
    return Gemma3ForConditionalGeneration(cfg), inputs


def mistral3(b: int = 2, seed: int = 1) -> tuple[nn.Module, dict[str, torch.Tensor]]:
    """Mistral3 (Pixtral tower, 2 x 2 patch merger, Mistral with 2 key/value heads): 4 image
    tokens."""
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
    text = dict(TEXT, model_type="mistral", head_dim=16)
    cfg = Mistral3Config(
        vision_config=vision,
        text_config=text,
        image_token_index=IMAGE_TOKEN,
        spatial_merge_size=2,
        tie_word_embeddings=False,
    )
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, IMAGE_TOKEN - 1, (b, SEQ), generator=gen)
    ids[:, 2:6] = IMAGE_TOKEN
    inputs = {
        "input_ids": ids,
        "pixel_values": torch.randn(b, 3, 16, 16, generator=gen),
        "image_sizes": torch.tensor([[16, 16]] * b),
    }
    return Mistral3ForConditionalGeneration(cfg), inputs


MODELS = {
    "llava": llava,
    "paligemma": paligemma,
    "qwen2vl": qwen2vl,
    "paligemma_mqa": paligemma_mqa,
    "gemma3": gemma3,
    "mistral3": mistral3,
}


def next_token_loss(out, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.logits.float().flatten(0, -2), target.flatten())


def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def grad_error(
    grads: dict[str, torch.Tensor | None], ref: dict[str, torch.Tensor]
) -> tuple[float, str]:
    """Largest max|g - g_ref| / max(max|g_ref|, 1e-3 of the largest reference gradient), and
    where. The floor: an attention key bias has a zero gradient in exact arithmetic, so its
    rounding noise is measured against the model's gradient scale, not its own."""
    scale = max(float(r.abs().max()) for r in ref.values())
    err, worst = 0.0, ""
    for n, g in grads.items():
        r = ref.get(n)
        if g is None and r is None:
            continue
        g = torch.zeros_like(r) if g is None else full(g)
        r = torch.zeros_like(g) if r is None else r
        e = float((g - r).abs().max()) / max(float(r.abs().max()), 1e-3 * scale)
        if e > err:
            err, worst = e, n
    return err, worst


def pipeline_case(rank: int, world: int, name: str, cfg_kw: dict, b: int = 8, m: int = 4) -> dict:
    """``parallel.parallelize`` (pp / tp / dp_shard from ``cfg_kw``) against one process: the
    step's loss, and the largest gradient difference over the parameters this rank holds."""
    import parallel

    torch.manual_seed(0)
    model, inputs = MODELS[name](b, seed=2)
    model.eval()  # dropout off: one process and the pipeline compute the same function
    target = torch.randint(
        0, IMAGE_TOKEN - 1, inputs["input_ids"].shape, generator=torch.Generator().manual_seed(3)
    )
    ref = copy.deepcopy(model)
    ref_loss = next_token_loss(ref(**inputs), target)
    ref_loss.backward()
    ref_grads = {n: p.grad for n, p in ref.named_parameters() if p.grad is not None}
    cfg = parallel.ParallelConfig(**({"microbatches": m, "schedule": "1f1b"} | cfg_kw))
    pm = parallel.parallelize(model, cfg, inputs, timeout_s=60)
    pm.zero_grad()
    loss = pm.train_step(inputs, target=target, loss_fn=next_token_loss)
    err, worst = grad_error({n: p.grad for n, p in pm.named_parameters()}, ref_grads)
    return dict(
        loss=float(loss.detach()),
        ref=float(ref_loss.detach()),
        err=err,
        worst=worst,
        n=sum(1 for _ in pm.named_parameters()),
        fsdp_units=len(pm.sharded.fsdp_units),
    )


def pipeline_suite(rank: int, world: int, cases: list[tuple[str, dict]]) -> dict:
    """``pipeline_case`` for several (model, config) pairs in one process group."""
    return {name: pipeline_case(rank, world, name, kw) for name, kw in cases}


def fsdp_hidden_states_case(rank: int, world: int) -> dict:
    """A CLIP vision tower made an FSDP2 root (its layers units of their own) and called with
    ``output_hidden_states=True``, as LLaVA calls it: its class's name, and its hidden states
    against the unsharded tower's."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule
    from transformers import CLIPVisionConfig, CLIPVisionModel

    from parallel.fsdp import apply_fsdp

    torch.manual_seed(0)
    tower = CLIPVisionModel(CLIPVisionConfig(**VISION))
    ref = copy.deepcopy(tower)
    x = torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(1))
    apply_fsdp(tower, init_device_mesh("cpu", (world,)), list(tower.encoder.layers))
    hidden = tower(pixel_values=x, output_hidden_states=True).hidden_states
    ref_hidden = ref(pixel_values=x, output_hidden_states=True).hidden_states
    err = (
        max((float((h - r).abs().max()) for h, r in zip(hidden, ref_hidden)), default=None)
        if hidden
        else None
    )
    return dict(
        fsdp=isinstance(tower, FSDPModule),
        cls=str(type(tower)),
        name=type(tower).__name__,
        hidden=None if hidden is None else len(hidden),
        ref_hidden=len(ref_hidden),
        err=err,
    )


class _Warnings(logging.Handler):
    """The messages of WARNING and above that the ``parallel`` loggers emit while installed."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())

    def __enter__(self) -> list[str]:
        logging.getLogger("parallel").addHandler(self)
        return self.lines

    def __exit__(self, *exc) -> None:
        logging.getLogger("parallel").removeHandler(self)


def tp_case(rank: int, world: int, name: str) -> dict:
    """``parallel.parallelize`` with tp=world against one process: loss, the largest gradient
    difference, the sharded share of 2-D weights outside embeddings, and the warnings logged."""
    import parallel

    torch.manual_seed(0)
    model, inputs = MODELS[name]()
    model.eval()
    target = torch.randint(
        0, IMAGE_TOKEN - 1, inputs["input_ids"].shape, generator=torch.Generator().manual_seed(2)
    )
    ref = copy.deepcopy(model)
    ref_loss = next_token_loss(ref(**inputs), target)
    ref_loss.backward()
    with _Warnings() as warned:
        pm = parallel.parallelize(model, parallel.ParallelConfig(tp=world), inputs)
    loss = pm.train_step(inputs, target=target, loss_fn=next_token_loss)
    err, worst = grad_error(
        {n: p.grad for n, p in model.named_parameters()},
        {n: p.grad for n, p in ref.named_parameters() if p.grad is not None},
    )
    frac, whole = sharded_share(model)
    return dict(
        loss=float(loss.detach()),
        ref=float(ref_loss.detach()),
        err=err,
        worst=worst,
        fraction=frac,
        whole=whole,
        warnings=warned,
        log=pm.sharded.tp_plan.log,
    )


def tp_warning_case(rank: int, world: int) -> list[str]:
    """The warnings ``apply_tp`` logs on the self-check's model with misread units
    (``tp_cases.SelfCheckLM``: ``mix`` and ``skew`` fail the check)."""
    from torch.distributed.device_mesh import init_device_mesh

    from parallel.tp import apply_tp
    from tests.parallel.tp_cases import SELFCHECK_MODELS

    torch.manual_seed(0)
    model, inputs = SELFCHECK_MODELS["selfcheck_lm"]()
    with _Warnings() as warned:
        apply_tp(model, init_device_mesh("cpu", (world,), mesh_dim_names=("tp",)), inputs)
    return warned


class ProbePool(nn.Module):
    """SigLIP's pooling head in miniature: a self-attention whose key and value arrive as aliases
    of its query (as FSDP2 hands a unit's arguments on: ``attn(x, x, x)`` becomes three tensor
    objects), then a learned probe attending over the result (cross-attention), both asked for
    their attention weights (per head, and averaged: torch's default)."""

    def __init__(self, dim: int = 32, heads: int = 4):
        super().__init__()
        self.probe = nn.Parameter(torch.randn(1, 1, dim))
        self.mix = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.pool = nn.MultiheadAttention(dim, heads, batch_first=True)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:  # x: (B, L, dim)
        # (B, 4, L, L)
        h, per_head = self.mix(x, x.view_as(x), x.view_as(x), average_attn_weights=False)
        # (B, 1, dim), (B, 1, L)
        y, mean = self.pool(self.probe.expand(x.shape[0], -1, -1), x + h, x + h)
        return y, per_head, mean


def mha_case(rank: int, world: int) -> dict:
    """``apply_tp`` on ``ProbePool`` against one process: the outputs and every gradient, and the
    roles (both attentions under the multihead_attention rule, and the self-check passing)."""
    from torch.distributed.device_mesh import init_device_mesh

    from parallel.tp import apply_tp

    torch.manual_seed(0)
    model = ProbePool()
    ref = copy.deepcopy(model)
    x = torch.randn(2, 6, 32, generator=torch.Generator().manual_seed(1))

    def loss(outs: tuple[torch.Tensor, ...]) -> torch.Tensor:  # fixed random cotangents
        gen = torch.Generator().manual_seed(2)
        return sum((o * torch.randn(o.shape, generator=gen)).sum() for o in outs)

    loss(ref(x)).backward()
    plan = apply_tp(model, init_device_mesh("cpu", (world,), mesh_dim_names=("tp",)), (x,))
    outs = model(x)
    loss(outs).backward()
    err, worst = grad_error(
        {n: p.grad for n, p in model.named_parameters()},
        {n: p.grad for n, p in ref.named_parameters()},
    )
    out_err = max(float((o - r).abs().max()) for o, r in zip(outs, ref(x)))
    return dict(
        out_err=out_err,
        err=err,
        worst=worst,
        roles={n: e.role for n, e in plan.entries.items()},
        sharded=sharded_share(model)[0],
    )


def tp_suite(rank: int, world: int, names: list[str]) -> dict:
    """``tp_case`` for each model, ``tp_warning_case`` and ``mha_case``, in one process group."""
    return {
        **{n: tp_case(rank, world, n) for n in names},
        "warnings": tp_warning_case(rank, world),
        "mha": mha_case(rank, world),
    }
