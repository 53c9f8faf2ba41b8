"""The reader on a Hugging Face causal LM: an open_clip vision tower, a projector into the LM's
embedding width (LLaVA), and the LM's own decoder with rag_mm's attention in it.

The LM is any model ``AutoModelForCausalLM`` builds: from a local pretrained directory
(offline, safetensors), from a config (``model.lm``, a preset, or ``model.lm_config``) with random
init, or on the meta device (no memory) for planning and delayed init. Its attention modules call
``parallel.kernels.attention`` through ``AttentionInterface`` (``hf_attention``), so documents
attend within themselves and the query to every document and causally to itself. Positions
restart in every segment (``position_ids``): learned, rotary or any other position scheme the
model has sees each document from position 0.

With no documents the sequence is [query patches, question, answer], one causal segment with
positions 0.., so the reader's logits are the LM's own forward on those embeddings.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
from omegaconf import OmegaConf

from rag_mm.config import ModelConfig, known_model_type, transformers_version
from rag_mm.model.blocks import Projector
from rag_mm.model.copy_head import CopyHead
from rag_mm.model.hf_attention import check_dispatch, implementation
from rag_mm.model.hf_base import HFReaderBase
from rag_mm.model.reader import build_vision_tower

log = logging.getLogger(__name__)


def _container(value: Any) -> dict:
    """An OmegaConf node or a mapping -> a plain dict (Hydra hands ``model.lm`` as a DictConfig)."""
    return (
        OmegaConf.to_container(value, resolve=True) if OmegaConf.is_config(value) else dict(value)
    )


def lm_config(cfg: ModelConfig):
    """The LM's ``PretrainedConfig`` from ``model.pretrained``, ``model.lm_config`` or
    ``model.lm``."""
    from transformers import AutoConfig

    if cfg.pretrained:
        return AutoConfig.from_pretrained(cfg.pretrained, local_files_only=True)
    if cfg.lm_config:
        path = Path(cfg.lm_config)
        fields = json.loads((path / "config.json" if path.is_dir() else path).read_text())
    else:
        fields = _container(cfg.lm)
    fields = dict(fields)
    model_type = fields.pop("model_type", None)
    fields.pop("architectures", None)
    if not known_model_type(model_type):
        raise ValueError(
            f"model.lm: transformers {transformers_version()} has no model_type {model_type!r}"
        )
    try:
        return AutoConfig.for_model(model_type, **fields)
    except (ValueError, KeyError, TypeError) as exc:
        raise ValueError(
            f"model.lm: transformers cannot build a {model_type} config from these fields: "
            f"{str(exc)[:300]}"
        ) from None


def build_lm(cfg: ModelConfig, meta: bool = False, vocab_size: int | None = None) -> nn.Module:
    """The causal LM with rag_mm's attention (``model.attention_backend``), fp32, on the CPU or on
    the meta device (``meta``: no memory, no init; ``factory.materialize`` gives it weights).
    ``vocab_size``: the tokenizer's; a randomly initialised LM with more rows is cut to it
    (``model.trim_vocab``)."""
    from transformers import AutoModelForCausalLM

    impl = implementation(cfg.attention_backend)
    # its errors name the key already
    config = None if cfg.pretrained and not meta else lm_config(cfg)
    text = None if config is None else config.get_text_config()
    if (
        vocab_size
        and not cfg.pretrained
        and getattr(cfg, "trim_vocab", False)
        and text is not None
        and getattr(text, "vocab_size", 0) > vocab_size
    ):
        log.info(
            "reader LM: vocabulary cut from %d to the tokenizer's %d rows (random init, "
            "model.trim_vocab)",
            text.vocab_size,
            vocab_size,
        )
        text.vocab_size = vocab_size
    try:
        if config is None:
            lm = AutoModelForCausalLM.from_pretrained(
                cfg.pretrained, local_files_only=True, attn_implementation=impl, dtype=torch.float32
            )
            source = f"from {cfg.pretrained}"
        else:
            with torch.device("meta") if meta else torch.device("cpu"):
                lm = AutoModelForCausalLM.from_config(
                    config, attn_implementation=impl, dtype=torch.float32
                )
            source = "random init on the meta device" if meta else "random init"
    except (OSError, ValueError, KeyError) as exc:
        # KeyError: a family whose attention classes are looked up by implementation name in a table
        # of its own (Falcon), not through AttentionInterface
        where = (
            f"model.pretrained={cfg.pretrained!r}" if cfg.pretrained and not meta else "model.lm"
        )
        why = (
            f"{type(exc).__name__}: {str(exc)[:300]}"
            if not (isinstance(exc, KeyError) and impl in str(exc))
            else (
                "the family looks its attention classes up itself, not through transformers' "
                "AttentionInterface"
            )
        )
        raise ValueError(
            f"{where}: transformers cannot build this LM with rag_mm's attention ({impl}): {why}"
        ) from None
    if not meta:
        check_dispatch(lm)
    log.info("reader LM: %s, %s, attention %s", type(lm).__name__, source, impl)
    return lm


class HFReader(HFReaderBase):
    def __init__(self, cfg: ModelConfig, lm: nn.Module, vocab_size: int) -> None:
        """``lm``: a causal LM from ``build_lm``; ``vocab_size``: the tokenizer's, at most the
        LM's embedding rows."""
        super().__init__()
        self.cfg = cfg
        rows = lm.get_input_embeddings().num_embeddings
        if vocab_size > rows:
            raise ValueError(
                f"the tokenizer has {vocab_size} tokens but the LM embeds {rows}: "
                "use the LM's own tokenizer (model.tokenizer) or a larger vocab_size in model.lm"
            )
        self.vocab_size = vocab_size
        self.max_docs, self.max_segment_len, self.max_answer = (
            cfg.max_docs,
            cfg.max_segment_len,
            cfg.max_answer,
        )
        self.question_first = cfg.question_first
        self.query_prefix = cfg.query_prefix
        self.num_patches = (cfg.image_size // cfg.patch_size) ** 2  # patch tokens per picture
        text = lm.config.get_text_config()
        dim = text.hidden_size
        # Gemma 2 caps its logits after the head
        self.softcap = getattr(text, "final_logit_softcapping", None)
        if (
            getattr(text, "max_position_embeddings", None)
            and cfg.max_segment_len > text.max_position_embeddings
        ):
            raise ValueError(
                f"model.max_segment_len={cfg.max_segment_len} > the LM's max_position_embeddings "
                f"({text.max_position_embeddings})"
            )
        self.lm = lm
        self.vision = build_vision_tower(cfg)
        self.projector = Projector(cfg.vision_width, dim, cfg.projector or "mlp2x_gelu")
        # zero: a document starts as the LM would read it alone, its rank learned from there
        self.rank_emb = nn.Embedding(cfg.max_docs, dim)
        # zero: which part of the sequence a token is in (document picture or text, query picture,
        # question, answer), learned from there; a pretrained LM starts as it reads on its own
        self.type_emb = nn.Embedding(5, dim)
        self.copy = CopyHead(dim, cfg.copy_supervision) if cfg.copy_head else None
        self.init_own_weights()
        if cfg.adapter and not self.rank_emb.weight.is_meta:
            self.load_adapter(cfg.adapter)

    # what neither the LM nor the vision tower holds
    ADAPTER_PARTS = (
        "projector.",
        "rank_emb.",
        "type_emb.",
        "copy.",
    )

    def adapter_state(self) -> dict[str, torch.Tensor]:
        return {n: t for n, t in self.state_dict().items() if n.startswith(self.ADAPTER_PARTS)}

    def load_adapter(self, path: str) -> None:
        """Load ``adapter_state`` from a safetensors file; every tensor must fit this reader."""
        from safetensors.torch import load_file

        state, own = load_file(path), self.adapter_state()
        wrong = sorted(set(state) ^ set(own)) + [
            n for n in state.keys() & own.keys() if state[n].shape != own[n].shape
        ]
        if wrong:
            raise ValueError(
                f"model.adapter={path!r} does not fit this reader (model.copy_head, "
                "model.projector, model.max_docs and the LM width must match the exported run's): "
                f"{wrong[:4]}"
            )
        self.load_state_dict(state, strict=False)

    @property
    def hf_model(self) -> nn.Module:
        return self.lm

    @property
    def decoder(self) -> nn.Module:
        return self.lm.base_model

    def init_own_weights(self) -> None:
        """Initialise what the LM and the vision tower do not bring: projector, ranks, copy head."""
        super().init_own_weights([self.projector])

    def encode_images(self, pics: torch.Tensor) -> torch.Tensor:
        _, patches = self.vision(pics)  # (N, P, Wv)
        return self.projector(patches)  # (N, P, D)
