"""Ask a trained run about your own picture: its answer and the documents it read.

    python -m rag_mm.ask runs/demo --image fox.png --question "What does it eat?"
    python -m rag_mm.ask runs/demo --image fox.png --question "What does it eat?" --top-k 8 --json
    python -m rag_mm.ask runs/demo --questions queries.jsonl      # one JSON line per question
    python -m rag_mm.ask runs/demo --checkpoint 1500 --device cuda ...

The model is the one ``python -m rag_mm.evaluate`` builds: the run's saved config, the newest valid
checkpoint (or ``--checkpoint STEP``), its document memory indexed with the loaded document encoder.
A question goes through the evaluation pipeline's own decoding (``QueryStream._decode``: the picture
resized to ``model.image_size`` and normalised, the question tokenised with the run's tokenizer and
cut to ``model.max_question``; no augmentation) and is batched by the pipeline's ``collate``; the
answer is evaluation's greedy decoding (``rag_mm.evaluate.greedy_answers``) over the documents the
retriever returns. Pictures that ``scripts/convert.py --image-size`` center-cropped for training
are not cropped here: crop a non-square picture the same way for the same view.

Each document is shown with its id, the retriever's similarity (the index's inner product of the
unit query and document embeddings), the first line of its passage and where it came from: the
corpus shard and sample key (``<shard>#<__key__>``), and as ``origin`` the json's ``source`` (the
file or URL ``scripts/convert.py corpus`` read) where there is one. A closed-book run
(``retriever.mode=none``) reads no document: ``"documents": []``.

``--questions FILE.jsonl``: one ``{"image": path, "question": text}`` object per line, optionally
with ``"question_id"``; relative picture paths are taken from the file's folder. Every line and
picture is checked before the model is built.

Bad input (a missing or unreadable file, a file that is no picture, a run directory without a
checkpoint, a bad line) prints one message on stderr and exits with status 2.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import torch
from PIL import UnidentifiedImageError

from rag_mm.build import batch_inputs
from rag_mm.checks.paths import file_problem, short_error
from rag_mm.components import checkpoint
from rag_mm.components.metrics import json_safe
from rag_mm.config import reader_tokenizer
from rag_mm.data.pipeline import QueryStream, SkipCounter, StreamSpec, collate, decode_image
from rag_mm.data.urls import expand_urls
from rag_mm.evaluate import EvalError, greedy_answers, load_config, load_run, read_texts

log = logging.getLogger(__name__)


class AskError(Exception):
    """Bad input: ``main`` prints the message and returns 2."""


@dataclass
class Query:
    """One question about one picture."""

    image: Path
    question: str
    question_id: int | str | None = None  # echoed in the output (--questions)


# ------------------------------------------------------------------------------ input
def read_picture(path: Path, key: str = "--image") -> bytes:
    """The bytes of a picture file PIL can decode, as the pipeline decodes shard members; ``key``
    names the input in messages."""
    why = file_problem(key, path)
    if why:
        raise AskError(why)
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise AskError(f"{key}: cannot read {path}: {short_error(exc)}") from None
    try:
        decode_image({"png": data})  # the pipeline's decoder: it opens any format PIL knows
    except UnidentifiedImageError:  # its message names an in-memory buffer, not the file
        raise AskError(f"{key}: {path} is not a picture (no image format PIL reads)") from None
    except Exception as exc:  # a truncated or corrupt picture: PIL raises several types
        raise AskError(f"{key}: {path} is not a picture ({short_error(exc)})") from None
    return data


def read_queries(path: Path) -> list[Query]:
    """The questions of a jsonl file, each line checked (its picture too)."""
    why = file_problem("--questions", path)
    if why:
        raise AskError(why)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise AskError(f"--questions: cannot read {path}: {short_error(exc)}") from None
    queries = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"--questions: {path} line {n}"
        try:
            row = json.loads(line)
        except ValueError as exc:
            raise AskError(f"{where} is not JSON ({exc})") from None
        if (
            not isinstance(row, dict)
            or not isinstance(row.get("image"), str)
            or not isinstance(row.get("question"), str)
        ):
            raise AskError(
                f'{where}: expected {{"image": path, "question": text}} (optional "question_id")'
            )
        qid = row.get("question_id")
        if qid is not None and (not isinstance(qid, int | str) or isinstance(qid, bool)):
            raise AskError(f"{where}: question_id must be a number or a string")
        image = (
            Path(row["image"]) if Path(row["image"]).is_absolute() else path.parent / row["image"]
        )
        try:
            queries.append(check_query(Query(image, row["question"], qid), "image", "question"))
        except AskError as exc:
            raise AskError(f"{where}: {exc}") from None
    if not queries:
        raise AskError(f"--questions: {path} holds no question")
    return queries


def check_query(q: Query, image_key: str = "--image", question_key: str = "--question") -> Query:
    """``q`` if its picture decodes and its question is not blank (the keys name them in
    messages)."""
    read_picture(q.image, image_key)
    if not q.question.strip():
        raise AskError(f"{question_key} is empty")
    return q


# ------------------------------------------------------------------------------ the run
def choose_checkpoint(run_dir: Path, step: int | None) -> Path:
    """The newest valid checkpoint of ``run_dir``, or the one of ``step`` (verified)."""
    root = run_dir / "checkpoints"
    if step is None:
        ckpt = checkpoint.latest_valid(root)
        if ckpt is None:
            raise AskError(f"no valid checkpoint in {root}")
        return ckpt
    ckpt = root / f"step_{step:08d}"
    if not ckpt.is_dir():
        have = sorted(
            int(p.name[5:]) for p in root.glob("step_*") if p.is_dir() and p.name[5:].isdigit()
        )
        raise AskError(
            f"--checkpoint {step}: no {ckpt} (steps there: {', '.join(map(str, have)) or 'none'})"
        )
    why = checkpoint.verify(ckpt)
    if why:
        raise AskError(f"--checkpoint {step}: {ckpt} is damaged: {why}")
    return ckpt


def document_sources(urls: list[str], store) -> dict[int, dict]:
    """doc_id -> {"source": "<shard>#<key>", "origin": json source or None} for the corpus ``urls``,
    as ``DocumentStore.load`` numbered them: the json's ``doc_id``, else the running number (known
    only when no document was dropped while loading, since drops shift the numbers)."""
    import webdataset as wds

    found: dict[int, dict] = {}
    pipe = wds.DataPipeline(
        wds.SimpleShardList(urls), wds.tarfile_to_samples(handler=wds.ignore_and_continue)
    )
    for n, sample in enumerate(pipe):
        try:
            meta = json.loads(sample["json"]) if "json" in sample else {}
            if not isinstance(meta, dict):
                raise TypeError("json is no object")
            doc_id = int(meta["doc_id"]) if "doc_id" in meta else (None if store.skipped else n)
        except (ValueError, TypeError):  # bad json: DocumentStore.load dropped it too
            continue
        if doc_id is not None:
            origin = meta.get("source") if isinstance(meta.get("source"), str) else None
            found.setdefault(
                doc_id,
                {"source": f"{sample.get('__url__')}#{sample.get('__key__')}", "origin": origin},
            )
    return found


class Asker:
    """A run's model loaded once, answering queries."""

    def __init__(self, run_dir: Path, step: int | None = None, device: str = "auto") -> None:
        if device == "cuda" and not torch.cuda.is_available():
            raise AskError("--device cuda: no CUDA device is available")
        try:
            self.cfg = cfg = load_config(run_dir, [f"device={device}"], queries=False)
        except EvalError as exc:
            raise AskError(str(exc)) from None
        if cfg.retriever.mode == "oracle":
            raise AskError(
                f"{run_dir} reads each query's gold document (retriever.mode=oracle), which a new "
                "question does not name: ask a run with a learned retriever or a closed-book one"
            )
        self.ckpt = choose_checkpoint(run_dir, step)
        try:
            self.parts, self.step, self.device = load_run(cfg, self.ckpt)
        except EvalError as exc:
            raise AskError(str(exc)) from None
        m = cfg.model
        # the evaluation stream's decoding: one sample at a time, no augmentation
        self.stream = QueryStream(
            StreamSpec(
                urls=["<ask>"],
                image_size=m.image_size,
                max_question=m.max_question,
                max_answer=m.max_answer,
                batch_size=1,
                augment=False,
                train=False,
                tokenizer=reader_tokenizer(m),
            )
        )
        self.sources: dict[int, dict] | None = None  # read on the first retrieval

    def close(self) -> None:
        if self.parts.memory is not None:
            self.parts.memory.close()

    def sample(self, q: Query) -> dict:
        """``q`` decoded as the pipeline decodes an evaluation sample (no answer to score)."""
        raw = {
            "__key__": "ask",
            "png": q.image.read_bytes(),
            "txt": q.question,
            "json": json.dumps({"answer": ""}),
        }
        out = self.stream._decode(raw, SkipCounter())
        if out is None:  # checked before the model was built; changed on disk since
            raise AskError(f"{q.image} could not be decoded")
        return out

    @torch.no_grad()
    def ask(self, queries: list[Query], top_k: int | None = None) -> list[dict]:
        """The answer and the ``top_k`` (default: as many as the reader reads) nearest documents of
        each query."""
        rag, tok = self.parts.rag, self.parts.tok
        rag.eval()
        learned = rag.rcfg.mode == "learned"
        show = top_k or rag.rcfg.top_k
        res = []
        for start in range(0, len(queries), self.cfg.data.eval_batch_size):
            chunk = queries[start : start + self.cfg.data.eval_batch_size]
            batch = collate([self.sample(q) for q in chunk])
            x = batch_inputs(batch, self.device)
            q = {k: x[k] for k in ("image", "q_ids", "q_len")}
            _, ids, ret = rag.reader_inputs(q, search_k=show if learned else 0, grad=False)
            sims = ret[3] if ret is not None else None  # (B, max(k, show)) nearest first
            ids = ids.cpu() if ids is not None else None  # the device search's are on the device
            # what evaluate()'s forward hands its greedy decoding: the ids and the scaled scores of
            # the k read
            scores = (
                rag.retriever.scale().to(sims.device) * sims[:, : rag.rcfg.top_k]
                if sims is not None
                else None
            )
            out = SimpleNamespace(doc_ids=ids, scores=scores)
            answers = greedy_answers(rag, batch, out, self.device, torch.arange(len(chunk)), tok)
            texts = read_texts(rag, out, batch.get("question"), range(len(chunk)))
            for i, (query, answer) in enumerate(zip(chunk, answers)):
                docs = self._documents(ids[i, :show], sims[i, :show]) if learned else []
                row = {
                    "answer": tok.spell(answer, texts[i]),
                    "documents": docs,
                    "checkpoint": str(self.ckpt),
                    "step": self.step,
                    "image": str(query.image),
                    "question": query.question,
                }
                if query.question_id is not None:
                    row = {"question_id": query.question_id, **row}
                res.append(row)
        return res

    def _documents(self, ids: torch.Tensor, sims: torch.Tensor) -> list[dict]:
        """The retrieved documents (ids (k,), similarities (k,)) as output rows."""
        store = self.parts.store
        if self.sources is None:
            self.sources = document_sources(
                expand_urls(self.cfg.data.root, self.cfg.data.corpus), store
            )
        keep = ids >= 0  # faiss pads a short result list with -1
        ids, sims = ids[keep], sims[keep]
        rows = store.rows(ids)
        docs = []
        for d, s, r in zip(ids.tolist(), sims.tolist(), rows.tolist()):
            text = store.passages[r].strip().splitlines()
            src = self.sources.get(d, {"source": None, "origin": None})
            docs.append({"doc_id": d, "score": s, "text": text[0] if text else "", **src})
        return docs


# ------------------------------------------------------------------------------ command line
def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m rag_mm.ask",
        description="Answer a question about a picture with a trained run.",
    )
    p.add_argument(
        "run_dir", type=Path, metavar="RUN_DIR", help="a run directory (rag_mm.train's run_dir)"
    )
    p.add_argument("--image", type=Path, help="the picture (any format PIL reads)")
    p.add_argument("--question", help="the question about it")
    p.add_argument(
        "--questions",
        type=Path,
        metavar="FILE.jsonl",
        help='one {"image", "question"[, "question_id"]} per line; prints one JSON line each',
    )
    p.add_argument(
        "--top-k", type=int, help="documents to show (default: as many as the reader reads)"
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument(
        "--checkpoint",
        type=int,
        metavar="STEP",
        help="the checkpoint of this step (default: newest valid)",
    )
    p.add_argument("--device", choices=("cpu", "cuda"), help="default: the run's device setting")
    return p


def _print_text(row: dict) -> None:
    print(f"answer: {row['answer']}")
    if row["documents"]:
        print(f"top {len(row['documents'])} documents (doc id, similarity, passage, source):")
    for d in row["documents"]:
        origin = f" ({d['origin']})" if d.get("origin") else ""
        print(f"  {d['doc_id']:>6}  {d['score']:+.3f}  {d['text'][:100]}  [{d['source']}{origin}]")
    print(f"checkpoint: {row['checkpoint']} (step {row['step']})")


def main(argv: list[str] | None = None) -> int:
    """Parse, check every input, load the run, answer; bad input returns 2."""
    args = parser().parse_args(argv)
    try:
        if args.questions is not None:
            if args.image is not None or args.question is not None:
                raise AskError("give --questions FILE.jsonl or --image and --question, not both")
            queries = read_queries(args.questions)
        elif args.image is None or args.question is None:
            raise AskError("give --image PATH and --question TEXT (or --questions FILE.jsonl)")
        else:
            queries = [check_query(Query(args.image, args.question))]
        if args.top_k is not None and args.top_k <= 0:
            raise AskError(f"--top-k must be positive (got {args.top_k})")
        if args.checkpoint is not None and args.checkpoint < 0:
            raise AskError(f"--checkpoint must be a step >= 0 (got {args.checkpoint})")
        asker = Asker(args.run_dir, args.checkpoint, args.device or "auto")
        try:
            rows = asker.ask(queries, args.top_k)
        finally:
            asker.close()
    except AskError as exc:
        print(f"ask: error: {exc}", file=sys.stderr)
        return 2
    for row in rows:
        if args.json or args.questions is not None:
            print(json.dumps(json_safe(row), allow_nan=False))
        else:
            _print_text(row)
    return 0


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s | %(name)s | %(message)s")
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    raise SystemExit(main())
