"""The learned retriever's training step on fake CUDA: the retriever warm-up's step and the joint
step (``SpreadRag.train_step`` with ``retriever.search=device``: query encoding, search, the
reader's read, the reader-driven loss, the contrastive terms with pseudo-queries and bank
negatives, the backward, the recall counts), then clipping, the non-finite check and the
optimizer: no host sync and no CPU tensor in a steady step, for each reader-driven loss and the
options that change the step's path (reading order shuffles, rerank, a centred memory, photo-like
pseudo-queries). Half of the batch names no gold document, so the contrastive terms' mask runs
too."""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from rag_mm.components.nonfinite import NonFiniteGuard
from rag_mm.components.optim import build_optimizer
from tests.gpu_fake.fake_cuda import audited, fake_cuda
from tests.gpu_fake.learned import learned_spread
from tests.gpu_fake.test_fake_cuda import (
    CUDA,
    B,
    _assert_clean,
    _backward,
    _cfg,
    _engine_error,
    _inputs,
    _reader,
)

N = 12  # documents
PATHS = {
    "pdist": [],  # the demo's: the reader's NLL with each document alone, pseudo-queries, bank
    "adist, shuffled reads": ["retriever.loss=adist", "retriever.reader_shuffle=0.5"],
    "emdr, rerank, centred, photo views": [
        "retriever.loss=emdr",
        "retriever.rerank=8",
        "retriever.centre=true",
        "retriever.pseudo_view=photo",
        "retriever.pseudo_restyle=0.5",
    ],
}


# the memory turns its (real) id tensor into numpy inside the fake mode, which fakes the detach
@pytest.mark.filterwarnings("ignore:Accessing the data pointer of FakeTensor")
@pytest.mark.parametrize("path", list(PATHS))
def test_learned_training_steps_read_nothing_back(path, monkeypatch):
    cfg = _cfg(f"data.batch_size={B}", "retriever.search=device", *PATHS[path])
    assert cfg.retriever.mode == "learned" and cfg.retriever.pseudo_queries > 0
    assert cfg.retriever.bank_negatives > 0
    mode = FakeTensorMode(allow_non_fake_inputs=False)
    reader, ids = _reader(cfg.model, mode), torch.arange(N) * 7 + 3
    with fake_cuda(mode):
        spread = learned_spread(cfg, mode, reader, ids)
        opt = build_optimizer(spread, cfg.optim)
        guard = NonFiniteGuard(opt, CUDA, limit=10, window=4)
        gold = torch.arange(B, device=CUDA) * 7 + 3
        x = {**_inputs(cfg.model, 0), "gold": gold.masked_fill(gold > 10, -1)}  # two unnamed
        params = list(spread.parameters())
        if _engine_error() is not None:
            monkeypatch.setattr(
                torch.Tensor, "backward", lambda loss, *a, **kw: _backward(loss, params)
            )
        for step, kind in enumerate(["retriever", "retriever", "joint", "joint"]):
            with audited() as audit:
                tokens = spread.step_answer_tokens([x]) if kind == "joint" else None
                out = spread.train_step(x, answer_tokens=tokens, loss=kind)
                gnorm = spread.clip_grad_norm_(1.0)
                assert guard.check(step, out.loss, gnorm)
                opt.step()
                opt.zero_grad(set_to_none=True)
            if step % 2:  # the second step of each kind: a steady one
                assert out.hits is not None and out.hits[0].device.type == "cuda"
                _assert_clean(audit, f"the {kind} step ({path})")
