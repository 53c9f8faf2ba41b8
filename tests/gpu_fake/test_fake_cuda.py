"""The GPU path on a machine without one: the demo and hf_tiny readers, the retriever and a pp=1
``ParallelModel`` built on fake CUDA (``tests/gpu_fake/fake_cuda.py``), each step audited for
device mismatches, CPU tensors and host syncs. A steady-state step must have none of them.

Backward: where the autograd engine runs on fake CUDA (a machine with a CUDA device), the step's
real backward runs and is audited too; where it cannot (no driver: ``engine_backward_error``),
the gradients are stood in for by zeros, so the optimizer step, clipping and the non-finite check
are still covered.
"""

from __future__ import annotations

import functools

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import parallel
from parallel.config import ParallelConfig
from rag_mm.components.nonfinite import NonFiniteGuard
from rag_mm.components.optim import build_optimizer
from rag_mm.config import compose
from rag_mm.model.factory import build_reader, materialize
from retriever import losses
from retriever.augment import random_views
from retriever.encoders import DualEncoder
from tests.gpu_fake.fake_cuda import HostAudit, audited, engine_backward_error, fake_cuda

CUDA = torch.device("cuda")
VOCAB = 49408  # the bundled CLIP BPE tokenizer's
B = 4  # queries per batch


@functools.cache
def _cfg(*overrides: str):
    # sdpa: the CUDA fallback of ``auto``, and a backend without a build step (flex needs Triton)
    return compose(["+experiment=demo", "model.attention_backend=sdpa", *overrides])


@functools.cache
def _engine_error() -> str | None:
    return engine_backward_error()


def _inputs(m, k: int) -> dict:
    """A batch on fake CUDA, ragged lengths, k documents per query."""
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


def _reader(m, mode):
    """The reader of model config ``m`` on fake CUDA: built on the meta device before the fake
    mode (inside it, meta tensors would be fake ones too), then given weights on the device
    (``materialize``, the delayed init; ``Module.to`` cannot move fake parameters: it swaps them,
    and a fake tensor's weak references forbid the swap). Meta tensors are not fake, so the mode
    lets them in while the weights are made."""
    reader = build_reader(m, VOCAB, meta=True)
    with fake_cuda(mode):
        mode.allow_non_fake_inputs = True
        try:
            materialize(reader, CUDA)
        finally:
            mode.allow_non_fake_inputs = False
    assert all(p.device.type == "cuda" for p in reader.parameters())
    return reader.train()


def _backward(loss: torch.Tensor, params: list[torch.Tensor]) -> None:
    """The real backward where the engine runs on fake CUDA, else zero gradients in its place."""
    if _engine_error() is None:
        loss.backward()
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)


def _train_steps(model, forward, steps: int = 2):
    """``steps`` training steps (the trainer's order: forward, backward, clip, non-finite check,
    fused AdamW update); the last one, a steady-state step, audited."""
    opt = build_optimizer(model, _cfg().optim)
    assert opt.defaults["fused"], (
        "AdamW on CUDA parameters must be fused (it skips non-finite steps on the device)"
    )
    params = [p for p in model.parameters() if p.requires_grad]
    guard = NonFiniteGuard(opt, CUDA, limit=10, window=steps)
    assert guard.on_device
    for step in range(steps):
        with audited() as audit:
            loss = forward()
            _backward(loss, params)
            gnorm = torch.nn.utils.clip_grad_norm_(params, 1.0)
            assert guard.check(step, loss.detach(), gnorm)
            opt.step()
            opt.zero_grad(set_to_none=True)
    return loss, audit


def _assert_clean(audit, what: str) -> None:
    assert not audit.syncs and not audit.cpu_tensors, f"{what}:\n{audit.report()}"


# ------------------------------------------------------------------------------ the audit itself
def test_audit_sees_syncs_cpu_tensors_and_mismatches():
    """Each kind of host sync and CPU tensor the audit is for is found, with its place."""
    with fake_cuda():
        x = torch.randn(4, device=CUDA)
        cases = {
            "item": lambda: x.sum().item(),
            "float": lambda: float(x.sum()),
            "bool": lambda: bool(x.all()),
            "cpu": lambda: x.cpu(),
            "tolist": lambda: x.tolist(),
            "nonzero": lambda: x.nonzero(),
            "tensor(list, cuda)": lambda: torch.tensor([1.0, 2.0], device=CUDA),
        }
        for name, fn in cases.items():
            with audited() as audit:
                fn()
            assert audit.syncs, name
        with audited() as audit:
            torch.arange(3)  # a factory without device=
            x * 2 + x.abs()  # nothing to report
        assert [f.op for f in audit.cpu_tensors] == ["aten.arange.default"] and not audit.syncs


def test_audit_boolean_mask_and_device_mismatch():
    with fake_cuda():
        x = torch.randn(4, device=CUDA)
        audit = HostAudit()
        with pytest.raises(Exception, match="nonzero|dynamic"), audit:
            x[x > 0]  # a boolean mask: its size is read back; counted, then raised (no stand-in)
        assert audit.syncs and "output size read back" in audit.syncs[0].op
        # torch's FakeTensorDeviceMismatchError is a RuntimeError naming both devices
        with pytest.raises(RuntimeError, match="(?i)device"):
            x + torch.randn(4, device="cpu")


# ------------------------------------------------------------------------------ readers
@pytest.mark.parametrize("model", ["demo", "hf_tiny"])
def test_reader_train_step_on_fake_cuda(model):
    """One steady-state train step of the reader with 4 documents per query: no sync, no CPU
    tensor."""
    cfg = _cfg() if model == "demo" else _cfg("model=hf_tiny")
    m, k = cfg.model, cfg.retriever.top_k
    mode = FakeTensorMode(allow_non_fake_inputs=False)
    reader = _reader(m, mode)
    with fake_cuda(mode):
        x = _inputs(m, k)
        loss, audit = _train_steps(reader, lambda: reader(**x).loss)
    assert loss.device.type == "cuda" and loss.shape == ()
    _assert_clean(audit, f"{model} reader step")


@pytest.mark.parametrize("model", ["demo", "hf_tiny"])
def test_reader_forward_with_flex_on_fake_cuda(model, monkeypatch):
    """The reader's forward with flex attention (auto's CUDA choice for the retrieval layout): its
    block mask is built on the device from the offsets, once per forward, nothing read back.
    flex_attention's own call cannot run under a dispatch mode (it wraps itself in torch.compile,
    which refuses one), so the kernel is replaced by an output of its shape: everything around it,
    the mask included, is audited. Without autograd: the backward builds no mask."""
    from parallel.kernels import attention, flex

    if not flex.available()[0]:
        pytest.skip(flex.available()[1])
    # no Triton on fake tensors
    monkeypatch.setattr(flex, "_compile_off", {"cuda": "fake CUDA: eager flex"})
    monkeypatch.setattr(attention, "_flex_gate", lambda q: (True, "fake CUDA (no device to ask)"))
    monkeypatch.setattr(flex, "_run", lambda q, k, v, mask, scale, compiled: torch.empty_like(q))
    built = []
    real = flex.create_block_mask
    monkeypatch.setattr(
        flex, "create_block_mask", lambda *a, **kw: (built.append(1), real(*a, **kw))[1]
    )
    cfg = _cfg("model.attention_backend=flex", *(["model=hf_tiny"] if model == "hf_tiny" else []))
    m, k = cfg.model, cfg.retriever.top_k
    mode = FakeTensorMode(allow_non_fake_inputs=False)
    reader = _reader(m, mode)
    with fake_cuda(mode), torch.no_grad():
        x = _inputs(m, k)
        reader(**x)
        built.clear()
        with audited() as audit:
            loss = reader(**x).loss
    assert loss.device.type == "cuda"
    _assert_clean(audit, f"{model} reader forward, flex")
    assert len(built) == 1  # one mask for the forward's layout, not one per layer


# ------------------------------------------------------------------------------ retriever
def test_retriever_on_fake_cuda():
    """Query and document encoding, the retrieval scores, every retriever loss and the random
    views of the pseudo-queries: no sync, no CPU tensor."""
    r, m = _cfg().retriever, _cfg().model
    k = r.top_k
    with fake_cuda():
        with torch.device(CUDA):
            torch.manual_seed(0)
            enc = DualEncoder(r, m.image_size).train()
        x = _inputs(m, k)
        gold, hard_ids = (
            torch.randint(0, 256, (B,), device=CUDA),
            torch.randint(0, 256, (B * k,), device=CUDA),
        )
        with audited() as audit:
            q = enc.embed_queries(random_views(x["image"]), x["q_ids"], x["q_len"])  # (B, E)
            d = enc.embed_docs(
                x["doc_image"].flatten(0, 1), x["doc_ids"].flatten(0, 1), x["doc_len"].flatten(0, 1)
            ).view(B, k, -1)  # (B, k, E)
            scores = enc.scale() * torch.einsum("be,bke->bk", q, d)  # (B, k)
            nll = torch.rand(B, k, device=CUDA)
            total = (
                losses.perplexity_distillation(scores, nll, 0.1)
                + losses.emdr2(scores, -nll)
                + losses.attention_distillation(scores, torch.rand(B, k, device=CUDA))
                + losses.contrastive(q, d[:, 0], gold, enc.scale(), d.flatten(0, 1), hard_ids)
            )
    assert total.device.type == "cuda" and scores.shape == (B, k)
    _assert_clean(audit, "retriever")


# ------------------------------------------------------------------------------ ParallelModel
def test_parallel_model_step_on_fake_cuda(monkeypatch):
    """One steady-state ``ParallelModel.train_step`` (pp=1, two microbatches weighted by answer
    tokens as a device tensor) of the demo reader: no sync, no CPU tensor."""
    m, k = _cfg().model, _cfg().retriever.top_k
    mode = FakeTensorMode(allow_non_fake_inputs=False)
    reader = _reader(m, mode)
    with fake_cuda(mode):
        x = _inputs(m, k)
        pm = parallel.parallelize(reader, ParallelConfig(microbatches=2), x)
        params = list(pm.parameters())
        if _engine_error() is not None:  # the step's own backward: zero gradients in its place
            monkeypatch.setattr(
                torch.Tensor, "backward", lambda loss, *a, **kw: _backward(loss, params)
            )
        tokens = lambda mb, _: (mb["a_len"] - 1).clamp_min(0).sum()  # noqa: E731
        for _ in range(2):
            with audited() as audit:
                loss = pm.train_step(x, weight_fn=tokens)
                pm.zero_grad()
    assert loss.device.type == "cuda" and loss.shape == ()
    _assert_clean(audit, "ParallelModel.train_step")


# -------------------------------------------------------------------------- the trainer's step path
def test_trainer_step_path_on_fake_cuda(monkeypatch):
    """The trainer's step over the closed-book demo reader: the step's answer-token count,
    ``SpreadRag.train_step``, its ``clip_grad_norm_``, the non-finite check and the optimizer (no
    data loader, no faiss)."""
    from rag_mm.data.documents import DocumentStore
    from rag_mm.distributed.spread import SpreadRag
    from rag_mm.model.rag import RagModel

    cfg = _cfg("retriever=none", f"data.batch_size={B}")
    mode = FakeTensorMode(allow_non_fake_inputs=False)
    reader = _reader(cfg.model, mode)
    with fake_cuda(mode):
        rag = RagModel(
            reader, DocumentStore.empty(cfg.model.image_size, cfg.model.max_doc_text), cfg.retriever
        )
        spread = SpreadRag(rag, cfg, CUDA)
        opt = build_optimizer(spread, cfg.optim)
        guard = NonFiniteGuard(opt, CUDA, limit=10, window=2)
        x = {**_inputs(cfg.model, 0), "gold": torch.full((B,), -1, device=CUDA)}
        params = list(spread.parameters())
        if _engine_error() is not None:
            monkeypatch.setattr(
                torch.Tensor, "backward", lambda loss, *a, **kw: _backward(loss, params)
            )
        for step in range(2):
            with audited() as audit:
                tokens = spread.step_answer_tokens([x])  # the step's token count, on the device
                out = spread.train_step(x, answer_tokens=tokens)
                gnorm = spread.clip_grad_norm_(1.0)
                assert guard.check(step, out.loss.detach(), gnorm)
                opt.step()
                opt.zero_grad(set_to_none=True)
    _assert_clean(audit, "the trainer's step path")


# ------------------------------------------------------------------------------ non-finite check
def test_nonfinite_check_reads_back_at_log_steps_only():
    """Between flushes the guard reads nothing back; a flush is one read of the window's flags."""
    with fake_cuda():
        with torch.device(CUDA):
            lin = torch.nn.Linear(8, 8)
        opt = torch.optim.AdamW(lin.parameters(), fused=True)
        guard = NonFiniteGuard(opt, CUDA, limit=10, window=4)
        with audited() as audit:
            for step in range(4):
                lin.weight.grad, lin.bias.grad = (
                    torch.ones_like(lin.weight),
                    torch.ones_like(lin.bias),
                )
                assert guard.check(step, lin.weight.sum(), torch.ones((), device=CUDA))
                opt.step()
        _assert_clean(audit, "four checked steps")
        with audited() as audit:
            guard.flush()  # the stand-in answer reads every step as finite
        assert len(audit.syncs) == 1, audit.report()
