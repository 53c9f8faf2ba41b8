"""The whole model as one compiled graph (``parallel.compile_scope=model``): the demo and hf_tiny
readers, in their static layout, trace as one graph with no break and train as eager does in fp32
(loss and every gradient), through ``parallelize`` and ``ParallelModel.train_step``; a second
step of the same shapes reuses the compiled code. The layouts it cannot run in are refused, and a
model replaying CUDA graphs (``compile_mode=reduce-overhead``) has each step marked as a new one.

``aot_eager``: dynamo traces and AOTAutograd partitions forward and backward exactly as for
Inductor, without writing C++."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts" / "bench"))

import stepbench as sb  # noqa: E402

import parallel  # noqa: E402
from parallel.config import ParallelConfig  # noqa: E402

READERS = {"demo": [], "hf_tiny": ["model=hf_tiny", "retriever.top_k=2"]}


def _step(pm, batch):
    """One training step through ``ParallelModel``: (loss, gradients), the gradients cleared."""
    loss = pm.train_step(batch)
    grads = {n: p.grad.clone() for n, p in pm.named_parameters() if p.grad is not None}
    pm.zero_grad()
    return loss, grads


@pytest.mark.parametrize("reader", list(READERS))
def test_whole_reader_is_one_graph_and_trains_as_eager(reader):
    torch._dynamo.reset()
    cfg, m, vocab = sb.compose_run(READERS[reader])
    models = [sb.build_model(m, vocab, "cpu").train() for _ in range(2)]  # same seed: same weights
    batch = sb.synthetic_batch(cfg, 2, vocab, "cpu")
    for model in models:
        model.packed_devices = ()  # the static layout (rag_mm's SpreadRag sets it likewise)
    # no break: the whole forward and loss in one graph
    ex = torch._dynamo.explain(lambda **x: models[0](**x).loss)(**batch)
    assert (ex.graph_count, ex.graph_break_count) == (1, 0), ex.break_reasons
    torch._dynamo.reset()
    eager = parallel.parallelize(models[0], ParallelConfig(), batch)
    whole = ParallelConfig(compile=True, compile_scope="model", compile_backend="aot_eager")
    compiled = parallel.parallelize(models[1], whole, batch)
    assert getattr(models[1], "_compiled_call_impl", None) is not None  # the module itself
    l0, g0 = _step(eager, batch)
    l1, g1 = _step(compiled, batch)  # fullgraph: a graph break would raise here
    torch.testing.assert_close(l1, l0, rtol=1e-5, atol=1e-5)
    assert g1.keys() == g0.keys() and len(g0) == len(list(models[0].parameters()))
    for n in g0:
        torch.testing.assert_close(g1[n], g0[n], rtol=1e-4, atol=1e-5, msg=n)
    with torch._dynamo.config.patch(error_on_recompile=True):  # the next step: no recompile
        l2, _ = _step(compiled, batch)
    torch.testing.assert_close(l2, l0, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "layout, world, named",
    [
        (dict(pp=2), 2, "pp=2"),
        (dict(tp=2), 2, "tp=2"),
        (dict(dp_shard=2), 2, "dp_shard=2"),
        (dict(mixed_precision="bf16"), 1, "mixed_precision='bf16'"),
        (dict(cpu_offload=True), 1, "cpu_offload=True"),
    ],
)
def test_whole_model_compile_is_refused_where_hooks_split_the_model(layout, world, named):
    problems = " ".join(
        ParallelConfig(compile=True, compile_scope="model", **layout).problems(world)
    )
    assert "compile_scope='model'" in problems and named in problems, problems
    assert not ParallelConfig(compile=True, compile_scope="model", dp_replicate=2).problems(2)


def test_cuda_graphs_need_the_whole_model_and_inductor():
    for bad in (
        dict(compile_mode="reduce-overhead"),
        dict(compile_mode="reduce-overhead", compile_scope="model", compile_backend="aot_eager"),
    ):
        problems = " ".join(ParallelConfig(compile=True, **bad).problems(1))
        assert "compile_mode='reduce-overhead'" in problems, bad
    ok = ParallelConfig(compile=True, compile_scope="model", compile_mode="reduce-overhead")
    assert not ok.problems(1)


def test_each_step_is_marked_for_cuda_graphs(monkeypatch):
    """With ``compile_mode=reduce-overhead`` every ``train_step`` and ``predict`` tells the CUDA
    graphs a new step begins (else a replay would overwrite outputs the caller still holds)."""
    import parallel.compile

    compiled = []
    monkeypatch.setattr(  # Inductor on the CPU would take minutes and record no CUDA graph
        parallel.compile, "apply_compile_model", lambda m, b, mode: compiled.append(mode)
    )
    marks = []
    monkeypatch.setattr(torch.compiler, "cudagraph_mark_step_begin", lambda: marks.append(1))
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
    x = torch.randn(6, 4)
    cfg = ParallelConfig(
        compile=True, compile_scope="model", compile_mode="reduce-overhead", microbatches=2
    )
    pm = parallel.parallelize(model, cfg, x)
    assert compiled == ["reduce-overhead"]
    pm.train_step(x, loss_fn=lambda out, _: out.square().mean())
    pm.predict(x)
    assert len(marks) == 2


def test_the_trainers_step_compiles_the_whole_reader():
    """rag_mm's step path (``SpreadRag``) with ``parallel.compile_scope=model``: the reader takes
    its static layout, so its first training step compiles as one graph (a length read back, as
    the host's packed layout does, would break it), and trains as the eager reader does."""
    from rag_mm.config import compose
    from rag_mm.data.documents import DocumentStore
    from rag_mm.distributed.spread import SpreadRag
    from rag_mm.model.rag import RagModel

    torch._dynamo.reset()
    losses = []
    for extra in ([], ["parallel.compile=true", "parallel.compile_scope=model"]):
        cfg = compose(
            ["+experiment=demo", "retriever=none", "data.batch_size=2"]
            + ["parallel.compile_backend=aot_eager", *extra]
        )
        cfg_, m, vocab = sb.compose_run(["retriever=none"])
        reader = sb.build_model(cfg.model, vocab, "cpu").train()
        store = DocumentStore.empty(cfg.model.image_size, cfg.model.max_doc_text)
        spread = SpreadRag(RagModel(reader, store, cfg.retriever), cfg, torch.device("cpu"))
        assert reader.packed_devices == (() if extra else ("cpu",))
        x = {**sb.synthetic_batch(cfg_, 2, vocab, "cpu"), "gold": torch.full((2,), -1)}
        assert (getattr(reader, "_compiled_call_impl", None) is not None) == bool(extra)
        losses.append(spread.train_step(x).loss)
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-5, atol=1e-5)


def test_flex_in_compiled_blocks_on_the_cpu_is_refused_by_name():
    """``model.attention_backend=flex`` with ``parallel.compile=true`` cannot train on the CPU (a
    fullgraph block cannot trace flex's CPU backward around its cached mask): the trainer's
    ``SpreadRag`` says so before the first step, and builds as usual without the compile."""
    from rag_mm.config import ConfigError, compose
    from rag_mm.data.documents import DocumentStore
    from rag_mm.distributed.spread import SpreadRag
    from rag_mm.model.rag import RagModel

    for compiled in (True, False):
        cfg = compose(
            ["+experiment=demo", "retriever=none", "data.batch_size=2"]
            + ["model.attention_backend=flex", f"parallel.compile={str(compiled).lower()}"]
        )
        _, _, vocab = sb.compose_run(["retriever=none"])
        reader = sb.build_model(cfg.model, vocab, "cpu").train()
        store = DocumentStore.empty(cfg.model.image_size, cfg.model.max_doc_text)
        rag = RagModel(reader, store, cfg.retriever)
        if compiled:
            with pytest.raises(ConfigError, match="attention_backend=flex with parallel.compile"):
                SpreadRag(rag, cfg, torch.device("cpu"))
        else:
            SpreadRag(rag, cfg, torch.device("cpu"))
