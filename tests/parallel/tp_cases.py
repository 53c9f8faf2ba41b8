"""Per-rank bodies of the tensor-parallel tests (module level: ``run_ranks`` spawns them)."""

from __future__ import annotations

import contextlib
import copy
import types

import torch
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from parallel.trace import default_loss


def reader_factory(layers: int = 2, mlp: str = "gelu"):
    from rag_mm.config import ModelConfig
    from rag_mm.model import Reader

    cfg = ModelConfig(
        dim=64,
        layers=layers,
        heads=4,
        mlp=mlp,
        vision_width=64,
        vision_layers=1,
        vision_head_width=32,
        attention_backend="reference",
    )
    model = Reader(cfg, vocab_size=96)
    g = torch.Generator().manual_seed(1)
    B = 2
    inputs = dict(
        image=torch.randn(B, 3, 32, 32, generator=g),
        q_ids=torch.randint(0, 96, (B, 6), generator=g),
        q_len=torch.tensor([6, 4]),
        a_ids=torch.randint(0, 96, (B, 4), generator=g),
        a_len=torch.tensor([4, 3]),
        doc_image=torch.randn(B, 1, 3, 32, 32, generator=g),
        doc_ids=torch.randint(0, 96, (B, 1, 5), generator=g),
        doc_len=torch.tensor([[5], [3]]),
    )
    return model, inputs


def reader_loss(out):
    return out.loss


def factory(name: str):
    if name == "reader":  # rag_mm's own attention: planned automatically, as the trainer does
        return reader_factory()
    if name == "reader_swiglu":  # the same reader with Llama's gated MLP (model.mlp=swiglu)
        return reader_factory(mlp="swiglu")
    if name == "hf_reader":  # a Hugging Face Llama decoder with rag_mm's attention inside
        from tests.rag_mm.hf_cases import reader_inputs, tiny_hf_reader

        return tiny_hf_reader("llama"), reader_inputs(2, k=1)
    from tests.parallel.partition_models import MODELS

    return MODELS[name]()


def run(model, inputs, loss_fn):
    out = model(**inputs) if isinstance(inputs, dict) else model(*inputs)
    return loss_fn(out)


def full(t):
    return t.full_tensor() if isinstance(t, DTensor) else t


def compare_grads(ref: torch.nn.Module, model: torch.nn.Module) -> dict:
    """Gradient agreement: ``param`` = largest max|g - g_ref| / max|g_ref| over parameters whose
    gradient is not negligible (max|g_ref| > 1e-3 of the largest; e.g. attention key biases have a
    zero gradient in exact arithmetic), ``global`` = largest max|g - g_ref| over all parameters
    relative to the largest gradient entry. Also the names of the DTensor parameters."""
    refp = dict(ref.named_parameters())
    pairs = []
    for n, p in model.named_parameters():
        r = refp[n].grad
        if r is None:
            assert p.grad is None or float(full(p.grad).abs().max()) == 0.0, n
            continue
        assert p.grad is not None, f"{n}: no gradient"
        pairs.append((n, full(p.grad), r, isinstance(p, DTensor)))
    scale = max(float(r.abs().max()) for _, _, r, _ in pairs)
    per, glob = 0.0, 0.0
    for n, g, r, _ in pairs:
        assert g.shape == r.shape, n
        d = float((g - r).abs().max())
        glob = max(glob, d / scale)
        if float(r.abs().max()) > 1e-3 * scale:
            per = max(per, d / float(r.abs().max()))
    return dict(gerr=per, gerr_global=glob, dtensors=[n for n, _, _, d in pairs if d])


def lm_loss(ids):
    def loss_fn(out):
        lg = out.logits
        if isinstance(lg, DTensor):
            from parallel.tp import vocab_parallel_cross_entropy

            return vocab_parallel_cross_entropy(lg, ids)
        return F.cross_entropy(lg.flatten(0, 1).float(), ids.flatten())

    return loss_fn


def loss_for(name, inputs):
    if name in ("reader", "hf_reader"):
        return reader_loss
    if name in ("gpt2", "llama", "bert"):
        return lm_loss(inputs[0] if isinstance(inputs, tuple) else inputs["input_ids"])
    return default_loss


def prepare(name):
    """The model (dropout off, so runs are deterministic), a reference copy, inputs, loss."""
    torch.manual_seed(0)
    model, inputs = factory(name)
    for m in model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
        elif isinstance(getattr(m, "dropout", None), float):  # functional dropout (T5's attention)
            m.dropout = 0.0
    return model, copy.deepcopy(model), inputs, loss_for(name, inputs)


def tp_equivalence(rank, world, name, sequence_parallel=False, loss_parallel=False):
    from parallel.tp import apply_tp

    model, ref, inputs, loss_fn = prepare(name)
    ref_loss = run(ref, inputs, loss_fn)
    ref_loss.backward()
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    plan = apply_tp(
        model, mesh, inputs, sequence_parallel=sequence_parallel, loss_parallel=loss_parallel
    )
    loss = run(model, inputs, loss_fn)
    loss.backward()
    return dict(
        loss=float(loss),
        ref=float(ref_loss),
        **compare_grads(ref, model),
        roles={n: e.role for n, e in plan.entries.items()},
        log=plan.log,
    )


def suite(rank, world, names, sp_names=(), lp_names=()):
    """TP equivalence for several models in one process group (amortises start-up)."""
    out = {}
    for n in names:
        out[n] = tp_equivalence(rank, world, n)
    for n in sp_names:
        out[n + "+sp"] = tp_equivalence(rank, world, n, sequence_parallel=True)
    for n in lp_names:
        out[n + "+loss_parallel"] = tp_equivalence(rank, world, n, loss_parallel=True)
    return out


def _kind(op) -> str:
    s = str(op)
    for k in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast"):
        if k in s:
            return k
    return s


def layer_collectives(rank, world, name="llama", sequence_parallel=False):
    """Forward collectives issued inside each transformer layer, counted by torch's
    CommDebugMode."""
    from torch.distributed.tensor.debug import CommDebugMode

    from parallel.spmd import find_blocks
    from parallel.tp import apply_tp

    model, _, inputs, _ = prepare(name)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    apply_tp(model, mesh, inputs, sequence_parallel=sequence_parallel)
    per_layer = []
    mode = CommDebugMode()
    start = {}

    def totals():
        out = {}
        for op, c in mode.get_comm_counts().items():
            out[_kind(op)] = out.get(_kind(op), 0) + c
        return out

    def pre(mod, args):
        start[id(mod)] = totals()

    def post(mod, args, out):
        t0, t1 = start.pop(id(mod)), totals()
        per_layer.append({k: v - t0.get(k, 0) for k, v in t1.items() if v - t0.get(k, 0)})

    for b in find_blocks(model):
        b.register_forward_pre_hook(pre)
        b.register_forward_hook(post)
    with torch.no_grad(), mode:
        run(model, inputs, lambda o: o)
    return per_layer


def spmd_case(rank, world, cfg_kw, name="reader", steps=1):
    """parallelize_spmd on the 4-D mesh vs one process: loss, gradients, and parameters after
    clipping + an AdamW step."""
    from parallel.config import ParallelConfig
    from parallel.fsdp import clip_grad_norm_
    from parallel.mesh import build_mesh
    from parallel.spmd import parallelize_spmd

    model, ref, inputs, loss_fn = prepare(name)
    cfg = ParallelConfig(**cfg_kw)
    mesh = build_mesh(cfg, world, "cpu")
    parallelize_spmd(model, cfg, mesh, inputs)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, foreach=False)
    res = {}
    for step in range(steps + 1):
        ref_loss = run(ref, inputs, loss_fn)
        ref_loss.backward()
        loss = run(model, inputs, loss_fn)
        loss.backward()
        if step == 0:
            res.update(loss=float(loss), ref=float(ref_loss), **compare_grads(ref, model))
        if step == steps:
            res.update(loss_after=float(loss), ref_after=float(ref_loss))
            break
        n = clip_grad_norm_(model.parameters(), 0.5)
        rn = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
        res.setdefault("norm", (float(n), float(rn)))
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
    refp = dict(ref.named_parameters())
    res["perr"] = max(
        float((full(p.detach()) - refp[n].detach()).abs().max())
        for n, p in model.named_parameters()
    )
    res["names_equal"] = [n for n, _ in model.named_parameters()] == [
        n for n, _ in ref.named_parameters()
    ]
    return res


def meta_fsdp_case(rank, world):
    """Build the reader on the meta device, shard it with FSDP2 over 2 ranks, materialise only
    the shards, load the reference weights with DCP's set_model_state_dict, compare losses."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        set_model_state_dict,
    )

    from parallel.config import ParallelConfig
    from parallel.memory import local_param_bytes, materialize, meta_init
    from parallel.mesh import build_mesh
    from parallel.spmd import parallelize_spmd

    _, ref, inputs, loss_fn = prepare("reader")
    with meta_init():
        torch.manual_seed(0)
        model, _ = reader_factory()
    on_meta = all(p.is_meta for p in model.parameters())
    cfg = ParallelConfig(dp_shard=world)
    parallelize_spmd(model, cfg, build_mesh(cfg, world, "cpu"))
    materialize(model, "cpu")
    set_model_state_dict(model, ref.state_dict(), options=StateDictOptions(full_state_dict=True))
    loss = run(model, inputs, loss_fn)
    ref_loss = run(ref, inputs, loss_fn)
    full_sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    sd_err = max(
        float((full_sd[k] - v).abs().max()) for k, v in ref.state_dict().items() if k in full_sd
    )
    total = sum(p.numel() * p.element_size() for p in ref.parameters())
    return dict(
        on_meta=on_meta,
        loss=float(loss),
        ref=float(ref_loss),
        local=local_param_bytes(model),
        total=total,
        sd_err=sd_err,
        keys_equal=set(full_sd) == set(ref.state_dict()),
    )


def api_case(rank, world, cfg_kw):
    """parallel.parallelize routes tp / dp_shard through parallelize_spmd; train_step matches."""
    from parallel import ParallelConfig, parallelize

    model, ref, inputs, _ = prepare("reader")
    pm = parallelize(model, ParallelConfig(**cfg_kw), inputs)
    loss = pm.train_step(inputs, loss_fn=lambda out, target: out.loss)
    ref_loss = run(ref, inputs, reader_loss)
    ref_loss.backward()
    names = [n for n, _ in pm.named_parameters()]
    return dict(
        loss=float(loss),
        ref=float(ref_loss),
        **compare_grads(ref, model),
        names_ok=set(names) == {n for n, _ in ref.named_parameters()},
    )


def pp_tp_case(rank, world, name, cfg_kw, m=4):
    """3-D (pp x tp [x dp]) through ``parallel.parallelize`` against one process: the step loss
    and every gradient (full tensors of the TP shards), over two steps (accumulation)."""
    import parallel
    from tests.parallel.pipeline_cases import make_case, reference

    model, inputs, target, loss_fn, weight_fn = make_case(name)
    for mod in model.modules():
        if isinstance(mod, torch.nn.Dropout):
            mod.p = 0.0
    ref_loss, ref_grads = reference(model, inputs, target, loss_fn, weight_fn, m)
    cfg_kw = dict(cfg_kw)
    split = cfg_kw.pop("split", None)  # module names where a stage begins: a manual partition
    cfg = parallel.ParallelConfig(**({"microbatches": m, "schedule": "1f1b"} | cfg_kw))
    partition = None
    if split is not None:
        from parallel.inputs import split_microbatches
        from parallel.partition import auto_partition

        partition = auto_partition(
            model, split_microbatches(inputs, m)[0], cfg.pp, manual=split, passes=1
        )
        model.zero_grad(set_to_none=True)  # tracing ran backward passes
    pm = parallel.parallelize(model, cfg, inputs, timeout_s=60, partition=partition)
    res = dict(
        pp_rank=pm.pp_rank,
        losses=[],
        err=0.0,
        n=0,
        dtensors=[],
        names=[],
        fsdp_units=len(pm.sharded.fsdp_units),
    )
    for step in range(2):
        pm.zero_grad()
        with count_collectives() as calls:
            loss = pm.train_step(inputs, target=target, loss_fn=loss_fn, weight_fn=weight_fn)
        if step == 1:  # the first step also gathers for FSDP's lazy initialisation
            res["collectives"] = dict(calls)
        res["losses"].append(float(loss))
        for n, p in pm.named_parameters():
            r, g = ref_grads.get(n), p.grad
            if r is None and g is None:
                continue
            g = full(g) if g is not None else torch.zeros_like(r)
            r = torch.zeros_like(g) if r is None else r
            # relative to the tensor's scale (a floor at 1% of its largest entry, as the pipeline
            # tests)
            err = float(((g - r).abs() / (r.abs() + r.abs().max() * 1e-2 + 1e-12)).max())
            res["err"] = max(res["err"], err)
            res["n"] += 1
            if isinstance(p, DTensor):
                res["dtensors"].append(n)
    res["ref"] = ref_loss
    res["names"] = sorted(n for n, _ in pm.named_parameters())
    # tensor-parallel shards that FSDP left whole on every data-parallel rank (a DTensor on the tp
    # mesh alone): under pp the units are chosen after TP replaced the parameters
    res["tp_not_fsdp"] = sorted(
        n
        for n, p in pm.named_parameters()
        if isinstance(p, DTensor) and "dp_shard" not in (p.device_mesh.mesh_dim_names or ())
    )
    tp_log = pm.sharded.tp_plan.log if pm.sharded.tp_plan is not None else []
    res["sp_regions"] = [line for line in tp_log if line.startswith("sequence parallel over")]
    # the collective timeout (timeout_s above) of every group on the mesh, not torch's 30 min
    mesh = pm.layout.mesh
    res["group_timeouts_s"] = {
        d: mesh.get_group(d)._get_backend(torch.device("cpu")).options._timeout.total_seconds()
        for d in mesh.mesh_dim_names
        if mesh[d].size() > 1
    }
    return res


@contextlib.contextmanager
def count_collectives():
    """Count FSDP's all-gathers and reduce-scatters inside the block (torch 2.14 calls the
    ``*_single`` collectives, 2.11 the ``*_tensor`` ones)."""
    import torch.distributed as dist

    kinds = {
        "all_gather_single": "all_gather",
        "all_gather_into_tensor": "all_gather",
        "reduce_scatter_single": "reduce_scatter",
        "reduce_scatter_tensor": "reduce_scatter",
    }
    calls = {"all_gather": 0, "reduce_scatter": 0}
    orig = {n: getattr(dist, n) for n in kinds if hasattr(dist, n)}

    def spy(n):
        def call(*a, **k):
            calls[kinds[n]] += 1
            return orig[n](*a, **k)

        return call

    for n in orig:
        setattr(dist, n, spy(n))
    try:
        yield calls
    finally:
        for n, f in orig.items():
            setattr(dist, n, f)


def pp_tp_suite(rank, world, cases):
    """``pp_tp_case`` for several (model, config) pairs in one process group."""
    return {f"{name}:{sorted(kw.items())}": pp_tp_case(rank, world, name, kw) for name, kw in cases}


def fsdp_mixed_precision_case(rank, world, name="llama"):
    """FSDP2 with mixed_precision=bf16 (Llama: the reader's copy head mixes dtypes under bf16
    parameters): sharded parameters, gradients and Adam state stay fp32, the blocks compute with
    bf16 parameters, gradients are reduced in fp32, and loss / gradients follow the fp32 single
    process within bf16 accuracy."""
    import torch.distributed as dist

    from parallel.config import ParallelConfig
    from parallel.mesh import build_mesh
    from parallel.spmd import parallelize_spmd

    model, ref, inputs, loss_fn = prepare(name)
    cfg = ParallelConfig(dp_shard=world, mixed_precision="bf16")
    parallelize_spmd(model, cfg, build_mesh(cfg, world, "cpu"), inputs)
    compute = []
    fc = model.model.layers[-1].mlp.up_proj
    fc.register_forward_pre_hook(lambda m, a: compute.append((m.weight.dtype, a[0].dtype)))
    reduced = []  # dtypes of the tensors FSDP hands to the reduction collectives
    names = [
        n
        for n in ("reduce_scatter_tensor", "reduce_scatter_single", "all_reduce")
        if hasattr(dist, n)
    ]
    orig = {n: getattr(dist, n) for n in names}

    def spy(n):
        def call(*a, **k):
            ts = [v for v in list(a) + list(k.values()) if isinstance(v, torch.Tensor)]
            # the input (last for RS)
            reduced.append(ts[-1].dtype if n != "all_reduce" else ts[0].dtype)
            return orig[n](*a, **k)

        return call

    for n in (
        names
    ):  # torch 2.11 reduce-scatters with reduce_scatter_tensor, 2.14 with reduce_scatter_single
        setattr(dist, n, spy(n))
    try:
        loss = run(model, inputs, loss_fn)
        loss.backward()
    finally:
        for n in names:
            setattr(dist, n, orig[n])
    ref_loss = run(ref, inputs, loss_fn)
    ref_loss.backward()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    opt.step()
    return dict(
        loss=float(loss),
        ref=float(ref_loss),
        **compare_grads(ref, model),
        compute=compute,
        reduced=reduced,
        loss_dtype=loss.dtype,
        param_dtypes={p.dtype for p in model.parameters()},
        grad_dtypes={p.grad.dtype for p in model.parameters() if p.grad is not None},
        state_dtypes={v.dtype for st in opt.state.values() for k, v in st.items() if k != "step"},
    )


# ----------------------------------------------------------------------------- the TP self-check


class InterleavedAttention(torch.nn.Module):
    """A fused qkv whose output is per head [q_h | k_h | v_h] (GPT-NeoX's layout): the width rule
    (3 x the sink's width) reads three contiguous blocks q|k|v; the dataflow shows one block."""

    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.qkv = torch.nn.Linear(dim, 3 * dim)
        self.out = torch.nn.Linear(dim, dim)

    def forward(self, x):
        B, S, _ = x.shape
        # 3 x (B, H, S, hd)
        q, k, v = self.qkv(x).view(B, S, self.heads, 3, -1).permute(3, 0, 2, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).flatten(2))


class GroupsAttention(torch.nn.Module):
    """A concatenated q|k|v (a layout the planner reads right) whose head count sits in an
    attribute no rule knows (``groups``): sharded, each rank splits its heads into half-heads and
    still runs, computing another function."""

    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.groups = heads
        self.qkv = torch.nn.Linear(dim, 3 * dim)
        self.out = torch.nn.Linear(dim, dim)

    def forward(self, x):
        B, S, _ = x.shape
        q, k, v = (t.view(B, S, self.groups, -1).transpose(1, 2) for t in self.qkv(x).chunk(3, -1))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, H, S, hd)
        return self.out(y.transpose(1, 2).flatten(2))


class SkewedMLP(torch.nn.Module):
    """An MLP whose registered rule (``_shard_skewed``) is wrong on tp rank 1 only: the ranks'
    own comparisons disagree, the decision must not."""

    def __init__(self, dim: int):
        super().__init__()
        self.fc = torch.nn.Linear(dim, 2 * dim)
        self.proj = torch.nn.Linear(2 * dim, dim)

    def forward(self, x):
        return self.proj(F.gelu(self.fc(x)))


_SKEW_REGISTERED: list = []


def _shard_skewed(m, ctx):
    ctx.colwise(m.fc)
    ctx.rowwise(m.proj)
    inner = m.forward

    def forward(self_, x):
        return inner(x) * (1.0 + 1e-3 * ctx.rank)  # rank 1: 1e-3 off, ten times the tolerance

    m.forward = types.MethodType(forward, m)


class SelfCheckLM(torch.nn.Module):
    """A small LM with one attention of each kind above, a rank-skewed MLP, an MLP, and a
    vocabulary-sized embedding and head."""

    def __init__(self, vocab: int = 64, dim: int = 32, heads: int = 4):
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, dim)
        self.norms = torch.nn.ModuleList(torch.nn.LayerNorm(dim) for _ in range(5))
        self.attn = InterleavedAttention(dim, heads)
        self.mix = GroupsAttention(dim, heads)
        self.skew = SkewedMLP(dim)
        self.mlp = torch.nn.Sequential(
            torch.nn.Linear(dim, 4 * dim), torch.nn.GELU(), torch.nn.Linear(4 * dim, dim)
        )
        self.head = torch.nn.Linear(dim, vocab, bias=False)

    def forward(self, input_ids):
        h = self.emb(input_ids)
        h = h + self.attn(self.norms[0](h))
        h = h + self.mix(self.norms[1](h))
        h = h + self.skew(self.norms[2](h))
        h = h + self.mlp(self.norms[3](h))
        return self.head(self.norms[4](h))


def _selfcheck_lm():
    from parallel.tp import register_tp_rule

    if not _SKEW_REGISTERED:  # once per process
        register_tp_rule(SkewedMLP, _shard_skewed)
        _SKEW_REGISTERED.append(_shard_skewed)
    return SelfCheckLM(), {"input_ids": torch.randint(0, 64, (2, 8))}


def _gptneox():
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    cfg = GPTNeoXConfig(
        num_hidden_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        intermediate_size=128,
        vocab_size=256,
        max_position_embeddings=64,
        rotary_pct=0.5,
    )
    return GPTNeoXForCausalLM(cfg), {"input_ids": torch.randint(0, 256, (2, 12))}


def _phi3():
    from transformers import Phi3Config, Phi3ForCausalLM

    # grouped-query attention (2 kv heads for 4 query heads) in a fused qkv_proj: unequal blocks
    cfg = Phi3Config(
        num_hidden_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        vocab_size=256,
        max_position_embeddings=64,
        pad_token_id=0,
    )
    return Phi3ForCausalLM(cfg), {"input_ids": torch.randint(0, 256, (2, 12))}


def _hf_causal_lm(config_cls: str, model_cls: str, **kw):
    """A tiny random-initialised causal LM of ``transformers`` and its example (2 x 12 tokens)."""
    import transformers

    base = dict(
        num_hidden_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        intermediate_size=128,
        vocab_size=256,
        max_position_embeddings=64,
    )
    cfg = getattr(transformers, config_cls)(**(base | kw))
    return getattr(transformers, model_cls)(cfg), {"input_ids": torch.randint(0, 256, (2, 12))}


SELFCHECK_MODELS = {
    "selfcheck_lm": _selfcheck_lm,
    "gptneox": _gptneox,
    "phi3": _phi3,
    "qwen2": lambda: _hf_causal_lm("Qwen2Config", "Qwen2ForCausalLM", num_key_value_heads=2),
    "mistral": lambda: _hf_causal_lm("MistralConfig", "MistralForCausalLM", num_key_value_heads=2),
    "phi": lambda: _hf_causal_lm("PhiConfig", "PhiForCausalLM", partial_rotary_factor=0.5),
    # multi-query attention in separate q / k / v projections, with per-head q_norm / k_norm
    "gemma3_mqa": lambda: _hf_causal_lm(
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        num_key_value_heads=1,
        head_dim=16,
        sliding_window=8,
    ),
    # multi-query attention in a fused c_attn (q | one k head | one v head)
    "gpt_bigcode": lambda: _hf_causal_lm(
        "GPTBigCodeConfig",
        "GPTBigCodeForCausalLM",
        n_layer=2,
        n_embd=64,
        n_head=4,
        n_positions=64,
        multi_query=True,
        attn_pdrop=0.0,
    ),
}


def _next_token_loss(ids):
    def loss_fn(out):
        lg = out if isinstance(out, torch.Tensor) else out.logits
        return F.cross_entropy(lg[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten())

    return loss_fn


def selfcheck_case(rank, world, name, read_layouts=True, sequence_parallel=False):
    """apply_tp with the self-check against one process: loss, gradients, the roles as applied,
    the plan's blocks and log, and the seconds discovery and check + apply took."""
    import time

    from parallel.tp import apply_tp, discover_plan

    torch.manual_seed(0)
    model, inputs = SELFCHECK_MODELS[name]()
    for m in model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
    ref = copy.deepcopy(model)
    loss_fn = _next_token_loss(inputs["input_ids"])
    ref_loss = run(ref, inputs, loss_fn)
    ref_loss.backward()
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    t0 = time.perf_counter()
    plan = discover_plan(
        model,
        world,
        example_inputs=inputs,
        read_layouts=read_layouts,
        sequence_parallel=sequence_parallel,
    )
    t1 = time.perf_counter()
    plan = apply_tp(model, mesh, inputs, plan=plan, sequence_parallel=sequence_parallel)
    t2 = time.perf_counter()
    loss = run(model, inputs, loss_fn)
    loss.backward()
    return dict(
        loss=float(loss),
        ref=float(ref_loss),
        **compare_grads(ref, model),
        roles={n: e.role for n, e in plan.entries.items()},
        blocks={n: e.blocks for n, e in plan.entries.items()},
        log=plan.log,
        discover_s=t1 - t0,
        apply_s=t2 - t1,
        placements=_placements(model),
    )


def _placements(model) -> dict[str, str]:
    """Parameter name -> 'sharded' (a DTensor with a non-Replicate placement) or 'whole'."""
    from torch.distributed.tensor import Replicate

    def sharded(p) -> bool:
        return isinstance(p, DTensor) and any(not isinstance(pl, Replicate) for pl in p.placements)

    return {n: "sharded" if sharded(p) else "whole" for n, p in model.named_parameters()}


def tp_default_group(rank, world):
    """The default-run TP cases in one process group (start-up paid once): equivalence on the
    reader (automatic plan) / GPT-2 / BERT / T5 / Llama (+sp,
    +loss_parallel), collectives per layer, and the self-check cases."""
    out = suite(
        rank, world, ["reader", "reader_swiglu", "gpt2", "bert", "t5"], ["llama"], ["llama"]
    )
    out["collectives"] = layer_collectives(rank, world, "llama", False)
    out["collectives+sp"] = layer_collectives(rank, world, "llama", True)
    out["selfcheck_lm"] = selfcheck_case(rank, world, "selfcheck_lm")
    out["selfcheck_lm+width_rule"] = selfcheck_case(rank, world, "selfcheck_lm", read_layouts=False)
    out["selfcheck_part"] = selfcheck_part_case(rank, world)
    out["gptneox"] = selfcheck_case(rank, world, "gptneox")
    out["gptneox+sp"] = selfcheck_case(rank, world, "gptneox", sequence_parallel=True)
    out["gptneox+width_rule+sp"] = selfcheck_case(
        rank, world, "gptneox", read_layouts=False, sequence_parallel=True
    )
    out["phi3"] = selfcheck_case(rank, world, "phi3")
    out["gemma3_mqa"] = selfcheck_case(rank, world, "gemma3_mqa")
    return out


def selfcheck_part_case(rank, world):
    """The pipeline path: inputs captured on the whole model before the split, then
    ``verify_and_apply`` on a part holding only ``attn`` and ``mix`` (the rest freed, as on a
    pipeline rank) with the plan restricted to it. Returns the roles, the log and each held
    module's max error against the unsharded module on a fresh input."""
    from parallel.tp import TPPlan, capture_inputs, discover_plan, verify_and_apply

    torch.manual_seed(0)
    model, inputs = _selfcheck_lm()
    ref = copy.deepcopy(model)
    plan = discover_plan(model, world, example_inputs=inputs)
    captured = capture_inputs(model, plan, inputs)
    held = ("attn", "mix")
    for n, p in model.named_parameters():
        if not n.startswith(tuple(h + "." for h in held)):
            p.data = torch.empty(0)  # another pipeline rank's
    part = TPPlan(
        entries={n: e for n, e in plan.entries.items() if n.split(".")[0] in held},
        owners={g: o for g, o in plan.owners.items() if o in held},
        log=list(plan.log),
    )
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    applied = verify_and_apply(model, part, mesh, captured)
    x = torch.randn(2, 8, 32, generator=torch.Generator().manual_seed(3))
    errs = {h: float((getattr(model, h)(x) - getattr(ref, h)(x)).abs().max()) for h in held}
    return dict(roles={n: e.role for n, e in applied.entries.items()}, log=applied.log, errs=errs)


def selfcheck_suite(rank, world, names):
    """``selfcheck_case`` for several models in one process group."""
    return {n: selfcheck_case(rank, world, n) for n in names}
