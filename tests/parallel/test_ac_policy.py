"""Which blocks activation checkpointing wraps: the reader's LM layers, never its vision tower
(``ac_skip``, the reader's default) nor a list of lone Linears (the copy head's); and checkpointing
changes no number: loss and gradients equal without it (fp32)."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts" / "bench"))

import stepbench as sb  # noqa: E402

from parallel.memory import checkpoint_candidates  # noqa: E402
from parallel.spmd import find_blocks  # noqa: E402


def _names(model, blocks):
    ids = {id(b) for b in blocks}
    return [n for n, m in model.named_modules() if id(m) in ids]


def test_reader_checkpoints_its_lm_layers_only():
    import parallel
    from rag_mm.config import compose, runtime_config

    skip = runtime_config(compose([])).ac_skip
    assert skip == ["vision"]  # the reader's default
    cfg, m, vocab = sb.compose_run(["model=hf_tiny", "retriever.top_k=2"])
    plain = sb.build_model(m, vocab, "cpu").train()
    model = sb.build_model(m, vocab, "cpu").train()
    blocks = find_blocks(model)
    names = _names(model, checkpoint_candidates(model, blocks, skip))
    assert names == [f"lm.model.layers.{i}" for i in range(4)], names
    assert any(n.startswith("vision.") for n in _names(model, blocks))  # found, then left out
    assert any(n.startswith("copy.") for n in _names(model, blocks))

    batch = sb.synthetic_batch(cfg, 2, vocab, "cpu")
    parallel.parallelize(
        model, parallel.ParallelConfig(activation_checkpointing="full", ac_skip=skip), batch
    )
    done = [n for n, mod in model.named_modules() if hasattr(mod, "_ac_inner_forward")]
    assert done == names
    losses, grads = [], []
    for mdl in (plain, model):
        loss = mdl(**batch).loss
        loss.backward()
        losses.append(loss.detach())
        grads.append({n: p.grad for n, p in mdl.named_parameters() if p.grad is not None})
    torch.testing.assert_close(losses[1], losses[0], rtol=0, atol=0)
    for n, g in grads[0].items():
        torch.testing.assert_close(grads[1][n], g, rtol=1e-6, atol=1e-7, msg=n)
