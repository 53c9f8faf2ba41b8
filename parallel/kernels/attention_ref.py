"""The PyTorch paths of every attention layout: the masks, the reference (the tests' ground truth
and the fused kernels' fallback check) and SDPA, for ``(B, H, S, D)`` tensors and packed
``(T, H, D)`` ones. ``attention.py`` holds the backend switch over these and the fused kernels;
its module docstring describes the layouts."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def layout_mask(seg_offsets: torch.Tensor, seq_len: int) -> torch.Tensor:
    """Boolean mask ``(B, 1, S, S)`` (True = may attend) for the retrieval block layout.

    Padding rows get no allowed key; callers that feed SDPA use ``sdpa_safe_mask``.
    """
    B = seg_offsets.shape[0]
    pos = torch.arange(seq_len, device=seg_offsets.device)  # (S,)
    # segment id of every position: number of interior boundaries at or before it
    # (B, S)
    seg = torch.searchsorted(
        seg_offsets[:, 1:].contiguous(), pos.expand(B, -1).contiguous(), right=True
    )
    n_seg = seg_offsets.shape[1] - 1
    query_seg = n_seg - 1
    valid = pos[None, :] < seg_offsets[:, -1:]  # (B, S)
    q_seg, k_seg = seg[:, :, None], seg[:, None, :]  # (B, S, 1), (B, 1, S)
    same_doc = (q_seg == k_seg) & (q_seg < query_seg)
    query_to_docs = (q_seg == query_seg) & (k_seg < query_seg)
    query_causal = (
        (q_seg == query_seg) & (k_seg == query_seg) & (pos[None, None, :] <= pos[None, :, None])
    )
    allowed = (same_doc | query_to_docs | query_causal) & valid[:, :, None] & valid[:, None, :]
    return allowed[:, None]  # (B, 1, S, S)


def sdpa_safe_mask(mask: torch.Tensor) -> torch.Tensor:
    """Let rows with no allowed key attend to themselves so SDPA yields no NaN (outputs ignored)."""
    S = mask.shape[-1]
    empty = ~mask.any(-1, keepdim=True)  # (B, 1, S, 1)
    eye = torch.eye(S, dtype=torch.bool, device=mask.device)
    return mask | (empty & eye)


def reference_attention(
    q, k, v, *, causal: bool = False, seg_offsets=None, scale: float | None = None
):
    """Plain PyTorch attention with an explicit (S, S) score matrix; the ground truth for tests."""
    S = q.shape[-2]
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    # fp32 math for 16-bit inputs, fp64 stays fp64
    acc = torch.promote_types(q.dtype, torch.float32)
    scores = torch.matmul(q.to(acc), k.to(acc).transpose(-1, -2)) * scale  # (B, H, S, S)
    allowed = None
    if seg_offsets is not None:
        allowed = layout_mask(seg_offsets, S)
    elif causal:
        allowed = torch.ones(S, S, dtype=torch.bool, device=q.device).tril()
    if allowed is not None:
        scores = scores.masked_fill(~allowed, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    probs = torch.nan_to_num(probs, nan=0.0)  # fully masked (padding) rows -> zero output
    return torch.matmul(probs, v.to(acc)).to(q.dtype)


def sdpa_attention(q, k, v, *, causal: bool = False, seg_offsets=None, scale: float | None = None):
    if seg_offsets is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)
    mask = layout_mask(seg_offsets, q.shape[-2])
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=sdpa_safe_mask(mask), scale=scale)
    valid = mask.any(-1, keepdim=True)  # (B, 1, S, 1): padding rows -> zero, as the kernel does
    return out * valid


def reference_varlen_attention(
    q, k, v, cu_seqlens, *, causal: bool = False, scale: float | None = None
):
    """Packed ``(T, H, D)`` reference: plain attention on every sequence; tokens past the last one
    -> 0."""
    out = torch.zeros_like(q)
    bounds = cu_seqlens.tolist()
    for a, e in zip(bounds[:-1], bounds[1:]):
        if e > a:
            seq = lambda t, a=a, e=e: t[a:e].transpose(0, 1)[None]  # noqa: E731  (1, H, L, D)
            o = reference_attention(seq(q), seq(k), seq(v), causal=causal, scale=scale)
            out[a:e] = o[0].transpose(0, 1)
    return out


def pad_packed(x: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int) -> torch.Tensor:
    """``(T, H, D)`` packed -> ``(B, H, max_seqlen, D)`` zero-padded (what padded SDPA consumes)."""
    lens = (cu_seqlens[1:] - cu_seqlens[:-1]).long()  # (B,)
    pos = torch.arange(max_seqlen, device=x.device)
    valid = pos[None, :] < lens[:, None]  # (B, M)
    # (B, M)
    idx = (cu_seqlens[:-1].long()[:, None] + pos[None, :]).clamp(max=max(x.shape[0] - 1, 0))
    padded = x[idx] * valid[:, :, None, None]  # (B, M, H, D)
    return padded.transpose(1, 2)


def sdpa_varlen_attention(
    q, k, v, cu_seqlens, max_seqlen: int, *, causal: bool = False, scale=None
):
    """Packed attention the usual way: pad to ``max_seqlen``, mask padded keys, SDPA, unpack."""
    lens = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    pos = torch.arange(max_seqlen, device=q.device)
    key_ok = pos[None, :] < lens[:, None]  # (B, M)
    mask = key_ok[:, None, None, :]  # (B, 1, 1, M)
    if causal:
        mask = mask & torch.ones(max_seqlen, max_seqlen, dtype=torch.bool, device=q.device).tril()
    mask = mask | torch.eye(max_seqlen, dtype=torch.bool, device=q.device)  # padded rows: no NaN
    qp, kp, vp = (pad_packed(t, cu_seqlens, max_seqlen) for t in (q, k, v))
    o = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=mask, scale=scale)  # (B, H, M, D)
    o = o.transpose(1, 2)  # (B, M, H, D)
    out = q.new_zeros(q.shape)
    tok = (cu_seqlens[:-1].long()[:, None] + pos[None, :])[key_ok]  # (T_valid,)
    return out.index_put((tok,), o[key_ok])
