"""Convert your own data into rag_mm shards: VQA-style questions and pictures, or a document corpus.

    python scripts/convert.py vqa --questions Q.json --annotations A.json --images DIR --out OUT \
        --split train
    python scripts/convert.py corpus --docs DIR --out OUT
    python scripts/convert.py corpus --shards 'web/{00000..00009}.tar' --out OUT
    python scripts/convert.py hf --path DIR_OR_PARQUET_GLOB --split train --image-column image \
        --question-column question --answers-column answers [--id-column question_id]
    python scripts/convert.py kb --jsonl kb.jsonl | --infoseek Wiki6M_ver_1_0.jsonl \
        | --evqa encyclopedic_kb_wiki.json | --okvqa okvqa_full_corpus.csv \
        [--images DIR] [--linked QUESTION_FILES ...] --out OUT
    python scripts/convert.py infoseek --questions infoseek_val.jsonl \
        --withkb infoseek_val_withkb.jsonl --qtype infoseek_val_qtype.jsonl \
        --images DIR --out OUT --split val
    python scripts/convert.py evqa --csv val.csv --images DIR --out OUT --split val

The layouts, the shard schema and the choices made are described in rag_mm/data/convert.py
(rag_mm/data/convert_hf.py for Hugging Face data sets, rag_mm/data/convert_kb.py and
convert_kvqa.py for knowledge-VQA data; docs/knowledge_vqa.md). Question converters normalise the
human answers as the VQA release did (rag_mm/data/convert_answers.py; --keep-answers: as given).
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from rag_mm.data.convert_cli import main  # noqa: E402

if __name__ == "__main__":
    raise SystemExit(main())
