"""The native reader: a joint text-image transformer of its own (GPT-2 style blocks) over an
open_clip vision tower. The sequence layout, scoring and generation are ``ReaderBase``'s
(``rag_mm.model.layout``); learned positions and token types are added to the embeddings here.
"""

from __future__ import annotations

import logging
import math

import open_clip
import torch
import torch.nn as nn
from open_clip.model import CLIPVisionCfg

from rag_mm.config import ModelConfig
from rag_mm.model.blocks import Block, Projector
from rag_mm.model.copy_head import CopyHead
from rag_mm.model.layout import IGNORE, ReaderBase, ReaderOutput

log = logging.getLogger(__name__)

__all__ = ["IGNORE", "Reader", "ReaderOutput", "build_vision_tower"]


def build_vision_tower(cfg: ModelConfig) -> nn.Module:
    """An open_clip ViT that also returns its patch tokens (random init or a local checkpoint)."""
    vcfg = CLIPVisionCfg(
        layers=cfg.vision_layers,
        width=cfg.vision_width,
        head_width=cfg.vision_head_width,
        patch_size=cfg.patch_size,
        image_size=cfg.image_size,
        output_tokens=True,
    )
    tower = open_clip.model._build_vision_tower(embed_dim=cfg.vision_width, vision_cfg=vcfg)
    tower.proj = None  # the reader uses patch tokens only; an unused projection would stall DDP
    if (
        cfg.vision_checkpoint and not tower.conv1.weight.is_meta
    ):  # a meta tower is loaded after materialising
        state = torch.load(cfg.vision_checkpoint, map_location="cpu", weights_only=True)
        state = state.get("state_dict", state)
        # accept a whole open_clip CLIP state dict: keep the 'visual.' entries
        if any(k.startswith("visual.") for k in state):
            state = {k[len("visual.") :]: v for k, v in state.items() if k.startswith("visual.")}
        missing, unexpected = tower.load_state_dict(state, strict=False)
        log.info(
            "vision tower: loaded %s (missing %d, unexpected %d keys)",
            cfg.vision_checkpoint,
            len(missing),
            len(unexpected),
        )
    return tower


class Reader(ReaderBase):
    def __init__(self, cfg: ModelConfig, vocab_size: int) -> None:
        super().__init__()
        self.cfg = cfg
        self.vocab_size = vocab_size
        self.max_docs, self.max_segment_len, self.max_answer = (
            cfg.max_docs,
            cfg.max_segment_len,
            cfg.max_answer,
        )
        self.question_first = cfg.question_first
        self.query_prefix = cfg.query_prefix
        self.num_patches = (cfg.image_size // cfg.patch_size) ** 2  # patch tokens per picture
        self.vision = build_vision_tower(cfg)
        # (N, P, vision_width) -> (N, P, dim): one linear map unless model.projector asks for an MLP
        self.image_proj = (
            nn.Linear(cfg.vision_width, cfg.dim)
            if (cfg.projector or "linear") == "linear"
            else Projector(cfg.vision_width, cfg.dim, cfg.projector)
        )
        self.tok_emb = nn.Embedding(vocab_size, cfg.dim)
        self.pos_emb = nn.Embedding(cfg.max_segment_len, cfg.dim)
        self.type_emb = nn.Embedding(5, cfg.dim)
        self.rank_emb = nn.Embedding(cfg.max_docs, cfg.dim)
        self.blocks = nn.ModuleList(
            Block(
                cfg.dim,
                cfg.heads,
                cfg.mlp_ratio,
                cfg.dropout,
                cfg.attention_backend,
                gated_mlp=cfg.mlp == "swiglu",
            )
            for _ in range(cfg.layers)
        )
        self.ln_f = nn.LayerNorm(cfg.dim)
        self.lm_head = nn.Linear(cfg.dim, vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.tok_emb.weight
        self.copy = CopyHead(cfg.dim, cfg.copy_supervision) if cfg.copy_head else None
        self._init_weights()

    def _init_weights(self) -> None:
        # GPT-2 init: N(0, 0.02), residual output projections scaled by 1/sqrt(2 * layers).
        for name, p in self.named_parameters():
            if name.startswith("vision."):
                continue  # open_clip initialises its own tower
            if p.dim() >= 2:
                std = (
                    0.02 / math.sqrt(2 * self.cfg.layers)
                    if name.endswith("proj.weight") and "blocks" in name
                    else 0.02
                )
                nn.init.normal_(p, 0.0, std)
            elif name.endswith("bias"):
                nn.init.zeros_(p)

    def embed_tokens(self, ids: torch.Tensor) -> torch.Tensor:
        return self.tok_emb(ids)

    def encode_images(self, pics: torch.Tensor) -> torch.Tensor:
        _, patches = self.vision(pics)  # (N, P, Wv)
        return self.image_proj(patches)  # (N, P, D)

    def forward(
        self,
        image,
        q_ids,
        q_len,
        a_ids,
        a_len,
        doc_image=None,
        doc_ids=None,
        doc_len=None,
        doc_prior=None,
    ) -> ReaderOutput:
        """image (B,3,H,W); q_ids (B,Lq); a_ids (B,La) ending in EOT; doc_* (B,k,...) or None;
        doc_prior (B,k) log retrieval probabilities of the documents (copy head only) or None."""
        a = self.assemble(image, q_ids, q_len, a_ids, a_len, doc_image, doc_ids, doc_len)
        # padding slots (type -1) take type 0: they attend to nothing and nothing attends to them
        x = a.x + self.pos_emb(a.pos) + self.type_emb(a.typ.clamp_min(0))  # (B, S, D)
        for block in self.blocks:
            x = block(x, a.seg_offsets)
        return self.read_out(self.ln_f(x), a, self.lm_head, doc_prior)
