"""Models, inputs, targets and losses for the pipeline equivalence tests (module-level so spawned
ranks can import them)."""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F

from tests.parallel.partition_models import MODELS

VOCAB = 512


def _resize(inputs, b: int, gen: torch.Generator):
    """The factory's inputs with batch b (fresh random values; all-ones masks stay ones)."""

    def one(x):
        if not isinstance(x, torch.Tensor):
            return x
        shape = (b, *x.shape[1:])
        if x.is_floating_point():
            return torch.randn(shape, generator=gen)
        if bool((x == 1).all()):
            return torch.ones(shape, dtype=x.dtype)
        return torch.randint(0, VOCAB, shape, generator=gen)

    if isinstance(inputs, dict):
        return {k: one(v) for k, v in inputs.items()}
    return tuple(one(v) for v in inputs)


def _logits_ce(out, target):
    logits = out.logits if hasattr(out, "logits") else out[0]
    return F.cross_entropy(logits.float().flatten(0, -2), target.flatten())


def hf_case(name: str, b: int = 8):
    """(model, inputs, target, loss_fn, weight_fn) for a Hugging Face model of ``MODELS``."""
    torch.manual_seed(0)
    model, inputs = MODELS[name]()
    model.eval()  # dropout off: the pipeline and the reference must see the same function
    gen = torch.Generator().manual_seed(1)
    inputs = _resize(inputs, b, gen)
    if name == "t5":
        tgt_len = inputs["decoder_input_ids"].shape[1]
    elif isinstance(inputs, dict):
        tgt_len = inputs["input_ids"].shape[1]
    else:
        tgt_len = inputs[0].shape[1]
    target = torch.randint(0, VOCAB, (b, tgt_len), generator=gen)
    return model, inputs, target, _logits_ce, None


def reader_case(b: int = 8):
    from rag_mm.config import ModelConfig
    from rag_mm.model import Reader

    torch.manual_seed(0)
    cfg = ModelConfig(
        dim=64,
        layers=4,
        heads=4,
        vision_width=64,
        vision_layers=1,
        vision_head_width=32,
        attention_backend="reference",
    )
    model = Reader(cfg, 49408)
    gen = torch.Generator().manual_seed(1)
    k, lt, lq, la = 2, 6, 5, 4
    inputs = {
        "image": torch.randn(b, 3, 32, 32, generator=gen),
        "q_ids": torch.randint(0, 49408, (b, lq), generator=gen),
        "q_len": torch.randint(2, lq + 1, (b,), generator=gen),
        "a_ids": torch.randint(0, 49408, (b, la), generator=gen),
        "a_len": torch.randint(1, la + 1, (b,), generator=gen),
        "doc_image": torch.randn(b, k, 3, 32, 32, generator=gen),
        "doc_ids": torch.randint(0, 49408, (b, k, lt), generator=gen),
        "doc_len": torch.randint(1, lt + 1, (b, k), generator=gen),
    }
    loss_fn = lambda out, _t: out.loss  # noqa: E731 - per-token mean of the microbatch
    weight_fn = lambda inp, _t: float(inp["a_len"].sum())  # noqa: E731 - tokens: full-batch token mean
    return model, inputs, None, loss_fn, weight_fn


def hf_reader_case(b: int = 8):
    """The reader on a Hugging Face Llama decoder (4 layers), 2 documents per query."""
    from tests.rag_mm.hf_cases import reader_inputs, tiny_hf_reader

    model = tiny_hf_reader("llama", layers=4)
    loss_fn = lambda out, _t: out.loss  # noqa: E731 - per-token mean of the microbatch
    weight_fn = lambda inp, _t: float(inp["a_len"].sum())  # noqa: E731 - answer tokens predicted
    return model, reader_inputs(b, k=2), None, loss_fn, weight_fn


def make_case(name: str, b: int = 8):
    if name == "hf_reader":
        return hf_reader_case(b)
    if name == "skip_mlp":
        return skip_mlp_case(b)
    if name == "seq_mlp":  # nn.Sequential: export renames its ``input`` argument to ``input_1``
        model, inputs, target, loss_fn, w = skip_mlp_case(b)
        return torch.nn.Sequential(*model.blocks), inputs, target, loss_fn, w
    return reader_case(b) if name == "reader" else hf_case(name, b)


def reference(model, inputs, target, loss_fn, weight_fn, m: int):
    """Single-process loss and gradients of the full batch (the quantity train_step defines)."""
    from parallel.inputs import _as_call, split_microbatches

    ref = copy.deepcopy(model)
    if weight_fn is None:  # equal microbatches of a mean loss: one full-batch pass is the reference
        args, kwargs = _as_call(inputs)
        loss = loss_fn(ref(*args, **kwargs), target)
        loss.backward()
    else:
        mbs, tgts = split_microbatches(inputs, m), split_microbatches(target, m)
        w = [weight_fn(mbs[i], tgts[i]) for i in range(m)]
        loss = 0.0
        for i in range(m):
            args, kwargs = _as_call(mbs[i])
            li = loss_fn(ref(*args, **kwargs), tgts[i]) * (w[i] / sum(w))
            li.backward()
            loss = loss + li.detach()
        # the weighted mean of per-token means equals the full-batch per-token mean; check that too
        args, kwargs = _as_call(inputs)
        full = loss_fn(copy.deepcopy(model)(*args, **kwargs), target)
        assert torch.allclose(full, loss, rtol=1e-5), (float(full), float(loss))
    grads = {n: p.grad.clone() for n, p in ref.named_parameters() if p.grad is not None}
    return float(loss.detach() if torch.is_tensor(loss) else loss), grads


class SkipMLP(torch.nn.Module):
    """An exportable stack (the graph path's case): input projection, 6 residual MLP blocks and a
    head that also reads the input projection (a long skip: relayed through every middle stage)."""

    def __init__(self, d: int = 32, n: int = 6):
        super().__init__()
        self.inp = torch.nn.Linear(d, d)
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(
                torch.nn.LayerNorm(d),
                torch.nn.Linear(d, 2 * d),
                torch.nn.GELU(),
                torch.nn.Linear(2 * d, d),
            )
            for _ in range(n)
        )
        self.out = torch.nn.Linear(d, d)

    def forward(self, x):
        h0 = self.inp(x)
        h = h0
        for blk in self.blocks:
            h = h + blk(h)
        return self.out(h + h0)


def skip_mlp_case(b: int = 8):
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(1)
    x, y = torch.randn(b, 32, generator=gen), torch.randn(b, 32, generator=gen)
    return SkipMLP(), (x,), y, lambda out, t: F.mse_loss(out, t), None
