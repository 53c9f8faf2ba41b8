"""The reader's accelerator layout (every slot kept, a fixed number of answer rows with a mask: no
read-back, ``rag_mm.model.layout``) scores and trains as the host's packed layout does. Run on the
CPU by taking the CPU out of ``packed_devices``, so the numbers can be compared here."""

from __future__ import annotations

import pytest
import torch

from tests.rag_mm.hf_cases import reader_inputs, tiny_hf_reader
from tests.rag_mm.test_reader import batch, tiny_reader


def _run(reader, x: dict, packed: bool):
    reader.packed_devices = ("cpu",) if packed else ()
    reader.zero_grad(set_to_none=True)
    out = reader(**x)
    out.loss.backward()
    grads = {n: p.grad.clone() for n, p in reader.named_parameters() if p.grad is not None}
    return out, grads


def _case(name: str):
    """(reader in training mode, its inputs) of one case."""
    if name == "native-copy":  # copy head weighed by a retrieval prior
        prior = torch.log_softmax(torch.randn(3, 2, generator=torch.Generator().manual_seed(5)), -1)
        return tiny_reader(copy_head=True).train(), {**batch(), "doc_prior": prior}
    if name == "native-closed":  # no documents, no copy head
        return tiny_reader(copy_head=False).train(), {
            k: v for k, v in batch().items() if not k.startswith("doc_")
        }
    return tiny_hf_reader(copy_head=True).train(), reader_inputs()  # a Llama LM, ragged lengths


@pytest.mark.parametrize("name", ["native-copy", "native-closed", "hf-copy"])
def test_static_layout_matches_packed(name):
    reader, x = _case(name)
    packed, g_packed = _run(reader, x, packed=True)
    static, g_static = _run(reader, x, packed=False)
    # the static layout really is the other path: all slots kept, fill rows present
    assert static.valid is not None and packed.valid is None
    assert len(static.example) == x["image"].shape[0] * x["a_ids"].shape[1] > len(packed.example), (
        name
    )
    torch.testing.assert_close(static.loss, packed.loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(static.nll, packed.nll, rtol=1e-5, atol=1e-6)
    assert torch.equal(static.correct, packed.correct)
    torch.testing.assert_close(static.logits[static.valid], packed.logits, rtol=1e-5, atol=1e-5)
    assert torch.equal(static.labels[static.valid], packed.labels)
    assert torch.equal(static.example[static.valid], packed.example)
    if packed.doc_attention is not None:
        torch.testing.assert_close(static.doc_attention, packed.doc_attention, rtol=1e-5, atol=1e-6)
    assert g_static.keys() == g_packed.keys()
    for n, g in g_packed.items():
        assert torch.isfinite(g_static[n]).all(), (
            f"{name}: non-finite gradient of {n} on the static layout"
        )
        torch.testing.assert_close(
            g_static[n], g, rtol=1e-4, atol=1e-6, msg=lambda m, n=n: f"{name}, {n}: {m}"
        )


def test_static_layout_generates_the_same_answers():
    reader = tiny_reader(copy_head=True)
    x = {k: v for k, v in batch().items() if k not in ("a_ids", "a_len")}
    answers = {}
    for packed in (True, False):
        reader.packed_devices = ("cpu",) if packed else ()
        answers[packed] = reader.generate(**x, eot_id=49407)
    assert answers[True] == answers[False]
