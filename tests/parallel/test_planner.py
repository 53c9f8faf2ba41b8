"""The layout planner: its memory model against exact counts, its ranking on clear-cut cases, its
candidates as runtime configs, and its speed on a 1000-module model over 128 devices."""

from __future__ import annotations

import math
import time

import pytest
import torch
from torch import nn

from parallel.cluster import Cluster
from parallel.config import ParallelConfig
from parallel.pipeline.schedule import stages_per_rank
from parallel.planner import SCHEDULE_COST, TP_TYPES, plan_layout
from parallel.planner.estimate import LOSS_WORKING_SET
from parallel.trace import trace_model

SEQ = 8  # tokens per sample in the toy models


class Block(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.ln1, self.q, self.o = nn.LayerNorm(d), nn.Linear(d, d), nn.Linear(d, d)
        self.ln2, self.fc1, self.act, self.fc2 = (
            nn.LayerNorm(d),
            nn.Linear(d, 4 * d),
            nn.GELU(),
            nn.Linear(4 * d, d),
        )

    def forward(self, x):  # (B, S, D)
        x = x + self.o(torch.softmax(self.q(self.ln1(x)), -1))
        return x + self.fc2(self.act(self.fc1(self.ln2(x))))


class Toy(nn.Module):
    def __init__(self, d: int = 32, layers: int = 4, vocab: int = 64):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(Block(d) for _ in range(layers))
        self.norm, self.head = nn.LayerNorm(d), nn.Linear(d, vocab)

    def forward(self, ids):  # (B, S) -> (B, S, vocab)
        x = self.embed(ids)
        for b in self.blocks:
            x = b(x)
        return self.head(self.norm(x))


def cluster(nodes=1, dpn=4, mem=2**30, intra=450e9, inter=50e9) -> Cluster:
    return Cluster(
        name="test",
        nodes=nodes,
        devices_per_node=dpn,
        device_memory_bytes=float(mem),
        peak_flops={"fp32": 1e12, "bf16": 4e12},
        compute_efficiency=0.5,
        intra_bandwidth=intra,
        intra_latency_s=2e-6,
        inter_bandwidth=inter,
        inter_latency_s=10e-6,
        host_bandwidth=25e9,
        usable_fraction=1.0,
    )


@pytest.fixture(scope="module")
def toy():
    torch.manual_seed(0)
    model = Toy()
    ids = torch.randint(0, 64, (4, SEQ))
    return model, ids, trace_model(model, (ids,), passes=1)


def exact_local_bytes(model: nn.Module, tp: int) -> tuple[float, float]:
    """(parameter bytes, Adam state bytes) one tp rank holds: TP_TYPES' weights split tp ways,
    everything else whole; Adam's state counted from a real optimizer step."""
    params = 0.0
    for mod in model.modules():
        for p in mod.parameters(recurse=False):
            params += p.numel() * p.element_size() / (tp if type(mod).__name__ in TP_TYPES else 1)
    opt = torch.optim.Adam(model.parameters())
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    total_params = sum(p.numel() * p.element_size() for p in model.parameters())
    adam = sum(
        v.numel() * v.element_size()
        for st in opt.state.values()
        for k, v in st.items()
        if k != "step"
    )
    for p in model.parameters():
        p.grad = None
    return params, adam * params / total_params


@pytest.mark.parametrize("tp,dp_shard", [(1, 4), (2, 2), (4, 1)])
def test_memory_matches_exact_counts(toy, tp, dp_shard):
    model, ids, tr = toy
    plan = plan_layout(
        tr, (ids,), cluster(), global_batch=8, precisions=("fp32",), checkpointing=(False,)
    )
    lay = plan.estimate(pp=1, tp=tp, dp_replicate=1, dp_shard=dp_shard, precision="fp32")
    params, adam = exact_local_bytes(model, tp)
    assert lay.memory["params"] == pytest.approx(params / dp_shard)
    assert lay.memory["grads"] == pytest.approx(params / dp_shard)
    assert lay.memory["optimizer"] == pytest.approx(adam / dp_shard)
    # the microbatch's activations: the traced ones (4 samples) scaled to 2 per replica, the
    # norms' replicated over tp and the rest split; and the loss over the output, whole
    stats = plan.planner.stats
    st = stats.whole
    per_sample = (
        (st.act - st.act_rep) / tp + st.act_rep + LOSS_WORKING_SET * stats.output_bytes
    ) / 4
    assert lay.memory["activations"] == pytest.approx(per_sample * lay.microbatch_size)
    # one microbatch a step: gradients come as backward frees activations, the larger one counts
    m = lay.memory
    static = m["params"] + m["optimizer"] + m["gathered"]
    assert lay.memory_bytes_per_device == pytest.approx(static + max(m["grads"], m["activations"]))
    acc = plan.estimate(
        pp=1, tp=tp, dp_replicate=1, dp_shard=dp_shard, microbatches=2, precision="fp32"
    )
    # accumulating: the first microbatch's gradients are there when the second's activations peak
    a = acc.memory
    assert acc.memory_bytes_per_device == pytest.approx(sum(a.values()))
    # checkpointing keeps less, and offload moves the state off the device
    ac = plan.estimate(
        pp=1,
        tp=tp,
        dp_replicate=1,
        dp_shard=dp_shard,
        precision="fp32",
        activation_checkpointing=True,
    )
    assert ac.memory["activations"] < lay.memory["activations"]
    off = plan.estimate(
        pp=1, tp=tp, dp_replicate=1, dp_shard=dp_shard, precision="fp32", cpu_offload=True
    )
    assert (
        off.memory["optimizer"] == 0 and off.memory_bytes_per_device < lay.memory_bytes_per_device
    )


def test_pure_data_parallel_ranks_first_on_fast_links():
    """A model that fits one device many times over, on NVSwitch-class links: data parallel over
    all 8 devices (replicated, or FSDP-sharded: both hide their traffic behind the backward) beats
    every pipeline and tensor-parallel layout, with no recompute and no offload."""
    with torch.device("meta"):
        model = Toy(d=256, layers=4, vocab=512)
    ids = torch.zeros(4, 64, dtype=torch.long, device="meta")
    plan = plan_layout(model, (ids,), cluster(dpn=8, mem=2**34), global_batch=256)
    best = plan.best
    print("\n" + plan.table(5, 2))
    assert best is not None and (best.pp, best.tp, best.dp_replicate * best.dp_shard) == (1, 1, 8)
    assert not best.activation_checkpointing and not best.cpu_offload and best.precision == "bf16"
    ddp = min(
        (lay for lay in plan.fitting if lay.dp_replicate == 8), key=lambda lay: lay.step_time_s
    )
    assert ddp.step_time_s <= 1.02 * best.step_time_s
    others = [lay for lay in plan.fitting if lay.pp > 1 or lay.tp > 1]
    assert others and min(lay.step_time_s for lay in others) > ddp.step_time_s


def test_model_too_big_for_one_device_needs_sharding(toy):
    model, ids, tr = toy
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    mem = 3 * params  # params + grads + Adam need 4x: no replica fits
    plan = plan_layout(tr, (ids,), cluster(dpn=8, mem=mem), global_batch=8, precisions=("fp32",))
    # (the batch splits: memory was modelled)
    dp_only = [
        lay
        for lay in plan.layouts
        if lay.pp == 1
        and lay.tp == 1
        and lay.dp_shard == 1
        and not lay.cpu_offload
        and lay.microbatch_size
    ]
    assert dp_only and not any(lay.fits for lay in dp_only)
    assert all(any(r.startswith("memory") for r in lay.reasons) for lay in dp_only)
    assert plan.best is not None and (
        plan.best.dp_shard > 1 or plan.best.tp > 1 or plan.best.pp > 1
    )


def test_bubble_and_schedules(toy):
    model, ids, tr = toy
    plan = plan_layout(
        tr, (ids,), cluster(), global_batch=16, precisions=("fp32",), checkpointing=(False,)
    )
    kw = dict(pp=2, tp=1, dp_replicate=2, dp_shard=1, microbatches=8, precision="fp32")
    one = plan.estimate(schedule="1f1b", **kw)
    b = one.breakdown
    slot = (b["compute"] + b["tp_comm"] + b["pp_comm"]) / 8
    assert b["bubble"] == pytest.approx(slot)  # (p - 1) / (m + p - 1) of the pipeline's time
    assert one.step_time_s == pytest.approx(9 * slot + b["dp_comm"])
    inter = plan.estimate(schedule="interleaved_1f1b", **kw)
    zbv = plan.estimate(schedule="zbv", **kw)
    assert inter.stages_per_rank == 2 and zbv.breakdown["bubble"] == 0.0
    islot = (inter.breakdown["compute"] + inter.breakdown["pp_comm"]) / 8
    assert inter.breakdown["bubble"] == pytest.approx(islot / 2)
    # zero-bubble's lower bubble costs memory: more microbatches in flight on rank 0
    zb = plan.estimate(schedule="zero_bubble", **kw)
    assert zb.step_time_s < one.step_time_s and zb.memory_by_rank[0] > one.memory_by_rank[0]
    # rank 1 under 1F1B: two microbatches in flight, the split drain's two deferred weight
    # gradients' output gradients, the received activation and the gradient packed to send back,
    # the loss over the output, and the state (gradients already there: 8 microbatches, 2 in
    # flight); one sample per microbatch, the trace's 4
    ps = plan.planner.stages(2)[1]
    act = (
        2 * ps.act
        + 2 * ps.wgrad_keep
        + 2 * ps.cut_in
        + LOSS_WORKING_SET * plan.planner.stats.output_bytes
    ) / 4
    assert ps.wgrad_keep > 0 and ps.cut_in > 0 and ps.cut_out == 0
    assert one.memory_by_rank[1] == pytest.approx(4 * ps.param_bytes + act)
    for name, (_, v) in SCHEDULE_COST.items():
        assert stages_per_rank(name, 1) == v


def test_data_parallel_traffic_hides_only_where_the_cluster_overlaps(toy):
    """FSDP's gathers and reduce-scatters hide behind compute on a GPU cluster; on CPU ranks
    (comm_overlap 0: gloo's threads take the compute's cores) they add up in full."""
    import dataclasses

    model, ids, tr = toy
    kw = dict(pp=1, tp=1, dp_replicate=1, dp_shard=4, microbatches=1, precision="fp32")
    slow_links = cluster(intra=2e9)
    gpu = plan_layout(
        tr, (ids,), slow_links, global_batch=16, precisions=("fp32",), checkpointing=(False,)
    )
    cpu = plan_layout(
        tr,
        (ids,),
        dataclasses.replace(slow_links, comm_overlap=0.0),
        global_batch=16,
        precisions=("fp32",),
        checkpointing=(False,),
    )
    hidden, exposed = gpu.estimate(**kw).breakdown, cpu.estimate(**kw).breakdown
    assert exposed["compute"] == hidden["compute"] and exposed["dp_comm"] > hidden["dp_comm"]


def test_collectives_alpha_beta():
    c = cluster(nodes=2, dpn=8)
    n, big = 8, 2**30
    assert c.all_reduce(big, n, 1) == pytest.approx(
        2 * (n - 1) * 2e-6 + 2 * (n - 1) / n * big / 450e9
    )
    assert c.all_reduce(8, n, 1) == pytest.approx(2 * 3 * 2e-6 + 16 / 450e9)  # tree: log2 n steps
    assert c.group_link(16, 1)[0] == 50e9  # one group spans the nodes: the whole network
    assert c.group_link(2, 8)[0] == 50e9 / 8  # eight groups share it
    assert c.group_link(8, 1)[2] is False and c.group_link(2, 8)[2] is True


def test_each_candidate_is_a_runtime_config_that_validates(toy):
    """The planner hands back the runtime's own ``ParallelConfig`` for every candidate: a fitting
    one validates for the cluster's world as ``parallelize`` will validate it, a candidate the
    runtime rejects is rejected with the runtime's own reason, and the fields the planner does
    not choose are the caller's (``base``)."""
    model, ids, tr = toy
    world = 8
    base = ParallelConfig(grad_reduce="shm", p2p="gloo", split_drain=False)
    plan = plan_layout(
        tr, (ids,), cluster(dpn=8, mem=2**34), global_batch=64, tp_divisor=4, base=base
    )
    kinds = set()
    for lay in plan.fitting:
        c = lay.config
        assert isinstance(c, ParallelConfig) and c.validate(world) is c and c.world_size == world
        assert (c.grad_reduce, c.p2p, c.split_drain) == ("shm", "gloo", False)
        assert c.microbatches == (lay.microbatches if c.pp_enabled else 1)
        assert lay.grad_accum == (1 if c.pp_enabled else lay.microbatches)
        assert lay.microbatch_size * lay.microbatches * c.dp == 64  # the global batch is kept
        kinds.add((c.pp_enabled, c.tp_enabled, c.dp_shard_enabled, lay.grad_accum > 1))
    assert len(kinds) >= 6, kinds  # pipelines, tensor parallel, FSDP and accumulation among them
    bad = plan.estimate(pp=2, tp=1, dp_replicate=2, dp_shard=2, microbatches=4, cpu_offload=True)
    assert not bad.fits and any("cpu_offload with pp=2" in r for r in bad.reasons), bad.reasons
    off = plan.estimate(pp=1, tp=1, dp_replicate=2, dp_shard=2)
    assert any("does not match the world size 8" in r for r in off.reasons), off.reasons


class Wide(nn.Module):
    """125 blocks of 8 modules plus the root, embedding, block list, norm and head: 1005 modules."""

    def __init__(self, d: int = 64, layers: int = 125):
        super().__init__()
        self.embed = nn.Embedding(128, d)
        self.blocks = nn.ModuleList(Block(d) for _ in range(layers))
        self.norm, self.head = nn.LayerNorm(d), nn.Linear(d, 128)

    forward = Toy.forward


@pytest.mark.slow  # seconds: a meta trace of 1000 modules, then the search over 128 devices
def test_plan_1000_modules_on_128_devices():
    with torch.device("meta"):
        model = Wide()
    assert len(list(model.modules())) >= 1000
    ids = torch.zeros(2, SEQ, dtype=torch.long, device="meta")
    t0 = time.perf_counter()
    plan = plan_layout(model, (ids,), Cluster.preset("p4d", nodes=16), global_batch=1024)
    dt = time.perf_counter() - t0
    print(
        f"\nplanned {len(plan.layouts)} layouts of a {len(list(model.modules()))}-module model on "
        f"128 devices in {dt:.1f} s (trace included)"
    )
    assert plan.best is not None and len(plan.layouts) > 1000
    assert any(lay.pp > 1 and lay.fits for lay in plan.layouts)


def test_tp_memory_follows_the_tp_plan_not_module_types():
    """Given the model, the planner counts what ``parallel.tp`` shards: GPT-2's column-parallel
    weights and biases and row-parallel weights, not its tied token embedding, position
    embedding, norms or row-parallel biases; and the inputs its column-parallel layers save
    whole."""
    from parallel.planner.stats import tp_plan_facts
    from tests.parallel.partition_models import MODELS

    torch.manual_seed(0)
    model, inputs = MODELS["gpt2"]()
    tr = trace_model(model, inputs, passes=1)
    got, whole_input = tp_plan_facts(model, tr)
    want = {
        f"transformer.h.{i}.{m}"
        for i in range(4)
        for m in (
            "attn.c_attn.weight",
            "attn.c_attn.bias",
            "attn.c_proj.weight",
            "mlp.c_fc.weight",
            "mlp.c_fc.bias",
            "mlp.c_proj.weight",
        )
    }
    assert got == want, sorted(got ^ want)
    plan = plan_layout(
        model,
        inputs,
        cluster(),
        global_batch=8,
        precisions=("fp32",),
        checkpointing=(False,),
        offload=(False,),
        trace=tr,
    )
    lay = plan.estimate(pp=1, tp=2, dp_replicate=2, dp_shard=1, precision="fp32")
    params = dict(model.named_parameters())
    total = sum(p.numel() * 4 for p in params.values())
    assert lay.memory["params"] == pytest.approx(
        total - sum(params[n].numel() * 4 for n in want) / 2
    )
    # the column-parallel layers keep their whole input for backward on every tp rank
    assert whole_input == {
        f"transformer.h.{i}.{m}" for i in range(4) for m in ("attn.c_attn", "mlp.c_fc")
    }
    mods, st = tr.modules, plan.planner.stats
    norms = {m for m, n in mods.items() if "Norm" in n.type or "Dropout" in n.type}
    # and what runs outside the blocks on modules TP leaves whole (the tied LM head, the containers)
    outside = {
        m for m in mods if not m.startswith("transformer.h.") and not set(mods[m].params) & want
    } - norms
    assert st.whole.act_rep == pytest.approx(
        sum(mods[m].saved_bytes for m in norms | whole_input | outside)
    )
    assert (
        sum(mods[m].saved_bytes for m in whole_input) > 0
        and sum(mods[m].saved_bytes for m in outside) > 0
    )


def test_fixed_overhead_is_measured_and_charged_per_microbatch_on_every_tp_rank(toy, monkeypatch):
    import parallel.cluster as pc

    # a step of 5 ms fixed + 2 ms per sample, on a clock the step advances: the fit finds both
    now = [0.0]
    monkeypatch.setattr(pc.time, "perf_counter", lambda: now[0])

    def step(b: int) -> None:
        now[0] += 0.005 + 0.002 * b

    rate, overhead = pc.measure_model(step, 1e6, batches=(1, 4, 8), reps=2)
    assert overhead == pytest.approx(0.005) and rate == pytest.approx(1e6 / 0.002)
    monkeypatch.undo()
    model, ids, tr = toy
    plain = plan_layout(
        tr, (ids,), cluster(), global_batch=8, precisions=("fp32",), checkpointing=(False,)
    )
    slow = plan_layout(
        tr,
        (ids,),
        cluster(),
        global_batch=8,
        precisions=("fp32",),
        checkpointing=(False,),
        overhead_s=0.01,
    )
    for tp, m in ((1, 1), (2, 2), (4, 4)):
        a = plain.estimate(
            pp=1, tp=tp, dp_replicate=4 // tp, dp_shard=1, microbatches=m, precision="fp32"
        )
        b = slow.estimate(
            pp=1, tp=tp, dp_replicate=4 // tp, dp_shard=1, microbatches=m, precision="fp32"
        )
        # not divided by tp
        assert b.breakdown["compute"] - a.breakdown["compute"] == pytest.approx(0.01 * m)
    # ranks time-sharing the cores run their host work at their share of a core, as their FLOPs
    import dataclasses

    shared = dataclasses.replace(cluster(), rank_share=0.5)
    a, b = (
        plan_layout(
            tr,
            (ids,),
            shared,
            global_batch=8,
            precisions=("fp32",),
            checkpointing=(False,),
            overhead_s=o,
        ).estimate(pp=1, tp=1, dp_replicate=4, dp_shard=1, microbatches=1, precision="fp32")
        for o in (0.0, 0.01)
    )
    assert b.breakdown["compute"] - a.breakdown["compute"] == pytest.approx(0.02)
    # a pipeline stage pays its share of the model's module calls
    a = plain.estimate(pp=2, tp=1, dp_replicate=2, dp_shard=1, microbatches=2, precision="fp32")
    b = slow.estimate(pp=2, tp=1, dp_replicate=2, dp_shard=1, microbatches=2, precision="fp32")
    assert 0.01 * 2 * 0.3 < b.breakdown["compute"] - a.breakdown["compute"] < 0.01 * 2 * 0.8


def test_fsdp_pays_one_collective_latency_per_unit(toy):
    """Each FSDP unit (the 4 blocks and the root) gathers in forward and backward and
    reduce-scatters its gradients: 15 collectives of 3 ring steps on 4 ranks, where links are all
    latency and nothing overlaps."""
    import dataclasses

    model, ids, tr = toy
    slow = dataclasses.replace(cluster(intra=1e18), intra_latency_s=1e-3, comm_overlap=0.0)
    plan = plan_layout(
        tr, (ids,), slow, global_batch=8, precisions=("fp32",), checkpointing=(False,)
    )
    lay = plan.estimate(pp=1, tp=1, dp_replicate=1, dp_shard=4, microbatches=1, precision="fp32")
    assert lay.breakdown["dp_comm"] == pytest.approx(15 * 3 * 1e-3, rel=1e-6)
    ddp = plan.estimate(pp=1, tp=1, dp_replicate=4, dp_shard=1, microbatches=1, precision="fp32")
    # one tree all-reduce
    assert ddp.breakdown["dp_comm"] == pytest.approx(2 * math.ceil(math.log2(4)) * 1e-3, rel=1e-6)
    # 2 accumulation steps: gathers in each one's forward and backward (20), the gradients
    # reduce-scattered once per optimizer step (5), as the runtime's train_step(sync=...) does
    acc = plan.estimate(
        pp=1, tp=1, dp_replicate=1, dp_shard=4, microbatches=2, mixed_precision="fp32"
    )
    assert acc.breakdown["dp_comm"] == pytest.approx((20 + 5) * 3 * 1e-3, rel=1e-6), acc.reasons
    ddp2 = plan.estimate(
        pp=1, tp=1, dp_replicate=4, dp_shard=1, microbatches=2, mixed_precision="fp32"
    )
    # once per step
    assert ddp2.breakdown["dp_comm"] == pytest.approx(ddp.breakdown["dp_comm"], rel=1e-6)


def test_tp_memory_of_a_module_rule_counts_its_weight_matrices():
    """open_clip's towers shard nn.MultiheadAttention by a module rule: its fused in_proj and its
    out_proj weights are split, their biases stay whole."""
    from parallel.planner.stats import tp_plan_facts
    from tests.parallel.partition_models import MODELS

    torch.manual_seed(0)
    model, inputs = MODELS["open_clip"]()
    tr = trace_model(model, inputs, passes=1)
    got, _ = tp_plan_facts(model, tr)
    attn = {n for n in got if ".attn." in n}
    assert attn and {n.rsplit(".attn.", 1)[1] for n in attn} == {
        "in_proj_weight",
        "out_proj.weight",
    }, sorted(attn)


def test_runtime_host_work_is_charged_per_sharded_call_and_fsdp_unit(toy):
    """``Cluster.tp_call_s`` on every call of a module whose weights tensor parallel shards (the
    toy's embedding, 4 linear layers a block, the head: 18 a forward), ``Cluster.fsdp_unit_s`` on
    every FSDP unit (4 blocks and the root), per microbatch (once a step under a pipeline); neither
    on other layouts."""
    import dataclasses

    model, ids, tr = toy
    base = cluster()
    busy = dataclasses.replace(base, tp_call_s=1e-3, fsdp_unit_s=2e-3)
    plans = [
        plan_layout(tr, (ids,), c, global_batch=8, precisions=("fp32",), checkpointing=(False,))
        for c in (base, busy)
    ]

    def extra(**layout) -> float:
        a, b = (p.estimate(precision="fp32", **layout) for p in plans)
        return b.breakdown["compute"] - a.breakdown["compute"]

    assert extra(pp=1, tp=2, dp_replicate=2, dp_shard=1, microbatches=2) == pytest.approx(2 * 18e-3)
    assert extra(pp=1, tp=1, dp_replicate=1, dp_shard=4, microbatches=2) == pytest.approx(
        2 * 5 * 2e-3
    )
    assert extra(pp=1, tp=1, dp_replicate=4, dp_shard=1, microbatches=2) == 0.0
    # under a pipeline a stage (2 blocks and the root) stays gathered for the step: its units' work
    # once
    assert extra(pp=2, tp=1, dp_replicate=1, dp_shard=2, microbatches=4) == pytest.approx(3 * 2e-3)


@pytest.mark.multirank
def test_calibrate_measures_link_and_runtime_host_work():
    """On 2 gloo processes: a positive link latency and bandwidth, and the FSDP2 / DTensor host
    work left over once their collectives are subtracted (milliseconds on a small CPU host)."""
    from parallel.cluster import calibrate

    c = calibrate(Cluster.preset("local"), ranks=2, seconds=0.05)
    assert c.intra_latency_s > 0 and c.intra_bandwidth > 0 and c.peak_flops["fp32"] > 0
    assert 1e-5 < c.fsdp_unit_s < 1.0 and 1e-5 < c.tp_call_s < 1.0


def test_one_kv_head_is_planned_with_replicated_kv():
    """Multi-query attention (tiny Gemma 3, one key/value head, 4 query heads) on 4 devices: tp=2
    and tp=4 are candidates (not ruled out), k_proj / v_proj count whole on every tp rank in the
    parameter memory, and each adds one gradient all-reduce per call to the TP communication."""
    from tests.parallel.tp_cases import SELFCHECK_MODELS

    torch.manual_seed(0)
    model, inputs = SELFCHECK_MODELS["gemma3_mqa"]()
    tr = trace_model(model, inputs, passes=0)
    plan = plan_layout(
        model,
        inputs,
        cluster(),
        global_batch=8,
        precisions=("fp32",),
        checkpointing=(False,),
        offload=(False,),
        trace=tr,
    )
    assert any(lay.tp == 4 and lay.fits for lay in plan.layouts), plan.table(5)
    params = dict(model.named_parameters())
    kv = {n for n in params if n.endswith(("k_proj.weight", "v_proj.weight"))}
    for tp in (2, 4):
        st = plan.planner.stats_at(tp)
        assert st.tp_kv == kv, sorted(st.tp_kv ^ kv)
        assert st.whole.kv_param_bytes == sum(params[n].numel() * 4 for n in kv)
        assert st.whole.kv_calls == len(kv)
        assert not (st.tp_kv & {p for p, sharded in st.tp_param.items() if sharded})
        lay = plan.estimate(pp=1, tp=tp, dp_replicate=4 // tp, dp_shard=1, precision="fp32")
        sharded = st.whole.tp_param_bytes
        assert lay.memory["params"] == pytest.approx(st.whole.param_bytes - sharded + sharded / tp)
        # the query projections are sharded: less than tp=1's memory, more than all-sharded
        assert "model.layers.0.self_attn.q_proj.weight" in {p for p, s in st.tp_param.items() if s}
    layout = dict(pp=1, tp=2, dp_replicate=2, dp_shard=1, precision="fp32")
    with_kv = plan.estimate(**layout).breakdown["tp_comm"]
    plan.planner.stats_at(2).whole.kv_calls = 0  # the layout without the K/V gradient all-reduces
    plan.planner._parts.clear()
    assert with_kv > plan.estimate(**layout).breakdown["tp_comm"]
