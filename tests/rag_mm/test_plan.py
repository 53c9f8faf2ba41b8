"""rag_mm.plan: the planning command line on the demo reader, its bad-input handling, and
``parallel=auto`` resolving a run's layout before validation."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from parallel.cluster import Cluster
from rag_mm import plan as rplan
from rag_mm.config import ConfigError, compose, parallel_config, validate

ROOT = Path(__file__).resolve().parents[2]
# the demo config with plain-PyTorch attention: the default backend may first JIT-build the fused
# C++ kernel (20-30 s), which is not what these tests check
DEMO, REF = "+experiment=demo", "model.attention_backend=reference"


def test_cli_table_and_json_layouts_run_in_rag_mm(capsys):
    assert rplan.main([DEMO, REF, "cluster=p4d", "top=5"]) == 0
    out = capsys.readouterr().out
    # the demo's data.global_batch_size
    assert "on p4d: 1 x 8 devices of 40 GiB, global batch 32" in out
    assert "best layouts, as rag_mm runs them:" in out
    launch = [
        line.strip()
        for line in out.splitlines()
        if line.strip().startswith("torchrun --nnodes=1 --nproc_per_node=8")
    ]
    assert launch, out
    assert "parallel.pp=" in launch[0] and DEMO in launch[0]

    assert (
        rplan.main([DEMO, REF, "cluster=p4d", "cluster.nodes=2", "global_batch=512", "format=json"])
        == 0
    )
    plan = json.loads(capsys.readouterr().out)
    assert {"parameters", "device_memory_bytes", "layouts"} <= plan.keys()
    assert plan["world"] == 16 and plan["global_batch"] == 512
    best = plan["layouts"][0]
    assert best["fits"]
    # the command line of its best layout composes and validates for the planned world
    cfg = compose([DEMO, REF, *best["overrides"]])
    validate(cfg, 16)
    p = parallel_config(cfg, 16)
    assert (p.pp, p.tp, p.dp_replicate, p.dp_shard) == tuple(
        best[k] for k in ("pp", "tp", "dp_replicate", "dp_shard")
    )
    assert cfg.data.batch_size * p.dp * cfg.optim.grad_accum == 512  # the global batch is kept


def test_bad_input_exits_2_without_traceback(capsys):
    # one real process (the module's entry point); the other cases in process
    r = subprocess.run(
        [sys.executable, "-m", "rag_mm.plan", DEMO, "cluster=nosuch"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert r.returncode == 2, r.stderr
    assert "unknown cluster preset 'nosuch'" in r.stderr and "Traceback" not in r.stderr
    assert r.stdout == ""
    cases = {
        "cluster.nodes must be positive": [DEMO, "cluster=p4d", "cluster.nodes=0"],
        "unknown key 'cluster.gpus'": [DEMO, "cluster=p4d", "cluster.gpus=8"],
        "nosuch": [DEMO, "nosuch.key=1"],  # neither a planner key nor a training key
        "global_batch must be an integer": [DEMO, "global_batch=many"],
        "format must be one of": [DEMO, "format=xml"],
        "expected key=value": [DEMO, "p4d"],
        "model.heads (3) must divide model.dim": [DEMO, "model.heads=3"],
    }
    for msg, argv in cases.items():
        assert rplan.main(argv) == 2, argv
        err = capsys.readouterr().err
        assert err.startswith("rag_mm.plan: ") and msg in err and "Traceback" not in err, (
            argv,
            err,
        )


def test_auto_resolves_single_process_layout_and_logs_it(caplog):
    cfg = compose([DEMO])
    assert rplan.resolve_auto(cfg, 1) is None  # launch.auto_layout off: the config is left as it is
    cfg = compose([DEMO, REF, "parallel=auto"])
    assert cfg.launch.auto_layout
    with caplog.at_level(logging.INFO, logger="rag_mm.plan"):
        lay = rplan.resolve_auto(cfg, 1)
    assert (lay.pp, lay.tp, lay.dp_replicate, lay.dp_shard) == (1, 1, 1, 1) and lay.fits
    p = cfg.parallel
    assert (p.pp, p.tp, p.dp_replicate, p.dp_shard) == (1, 1, 1, 1)
    assert cfg.data.batch_size * cfg.optim.grad_accum == 32 and cfg.optim.precision == "fp32"
    assert cfg.data.eval_batch_size == 128  # divisible by the microbatches: the run's own stays
    validate(cfg, 1)
    text = caplog.text
    assert "parallel=auto: pp1 tp1 dpr1 dps1" in text and "1 x 1 devices" in text
    assert (
        "parallel=auto overrides: parallel.pp=1 parallel.dp_replicate=1 parallel.dp_shard=1 "
        "parallel.tp=1" in text
    )


def _local(memory: float):
    def cluster(world, local_world=None):
        return Cluster.preset("local", nodes=1, devices_per_node=world, device_memory_bytes=memory)

    return cluster


def test_auto_takes_only_fitting_layouts_and_ranks_agree(monkeypatch):
    # 0.5 GiB a rank (0.4 usable): the demo reader's 32-sample step needs ~0.7 GiB, so only
    # gradient accumulation (smaller microbatches) fits
    monkeypatch.setattr(rplan, "auto_cluster", _local(0.5 * 2**30))
    per_rank = "data.global_batch_size=0"  # 32 samples on each rank: a global batch of 64
    cfg = compose([DEMO, REF, "parallel=auto", per_rank])
    lay = rplan.resolve_auto(cfg, 2)
    assert lay.fits and lay.microbatches > 1 and lay.memory_bytes_per_device <= 0.4 * 2**30
    assert cfg.optim.grad_accum == lay.microbatches  # accumulation, not a pipeline, at pp = 1
    assert cfg.data.batch_size * cfg.optim.grad_accum * parallel_config(cfg, 2).dp == 64
    validate(cfg, 2)
    # every rank plans on its own: a second plan (another "rank") picks the same layout
    again = compose([DEMO, REF, "parallel=auto", per_rank])
    assert rplan.resolve_auto(again, 2).key == lay.key and again == cfg

    monkeypatch.setattr(rplan, "auto_cluster", _local(2**20))  # 1 MiB: nothing fits
    with pytest.raises(ConfigError, match="no layout of the reader fits 2 rank"):
        rplan.resolve_auto(compose([DEMO, REF, "parallel=auto"]), 2)


def test_a_billion_parameter_preset_plans_on_the_meta_device(capsys):
    """The Llama-3.2-1B reader preset (1.40 B parameters with its ViT-L/14, its vocabulary cut to
    the tokenizer's) is planned without a weight in memory: the trace runs on the meta device."""
    import resource

    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB
    assert (
        rplan.main(
            [
                DEMO,
                "model=llama3_2_1b",
                "retriever.top_k=2",
                "data.batch_size=4",
                "cluster=p4d",
                "cluster.nodes=2",
                "format=json",
            ]
        )
        == 0
    )
    grown = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024
    plan = json.loads(capsys.readouterr().out)
    assert 1.40e9 < plan["parameters"] < 1.41e9, plan["parameters"]  # 1.57 B with 128,256 rows
    assert plan["layouts"][0]["fits"]
    assert grown < 2e9, grown  # fp32 weights alone would be 6.3 GB


def test_global_batch_size_sets_the_per_replica_batch():
    """``data.global_batch_size``: each data-parallel replica takes its share, whatever the layout
    (the demo on 4 ranks as pp=2 x dp_shard=2 trains one process's batch of 32); replicas that do
    not divide it stop the run with a message naming the key."""
    from rag_mm.config import resolve_batch

    for world, extra, per_replica in (
        (1, [], 32),
        (4, ["parallel.pp=2", "parallel.dp_shard=2"], 16),
        (4, [], 8),
        (8, ["parallel.tp=2"], 8),
    ):
        cfg = compose([DEMO, *extra])
        resolve_batch(cfg, world)
        assert cfg.data.batch_size == per_replica, (world, extra)
    cfg = compose([DEMO, "data.global_batch_size=0", "data.batch_size=24"])
    resolve_batch(cfg, 4)
    assert cfg.data.batch_size == 24  # 0: the per-replica batch as given
    cfg = compose([DEMO, "data.global_batch_size=30"])
    resolve_batch(cfg, 4)
    with pytest.raises(
        ConfigError, match=r"data.global_batch_size \(30\) must be divisible by the 4 data-parallel"
    ):
        validate(cfg, 4)


def test_planned_configs_become_command_lines_that_reach_the_runtime():
    """The planner returns runtime configs; ``layout_overrides`` turns each into rag_mm's command
    line, which composes, validates and gives back the very config planned (the run's own
    fields, here grad_reduce, kept), with the global batch kept."""
    from parallel.cluster import Cluster

    world = 8
    cfg = compose([DEMO, REF, "parallel.grad_reduce=shm"])
    p = rplan.plan(cfg, Cluster.preset("p4d"), 64)
    seen, checked = set(), 0
    for est in p.fitting:
        c = est.config
        kind = (c.pp > 1, c.tp > 1, c.dp_shard > 1, est.grad_accum > 1)
        if kind in seen:
            continue
        seen.add(kind)
        overrides = rplan.layout_overrides(cfg, est)
        assert not any(
            o.startswith(("parallel.dp=", "parallel.backend", "parallel.auto")) for o in overrides
        )
        run = compose([DEMO, REF, "parallel.grad_reduce=shm", *overrides])
        validate(run, world)
        assert parallel_config(run, world) == c, (overrides, c)
        assert c.grad_reduce == "shm"
        assert run.data.batch_size * run.optim.grad_accum * c.dp == 64, overrides
        checked += 1
        if checked == 4:  # each compose takes about a second
            break
    assert checked == 4, seen
