"""Offline tokenizers behind one small interface (``encode``, ``decode``, ``pad``, ``eot_id``,
``vocab_size``): open_clip's CLIP BPE, whose vocabulary ships inside the package (the default,
for randomly initialised readers), or a Hugging Face tokenizer saved in a local directory (a
pretrained reader's own)."""

from __future__ import annotations

import re
from functools import lru_cache
from pathlib import Path

import torch
from open_clip.tokenizer import SimpleTokenizer, basic_clean, whitespace_clean

# CLIP's BPE ends every pre-token with a word end, so its decoding spaces every digit and the point
# inside a number ("13.0" comes back "1 3 . 0"): the spaces between digits, and around a point or
# comma between digits, are taken out again
_DIGIT_GAP = re.compile(r"(?<=\d) (?:([.,]) )?(?=\d)")


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
        return _DIGIT_GAP.sub(lambda m: m.group(1) or "", self._bpe.decode(ids).strip())

    def spans(self, text: str) -> tuple[str, list[int], list[tuple[int, int]]] | None:
        """``text`` as the tokenizer reads it (cleaned, case kept), its token ids and each token's
        character span in it; None where lowercasing changes the text's length (spans would
        drift)."""
        bpe = self._bpe
        cased = whitespace_clean(basic_clean(text))
        lower = cased.lower()
        if len(lower) != len(cased):
            return None
        ids, spans = [], []
        for m in bpe.pat.finditer(lower):
            raw = m.group().encode("utf-8")
            pieces = bpe.bpe("".join(bpe.byte_encoder[b] for b in raw)).split(" ")
            done = 0  # bytes of the pre-token before this piece
            for piece in pieces:
                n = len(piece.removesuffix("</w>"))  # one character per byte (byte_encoder)
                start = m.start() + len(raw[:done].decode("utf-8", "ignore"))
                done += n
                end = m.start() + len(raw[:done].decode("utf-8", "ignore"))
                ids.append(bpe.encoder[piece])
                spans.append((start, end))
        return cased, ids, spans

    def spell(self, ids: list[int], sources: list[str]) -> str:
        """The answer ``ids`` as written in the first of ``sources`` (the passages the reader read,
        the question) that holds them as a run of tokens, else decoded. The decoding cannot tell
        where the text had spaces ("1f62f" and "1 f 6 2 f" are the same tokens); a copied span's
        source can."""
        ids = [i for i in ids if i != self.eot_id]
        n = len(ids)
        for src in sources if n else ():
            read = self.spans(src)
            if read is None:
                continue
            text, src_ids, spans = read
            for i in range(len(src_ids) - n + 1):
                if src_ids[i : i + n] == ids:  # (a byte-level BPE's span holds its space)
                    return text[spans[i][0] : spans[i + n - 1][1]].strip()
        return self.decode(ids)

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

    def spans(self, text: str) -> tuple[str, list[int], list[tuple[int, int]]] | None:
        """As ``Tokenizer.spans``, from a fast tokenizer's offsets; None for a slow tokenizer."""
        if not self._tok.is_fast:
            return None
        enc = self._tok(text, add_special_tokens=False, return_offsets_mapping=True)
        return text, list(enc["input_ids"]), [tuple(o) for o in enc["offset_mapping"]]


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def has_tokenizer(path: str | None) -> bool:
    """Whether a local directory holds a saved Hugging Face tokenizer."""
    return bool(path) and any((Path(path) / f).is_file() for f in TOKENIZER_FILES)


@lru_cache(maxsize=4)
def get_tokenizer(path: str | None = None) -> Tokenizer:
    """The tokenizer saved in the local directory ``path``, or the bundled CLIP BPE for None."""
    return HFTokenizer(path) if path else Tokenizer()
