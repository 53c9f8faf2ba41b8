"""Offline tokenizers behind one small interface (``encode``, ``decode``, ``pad``, ``eot_id``,
``vocab_size``): open_clip's CLIP BPE, whose vocabulary ships inside the package (the default,
for randomly initialised readers), or a Hugging Face tokenizer saved in a local directory (a
pretrained reader's own)."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

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


class HFTokenizer(Tokenizer):
    """A Hugging Face tokenizer from a local directory (``AutoTokenizer``, offline). Its
    end-of-sequence token ends answers, as the pretrained model learned it."""

    def __init__(self, path: str) -> None:
        from transformers import AutoTokenizer

        try:
            self._tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
        except (OSError, ValueError) as exc:
            raise ValueError(f"no usable tokenizer in {path!r}: {exc}") from None
        if self._tok.eos_token_id is None:
            raise ValueError(
                f"the tokenizer in {path!r} has no end-of-sequence token to end answers with"
            )
        self.vocab_size = len(self._tok)
        self.eot_id = int(self._tok.eos_token_id)
        self.pad_id = 0

    def encode(self, text: str) -> list[int]:
        return self._tok(text, add_special_tokens=False)["input_ids"]

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(
            [i for i in ids if i != self.eot_id], skip_special_tokens=True
        ).strip()


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def has_tokenizer(path: str | None) -> bool:
    """Whether a local directory holds a saved Hugging Face tokenizer."""
    return bool(path) and any((Path(path) / f).is_file() for f in TOKENIZER_FILES)


@lru_cache(maxsize=4)
def get_tokenizer(path: str | None = None) -> Tokenizer:
    """The tokenizer saved in the local directory ``path``, or the bundled CLIP BPE for None."""
    return HFTokenizer(path) if path else Tokenizer()
