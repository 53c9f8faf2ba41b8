"""Errors raised by the retrieval index layer, with messages that say what was expected."""

from __future__ import annotations


class RetrievalIndexError(Exception):
    """Base class for the errors of the index layer (``IndexError`` is taken by Python)."""


class CorruptIndexError(RetrievalIndexError, OSError):
    """The index file is truncated, altered or not an index file at all.

    Raised before faiss sees the bytes, so a damaged file never reaches the C++ reader.
    """


class IndexMismatchError(RetrievalIndexError, ValueError):
    """The index file is intact but was built for something else (other encoder, corpus, dim...).

    ``mismatches`` maps each field to ``(expected, found)``.
    """

    def __init__(self, path: str, mismatches: dict[str, tuple[object, object]]):
        self.path = path
        self.mismatches = mismatches
        lines = [f"  {k}: expected {exp!r}, found {got!r}" for k, (exp, got) in mismatches.items()]
        hint = ""
        if "encoder_hash" in mismatches or "corpus_hash" in mismatches:
            hint = (
                "\nThe index is stale: re-embed the memory with the current encoder and rebuild it."
            )
        super().__init__(
            f"index {path} does not match what was expected:\n" + "\n".join(lines) + hint
        )


class RefreshInterrupted(Exception):
    """An embedding pass over the memory was stopped between two of its forward passes, at the
    caller's request (a preemption signal): ``done`` of ``total`` passes had run. The index that
    served before the refresh still serves."""

    def __init__(self, done: int, total: int):
        self.done, self.total = done, total
        super().__init__(f"embedding of the memory stopped after {done} of {total} passes")
