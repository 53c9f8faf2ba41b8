"""Host syncs and CPU tensors in one steady-state training step, counted on fake CUDA (no GPU
needed): the audit of ``tests/gpu_fake/fake_cuda.py`` over each step kind, as JSON.

    python scripts/bench/host_syncs.py            # every step kind
    python scripts/bench/host_syncs.py --kinds reader_demo spread_closed_book

Step kinds: the demo / hf_tiny reader (forward, backward where the autograd engine runs on fake
CUDA, else zero gradients in its place, clipping, the non-finite check, the optimizer); the
retriever (query and document encoding, scores, every loss, random views); a pp=1
``ParallelModel.train_step`` weighted by answer tokens; and the trainer's own step path over the
closed-book reader (``SpreadRag.train_step`` + ``SpreadRag.clip_grad_norm_`` + the check). Each
sync and CPU tensor is listed with the project line that issued it. A sync on fake tensors gets a
stand-in value, so the step runs on and every sync is counted.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from rag_mm.config import compose  # noqa: E402
from rag_mm.model.factory import build_reader, materialize  # noqa: E402
from tests.gpu_fake.fake_cuda import audited, engine_backward_error, fake_cuda  # noqa: E402

CUDA, VOCAB, B = torch.device("cuda"), 49408, 4
KINDS = (
    "reader_demo",
    "reader_hf_tiny",
    "retriever",
    "parallel_model",
    "spread_closed_book",
    "spread_learned_warmup",
    "spread_learned_joint",
)


def _cfg(*overrides):
    return compose(["+experiment=demo", "model.attention_backend=sdpa", *overrides])


def _reader(m, mode):
    reader = build_reader(m, VOCAB, meta=True)
    with mode:
        mode.allow_non_fake_inputs = True
        materialize(reader, CUDA)
        mode.allow_non_fake_inputs = False
    return reader.train()


def _inputs(m, k):
    lens = lambda hi, *s: torch.randint(1, hi + 1, s, device=CUDA)  # noqa: E731
    x = dict(
        image=torch.randn(B, 3, m.image_size, m.image_size, device=CUDA),
        q_ids=torch.randint(0, VOCAB, (B, m.max_question), device=CUDA),
        q_len=lens(m.max_question, B),
        a_ids=torch.randint(0, VOCAB, (B, m.max_answer), device=CUDA),
        a_len=lens(m.max_answer - 1, B) + 1,
    )
    if k:
        x.update(
            doc_image=torch.randn(B, k, 3, m.image_size, m.image_size, device=CUDA),
            doc_ids=torch.randint(0, VOCAB, (B, k, m.max_doc_text), device=CUDA),
            doc_len=lens(m.max_doc_text, B, k),
            doc_prior=torch.randn(B, k, device=CUDA).log_softmax(-1),
        )
    return x


@functools.cache
def _engine_error() -> str | None:
    return engine_backward_error()


def _backward(loss, params):
    if _engine_error() is None:
        loss.backward()
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)


def _checker(opt):
    """The trainer's non-finite check: ``rag_mm.components.nonfinite`` where it exists, else the
    per-step expression the trainer had before it."""
    try:
        from rag_mm.components.nonfinite import NonFiniteGuard
    except ImportError:
        return lambda step, loss, gnorm: (
            torch.tensor([float(torch.isfinite(loss) and torch.isfinite(gnorm))]).item() >= 1
        )
    return NonFiniteGuard(opt, CUDA, limit=10, window=20).check


def _steps(step_fn, n=2):
    """Run ``step_fn`` n times; the audit of the last (steady-state) run."""
    for _ in range(n):
        with audited() as audit:
            step_fn()
    return audit


def reader_step(overrides=()):
    from rag_mm.components.optim import build_optimizer

    cfg = _cfg(*overrides)
    mode = torch._subclasses.fake_tensor.FakeTensorMode(allow_non_fake_inputs=False)
    reader = _reader(cfg.model, mode)
    with fake_cuda(mode):
        x = _inputs(cfg.model, cfg.retriever.top_k)
        opt = build_optimizer(reader, cfg.optim)
        check = _checker(opt)
        params = [p for p in reader.parameters() if p.requires_grad]

        def step():
            loss = reader(**x).loss
            _backward(loss, params)
            gnorm = torch.nn.utils.clip_grad_norm_(params, 1.0)
            if check(0, loss.detach(), gnorm):
                opt.step()
            opt.zero_grad(set_to_none=True)

        return _steps(step)


def retriever_step():
    from retriever import losses
    from retriever.augment import random_views
    from retriever.encoders import DualEncoder

    cfg = _cfg()
    r, m, k = cfg.retriever, cfg.model, cfg.retriever.top_k
    with fake_cuda():
        with torch.device(CUDA):
            enc = DualEncoder(r, m.image_size).train()
        x = _inputs(m, k)
        gold, hard = (
            torch.randint(0, 256, (B,), device=CUDA),
            torch.randint(0, 256, (B * k,), device=CUDA),
        )

        def step():
            q = enc.embed_queries(random_views(x["image"]), x["q_ids"], x["q_len"])
            d = enc.embed_docs(
                x["doc_image"].flatten(0, 1), x["doc_ids"].flatten(0, 1), x["doc_len"].flatten(0, 1)
            ).view(B, k, -1)
            scores = enc.scale() * torch.einsum("be,bke->bk", q, d)
            nll = torch.rand(B, k, device=CUDA)
            return (
                losses.perplexity_distillation(scores, nll, 0.1)
                + losses.emdr2(scores, -nll)
                + losses.attention_distillation(scores, torch.rand(B, k, device=CUDA))
                + losses.contrastive(q, d[:, 0], gold, enc.scale(), d.flatten(0, 1), hard)
            )

        return _steps(step)


def parallel_model_step():
    import parallel
    from parallel.config import ParallelConfig

    cfg = _cfg()
    mode = torch._subclasses.fake_tensor.FakeTensorMode(allow_non_fake_inputs=False)
    reader = _reader(cfg.model, mode)
    with fake_cuda(mode):
        x = _inputs(cfg.model, cfg.retriever.top_k)
        pm = parallel.parallelize(reader, ParallelConfig(microbatches=2), x)
        params = list(pm.parameters())
        backward, torch.Tensor.backward = (
            torch.Tensor.backward,
            lambda loss, *a, **kw: _backward(loss, params),
        )
        try:
            tokens = lambda mb, _: (mb["a_len"] - 1).clamp_min(0).sum()  # noqa: E731
            return _steps(lambda: (pm.train_step(x, weight_fn=tokens), pm.zero_grad()))
        finally:
            torch.Tensor.backward = backward


def spread_step():
    """The trainer's step path over the closed-book demo reader (no faiss, no document store)."""
    from rag_mm.data.documents import DocumentStore
    from rag_mm.distributed.spread import SpreadRag
    from rag_mm.model.rag import RagModel

    cfg = _cfg("retriever=none", "data.batch_size=4")
    mode = torch._subclasses.fake_tensor.FakeTensorMode(allow_non_fake_inputs=False)
    reader = _reader(cfg.model, mode)
    with fake_cuda(mode):
        store = DocumentStore.empty(cfg.model.image_size, cfg.model.max_doc_text)
        rag = RagModel(reader, store, cfg.retriever)
        spread = SpreadRag(rag, cfg, CUDA)
        x = {**_inputs(cfg.model, 0), "gold": torch.full((B,), -1, device=CUDA)}
        return _trainer_steps(spread, cfg, x, "joint")


def learned_step(kind: str):
    """The trainer's step path with the demo's learned retriever and the device search
    (``retriever.search=device``): the retriever warm-up's step or the joint step (search, the
    reader, pdist over each document alone, the contrastive terms with pseudo-queries and bank
    negatives), clipping, the check and the optimizer. Half of the batch names no gold
    document."""
    from tests.gpu_fake.learned import learned_spread

    cfg = _cfg("data.batch_size=4", "retriever.search=device")
    mode = torch._subclasses.fake_tensor.FakeTensorMode(allow_non_fake_inputs=False)
    reader, ids = _reader(cfg.model, mode), torch.arange(12) * 7 + 3
    with fake_cuda(mode):
        spread = learned_spread(cfg, mode, reader, ids)
        gold = torch.arange(B, device=CUDA) * 7 + 3
        x = {**_inputs(cfg.model, 0), "gold": gold.masked_fill(gold > 10, -1)}
        return _trainer_steps(spread, cfg, x, kind)


def _trainer_steps(spread, cfg, x: dict, kind: str):
    """The trainer's step on ``spread`` (inside the fake mode): the step's answer-token count (the
    joint step), ``train_step`` of ``kind``, the one clipper, the non-finite check, the optimizer;
    the audit of the last of two."""
    from rag_mm.components.optim import build_optimizer

    opt = build_optimizer(spread, cfg.optim)
    check = _checker(opt)
    params = list(spread.parameters())
    backward, torch.Tensor.backward = (
        torch.Tensor.backward,
        lambda loss, *a, **kw: _backward(loss, params),
    )
    try:

        def step():
            tokens = spread.step_answer_tokens([x]) if kind == "joint" else None
            out = spread.train_step(x, answer_tokens=tokens, loss=kind)
            gnorm = spread.clip_grad_norm_(1.0)
            if check(0, out.loss.detach(), gnorm):
                opt.step()
            opt.zero_grad(set_to_none=True)

        return _steps(step)
    finally:
        torch.Tensor.backward = backward


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kinds", nargs="*", default=list(KINDS), choices=KINDS)
    args = ap.parse_args()
    run = {
        "reader_demo": reader_step,
        "reader_hf_tiny": lambda: reader_step(["model=hf_tiny"]),
        "retriever": retriever_step,
        "parallel_model": parallel_model_step,
        "spread_closed_book": spread_step,
        "spread_learned_warmup": lambda: learned_step("retriever"),
        "spread_learned_joint": lambda: learned_step("joint"),
    }
    why = _engine_error()  # before any step patches Tensor.backward
    out = {
        "torch": torch.__version__,
        "backward": f"zero gradients in its place ({why})" if why else "autograd engine",
    }
    for kind in args.kinds:
        audit = run[kind]()
        out[kind] = {
            "syncs": len(audit.syncs),
            "cpu_tensors": len(audit.cpu_tensors),
            "where": sorted({str(f) for f in audit.syncs + audit.cpu_tensors}),
        }
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
