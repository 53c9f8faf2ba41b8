"""Encode a corpus with the retriever's document tower and build, save and check a faiss index: the
same program as ``rag_mm build-index`` (rag_mm/build_index.py), runnable from a checkout.

    python scripts/build_index.py corpus=... checkpoint=RUN out=FILE [factory=auto] [queries=...]
    torchrun --nproc_per_node=2 scripts/build_index.py ...
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from rag_mm.build_index import main  # noqa: E402

if __name__ == "__main__":
    raise SystemExit(main())
