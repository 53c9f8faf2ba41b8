"""Offline tokenizer: open_clip's CLIP BPE, whose vocabulary ships inside the package."""

from __future__ import annotations

from functools import lru_cache

import torch
from open_clip.tokenizer import SimpleTokenizer


class Tokenizer:
    """Text <-> token ids without start/end markers; ``eot_id`` ends every answer."""

    def __init__(self) -> None:
        self._bpe = SimpleTokenizer()
        self.vocab_size = len(self._bpe.encoder)  # 49408 for CLIP's BPE
        self.eot_id = self._bpe.eot_token_id
        self.pad_id = 0  # any id works: padded positions are masked out of attention and loss

    def encode(self, text: str) -> list[int]:
        return self._bpe.encode(text)

    def decode(self, ids: list[int]) -> str:
        ids = [i for i in ids if i != self.eot_id]
        return self._bpe.decode(ids).strip()

    def pad(self, seqs: list[list[int]], max_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Truncate to ``max_len`` and right-pad: ``(ids (N, L), lengths (N,))``."""
        seqs = [s[:max_len] for s in seqs]
        width = max(1, max((len(s) for s in seqs), default=1))
        ids = torch.full((len(seqs), width), self.pad_id, dtype=torch.long)
        for i, s in enumerate(seqs):
            if s:
                ids[i, : len(s)] = torch.tensor(s, dtype=torch.long)
        return ids, torch.tensor([len(s) for s in seqs], dtype=torch.long)


@lru_cache(maxsize=1)
def get_tokenizer() -> Tokenizer:
    return Tokenizer()
