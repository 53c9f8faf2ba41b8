"""The reader a ``model`` config describes, native or Hugging Face, on the CPU or the meta
device."""

from __future__ import annotations

import contextlib
import logging

import torch
import torch.nn as nn

from rag_mm.config import ModelConfig
from rag_mm.model.layout import ReaderBase

log = logging.getLogger(__name__)


def build_reader(m: ModelConfig, vocab_size: int, meta: bool = False) -> ReaderBase:
    """``model`` config -> a freshly initialised reader (seed the global RNG first for a given
    init), or with ``meta`` one on the meta device with no memory and no init: its shapes can be
    counted and planned, and ``materialize`` gives it weights."""
    if m.question_first and m.pretrained:
        log.warning(
            "model.question_first=true with model.pretrained=%s: a pretrained reader learned to "
            "read its picture before the question; model.question_first=false keeps that order",
            m.pretrained,
        )
    if m.family == "native":
        from rag_mm.model.reader import Reader

        with torch.device("meta") if meta else contextlib.nullcontext():
            return Reader(m, vocab_size)
    if m.family == "hf_vlm":
        from rag_mm.model.hf_vlm import build_vlm_reader

        return build_vlm_reader(m, vocab_size, meta=meta)
    from rag_mm.model.hf_reader import HFReader, build_lm

    lm = build_lm(m, meta=meta, vocab_size=vocab_size)
    with torch.device("meta") if meta else contextlib.nullcontext():
        return HFReader(m, lm, vocab_size)


def materialize(reader: nn.Module, device: torch.device | str = "cpu") -> nn.Module:
    """Give a meta-device reader real, initialised weights on ``device`` (delayed init): each part
    is initialised as its own library would (the LM, or a VLM whole, by transformers, the vision
    tower by torch's defaults as open_clip builds it, the rest by the reader). Pretrained weights
    (``model.pretrained``, ``model.vision_checkpoint``, ``model.adapter``) are not read here: load
    them afterwards."""
    tied = _tied_pairs(reader)
    reader.to_empty(device=device)
    for owner, name, (src, src_name) in tied:  # to_empty may give each its own tensor: tie again
        setattr(owner, name, getattr(src, src_name))
    with torch.no_grad():
        if getattr(reader, "lm", None) is None and getattr(reader, "vlm", None) is None:
            # the native reader: its own init covers matrices and biases; norms and the rest
            # take their modules' defaults, as a reader built on the CPU has them
            for mod in reader.modules():
                if mod is not reader and hasattr(mod, "reset_parameters"):
                    mod.reset_parameters()
        for lm in (
            getattr(reader, "lm", None),
            getattr(reader, "vlm", None),
        ):  # a transformers model
            if lm is None:
                continue
            for mod in lm.modules():  # to_empty cleared the flags' meaning: initialise everything
                mod.__dict__.pop("_is_hf_initialized", None)
            lm.initialize_weights()
            lm.tie_weights()
        vision = getattr(reader, "vision", None)  # an open_clip tower; a VLM's tower is inside it
        if vision is None:
            reader.init_own_weights()
            return reader
        for mod in vision.modules():
            if mod is not vision and hasattr(mod, "reset_parameters"):
                mod.reset_parameters()
        for mod in vision.modules():  # after its out_proj's: attention zeroes that bias
            if isinstance(mod, nn.MultiheadAttention):
                mod._reset_parameters()
        for name in ("class_embedding", "positional_embedding"):  # open_clip: randn * width ** -0.5
            p = getattr(vision, name, None)
            if isinstance(p, nn.Parameter):
                nn.init.normal_(p, 0.0, p.shape[-1] ** -0.5)
        if hasattr(reader, "init_own_weights"):
            reader.init_own_weights()
        elif hasattr(reader, "_init_weights"):
            reader._init_weights()
    return reader


def _tied_pairs(model: nn.Module) -> list[tuple[nn.Module, str, tuple[nn.Module, str]]]:
    """(module, attribute, (module, attribute) first holding it) for every parameter reached a
    second time."""
    first: dict[int, tuple[nn.Module, str]] = {}
    out = []
    for mod in model.modules():
        for name, p in mod.named_parameters(recurse=False):
            if id(p) in first:
                out.append((mod, name, first[id(p)]))
            else:
                first[id(p)] = (mod, name)
    return out


def count_parameters(module: nn.Module) -> int:
    """Distinct parameters (tied weights counted once); works on the meta device."""
    return sum(p.numel() for p in {id(p): p for p in module.parameters()}.values())
