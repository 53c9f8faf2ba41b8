from rag_mm.model.reader import Reader, ReaderOutput

__all__ = ["Reader", "ReaderOutput"]
