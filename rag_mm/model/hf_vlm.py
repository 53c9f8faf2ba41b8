"""The reader on a Hugging Face vision-language model (``model.family=hf_vlm``): LLaVA,
PaliGemma and their kin, as ``AutoModelForImageTextToText`` builds them.

The VLM comes from a local ``save_pretrained`` directory (``model.pretrained``, offline), or from a
config (``model.vlm_config``: a family at the reader's size fields, a public preset, or a
config.json; ``rag_mm.model.vlm_presets``) with random init, or on the meta device for planning.

Pictures (the data's CLIP-normalised ``model.image_size`` pictures, mapped back to 0..1) go
through the VLM's own image processor (resize and normalisation as the model was trained with:
the saved one, or for a config without one CLIP's mean/std at the tower's image size) and its own
``get_image_features`` (vision tower, feature layer and projector), so a picture's features are
the VLM's own. They take the place of the ``<image>`` placeholders the VLM's forward would fill:
[picture features, question, answer] with positions 0.. is the VLM's own forward on
``[<image> x P, question, answer]``. The language model runs rag_mm's attention
(``hf_attention``, the text sub-config only; the vision tower keeps SDPA), so retrieved documents
attend within themselves and the query attends to every document and causally to itself.

Not supported, refused at build: multimodal rotary positions (Qwen2-VL's M-RoPE: the layout's
positions are 1-D) and towers whose ``get_image_features`` needs more than the pixels (LLaVA-NeXT's
image sizes, Qwen2-VL's grids). PaliGemma runs causally over its image and prompt (its own
forward does too without ``token_type_ids``; its pretrained weights saw a bidirectional prefix).
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
from pathlib import Path

import torch
import torch.nn as nn

from rag_mm.config import ModelConfig, known_model_type, transformers_version
from rag_mm.data.pipeline import MEAN as DATA_MEAN
from rag_mm.data.pipeline import STD as DATA_STD
from rag_mm.model import vlm_presets
from rag_mm.model.copy_head import CopyHead
from rag_mm.model.hf_attention import check_dispatch, implementation
from rag_mm.model.hf_base import HFReaderBase

log = logging.getLogger(__name__)

# the vision tower attends bidirectionally over its patches: transformers' own SDPA
VISION_ATTENTION = "sdpa"


def _auto_classes() -> list:
    """The transformers auto classes that build a VLM (``AutoModelForVision2Seq`` where it still
    exists)."""
    import transformers

    return [
        c
        for c in (
            getattr(transformers, n, None)
            for n in ("AutoModelForImageTextToText", "AutoModelForVision2Seq")
        )
        if c is not None
    ]


def _vlm_class(config) -> type | None:
    """The model class an auto VLM class maps ``config`` to, or None."""
    for auto in _auto_classes():
        if type(config) in auto._model_mapping:
            return auto._model_mapping[type(config)]
    return None


def vlm_config(cfg: ModelConfig, vocab_size: int):
    """The VLM's ``PretrainedConfig`` from ``model.pretrained`` or ``model.vlm_config``; a clear
    ``ValueError`` for anything that is not a vision-language model rag_mm can read."""
    from transformers import AutoConfig

    if cfg.pretrained:
        where = f"model.pretrained={cfg.pretrained!r}"
        try:
            config = AutoConfig.from_pretrained(cfg.pretrained, local_files_only=True)
        except (OSError, ValueError, KeyError) as exc:
            raise ValueError(
                f"{where}: transformers cannot read its config.json: {str(exc)[:300]}"
            ) from None
    else:
        name, where = cfg.vlm_config, f"model.vlm_config={cfg.vlm_config!r}"
        if name in vlm_presets.SMALL:
            fields = vlm_presets.SMALL[name](cfg, vocab_size)
        elif name in vlm_presets.PRESETS:
            # a deep copy: the config pops keys
            fields = json.loads(json.dumps(vlm_presets.PRESETS[name]))
        elif name and (Path(name).is_file() or (Path(name) / "config.json").is_file()):
            path = Path(name)
            fields = json.loads((path / "config.json" if path.is_dir() else path).read_text())
        else:
            raise ValueError(f"{where} is none of {vlm_presets.names()} and no config.json")
        fields = dict(fields)
        model_type = fields.pop("model_type", None)
        fields.pop("architectures", None)
        if not known_model_type(model_type):
            raise ValueError(
                f"{where}: transformers {transformers_version()} has no model_type {model_type!r}"
            )
        try:
            config = AutoConfig.for_model(model_type, **fields)
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(
                f"{where}: transformers cannot build a {model_type} config from these fields: "
                f"{str(exc)[:300]}"
            ) from None
    if _vlm_class(config) is None:
        arch = ", ".join(getattr(config, "architectures", None) or []) or config.model_type
        raise ValueError(
            f"{where} holds a {arch} model, not a vision-language model: "
            "AutoModelForImageTextToText builds none of that type "
            "(a causal LM is model=hf with model.pretrained)"
        )
    text = config.get_text_config()
    rope = getattr(text, "rope_scaling", None) or getattr(text, "rope_parameters", None) or {}
    if "mrope_section" in rope or rope.get("type") == "mrope" or rope.get("rope_type") == "mrope":
        raise ValueError(
            f"{where}: {config.model_type} uses multimodal rotary positions (M-RoPE: time, height, "
            "width per picture token); the reader's retrieval layout has 1-D positions"
        )
    return config


def _attn_implementations(config, impl: str) -> dict[str, str]:
    """rag_mm's attention for the text sub-config, transformers' SDPA for the others (the tower)."""
    text = config.get_text_config()
    return {
        k: impl if getattr(config, k, None) is text else VISION_ATTENTION
        for k in getattr(config, "sub_configs", {})
    }


def build_vlm(cfg: ModelConfig, vocab_size: int, meta: bool = False) -> nn.Module:
    """The VLM with rag_mm's attention in its language model, fp32, on the CPU or the meta
    device."""
    config = vlm_config(cfg, vocab_size)
    impl = implementation(cfg.attention_backend)
    attn = _attn_implementations(config, impl)
    cls = _vlm_class(config)
    try:
        if cfg.pretrained and not meta:
            vlm = cls.from_pretrained(
                cfg.pretrained, local_files_only=True, attn_implementation=attn, dtype=torch.float32
            )
            source = f"from {cfg.pretrained}"
        else:
            with torch.device("meta") if meta else torch.device("cpu"):
                vlm = cls._from_config(config, attn_implementation=attn, dtype=torch.float32)
            source = "random init on the meta device" if meta else "random init"
    except (OSError, ValueError, KeyError, TypeError) as exc:
        where = (
            f"model.pretrained={cfg.pretrained!r}"
            if cfg.pretrained
            else f"model.vlm_config={cfg.vlm_config!r}"
        )
        raise ValueError(
            f"{where}: transformers cannot build this VLM with rag_mm's attention ({impl}): "
            f"{type(exc).__name__}: {str(exc)[:300]}"
        ) from None
    if not meta:
        check_dispatch(vlm.get_decoder())
    log.info(
        "reader VLM: %s, %s, text attention %s, vision attention %s",
        cls.__name__,
        source,
        impl,
        VISION_ATTENTION,
    )
    return vlm


def image_processor(cfg: ModelConfig, config):
    """The VLM's image processor: the one saved beside ``model.pretrained``, else CLIP's
    (OpenAI mean/std, bicubic) resizing to the vision tower's image size."""
    from transformers import AutoImageProcessor, CLIPImageProcessor

    if cfg.pretrained and any(
        (Path(cfg.pretrained) / f).is_file()
        for f in ("preprocessor_config.json", "processor_config.json")
    ):
        try:
            proc = AutoImageProcessor.from_pretrained(cfg.pretrained, local_files_only=True)
        except (OSError, ValueError, KeyError) as exc:
            raise ValueError(
                f"model.pretrained={cfg.pretrained!r}: its image processor does not load: "
                f"{str(exc)[:300]}"
            ) from None
        log.info("reader VLM pictures: %s from %s", type(proc).__name__, cfg.pretrained)
        return proc
    side = config.vision_config.image_size
    log.info(
        "reader VLM pictures: no saved image processor; CLIP's mean/std, bicubic, at the tower's "
        "%d px",
        side,
    )
    return CLIPImageProcessor(
        size={"height": side, "width": side},
        do_center_crop=False,
        image_mean=list(vlm_presets.CLIP_MEAN),
        image_std=list(vlm_presets.CLIP_STD),
    )


def tp_divisor(cfg: ModelConfig, vocab_size: int = 49408) -> int:
    """What tp must divide: the language model's query heads and the tower's heads (key/value
    heads tp does not divide are replicated; ``vocab_size``: the tokenizer's, which only a small
    config's vocabulary depends on)."""
    config = vlm_config(cfg, vocab_size)
    text, vision = config.get_text_config(), config.vision_config
    return math.gcd(text.num_attention_heads, vision.num_attention_heads)


class HFVLMReader(HFReaderBase):
    def __init__(self, cfg: ModelConfig, vlm: nn.Module, vocab_size: int, processor=None) -> None:
        """``vlm``: from ``build_vlm``; ``vocab_size``: the tokenizer's, at most the VLM's
        embedding rows; ``processor``: its image processor (``image_processor``)."""
        super().__init__()
        self.cfg = cfg
        meta = next(vlm.parameters()).is_meta
        rows = vlm.get_input_embeddings().num_embeddings
        if vocab_size > rows:
            msg = (
                f"the tokenizer has {vocab_size} tokens but the VLM embeds {rows}: use the VLM's "
                "own tokenizer (model.pretrained holding one, or model.tokenizer)"
            )
            if not meta:
                raise ValueError(msg)
            log.warning("%s (planning on the meta device goes on)", msg)
        self.vocab_size = vocab_size
        self.max_docs, self.max_segment_len, self.max_answer = (
            cfg.max_docs,
            cfg.max_segment_len,
            cfg.max_answer,
        )
        self.question_first = cfg.question_first
        self.query_prefix = cfg.query_prefix
        text = vlm.config.get_text_config()
        dim = text.hidden_size
        # Gemma 2 caps its logits after the head
        self.softcap = getattr(text, "final_logit_softcapping", None)
        if (
            getattr(text, "max_position_embeddings", None)
            and cfg.max_segment_len > text.max_position_embeddings
        ):
            raise ValueError(
                f"model.max_segment_len={cfg.max_segment_len} > the VLM's max_position_embeddings "
                f"({text.max_position_embeddings})"
            )
        self.vlm = vlm
        self.processor = processor if processor is not None else image_processor(cfg, vlm.config)
        # zero: a document starts as the VLM would read it alone, its rank learned from there
        self.rank_emb = nn.Embedding(cfg.max_docs, dim)
        # zero: which part of the sequence a token is in, learned from there
        self.type_emb = nn.Embedding(5, dim)
        self.copy = CopyHead(dim, cfg.copy_supervision) if cfg.copy_head else None
        self.init_own_weights()
        if not meta:
            self._check_pictures()

    @property
    def hf_model(self) -> nn.Module:
        return self.vlm

    def _check_pictures(self) -> None:
        """One picture through the tower at build: a family whose features need more than the
        pixels (image sizes, grids) fails here, by name, not in the first training step."""
        pic = torch.zeros(
            1,
            3,
            self.cfg.image_size,
            self.cfg.image_size,
            device=next(self.vlm.parameters()).device,
        )
        try:
            with torch.no_grad():
                feats = self.encode_images(pic)
        except (TypeError, ValueError, RuntimeError, AttributeError) as exc:
            raise ValueError(
                f"{type(self.vlm).__name__}: get_image_features(pixel_values) does not give one "
                f"feature per picture token ({type(exc).__name__}: {str(exc)[:200]}); "
                "the reader supports towers that need only the pixels"
            ) from None
        if feats.dim() != 3 or feats.shape[-1] != self.vlm.config.get_text_config().hidden_size:
            raise ValueError(
                f"{type(self.vlm).__name__}: picture features of shape {tuple(feats.shape)}, "
                "not (pictures, tokens, text width)"
            )

    @property
    def decoder(self) -> nn.Module:
        """The VLM's language model without its head (transformers' ``get_decoder``)."""
        return self.vlm.get_decoder()

    def pixel_values(self, pics: torch.Tensor) -> torch.Tensor:
        """(N, 3, H, W) CLIP-normalised data pictures -> (N, 3, Hv, Wv) as the VLM's processor
        prepares a 0..1 picture (its resize and normalisation; no rescale: already 0..1)."""
        if pics.is_meta:  # shapes only: the processor's output size
            side = self.vlm.config.vision_config.image_size
            return torch.empty(pics.shape[0], 3, side, side, device="meta")
        # (N, 3, H, W) in 0..1
        raw = pics.float() * DATA_STD.to(pics.device) + DATA_MEAN.to(pics.device)
        out = self.processor(images=raw, do_rescale=False, return_tensors="pt").pixel_values
        return out.to(pics.device)

    @property
    def picture_tower(self) -> nn.Module:
        return VLMPictureTower(self)

    def encode_images(self, pics: torch.Tensor) -> torch.Tensor:
        """(N, 3, H, W) -> (N, P, D): the VLM's own picture features (tower, layer, projector)."""
        dtype = next(self.vlm.parameters()).dtype
        out = self.vlm.get_image_features(pixel_values=self.pixel_values(pics).to(dtype))
        # transformers 5: per-picture features in pooler_output
        feats = getattr(out, "pooler_output", out)
        return torch.stack(list(feats)) if isinstance(feats, (list, tuple)) else feats


class VLMPictureTower(nn.Module):
    """A VLM's vision tower as the vision warm-up reads a tower (``ReaderBase.picture_tower``):
    pictures -> (pooled (N, W), tokens (N, P, W)). The tokens are what the VLM's projector reads
    (its feature layer and selection applied: LLaVA's layer and CLS drop, PaliGemma's and Gemma
    3's last layer), caught on the projector's input, so the warm-up trains what the reader reads
    and nothing model-specific is written here; pooled is their mean (the towers differ in whether
    they have a pooled output at all). Its only submodule is the VLM's tower: the projector runs
    but is not trained by the warm-up, as the native reader's ``image_proj`` is not. (Named
    ``tower``, not ``vision_tower``: the warm-up's optimizer trains it at its own rate, which
    ``optim.vision_lr_scale`` must not scale.)"""

    def __init__(self, reader: HFVLMReader) -> None:
        super().__init__()
        inner = getattr(reader.vlm, "model", None)
        tower = getattr(inner, "vision_tower", None)
        projector = getattr(inner, "multi_modal_projector", None)
        if tower is None or projector is None:
            raise ValueError(
                f"{type(reader.vlm).__name__} has no model.vision_tower and "
                "model.multi_modal_projector: the vision warm-up (model.vision_ssl_steps) and "
                "optim.vision_lr_scale need them; set model.vision_ssl_steps=0 and "
                "optim.vision_lr_scale=1"
            )
        self.tower = tower
        # plain attributes, not submodules: neither is this module's to train
        self.__dict__["_projector"] = projector
        self.__dict__["_encode"] = reader.encode_images

    def forward(self, pics: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        caught: list[torch.Tensor] = []
        handle = self._projector.register_forward_pre_hook(
            lambda m, args, kwargs: caught.append(args[0] if args else next(iter(kwargs.values()))),
            with_kwargs=True,
        )
        try:
            self._encode(pics)
        finally:
            handle.remove()
        toks = caught[0]  # (N, P, W)
        return toks.mean(1), toks


def build_vlm_reader(cfg: ModelConfig, vocab_size: int, meta: bool = False) -> HFVLMReader:
    """``model`` config (family hf_vlm) -> the reader, on the CPU or the meta device."""
    vlm = build_vlm(cfg, vocab_size, meta=meta)
    processor = image_processor(cfg, vlm.config)
    with torch.device("meta") if meta else contextlib.nullcontext():
        return HFVLMReader(cfg, vlm, vocab_size, processor)
