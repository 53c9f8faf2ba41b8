"""The dual encoder: open_clip towers embedding queries (picture + question) and documents
(picture + passage) into one space searched by faiss.

Each side is an open_clip ``CLIP`` (vision + text tower); the two towers' normalised outputs are
fused by a learned weighted sum. Query and document sides are separate encoders unless
``shared_towers`` (Contriever/Atlas share one); ``query_side_only`` freezes the document side.
"""

from __future__ import annotations

import contextlib
import logging

import open_clip
import torch
import torch.nn as nn
import torch.nn.functional as F
from open_clip.model import CLIPTextCfg, CLIPVisionCfg

from retriever.config import RetrieverConfig
from retriever.replicas import replica_batch_norms
from retriever.side_norm import doc_stats_from_queries, on_side, side_batch_norms

log = logging.getLogger(__name__)

SOT, EOT = 49406, 49407  # CLIP BPE start/end-of-text ids (open_clip.tokenizer.SimpleTokenizer)
VOCAB = 49408  # CLIP BPE vocabulary size


def clip_tokens(ids: torch.Tensor, lengths: torch.Tensor, context_length: int) -> torch.Tensor:
    """Right-padded ids without markers (N, L) -> open_clip text input [SOT, ids..., EOT, 0...] (N,
    ctx)."""
    body = min(ids.shape[1], context_length - 2)
    # masked_fill with Python numbers throughout: a number assigned into a CUDA tensor by index
    # (out[:, 0] = SOT) becomes a CPU tensor first, on every call
    out = F.pad(ids[:, :body].long(), (1, context_length - 1 - body))  # (N, ctx): [0, ids..., 0...]
    n = lengths.clamp(max=body)[:, None]  # (N, 1)
    pos = torch.arange(context_length, device=ids.device)[None]  # (1, ctx)
    out = out.masked_fill(pos > n, 0)  # drop padding that sat inside the body
    out = out.masked_fill(pos == 0, SOT)
    return out.masked_fill(pos == 1 + n, EOT)  # open_clip pools at the EOT (argmax id)


def _vision_cfg(cfg: RetrieverConfig, image_size: int) -> CLIPVisionCfg:
    """open_clip picks the tower by the type of ``layers``: an int builds a ViT, a 4-tuple a
    ModifiedResNet."""
    layers = cfg.vision_layers if cfg.vision_tower == "vit" else (cfg.vision_layers,) * 4
    return CLIPVisionCfg(
        layers=layers,
        width=cfg.vision_width,
        head_width=cfg.vision_head_width,
        patch_size=cfg.patch_size,
        image_size=image_size,
    )


class Encoder(nn.Module):
    """One side of the dual encoder: (picture, text tokens) -> unit vector (N, embed_dim)."""

    def __init__(self, cfg: RetrieverConfig, image_size: int) -> None:
        super().__init__()
        self.fusion = cfg.fusion
        self.clip = open_clip.CLIP(
            embed_dim=cfg.embed_dim,
            vision_cfg=_vision_cfg(cfg, image_size),
            text_cfg=CLIPTextCfg(
                context_length=cfg.context_length,
                vocab_size=VOCAB,
                width=cfg.text_width,
                heads=cfg.text_heads,
                layers=cfg.text_layers,
            ),
        )
        del self.clip.logit_scale  # the dual encoder keeps its own temperature
        # A tower the fusion never calls would hold parameters that get no gradient (DDP rejects
        # those) and cost memory: drop it. A checkpoint's keys for it are then reported as
        # unexpected.
        if self.fusion == "image":
            for name in (
                "transformer",
                "token_embedding",
                "ln_final",
                "positional_embedding",
                "text_projection",
                "attn_mask",
            ):
                delattr(self.clip, name)
        elif self.fusion == "text":
            del self.clip.visual
        self.mix = nn.Parameter(torch.ones(2))  # learned weights of the image and text embeddings
        if cfg.side_norm:  # before a checkpoint loads: it may hold the document side's statistics
            side_batch_norms(self.clip)
        if cfg.checkpoint:
            state = torch.load(cfg.checkpoint, map_location="cpu", weights_only=True)
            state = dict(state.get("state_dict", state))
            # rag_mm.export's file also carries the fusion weights (not an open_clip key)
            mix = state.pop("mix", None)
            # rag_mm.export keeps the document side's batch-norm statistics apart, so the file
            # stays an open_clip state dict (retriever/side_norm.py)
            doc_stats = state.pop("side_norm_doc", {})
            if cfg.side_norm:
                state |= doc_stats
            if mix is not None and self.fusion == "sum":
                with torch.no_grad():
                    self.mix.copy_(mix)
            try:
                missing, unexpected = self.clip.load_state_dict(state, strict=False)
            except RuntimeError as exc:  # a tensor of another shape: another tower's checkpoint
                sizes = [ln.strip() for ln in str(exc).splitlines() if "size mismatch" in ln]
                first = sizes[0] if sizes else str(exc).splitlines()[0]
                raise ValueError(
                    f"retriever.checkpoint {cfg.checkpoint} does not fit the towers this config "
                    f"builds ({len(sizes)} tensors of another shape, e.g. {first}); build the "
                    "retriever as the run that wrote it (rag_mm.export writes those overrides "
                    "to import.json)"
                ) from None
            if cfg.side_norm and not doc_stats:  # a tower without sides: both start as its one
                doc_stats_from_queries(self.clip)
            log.info(
                "retriever tower: loaded %s (missing %d, unexpected %d)",
                cfg.checkpoint,
                len(missing),
                len(unexpected),
            )

    def forward(self, image: torch.Tensor, text: torch.Tensor) -> torch.Tensor:
        """image (N, 3, H, W), text (N, ctx) open_clip tokens -> (N, embed_dim), unit norm."""
        if self.fusion == "image":
            return F.normalize(self.clip.encode_image(image), dim=-1) + 0 * self.mix.sum()
        if self.fusion == "text":
            return F.normalize(self.clip.encode_text(text), dim=-1) + 0 * self.mix.sum()
        img = F.normalize(self.clip.encode_image(image), dim=-1)
        txt = F.normalize(self.clip.encode_text(text), dim=-1)
        return F.normalize(self.mix[0] * img + self.mix[1] * txt, dim=-1)


class DualEncoder(nn.Module):
    """Query and document encoders plus the score temperature (CLIP's learnable logit scale)."""

    def __init__(self, cfg: RetrieverConfig, image_size: int) -> None:
        super().__init__()
        self.cfg = cfg
        self.query = Encoder(cfg, image_size)
        self.doc = self.query if cfg.shared_towers else Encoder(cfg, image_size)
        # BatchNorm (the ResNet tower's) that can take its batch statistics over data-parallel
        # replicas
        replica_batch_norms(self)
        # log(1/0.07): CLIP's initial temperature (Radford et al. 2021)
        self.logit_scale = nn.Parameter(torch.tensor(2.6592))
        if cfg.query_side_only:
            if cfg.shared_towers:
                raise ValueError(
                    "retriever.query_side_only needs separate towers "
                    "(retriever.shared_towers=false)"
                )
            self.doc.requires_grad_(False)

    def scale(self) -> torch.Tensor:
        return self.logit_scale.clamp(max=4.6052).exp()  # at most 100, as CLIP clamps it

    # (also the methods of retriever.memory's frozen copy of the document side: they read only
    # cfg and the tower they call)
    def embed_queries(self, image, q_ids, q_len) -> torch.Tensor:
        with _on_side(self.query, "query", self.cfg):
            return self.query(image, clip_tokens(q_ids, q_len, self.cfg.context_length))

    def embed_docs(self, image, text_ids, text_len) -> torch.Tensor:
        with _on_side(self.doc, "doc", self.cfg):
            return self.doc(image, clip_tokens(text_ids, text_len, self.cfg.context_length))


def _on_side(tower: nn.Module, side: str, cfg: RetrieverConfig):
    """The tower's batch norms on ``side`` for a call (retriever.side_norm), else nothing."""
    return on_side(tower, side) if cfg.side_norm else contextlib.nullcontext()
