"""rag_mm's attention inside Hugging Face models, through transformers' ``AttentionInterface``.

``register()`` adds one implementation per backend, ``rag_mm_<backend>`` (``rag_mm_auto``,
``rag_mm_fused``, ``rag_mm_sdpa``, ``rag_mm_flex``, ``rag_mm_reference``): a model built with
``attn_implementation="rag_mm_fused"`` has every attention module of its own code call
``parallel.kernels.attention`` with that backend. The backend is in the name, not in a global,
so two readers with different backends coexist.

The retrieval layout travels as a keyword argument, ``seg_offsets`` (B, n_seg + 1), that the
reader passes to the base model's forward; transformers hands model keyword arguments down to
every attention call. Without it (the model used on its own) attention is causal, as the
model's default. No mask function is registered: transformers builds no mask for an
implementation it has no mask function for, and the kernels build theirs from the offsets.
"""

from __future__ import annotations

import functools
import logging
import math

import torch

from parallel.kernels.attention import BACKENDS, attention

log = logging.getLogger(__name__)

PREFIX = "rag_mm_"
_calls = [0]  # attention calls so far in this process: ``check_dispatch`` counts a probe's


def implementation(backend: str) -> str:
    """The ``attn_implementation`` name of a backend, registered on first use."""
    register()
    return PREFIX + backend


def rag_mm_attention(
    module,
    query,
    key,
    value,
    attention_mask,
    scaling=None,
    dropout: float = 0.0,
    *,
    backend: str = "auto",
    seg_offsets=None,
    sliding_window=None,
    softcap=None,
    **_kwargs,
):
    """query (B, H, S, hd), key / value (B, Hkv, S, hd) -> ((B, S, H, hd), None), as every
    transformers attention function returns. Grouped-query K/V heads go to ``attention`` as they are
    (flex reads them in place; the other kernels get them repeated, as HF's ``repeat_kv``). q and k
    take v's dtype: under autocast v comes from a bf16 matmul, q and k from RoPE's fp32."""
    S = query.shape[-2]
    if not torch.compiler.is_compiling():  # a Python counter in a compiled block is a guard that
        # fails on every call: each call would recompile (``check_dispatch`` is eager)
        _calls[0] += 1
    if softcap is not None:
        raise ValueError(
            f"{type(module).__name__}: attention logit soft-capping ({softcap}) is not "
            "supported by rag_mm's attention kernels"
        )
    if sliding_window is not None and sliding_window < S:
        raise ValueError(
            f"{type(module).__name__}: a sliding window of {sliding_window} tokens is shorter "
            f"than the reader's sequence ({S}); rag_mm's layouts attend over whole segments"
        )
    if dropout > 0.0:
        _warn_dropout(type(module).__name__, dropout)
    if query.dtype != value.dtype:  # under autocast RoPE hands q and k over in fp32, v in bf16:
        query, key = query.to(value.dtype), key.to(value.dtype)  # one dtype, the matmuls' own
    scale = 1.0 / math.sqrt(query.shape[-1]) if scaling is None else float(scaling)
    if seg_offsets is None:
        y = attention(query, key, value, causal=True, backend=backend, scale=scale)
    else:
        y = attention(query, key, value, seg_offsets=seg_offsets, backend=backend, scale=scale)
    return y.transpose(1, 2).contiguous(), None


@functools.cache
def _warn_dropout(module: str, p: float) -> None:
    log.warning(
        "%s: attention dropout %.3g is not applied by rag_mm's attention kernels", module, p
    )


@functools.lru_cache(maxsize=1)
def register() -> None:
    """Register ``rag_mm_<backend>`` for every backend with transformers (once per process)."""
    from transformers import AttentionInterface

    for b in BACKENDS:
        AttentionInterface.register(PREFIX + b, functools.partial(rag_mm_attention, backend=b))


def check_dispatch(lm) -> None:
    """Fail unless every decoder layer of ``lm`` calls its attention through ``AttentionInterface``.

    A model whose attention classes ignore the interface (its own dispatch table, remote code)
    would run its own causal attention and silently read documents as one causal stream; a
    two-token probe forward counts the calls that reach rag_mm instead."""
    text = lm.config.get_text_config()
    layers = getattr(text, "num_hidden_layers", None)
    dim = text.hidden_size
    p = next(lm.parameters())
    probe = torch.zeros(1, 2, dim, dtype=p.dtype, device=p.device)
    before = _calls[0]
    with torch.no_grad():
        lm.base_model(
            inputs_embeds=probe,
            position_ids=torch.arange(2, device=p.device)[None],
            seg_offsets=torch.tensor([[0, 1, 2]], dtype=torch.int32, device=p.device),
            use_cache=False,
        )
    calls = _calls[0] - before
    if layers and calls < layers:
        raise ValueError(
            f"{type(lm).__name__}: {layers - calls} of its {layers} layers do not call their "
            "attention through transformers' AttentionInterface, so rag_mm's retrieval layout "
            "cannot be applied to them (the model family dispatches attention itself)"
        )
