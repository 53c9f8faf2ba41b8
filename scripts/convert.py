"""Convert your own data into rag_mm shards: VQA-style questions and pictures, or a document corpus.

    python scripts/convert.py vqa --questions Q.json --annotations A.json --images DIR --out OUT --split train
    python scripts/convert.py corpus --docs DIR --out OUT
    python scripts/convert.py corpus --shards 'web/{00000..00009}.tar' --out OUT

The layouts, the shard schema and the choices made are described in rag_mm/data/convert.py.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from rag_mm.data.convert import main  # noqa: E402

if __name__ == "__main__":
    raise SystemExit(main())
