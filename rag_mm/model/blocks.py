"""Transformer blocks of the reader: pre-norm attention + MLP, single-device code (nanoGPT style).

Attention goes through ``parallel.kernels.attention.attention`` only, so the backend switch
(fused kernel, SDPA, reference) is decided in one place.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from parallel.kernels.attention import attention


class SelfAttention(nn.Module):
    def __init__(self, dim: int, heads: int, dropout: float, backend: str) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.dropout = nn.Dropout(dropout)
        self.backend = backend

    def forward(self, x: torch.Tensor, seg_offsets: torch.Tensor) -> torch.Tensor:
        # head width comes from the projection, not from x: under tensor parallelism qkv holds
        # this rank's heads only (self.heads is divided in place), and the code stays the same
        # 3 x (B, H, S, hd)
        q, k, v = self.qkv(x).unflatten(-1, (3, self.heads, -1)).permute(2, 0, 3, 1, 4)
        y = attention(q, k, v, seg_offsets=seg_offsets, backend=self.backend)  # (B, H, S, hd)
        y = y.transpose(1, 2).flatten(2)  # (B, S, H * hd)
        return self.dropout(self.proj(y))


class MLP(nn.Module):
    """GPT-2's ``proj(GELU(fc x))``, or with ``gated`` Llama's SwiGLU ``proj(SiLU(gate x) * fc x)``.

    The gated form holds a third matrix, so its hidden width is two thirds of ``ratio * dim``:
    the same parameters and FLOPs as the plain one (as Llama sizes it)."""

    def __init__(self, dim: int, ratio: float, dropout: float, gated: bool = False) -> None:
        super().__init__()
        hidden = int(dim * ratio * 2 / 3) if gated else int(dim * ratio)
        self.gate = nn.Linear(dim, hidden) if gated else None
        self.fc = nn.Linear(dim, hidden)
        self.proj = nn.Linear(hidden, dim)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.gelu(self.fc(x)) if self.gate is None else F.silu(self.gate(x)) * self.fc(x)
        return self.dropout(self.proj(h))


class Block(nn.Module):
    def __init__(
        self,
        dim: int,
        heads: int,
        mlp_ratio: float,
        dropout: float,
        backend: str,
        gated_mlp: bool = False,
    ) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(dim)
        self.attn = SelfAttention(dim, heads, dropout, backend)
        self.ln2 = nn.LayerNorm(dim)
        self.mlp = MLP(dim, mlp_ratio, dropout, gated_mlp)

    def forward(self, x: torch.Tensor, seg_offsets: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x), seg_offsets)
        return x + self.mlp(self.ln2(x))


class Projector(nn.Module):
    """Picture tokens of the vision tower's width -> the reader's width: one linear map
    (``linear``), or LLaVA-1.5's two-layer MLP with GELU (``mlp2x_gelu``), which maps each patch
    through a nonlinearity of its own before the blocks mix patches with words."""

    def __init__(self, vision_width: int, dim: int, kind: str = "mlp2x_gelu") -> None:
        super().__init__()
        self.fc1 = nn.Linear(vision_width, dim)
        self.act = nn.GELU() if kind == "mlp2x_gelu" else nn.Identity()
        self.fc2 = nn.Linear(dim, dim) if kind == "mlp2x_gelu" else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))  # (..., vision_width) -> (..., dim)
