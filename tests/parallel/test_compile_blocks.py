"""torch.compile per block (``parallel.compile``, ``ParallelConfig.compile``): the native reader
and the hf_tiny reader compile with ``fullgraph=True`` (so with zero graph breaks) and give the
eager forward and gradients in fp32; ``parallelize`` applies it after activation checkpointing.

``aot_eager``: dynamo traces and AOTAutograd partitions forward and backward exactly as for
Inductor, without writing C++ (seconds instead of minutes on a CPU)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts" / "bench"))

import stepbench as sb  # noqa: E402

from parallel.compile import apply_compile  # noqa: E402
from parallel.spmd import find_blocks  # noqa: E402

READERS = {"demo": [], "hf_tiny": ["model=hf_tiny", "retriever.top_k=2"]}


def _loss_and_grads(model, batch):
    loss = model(**batch).loss
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return loss.detach(), grads


@pytest.mark.parametrize("reader", list(READERS))
def test_compiled_blocks_equal_eager_with_no_graph_break(reader):
    torch._dynamo.reset()
    cfg, m, vocab = sb.compose_run(READERS[reader])
    eager = sb.build_model(m, vocab, "cpu").train()
    compiled = sb.build_model(m, vocab, "cpu").train()  # same seed: the same weights
    batch = sb.synthetic_batch(cfg, 2, vocab, "cpu")
    blocks = find_blocks(compiled)
    assert apply_compile(blocks, backend="aot_eager", fullgraph=True) == len(blocks) > 0
    l0, g0 = _loss_and_grads(eager, batch)
    l1, g1 = _loss_and_grads(compiled, batch)  # fullgraph: a graph break would raise here
    torch.testing.assert_close(l1, l0, rtol=1e-5, atol=1e-5)
    assert g1.keys() == g0.keys()
    for n in g0:
        torch.testing.assert_close(g1[n], g0[n], rtol=1e-4, atol=1e-5, msg=n)
    # a second step of the same shapes reuses the compiled code: a guard on anything that changes
    # from call to call (a Python counter, say) would recompile every step, then fall back to eager
    with torch._dynamo.config.patch(error_on_recompile=True):
        l2, _ = _loss_and_grads(compiled, batch)
    torch.testing.assert_close(l2, l0, rtol=1e-5, atol=1e-5)


def test_flex_block_traces_whole():
    """With flex selected, a decoder layer's graph holds the block mask and flex_attention: one
    graph, no break (forward without autograd: flex has no CPU backward to trace)."""
    torch._dynamo.reset()
    cfg, m, vocab = sb.compose_run([*READERS["hf_tiny"], "model.attention_backend=flex"])
    model = sb.build_model(m, vocab, "cpu").eval()
    layer = model.lm.model.layers[0]
    seen = []
    h = layer.register_forward_hook(
        lambda mod, a, kw, out: seen.append((a, kw)) and None, with_kwargs=True
    )
    with torch.no_grad():
        model(**sb.synthetic_batch(cfg, 2, vocab, "cpu"))
        h.remove()
        a, kw = seen[0]
        ex = torch._dynamo.explain(layer)(*a, **kw)
    assert (ex.graph_count, ex.graph_break_count) == (1, 0), ex.break_reasons
    ops = " ".join(str(n.target) for g in ex.graphs for n in g.graph.nodes)
    assert "flex_attention" in ops


def test_parallelize_compiles_after_checkpointing():
    import parallel

    torch._dynamo.reset()
    cfg, m, vocab = sb.compose_run(READERS["demo"])
    model = sb.build_model(m, vocab, "cpu").train()
    eager = sb.build_model(m, vocab, "cpu").train()
    batch = sb.synthetic_batch(cfg, 2, vocab, "cpu")
    pcfg = parallel.ParallelConfig(
        activation_checkpointing="full", compile=True, compile_backend="aot_eager"
    )
    pm = parallel.parallelize(model, pcfg, batch)
    blocks = find_blocks(model)
    assert all(getattr(b, "_compiled_call_impl", None) is not None for b in blocks)  # compiled
    # around the checkpointed forward (every block but the copy head's lone Linears)
    assert [hasattr(b, "_ac_inner_forward") for b in blocks] == [
        any(True for _ in b.children()) for b in blocks
    ]
    assert sum(hasattr(b, "_ac_inner_forward") for b in blocks) >= 4
    l1, _ = _loss_and_grads(model, batch)
    l0, _ = _loss_and_grads(eager, batch)
    torch.testing.assert_close(l1, l0, rtol=1e-5, atol=1e-5)
    assert pm is not None
