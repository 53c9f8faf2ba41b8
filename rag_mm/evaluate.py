"""Evaluation: exact-match answer accuracy and answer NLL, for seen and held-out entities, and the
VQA accuracy where queries carry their human answers.

    python -m rag_mm.evaluate runs/demo                    # the newest valid checkpoint, test split
    python -m rag_mm.evaluate runs/demo split=val data.eval_batch_size=64
    # VQA results file
    python -m rag_mm.evaluate runs/vqa split=test predictions=runs/vqa/test_results.json
    python -m rag_mm.evaluate runs/kvqa modes=all   # closed book / learned / oracle side by side

Exact match is computed in one teacher-forced pass: greedy decoding reproduces the gold answer
exactly when every gold token (EOT included) is the argmax given the gold prefix. The VQA accuracy
(``rag_mm.eval.vqa_metric``) scores the greedy answer itself against the human answers, so queries
whose json has ``answers`` (VQA shards from ``scripts/convert.py``) are also decoded token by token.

Whether the reader uses the picture at all is measured three ways: the blind prior (the score of
answering each question with its text's most frequent training answer, ``rag_mm.eval.blind_prior``),
accuracy per VQA answer type (yes/no, number, other: question-only priors differ most between them),
and an ablation that blanks every query picture to the batch's mean pixel and evaluates again
(``image_drop``). A reader within two points of the blind prior, or one that loses under two points
without the picture, is warned about: it answers from the question.

The command line evaluates a run directory in one process, whatever layout trained it: the run's
saved config builds the model (``rag_mm.build``), and only the checkpoint's model entries are
loaded -- no optimizer, no process group. DCP checkpoints hold the whole RagModel under its own
parameter names however it was spread over ranks, so one process reads them all.
"""

from __future__ import annotations

import base64
import io
import itertools
import json
import logging
import re
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

from rag_mm.build import SPLITS, RagParts, batch_inputs, build_rag, make_stream
from rag_mm.checks.paths import data_key, output_file_problems, writable_dir_problem
from rag_mm.components import checkpoint
from rag_mm.components.metrics import json_safe, strict_dumps
from rag_mm.config import TrainConfig
from rag_mm.data.pipeline import DataError
from rag_mm.data.tokenizer import get_tokenizer
from rag_mm.data.urls import expand_urls
from rag_mm.distributed.env import all_reduce_sum
from rag_mm.eval.blind_prior import CACHE_NAME, BlindPrior, load_or_build
from rag_mm.eval.kinds import KindSums
from rag_mm.eval.knowledge import KnowledgeSums, retrieval_line
from rag_mm.eval.predictions import PredictionError, write_predictions
from rag_mm.eval.vqa_metric import ANSWER_TYPES, answer_type, vqa_accuracy
from rag_mm.ft.preemption import Stopped

log = logging.getLogger(__name__)

RECALL_AT = (1, 5, 10)  # recall@k reported for the gold document


@torch.no_grad()
def evaluate(
    rag,
    loader,
    device,
    max_batches: int = 0,
    examples_path: Path | None = None,
    n_examples: int = 0,
    tokenizer=None,
    replicas: int = 1,
    prior: BlindPrior | None = None,
    ablation: bool = True,
    split: str = "",
    predictions: list[tuple[str, str]] | None = None,
    stop: Callable[[], bool] | None = None,
    name: str = "evaluation",
) -> dict:
    """Run the RagModel over ``loader``: answer accuracy and NLL, and recall@k when it retrieves.

    Every rank evaluates its share of the split; the sums are all-reduced (and divided by
    ``replicas``, the ranks that see each batch: the stages of a pipeline). ``examples_path``
    (main rank only) receives a few queries with their retrieved documents for inspection.
    ``vqa_acc`` (with ``n_vqa``, the queries it averages) is reported when queries carry human
    answers and the reader is whole on every rank (greedy decoding needs it).

    Whether the reader uses the picture:

    * ``blind_prior``: the score of answering each question with its text's most frequent training
      answer (``prior``, ``rag_mm.eval.blind_prior``; None without one), scored per query as the
      reader is (VQA accuracy against the human answers where there are some, else exact match);
    * ``by_type``: per VQA answer type (``rag_mm.eval.vqa_metric.answer_type``: the query's json
      ``answer_type``, else inferred from its gold answer) n, acc, vqa_acc, the blind prior and the
      ablation's numbers;
    * ``ablation``: the same forward (retrieval included) with every query picture replaced by the
      batch's mean pixel: ``acc_blank`` (``vqa_acc_blank`` greedily decoded), and ``image_drop`` =
      accuracy minus blanked accuracy (VQA accuracy when reported, else exact match). One extra
      forward per batch; the trainer's periodic validation passes turn it off.

    What retrieval adds (``rag_mm.eval.knowledge``): queries with knowledge-VQA fields (json
    ``kvqa``, from ``scripts/convert.py infoseek`` / ``evqa``) are decoded greedily and scored by
    their source's rule (``kvqa_acc``, seen and held out; ``infoseek_score`` on InfoSeek's two
    unseen splits), and ``pseudo_recall@k`` counts the queries whose answer appears in a retrieved
    passage (``pseudo_recall_gold`` in the gold passage, oracle mode), beside recall@k against gold.

    ``predictions`` (a list; the reader whole, as for ``vqa_acc``) receives (sample key, greedy
    answer text) for every query, in loader order: the VQA results file
    (``rag_mm.eval.predictions``).

    ``split`` names the split in one INFO line of these numbers and a warning when the reader does
    not beat the blind prior or barely needs the picture (every rank must pass the same arguments:
    the ablation's forwards are collective under a spread reader).

    ``stop()`` (a preemption flag) is asked before each batch; when it is set on any rank, every
    rank leaves after the same batch with ``rag_mm.ft.preemption.Stopped`` (``name`` says what
    stopped).
    """
    was_training = rag.training
    rag.eval()
    learned = rag.rcfg.mode == "learned"
    search_k = max(RECALL_AT) if learned else 0
    # per group (seen, held-out): n, correct, nll, queries with a gold document, then recall hits
    # for each k in RECALL_AT (a query naming no gold document, doc_id -1, is no recall query:
    # faiss pads short result lists with id -1 too)
    width = 4 + len(RECALL_AT)
    acc = torch.zeros(2 * width, dtype=torch.float64)
    # per answer type, the TYPED sums
    typed = torch.zeros(len(ANSWER_TYPES), len(TYPED), dtype=torch.float64)
    whole = rag.whole_reader
    tok = tokenizer if tokenizer is not None else get_tokenizer()
    store = getattr(rag, "store", None)
    know = KnowledgeSums(RECALL_AT, store.passages if store is not None else [])
    kinds = KindSums()  # accuracy by kind of question (json attribute), seen and held-out apart
    warned = False
    examples: list[dict] = []
    # (a stop puts the model back in its mode before Stopped leaves the loop)
    for batch in _batches(
        loader, max_batches, stop, name, before_stop=lambda: rag.train(was_training)
    ):
        out = _on_host(rag(**batch_inputs(batch, device), retriever_loss=False, search_k=search_k))
        held = batch["heldout"]
        correct, nll = out.reader.correct.cpu(), out.reader.nll.cpu()
        kinds.add(batch.get("attribute") or [""] * len(correct), correct, held)
        hits = []
        has_gold = batch["doc_id"] >= 0
        if learned:
            gold = batch["doc_id"][:, None]
            hits = [(out.doc_ids[:, :k] == gold).any(1) & has_gold for k in RECALL_AT]
        for j, mask in enumerate((~held, held)):
            base = j * width
            acc[base] += float(mask.sum())
            acc[base + 1] += float((correct & mask).sum())
            acc[base + 2] += float((nll * mask).sum())
            acc[base + 3] += float((has_gold & mask).sum())
            for h, hit in enumerate(hits):
                acc[base + 4 + h] += float((hit & mask).sum())
        B = len(correct)
        golds = batch.get("answer") or [""] * B
        answers = batch.get("answers") or [None] * B
        # (B,)
        types = torch.tensor(
            [
                ANSWER_TYPES.index(answer_type(t, g))
                for t, g in zip(batch.get("answer_type") or [None] * B, golds)
            ]
        )
        _add(typed, "n", types, torch.ones(B))
        _add(typed, "correct", types, correct)
        if prior is not None:
            _add(
                typed,
                "prior",
                types,
                torch.tensor(
                    [prior.score(q, g, a) for q, g, a in zip(batch["question"], golds, answers)]
                ),
            )
        rows = [r for r, a in enumerate(answers) if a]
        vqa_rows = bool(rows) and whole
        preds = None
        if predictions is not None:  # every query's greedy answer, decoded once for both uses
            preds = greedy_answers(rag, batch, out, device, torch.arange(B), tok)
            max_answer = rag.reader.cfg.max_answer
            texts = read_texts(rag, out, batch.get("question"), range(B))
            predictions += [
                (key, _answer_text(ids, a or [], tok, max_answer, src))
                for key, ids, a, src in zip(batch["key"], preds, answers, texts)
            ]
        if vqa_rows:
            _add_vqa(
                typed,
                "",
                rag,
                batch,
                out,
                device,
                rows,
                types,
                tok,
                [preds[r] for r in rows] if preds is not None else None,
            )
        elif (
            rows and not warned
        ):  # every rank has the same layout, so the same (fixed-size) sums below
            warned = True
            log.warning(
                "vqa_acc not computed: greedy answers need the whole reader on each rank "
                "(parallel.pp, tp and dp_shard 1); evaluate the run with python -m rag_mm.evaluate"
            )
        kvqas = batch.get("kvqa") or [None] * B
        krows = [r for r, kv in enumerate(kvqas) if kv]
        if krows and whole:  # knowledge-VQA queries: greedy answers, scored by the source's rule
            if preds is not None:
                kp = [preds[r] for r in krows]
            else:
                kp = greedy_answers(rag, batch, out, device, torch.tensor(krows), tok)
            max_answer = rag.reader.cfg.max_answer
            know.add_answers(
                batch,
                krows,
                [
                    _answer_text(ids, kvqas[r]["aliases"], tok, max_answer, src)
                    for r, ids, src in zip(
                        krows, kp, read_texts(rag, out, batch.get("question"), krows)
                    )
                ],
            )
        if out.doc_ids is not None and store is not None and len(store):
            oracle = rag.rcfg.mode == "oracle"
            read = out.doc_ids[:, :1] if oracle else out.doc_ids
            know.add_passages(batch, read, store, gold=oracle)
        if ablation:
            blank = _blank(batch)
            out_blank = _on_host(
                rag(**batch_inputs(blank, device), retriever_loss=False, search_k=search_k)
            )
            _add(typed, "correct_blank", types, out_blank.reader.correct.cpu())
            if vqa_rows:
                _add_vqa(typed, "_blank", rag, blank, out_blank, device, rows, types, tok)
        if examples_path is not None and len(examples) < n_examples:
            examples += _examples(rag, batch, out, device, tokenizer, n_examples - len(examples))
    sums = all_reduce_sum(torch.cat([acc, typed.flatten(), know.sums])) / replicas
    acc, typed, ksums = sums.split([2 * width, typed.numel(), know.sums.numel()])
    typed = typed.view(len(ANSWER_TYPES), len(TYPED))
    rag.train(was_training)
    seen, held = acc[:width].tolist(), acc[width:].tolist()
    n = seen[0] + held[0]
    res = {
        "n": int(n),
        "acc": (seen[1] + held[1]) / max(n, 1),
        "acc_seen": seen[1] / seen[0] if seen[0] else float("nan"),
        "acc_heldout": held[1] / held[0] if held[0] else float("nan"),
        "nll": (seen[2] + held[2]) / max(n, 1),
        "n_seen": int(seen[0]),
        "n_heldout": int(held[0]),
    }
    n_gold = seen[3] + held[3]
    if learned and n_gold:
        for h, k in enumerate(RECALL_AT):
            res[f"recall@{k}"] = (seen[4 + h] + held[4 + h]) / n_gold
            res[f"recall@{k}_heldout"] = held[4 + h] / held[3] if held[3] else float("nan")
    total = typed.sum(0)
    if total[TYPED["n_vqa"]] > 0:
        res["vqa_acc"] = float(total[TYPED["vqa"]] / total[TYPED["n_vqa"]])
        res["n_vqa"] = int(total[TYPED["n_vqa"]])
    res.update(know.results(ksums, gold=rag.rcfg.mode == "oracle"))
    res.update(_picture_metrics(total, prior is not None, ablation))
    by_kind = kinds.results(replicas)
    if by_kind:
        res["by_attribute"] = by_kind
    res["by_type"] = {
        name: {
            "n": int(row[TYPED["n"]]),
            **_picture_metrics(row, prior is not None, ablation, typed=True),
        }
        for name, row in zip(ANSWER_TYPES, typed)
        if row[TYPED["n"]] > 0
    }
    if split and _is_main():
        _report(split, res)
    if examples_path is not None and examples:
        examples_path.parent.mkdir(parents=True, exist_ok=True)
        examples_path.write_text(strict_dumps(examples, indent=1))
    return res


def _batches(
    loader,
    max_batches: int,
    stop: Callable[[], bool] | None,
    name: str,
    before_stop: Callable[[], None],
):
    """The loader's batches (the first ``max_batches`` when > 0). With ``stop``, before each batch
    every rank says in one all-reduce whether it has a batch and whether its ``stop()`` is set: a
    rank whose share of the split ran out keeps answering until every share has, so all ranks
    leave together, at the end or, when any rank is stopped, with ``Stopped`` after the same
    batch."""
    it, done, exhausted = iter(loader), 0, False
    while True:
        batch = None
        if not exhausted and not (max_batches and done >= max_batches):
            batch = next(it, None)
            exhausted = batch is None
        if stop is not None:
            have, halt = all_reduce_sum(
                torch.tensor([float(batch is not None), float(bool(stop()))])
            ).tolist()
            if halt:
                before_stop()
                raise Stopped(f"{name} stopped after {done} batch{'' if done == 1 else 'es'}")
            if not have:
                return
        if batch is None:
            if stop is None:
                return
            continue  # other ranks still have batches: keep answering
        yield batch
        done += 1


# The per-answer-type sums evaluate() all-reduces, by column: queries, exact-match correct, summed
# VQA accuracy and the queries it sums over, summed blind-prior score, and the same for the blanked
# picture.
TYPED = {
    name: i
    for i, name in enumerate(
        ("n", "correct", "vqa", "n_vqa", "prior", "correct_blank", "vqa_blank", "n_vqa_blank")
    )
}
# accuracy over the blind prior, and lost by blanking the picture, below which evaluate() warns
MIN_GAIN = 0.02


def _add(typed: torch.Tensor, col: str, types: torch.Tensor, values) -> None:
    """Add each query's ``values`` (B,) into its answer type's row of column ``col``."""
    v = torch.as_tensor(values, dtype=torch.float64)
    typed[:, TYPED[col]] += torch.zeros(len(ANSWER_TYPES), dtype=torch.float64).index_add_(
        0, types, v
    )


def _add_vqa(
    typed,
    suffix: str,
    rag,
    batch,
    out,
    device,
    rows: list[int],
    types,
    tok,
    preds: list[list[int]] | None = None,
) -> None:
    """Greedily decode the queries ``rows`` (those with human answers) as ``out`` read them (or take
    their decoded ``preds``) and add their VQA accuracy to columns ``vqa<suffix>`` /
    ``n_vqa<suffix>``."""
    if preds is None:
        preds = greedy_answers(rag, batch, out, device, torch.tensor(rows), tok)
    max_answer = rag.reader.cfg.max_answer
    answers = batch["answers"]
    texts = read_texts(rag, out, batch.get("question"), rows)
    scores = [
        vqa_accuracy(_answer_text(ids, answers[r], tok, max_answer, src), answers[r])
        for r, ids, src in zip(rows, preds, texts)
    ]
    _add(typed, f"vqa{suffix}", types[rows], scores)
    _add(typed, f"n_vqa{suffix}", types[rows], torch.ones(len(rows)))


def _blank(batch: dict) -> dict:
    """``batch`` with every query picture replaced by one blank picture: the mean pixel of the
    batch's pictures, per channel, in the pipeline's normalised space (so the ablation asks what
    the reader does with a picture that carries no content, not with an out-of-range one)."""
    img = batch["image"]  # (B, 3, H, W), normalised
    return {**batch, "image": img.mean(dim=(0, 2, 3), keepdim=True).expand_as(img).contiguous()}


def _picture_metrics(
    sums: torch.Tensor, has_prior: bool, ablation: bool, typed: bool = False
) -> dict:
    """blind_prior, acc_blank, vqa_acc_blank and image_drop from one row of TYPED sums (a type's or
    the total); ``typed`` adds the row's acc and vqa_acc (the split's own come from the main
    sums)."""
    n, n_vqa = float(sums[TYPED["n"]]), float(sums[TYPED["n_vqa"]])
    res: dict = {}
    if typed:
        res["acc"] = float(sums[TYPED["correct"]]) / n if n else None
        if n_vqa:
            res["vqa_acc"] = float(sums[TYPED["vqa"]]) / n_vqa
    res["blind_prior"] = float(sums[TYPED["prior"]]) / n if has_prior and n else None
    if ablation:
        res["acc_blank"] = float(sums[TYPED["correct_blank"]]) / n if n else None
        n_blank = float(sums[TYPED["n_vqa_blank"]])
        if n_blank:
            res["vqa_acc_blank"] = float(sums[TYPED["vqa_blank"]]) / n_blank
        if n_vqa and n_blank:  # accuracy as the headline is: VQA accuracy where the queries have it
            res["image_drop"] = float(sums[TYPED["vqa"]]) / n_vqa - res["vqa_acc_blank"]
        else:
            res["image_drop"] = (
                (float(sums[TYPED["correct"]] - sums[TYPED["correct_blank"]]) / n) if n else None
            )
    return res


def headline(res: dict) -> float:
    """The accuracy a split's metrics lead with: the VQA accuracy where queries had human answers,
    else exact match (what ``blind_prior`` and ``image_drop`` are compared with)."""
    return res["vqa_acc"] if res.get("vqa_acc") is not None else res["acc"]


def _is_main() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def _fmt(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.3f}"


def _report(split: str, res: dict) -> None:
    """One INFO line per split (accuracy, blind prior, accuracy by answer type, image drop) and one
    warning when the reader does not beat the blind prior or barely needs the picture."""
    accuracy, prior, drop = headline(res), res.get("blind_prior"), res.get("image_drop")
    by_type = ", ".join(
        f"{name} {_fmt(headline(t))} (n={t['n']}, prior {_fmt(t.get('blind_prior'))})"
        for name, t in res["by_type"].items()
    )
    log.info(
        "%s: accuracy %.3f, blind prior %s, by answer type: %s; blanked picture %s, image drop %s",
        split,
        accuracy,
        _fmt(prior),
        by_type or "none",
        _fmt(res.get("vqa_acc_blank", res.get("acc_blank"))),
        _fmt(drop),
    )
    if res.get("by_attribute"):
        log.info(
            "%s: by kind of question, seen / held out: %s",
            split,
            ", ".join(
                f"{kind} {_fmt(r['acc_seen'])} / {_fmt(r['acc_heldout'])}"
                for kind, r in res["by_attribute"].items()
            ),
        )
    retrieval = retrieval_line(res, RECALL_AT)
    if retrieval:
        log.info("%s: %s", split, retrieval)
    problems = []
    if prior is not None and accuracy < prior + MIN_GAIN:
        where = "below" if accuracy < prior - MIN_GAIN else f"within {MIN_GAIN * 100:.0f} points of"
        problems.append(
            f"accuracy {accuracy:.3f} is {where} the blind prior {prior:.3f} (answering from the "
            "question alone)"
        )
    if drop is not None and drop < MIN_GAIN:
        problems.append(
            f"the picture is barely used: blanking it costs {drop:.3f}"
            if drop >= 0
            else f"the picture is not used: blanking it raises accuracy by {-drop:.3f}"
        )
    if problems:
        hint = (
            "; scripts/bench/picture_signal.py shows where the picture's signal dies, and a finer "
            "patch grid (model.patch_size, as +experiment=vqa sets it) is the usual cure"
            if drop is not None and drop < MIN_GAIN
            else ""
        )
        log.warning("%s: %s%s", split, " / ".join(problems), hint)


def _png_b64(img: torch.Tensor) -> str:
    """Normalised (3, H, W) picture -> base64 PNG (for the notebooks' gallery)."""
    from PIL import Image

    from rag_mm.data.pipeline import MEAN, STD

    x = ((img.cpu() * STD + MEAN).clamp(0, 1) * 255).round().byte().permute(1, 2, 0).numpy()
    buf = io.BytesIO()
    Image.fromarray(x).save(buf, format="PNG")
    return base64.b64encode(buf.getvalue()).decode()


def _on_host(out):
    """A forward's output with its retrieved ids on the host, beside the batch's gold ids (the
    device search, ``retriever.search``, answers on the device)."""
    if out.doc_ids is not None:
        out.doc_ids = out.doc_ids.cpu()
    return out


def greedy_answers(rag, batch, out, device, rows: torch.Tensor, tokenizer) -> list[list[int]]:
    """The reader's greedy answers (token ids, EOT dropped) to the queries ``rows`` of ``batch``,
    reading the documents the evaluated forward ``out`` read.

    A query whose teacher-forced forward (``out.reader``) took the argmax at every answer position
    is not decoded again: the reader is causal, so each position's argmax is the greedy choice after
    the target tokens before it, and greedy decoding reproduces the target. Only the others run the
    token-by-token decoding (one full forward per token), which a well-trained reader rarely needs.
    """
    order = rows.tolist()
    known = _teacher_forced_answers(getattr(out, "reader", None), tokenizer.eot_id)
    todo = [r for r in order if r not in known]
    if todo:
        known.update(zip(todo, _decode(rag, batch, out, device, torch.tensor(todo), tokenizer)))
    return [known[r] for r in order]


def _teacher_forced_answers(reader_out, eot_id: int) -> dict[int, list[int]]:
    """{query: its target's token ids up to its first EOT} for the queries of a teacher-forced
    forward whose every answer token was the argmax (``ReaderOutput.correct``); {} without one.
    Greedy decoding stops at the first EOT, so a target that holds one inside its text (a tokenizer
    parses a literal ``<end_of_text>``) is cut there as decoding would cut it."""
    # a ReaderOutput's, or the lists a spread reader's forward hands over (``SpreadRag.__call__``)
    targets = getattr(reader_out, "targets", None)
    if targets is None:
        return {}
    return {
        r: list(itertools.takewhile(lambda t: t != eot_id, targets[r]))
        for r in reader_out.correct.nonzero().flatten().tolist()
    }


def _decode(rag, batch, out, device, rows: torch.Tensor, tokenizer) -> list[list[int]]:
    """Greedy decoding, token by token, of the queries ``rows`` (``greedy_answers``)."""
    x = batch_inputs(batch, device)
    r = rows.to(device)
    docs = {}
    if out.doc_ids is not None:
        docs = {
            name: t.to(device)
            for name, t in rag.store.fetch(out.doc_ids[rows, : rag.rcfg.top_k]).items()
        }
    prior = None
    if rag.rcfg.reader_prior and out.scores is not None:  # as the evaluated forward read them
        prior = torch.log_softmax(out.scores[rows].to(device), -1)
    return rag.reader.generate(
        x["image"][r],
        x["q_ids"][r],
        x["q_len"][r],
        docs.get("doc_image"),
        docs.get("doc_ids"),
        docs.get("doc_len"),
        eot_id=tokenizer.eot_id,
        doc_prior=prior,
    )


def read_texts(rag, out, questions: list[str] | None, rows) -> list[list[str]]:
    """For each of the queries ``rows``: the passages its reader read (``out.doc_ids``, nearest
    first), then its question (when the batch carries the texts); the texts a copied answer is
    spelled from (``Tokenizer.spell``)."""
    rows = list(rows)
    asked = [[questions[r]] if questions is not None else [] for r in rows]
    store = getattr(rag, "store", None)
    if out.doc_ids is None or store is None or not len(store) or not rows:
        return asked
    read = store.rows(out.doc_ids[torch.tensor(rows), : rag.rcfg.top_k]).tolist()
    return [[store.passages[j] for j in js] + q for js, q in zip(read, asked)]


def _answer_text(
    ids: list[int], answers: list[str], tokenizer, max_answer: int, sources: list[str]
) -> str:
    """A greedy answer as text: the human answer whose (training-truncated) tokens it reproduces,
    if any, else as written in the texts it was read from (``sources``), else its decoding. The BPE
    decoding respaces punctuation ("t-shirt" comes back as "t - shirt") and letters among digits
    ("1f62f" as "1 f 62 f"), which the metric would otherwise count against a right answer."""
    for a in answers:
        if tokenizer.encode(a)[: max_answer - 1] == ids:
            return a
    return tokenizer.spell(ids, sources)


def _examples(rag, batch, out, device, tokenizer, n: int) -> list[dict]:
    """A few queries with what the reader answered and which documents it was given."""
    n = min(n, len(batch["key"]))
    if n <= 0 or out.doc_ids is None:
        return []
    k = rag.rcfg.top_k
    ids = out.doc_ids[:n, :k]
    pred = greedy_answers(rag, batch, out, device, torch.arange(n), tokenizer)
    rows = rag.store.rows(ids)
    texts = read_texts(rag, out, batch.get("question"), range(n))
    res = []
    for i in range(n):
        res.append(
            {
                "key": batch["key"][i],
                "question": batch["question"][i],
                "answer": batch["answer"][i],
                "prediction": tokenizer.spell(pred[i], texts[i]),
                "heldout": bool(batch["heldout"][i]),
                "gold_doc_id": int(batch["doc_id"][i]),
                "query_image": _png_b64(batch["image"][i]),
                "retrieved": [
                    {
                        "doc_id": int(ids[i, j]),
                        "passage": rag.store.passages[int(rows[i, j])],
                        "image": _png_b64(rag.store.images[int(rows[i, j])]),
                    }
                    for j in range(ids.shape[1])
                ],
            }
        )
    return res


class EvalError(Exception):
    """Bad input to the command line: its message goes to stderr, the exit status is 2."""


USAGE = (
    "usage: python -m rag_mm.evaluate RUN_DIR [split=test] [predictions=PATH.json] "
    "[modes=all|closed_book,learned,oracle] [key=value ...]"
)
OWN = ("split", "predictions", "modes")  # the command's own arguments; the rest: config overrides
OVERRIDE = re.compile(r"[A-Za-z_][\w.]*=")  # a dotted config key, then its value


def load_config(run_dir: Path, overrides: list[str], queries: bool = True):
    """The run's saved config (``RUN_DIR/.hydra/config.yaml``) with ``overrides``, checked
    against the schema and laid out for one process; its checkpoints are looked for in ``run_dir``.
    ``queries=False`` (``rag_mm.ask``: the questions come from the user) checks the corpus but not
    the query splits' shards, and writes nothing into the run directory."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException
    from yaml import YAMLError

    from rag_mm.checks.paths import dir_problem, file_problem, path_problems, writable_dir_problem
    from rag_mm.config import (
        ConfigError,
        TrainConfig,
        validate,
    )

    if not run_dir.exists():
        raise EvalError(f"run directory {run_dir} not found")
    why = dir_problem("RUN_DIR", run_dir)
    if why:
        raise EvalError(why)
    cfg_path = run_dir / ".hydra" / "config.yaml"
    if not cfg_path.exists():
        raise EvalError(f"{cfg_path} not found (is {run_dir} a run directory?)")
    why = file_problem("RUN_DIR", cfg_path)
    if why:
        raise EvalError(why)
    for o in overrides:
        if not OVERRIDE.match(o):
            raise EvalError(
                f"bad override {o!r}: expected key=value (e.g. data.eval_batch_size=64)"
            )
    try:
        cfg = OmegaConf.merge(
            OmegaConf.structured(TrainConfig),
            OmegaConf.load(cfg_path),
            OmegaConf.from_dotlist(overrides),
        )
    except (OmegaConfBaseException, YAMLError) as exc:
        raise EvalError(f"bad config or override: {exc}".rstrip()) from None
    cfg.run_dir = str(run_dir)
    p = cfg.parallel  # one process, whatever layout trained the run
    p.dp_replicate = p.pp = p.tp = p.dp_shard = p.microbatches = 1
    try:
        validate(cfg, world_size=1)
    except ConfigError as exc:
        raise EvalError(str(exc)) from None
    # shard_problems names its key first
    skip = () if queries else tuple(f"data.{split}:" for split in SPLITS)
    problems = [p for p in path_problems(cfg, training=False) if not p.startswith(skip)]
    if problems:
        raise EvalError("invalid paths:\n  - " + "\n  - ".join(problems))
    if queries and cfg.retriever.mode == "learned":  # retrieved_examples.json is written there
        why = writable_dir_problem("RUN_DIR", run_dir)
        if why:
            raise EvalError(why)
    return cfg


def load_model_state(rag: torch.nn.Module, ckpt: Path) -> dict:
    """Load a training checkpoint's model entries (``model.<name>``) into ``rag``; the optimizer
    and scheduler state stay on disk. Returns the trainer state (``step``, ...)."""
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    state = {"model": get_model_state_dict(rag)}  # the names and shapes Trainer._state saves
    try:
        # in one process: DCP's note that it assumes so is filtered there
        ts = checkpoint.load(ckpt, state)
    except CheckpointException as exc:  # DCP's message carries each rank's stack: keep the errors
        why = "; ".join(f"{type(e).__name__}: {e}" for e, _ in exc.failures.values())
        if "image_proj.fc1." in why:  # the config asks for the MLP, the checkpoint holds one map
            why += (
                " (the checkpoint's reader maps picture tokens with one linear map: evaluate it "
                "with model.projector=linear)"
            )
        raise EvalError(f"cannot load {ckpt} into the model the config builds: {why}") from None
    except RuntimeError as exc:  # failed verification, an unsafe entry
        raise EvalError(f"cannot load {ckpt}: {exc}") from None
    set_model_state_dict(rag, state["model"])
    return ts


def _device(name: str) -> torch.device:
    """``cfg.device`` (auto | cpu | cuda) -> the device this process evaluates on."""
    use_cuda = torch.cuda.is_available() if name == "auto" else name == "cuda"
    return torch.device("cuda", torch.cuda.current_device()) if use_cuda else torch.device("cpu")


def load_run(cfg: TrainConfig, ckpt: Path) -> tuple[RagParts, int, torch.device]:
    """The run's model as ``cfg`` builds it, with checkpoint ``ckpt``'s weights and, when it
    retrieves, its documents indexed by the loaded document encoder: (parts, the checkpoint's
    step, the device). The caller closes ``parts.memory``."""
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    if cfg.deterministic:
        torch.use_deterministic_algorithms(True, warn_only=True)
    torch.manual_seed(cfg.seed)
    device = _device(cfg.device)
    try:
        parts = build_rag(cfg, device)
    except DataError as exc:  # the corpus holds no readable document
        raise EvalError(f"{data_key(cfg, exc.urls)}: {exc}") from None
    try:
        step = load_model_state(parts.rag, ckpt)["step"]
        if parts.memory is not None:  # index the documents with the loaded document encoder
            parts.memory.refresh(step=step)
    except BaseException:
        if parts.memory is not None:
            parts.memory.close()
        raise
    return parts, step, device


def run(
    run_dir: Path,
    split: str,
    overrides: list[str],
    predictions: Path | None = None,
    modes: str | None = None,
) -> dict:
    """Build the run's model, load its newest valid checkpoint and evaluate ``split``;
    ``predictions``: where every query's greedy answer goes, in the VQA results format; ``modes``
    (``rag_mm.eval.modes``): also evaluate closed book / learned / oracle on the same weights, the
    table under ``modes`` (and in the run's metrics.json under ``modes.<split>``)."""
    if split not in SPLITS:
        raise EvalError(f"unknown split {split!r} (one of {', '.join(SPLITS)})")
    cfg = load_config(run_dir, overrides)
    wanted = _modes(cfg, split, modes) if modes else []
    if (
        cfg.retriever.mode == "oracle"
    ):  # it reads each query's gold document: checked before any work
        from rag_mm.checks.gold import oracle_problem

        why = oracle_problem(cfg, split)
        if why:
            raise EvalError(why)
    if predictions is not None:
        why = output_file_problems("predictions", str(predictions))
        if why:
            raise EvalError(why[0])
    ckpt = checkpoint.latest_valid(run_dir / "checkpoints")
    if ckpt is None:
        raise EvalError(f"no valid checkpoint in {run_dir / 'checkpoints'}")
    parts, step, device = load_run(cfg, ckpt)
    answered: list[tuple[str, str]] | None = [] if predictions is not None else None
    try:
        examples = run_dir / "retrieved_examples.json" if parts.memory is not None else None
        # the blind prior's table: cached in the run directory (the trainer's final evaluation made
        # it)
        writable = writable_dir_problem("RUN_DIR", run_dir) is None
        prior = load_or_build(
            expand_urls(cfg.data.root, cfg.data.train), run_dir / CACHE_NAME if writable else None
        )
        metrics = evaluate(
            parts.rag,
            make_stream(cfg, split, train=False),
            device,
            examples_path=examples,
            n_examples=cfg.retriever.eval_examples,
            tokenizer=parts.tok,
            prior=prior,
            split=split,
            predictions=answered,
        )
        if wanted:  # the other modes on the same weights, without the picture ablation (fast)
            from rag_mm.eval.modes import NAMES, compare

            def other(name: str) -> dict:
                return evaluate(
                    parts.rag,
                    make_stream(cfg, split, train=False),
                    device,
                    tokenizer=parts.tok,
                    prior=prior,
                    ablation=False,
                )

            metrics["modes"] = compare(
                parts.rag,
                split,
                wanted,
                NAMES.get(cfg.retriever.mode),
                metrics,
                other,
                run_dir / "metrics.json",
            )
    except DataError as exc:  # no usable sample in the split
        raise EvalError(f"{data_key(cfg, exc.urls)}: {exc}") from None
    finally:
        if parts.memory is not None:
            parts.memory.close()
    if predictions is not None:
        try:
            write_predictions(
                predictions, answered, expand_urls(cfg.data.root, getattr(cfg.data, split))
            )
        except PredictionError as exc:
            raise EvalError(f"predictions: {exc}") from None
    return {"split": split, "step": step, **metrics}


def _modes(cfg: TrainConfig, split: str, text: str) -> list[str]:
    """The modes ``modes=`` asks for, checked against the run and the split's data."""
    from rag_mm.checks.gold import oracle_problem
    from rag_mm.config import data_splits
    from rag_mm.eval.modes import ModeError, parse

    has_corpus = "corpus" in data_splits(cfg)
    gold = None
    if has_corpus and ("oracle" in text or text == "all"):
        gold = oracle_problem(cfg, split)
    try:
        return parse(text, cfg.retriever.mode, has_corpus, gold)
    except ModeError as exc:
        raise EvalError(str(exc)) from None


def main(argv: list[str] | None = None) -> int:
    """Evaluate a finished or running run directory with its saved config; one JSON line."""
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] in (["-h"], ["--help"]):
        print(USAGE)
        return 0
    if not argv:
        print(USAGE, file=sys.stderr)
        return 2
    # split=, predictions= and modes= are the command's own arguments, the rest config overrides
    own = {key: a.split("=", 1)[1] for a in argv[1:] for key in OWN if a.startswith(f"{key}=")}
    overrides = [a for a in argv[1:] if not a.startswith(tuple(f"{k}=" for k in OWN))]
    predictions = Path(own["predictions"]) if own.get("predictions") else None
    try:
        res = run(Path(argv[0]), own.get("split", "test"), overrides, predictions, own.get("modes"))
    except EvalError as exc:
        print(f"evaluate: error: {exc}", file=sys.stderr)
        return 2
    # strict JSON: null where there is nothing to average
    print(json.dumps(json_safe(res), allow_nan=False))
    return 0


if __name__ == "__main__":
    # stderr: the split's summary line and its warnings (stdout holds the JSON line alone)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s | %(name)s | %(message)s")
    logging.getLogger("faiss").setLevel(logging.WARNING)  # its loader logs every CPU-feature probe
    raise SystemExit(main())
