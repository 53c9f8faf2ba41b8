"""Sharded forms of modules, and the context rules use to build them.

Parameters become DTensors on the tensor-parallel mesh under their original names (``Shard`` for
plain column/row layouts, ``_StridedShard`` for fused blocks such as q|k|v, so ``full_tensor()``
and distributed checkpoints see the single-device layout). Forwards run on the local shards with
explicit collectives (``parallel.tp.comm``), Megatron style: per column->row pair one all-reduce
forward and one backward, or with sequence parallel one all-gather + one reduce-scatter each way.
"""

from __future__ import annotations

import logging
import types
import weakref
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from parallel.tp import comm
from parallel.tp.registry import linear_kind, log, register_tp_rule

try:  # private in torch 2.11-2.14; the placement FSDP2 itself uses for TP x FSDP on one dim
    from torch.distributed.tensor.placement_types import _StridedShard
except ImportError:  # pragma: no cover
    _StridedShard = None

# attributes holding a head count: divided by tp on the module that owns a sharded pair
HEAD_ATTRS = (
    "num_heads",
    "num_attention_heads",
    "n_head",
    "n_heads",
    "heads",
    "num_key_value_heads",
    "num_kv_heads",
    "n_kv_heads",
)
# of those, key/value head counts: with fewer key/value heads than tp ranks the k / v sources are
# replicated and these become the heads each rank computes (``parallel.tp.plan``)
KV_HEAD_ATTRS = ("num_key_value_heads", "num_kv_heads", "n_kv_heads")
# query heads per key/value head (HF's ``repeat_kv`` factor): unchanged when tp shards both, divided
# by the number of ranks that compute each key/value head when those are replicated
KV_GROUP_ATTRS = ("num_key_value_groups", "n_rep", "num_queries_per_kv")
# attributes holding the projected width (GPT-2's ``split_size``, BERT's ``all_head_size``)
SIZE_ATTRS = ("split_size", "all_head_size", "inner_dim")


def local(t):
    """The local shard of a DTensor parameter (differentiable); plain tensors pass through."""
    return t.to_local() if isinstance(t, DTensor) else t


@dataclass
class TPContext:
    """What a rule needs: the 1-D tp mesh, its group, and the options of this parallelization."""

    mesh: DeviceMesh
    sequence_parallel: bool = False
    seq_dim: int = 1  # sequence dimension of activations inside blocks (batch first)
    loss_parallel: bool = False  # LM head returns vocab-sharded DTensor logits
    log: list[str] = field(default_factory=list)  # what was sharded, left alone, and why
    sharded: set = field(default_factory=set)  # ids of modules already given a sharded form
    # also send log lines to the ``parallel.tp`` logger (off for the self-check's trial copies)
    echo: bool = True

    def __post_init__(self):
        self.group = self.mesh.get_group()
        self.size = self.mesh.size()
        self.rank = self.mesh.get_local_rank()

    def note(self, msg: str, level: int = logging.INFO) -> None:
        self.log.append(msg)
        if self.echo:
            log.log(level, "tp: %s", msg)

    # ------------------------------------------------------------------ parameters
    def shard_param(self, m: nn.Module, pname: str, dim: int, blocks: int = 1) -> None:
        """Replace ``m.<pname>`` by a DTensor sharded on ``dim``; with ``blocks`` > 1 the dimension
        holds that many equal fused blocks and each rank keeps its slice of every block."""
        p = m._parameters[pname]
        n = p.shape[dim]
        if n % (self.size * blocks):
            raise ValueError(
                f"tp={self.size}: {type(m).__name__}.{pname} dimension {dim} of size {n} "
                f"is not divisible into {blocks} block(s) x {self.size} shards"
            )
        if blocks == 1:
            loc, placement = p.detach().chunk(self.size, dim)[self.rank], Shard(dim)
        else:
            loc = torch.cat(
                [b.chunk(self.size, dim)[self.rank] for b in p.detach().chunk(blocks, dim)], dim
            )
            placement = _StridedShard(dim, split_factor=blocks)
        d = DTensor.from_local(
            loc.contiguous(),
            self.mesh,
            [placement],
            run_check=False,
            shape=p.shape,
            stride=p.stride(),
        )
        m._parameters[pname] = nn.Parameter(d, requires_grad=p.requires_grad)

    def divide_attr(self, m: nn.Module, attr: str, by: int | None = None) -> None:
        """``m.<attr>`` divided by ``by`` (default: the tp degree)."""
        by = by or self.size
        v = getattr(m, attr)
        if v % by:
            raise ValueError(
                f"tp={self.size} does not divide {type(m).__name__}.{attr}={v}: "
                f"choose a tp that divides the head count"
            )
        setattr(m, attr, v // by)
        self.note(f"{type(m).__name__}.{attr}: {v} -> {v // by} per rank")

    def _enter(self, x: torch.Tensor, cache_owner) -> torch.Tensor:
        """Input of a column-parallel layer: identity fwd / all-reduce bwd (or all-gather over the
        sequence under SP). Layers sharing one input (q, k, v) share one collective."""
        if cache_owner is not None:
            c = getattr(cache_owner, "_tp_in_cache", None)
            if c is not None and c[0]() is x and c[1]() is not None:
                return c[1]()
        y = (
            comm.gather_seq(x, self.seq_dim, self.group)
            if self.sequence_parallel
            else comm.copy_to_tp(x, self.group)
        )
        if cache_owner is not None:
            cache_owner._tp_in_cache = (weakref.ref(x), weakref.ref(y))
        return y

    def _exit(self, y: torch.Tensor) -> torch.Tensor:
        """Output of a row-parallel layer: all-reduce (or reduce-scatter over the sequence)."""
        if self.sequence_parallel:
            return comm.reduce_scatter_seq(y, self.seq_dim, self.group)
        return comm.reduce_from_tp(y, self.group)

    # ------------------------------------------------------------------ module forms
    def colwise(
        self,
        m: nn.Module,
        blocks: int = 1,
        *,
        gather_output: bool = False,
        input_group: object | None = None,
        sequence_input: bool | None = None,
        input_ready: bool = False,
    ) -> None:
        """Column-parallel linear: output features sharded (``blocks`` fused equal blocks).
        ``input_ready``: the input was already gathered by ``gather_input`` on a parent."""
        kind = linear_kind(m)
        ctx = self
        self.shard_param(m, "weight", kind.out_dim, blocks)
        fused_bias = m._parameters.get("bias") is not None and blocks > 1
        if m._parameters.get("bias") is not None and not fused_bias:
            self.shard_param(m, "bias", 0)
        seq_in = self.sequence_parallel if sequence_input is None else sequence_input
        sub = self if seq_in == self.sequence_parallel else _with_sp(self, seq_in)

        def forward(self_, x):
            if not input_ready:
                x = sub._enter(x, input_group)
            b = self_.bias
            if fused_bias:  # full bias kept replicated; this rank's slice of each block
                b = (
                    comm.grad_all_reduce(b, ctx.group)
                    .view(blocks, ctx.size, -1)[:, ctx.rank]
                    .reshape(-1)
                )
            y = kind.compute(x, local(self_.weight), local(b) if b is not None else None)
            if gather_output:
                if ctx.loss_parallel:
                    return DTensor.from_local(y, ctx.mesh, [Shard(y.dim() - 1)], run_check=False)
                return comm.gather_last(y, ctx.group)
            return y

        m.forward = types.MethodType(forward, m)
        self.sharded.add(id(m))

    def replicated_rows(
        self,
        m: nn.Module,
        rows: list[int],
        *,
        input_group: object | None = None,
        input_ready: bool = False,
    ) -> None:
        """A linear kept whole on every rank of which this rank computes the output features
        ``rows`` (the key/value heads its query heads read, when the ranks outnumber them). Its
        weight's (and bias's) gradient is summed over the tp group: each rank's holds the part
        its own query heads contribute."""
        kind = linear_kind(m)
        ctx = self
        idx = torch.tensor(rows, dtype=torch.long, device=m.weight.device)
        sub = self

        def forward(self_, x):
            if not input_ready:
                x = sub._enter(x, input_group)
            w = comm.grad_all_reduce(self_.weight, ctx.group)
            w = w.index_select(kind.out_dim, idx.to(x.device))
            b = self_.bias
            if b is not None:
                b = comm.grad_all_reduce(b, ctx.group).index_select(0, idx.to(x.device))
            return kind.compute(x, w, b)

        m.forward = types.MethodType(forward, m)
        self.sharded.add(id(m))

    def partial_grad(self, m: nn.Module) -> None:
        """A module with replicated parameters that each rank applies to its own part of the
        work (a norm over each of this rank's heads): their gradients are summed over the group."""
        _sum_param_grads(m, self.group)
        self.sharded.add(id(m))

    def rowwise(self, m: nn.Module) -> None:
        """Row-parallel linear: input features sharded, output summed over ranks, bias added
        once."""
        kind = linear_kind(m)
        ctx = self
        self.shard_param(m, "weight", 1 - kind.out_dim)

        def forward(self_, x):
            y = ctx._exit(kind.compute(x, local(self_.weight), None))
            if self_.bias is None:
                return y
            # under SP each rank adds the bias to its own sequence chunk: sum its gradient
            return y + (
                comm.grad_all_reduce(self_.bias, ctx.group) if ctx.sequence_parallel else self_.bias
            )

        m.forward = types.MethodType(forward, m)
        self.sharded.add(id(m))

    def vocab_embedding(self, m: nn.Embedding) -> None:
        """Vocabulary-parallel embedding: each rank holds V/tp rows; ids outside give zeros; sum."""
        if m.max_norm is not None:
            raise ValueError("vocab-parallel embedding does not support max_norm")
        self.shard_param(m, "weight", 0)
        ctx = self
        n = m.num_embeddings // self.size
        start = self.rank * n

        def forward(self_, ids):
            outside = (ids < start) | (ids >= start + n)
            pad = self_.padding_idx
            pad = pad - start if pad is not None and start <= pad < start + n else None
            y = F.embedding(
                (ids - start).masked_fill(outside, 0),
                local(self_.weight),
                pad,
                None,
                2.0,
                self_.scale_grad_by_freq,
                self_.sparse,
            )
            return comm.reduce_from_tp(y.masked_fill(outside[..., None], 0.0), ctx.group)

        m.forward = types.MethodType(forward, m)
        self.sharded.add(id(m))

    def sequence_local(self, m: nn.Module) -> None:
        """A module that runs on this rank's sequence chunk with replicated parameters (norms,
        layer scales under SP): its parameter gradients are summed over the tp group."""
        _sum_param_grads(m, self.group)
        self.sharded.add(id(m))

    def gather_input(self, m: nn.Module) -> None:
        """Sequence parallel: all-gather ``m``'s hidden-state input over the sequence
        (reduce-scatter its gradient), for modules that read the sequence length from their input
        (HF attention)."""
        ctx = self
        m.register_forward_pre_hook(
            lambda mod, a, k: _map_hidden(
                a, k, lambda t: comm.gather_seq(t, ctx.seq_dim, ctx.group)
            ),
            with_kwargs=True,
        )

    def sequence_region(self, first: nn.Module, last: nn.Module) -> None:
        """Hidden states are split over the sequence at ``first``'s input and gathered again at
        ``last``'s output (the residual stream between them stays sharded). Both go into the
        modules' forwards rather than into hooks: the pipeline's replay sends what a block's
        forward returned, which must already be whole when the region ends at a stage's cut."""
        ctx = self

        def gather(out):
            if isinstance(out, torch.Tensor):
                return comm.gather_from_seq(out, ctx.seq_dim, ctx.group)
            if isinstance(out, tuple) and out and isinstance(out[0], torch.Tensor):
                return (comm.gather_from_seq(out[0], ctx.seq_dim, ctx.group), *out[1:])
            raise TypeError(
                f"sequence parallel: cannot find the hidden states in {type(out).__name__}"
            )

        first_fwd = first.forward

        def split_then_forward(*args, **kwargs):
            args, kwargs = _map_hidden(
                args, kwargs, lambda t: comm.split_seq(t, ctx.seq_dim, ctx.group)
            )
            return first_fwd(*args, **kwargs)

        first.forward = split_then_forward
        last_fwd = last.forward

        def forward_then_gather(*args, **kwargs):
            return gather(last_fwd(*args, **kwargs))

        last.forward = forward_then_gather


def _sum_param_grads(m: nn.Module, group) -> None:
    """``m``'s forward with its own parameters passed through ``comm.grad_all_reduce``."""
    orig = type(m).forward
    names = [n for n, p in m._parameters.items() if p is not None]

    def forward(self_, *args, **kwargs):
        saved = {n: self_._parameters[n] for n in names}
        try:
            for n in names:
                self_._parameters[n] = comm.grad_all_reduce(local(saved[n]), group)
            return orig(self_, *args, **kwargs)
        finally:
            self_._parameters.update(saved)

    m.forward = types.MethodType(forward, m)


def _map_hidden(args, kwargs, fn):
    """Apply ``fn`` to the hidden states among a forward's inputs: ``hidden_states=`` if given,
    else the first positional tensor, else the first tensor keyword."""
    if isinstance(kwargs.get("hidden_states"), torch.Tensor):
        return args, {**kwargs, "hidden_states": fn(kwargs["hidden_states"])}
    for i, a in enumerate(args):
        if isinstance(a, torch.Tensor):
            return (*args[:i], fn(a), *args[i + 1 :]), kwargs
    key = next(k for k, v in kwargs.items() if isinstance(v, torch.Tensor))
    return args, {**kwargs, key: fn(kwargs[key])}


def _with_sp(ctx: TPContext, sp: bool) -> TPContext:
    c = TPContext.__new__(TPContext)
    c.__dict__.update(ctx.__dict__)
    c.sequence_parallel = sp
    return c


# ---------------------------------------------------------------------------- built-in module rules


@register_tp_rule(nn.MultiheadAttention, name="multihead_attention")
def shard_multihead_attention(m: nn.MultiheadAttention, ctx: TPContext) -> None:
    """nn.MultiheadAttention (open_clip, timm-style towers, SigLIP's pooling head): fused in_proj
    split per head block (column), out_proj row-parallel, num_heads per rank. Self-attention runs
    one fused projection; cross-attention (a query other than the key / value, such as a learned
    probe) projects each input with its rows of the weight. With ``need_weights`` (torch's
    default) the attention probabilities are computed explicitly and returned whole: averaged over
    the heads (one all-reduce) or per head (one all-gather)."""
    if not m._qkv_same_embed_dim or m.bias_k is not None or m.add_zero_attn:
        raise NotImplementedError(
            "tp: nn.MultiheadAttention with kdim/vdim, bias_k/v or add_zero_attn"
        )
    ctx.divide_attr(m, "num_heads")
    ctx.shard_param(m, "in_proj_weight", 0, blocks=3)
    has_bias = m.in_proj_bias is not None
    ctx.rowwise(m.out_proj)

    def forward(
        self_,
        query,
        key,
        value,
        key_padding_mask=None,
        need_weights=True,
        attn_mask=None,
        average_attn_weights=True,
        is_causal=False,
    ):
        def batch_first(t: torch.Tensor) -> torch.Tensor:
            return t if self_.batch_first else t.transpose(0, 1)  # (B, L, E)

        w = local(self_.in_proj_weight)  # (3 E/tp, E): this rank's rows of q, k and v
        b = None
        if has_bias:
            b = (
                comm.grad_all_reduce(self_.in_proj_bias, ctx.group)
                .view(3, ctx.size, -1)[:, ctx.rank]
                .reshape(-1)
            )
        if _same_values(query, key) and _same_values(key, value):  # self-attention: one projection
            qkv = F.linear(ctx._enter(batch_first(query), None), w, b)  # (B, L, 3 E/tp)
            # 3 x (B, h, L, hd)
            q, k, v = qkv.unflatten(-1, (3, self_.num_heads, -1)).permute(2, 0, 3, 1, 4)
        else:
            ws, bs = w.chunk(3), (b.chunk(3) if b is not None else (None,) * 3)
            xq = ctx._enter(batch_first(query), None)
            xk = ctx._enter(batch_first(key), None)
            xv = xk if _same_values(key, value) else ctx._enter(batch_first(value), None)
            q, k, v = (
                F.linear(x, wi, bi)
                .unflatten(-1, (self_.num_heads, -1))
                .transpose(1, 2)  # (B, h, L, hd)
                for x, wi, bi in zip((xq, xk, xv), ws, bs)
            )
        mask = _sdpa_mask(attn_mask, key_padding_mask, q)
        p = self_.dropout if self_.training else 0.0
        weights = None
        if need_weights:  # torch's default: the probabilities too, which SDPA does not return
            # (B, h/tp, Lq, Lk)
            y, probs = _attention_with_weights(q, k, v, mask, is_causal and mask is None, p)
            if average_attn_weights:  # the mean over all heads: this rank's sum, summed over ranks
                weights = comm.reduce_from_tp(probs.sum(1), ctx.group) / (
                    self_.num_heads * ctx.size
                )
            else:  # every head, in head order (rank r holds heads r*h/tp .. (r+1)*h/tp - 1)
                weights = comm.gather_from_seq(probs, 1, ctx.group)
        else:
            y = F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, dropout_p=p, is_causal=is_causal and mask is None
            )
        y = self_.out_proj(y.transpose(1, 2).flatten(2))  # (B, Lq, E)
        # the weights are batch first whatever ``batch_first`` says, as nn.MultiheadAttention's
        return (y if self_.batch_first else y.transpose(0, 1)), weights

    m.forward = types.MethodType(forward, m)
    ctx.sharded.add(id(m))


def _attention_with_weights(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    is_causal: bool,
    dropout_p: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention computed step by step, as ``F.multi_head_attention_forward`` does when asked for
    its weights: (output (B, h, Lq, hd), probabilities after dropout (B, h, Lq, Lk))."""
    scores = (q * q.shape[-1] ** -0.5) @ k.transpose(-2, -1)  # (B, h, Lq, Lk)
    if mask is not None:
        scores = scores + mask
    elif is_causal:
        scores = scores.masked_fill(
            torch.ones_like(scores, dtype=torch.bool).triu(1), float("-inf")
        )
    w = scores.softmax(-1)
    if dropout_p > 0.0:
        w = F.dropout(w, dropout_p)
    return w @ v, w


def _same_values(a: torch.Tensor, b: torch.Tensor) -> bool:
    """``a`` and ``b`` are one tensor, or views of one storage at the same offset, shape and
    stride (so the same values). FSDP2 hands a unit's tensor arguments on through an autograd
    function (its post-backward hook), which turns ``attn(x, x, x)`` into three distinct aliases
    of ``x``: identity alone would take that self-attention for cross-attention."""
    return a is b or (
        a.data_ptr() == b.data_ptr()
        and a.shape == b.shape
        and a.stride() == b.stride()
        and a.dtype == b.dtype
        and a.device == b.device
    )


def _sdpa_mask(attn_mask, key_padding_mask, q):
    """MHA masks (bool True = masked out, or additive float) as one SDPA mask (additive float)."""

    def additive(mk):
        if mk is None:
            return None
        if mk.dtype == torch.bool:
            return torch.zeros(mk.shape, dtype=q.dtype, device=q.device).masked_fill(
                mk, float("-inf")
            )
        return mk.to(q.dtype)

    mask = additive(attn_mask)
    if mask is not None and mask.dim() == 3:
        raise NotImplementedError("tp: per-head 3-D attn_mask for sharded nn.MultiheadAttention")
    kp = additive(key_padding_mask)
    if kp is not None:
        kp = kp[:, None, None, :]  # (B, 1, 1, L)
        mask = kp if mask is None else mask + kp
    return mask
