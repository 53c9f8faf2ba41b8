"""The training job with the reader pipelined (parallel.pp=2) against one process."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rag_mm.config import ConfigError, compose, validate
from tests.distributed import free_port
from tests.rag_mm.conftest import tiny_overrides
from tests.rag_mm.test_train import run_module

STEPS = 4
# oracle retrieval, deterministic kernels, no clipping surprises: the pipeline must reproduce the
# single-process losses up to float reassociation (microbatch sums, token-weighted)
COMMON = [
    "retriever=oracle",
    "deterministic=true",
    f"max_steps={STEPS}",
    "log_every=1",
    "ckpt_every=2",
]


PP2 = [*COMMON, "parallel.pp=2", "parallel.microbatches=2"]
_PP2_RUN: dict[str, tuple[Path, Path]] = {}


def pp2_run(root, tmp_path_factory) -> tuple[Path, Path]:
    """A pipelined run (pp=2, 2 microbatches, 2 gloo ranks) on the world ``root``, once per test
    session: the first caller's world and run directory, (root, run_dir), for every later caller.
    The one-process comparison below and the notebook tests (its timeline) read it."""
    if "run" not in _PP2_RUN:
        run = tmp_path_factory.mktemp("pp2") / "run"
        args = [
            "-m",
            "torch.distributed.run",
            "--nproc_per_node=2",
            f"--master_port={free_port()}",
            "-m",
            "rag_mm.train",
            *tiny_overrides(root, run, *PP2),
        ]
        res = run_module(args, timeout=600)
        assert res.returncode == 0, res.stderr[-3000:]
        _PP2_RUN["run"] = (Path(root), run)
    return _PP2_RUN["run"]


def check_run_timeline(run_dir: Path, microbatches: int = 2) -> list:
    """The run directory's pipeline timeline, as the trainer writes it for its last step: both
    ranks' events on one time base (timeline.json), the figure (timeline.png), the bubble fraction
    (metrics.json's "pipeline", the trace's "otherData"), measured from those events. The events."""
    from parallel.timeline import bubble_fraction, from_chrome_trace, theory_bubble

    trace = json.loads((run_dir / "timeline.json").read_text())
    events = from_chrome_trace(trace["traceEvents"])
    assert {e.rank for e in events} == {0, 1}
    # every microbatch's forward and backward on each rank, on its own stage: a backward is B, or
    # its input gradient (I, sent upstream at once) and weight gradient (W) apart, as the pipeline
    # runs the last backwards of a step on every rank but the first (parallel.split_drain)
    for r in (0, 1):
        mine = [e for e in events if e.rank == r and e.kind in "FBIW"]
        assert {e.stage for e in mine} == {r}
        for i in range(microbatches):
            kinds = sorted(e.kind for e in mine if e.mb == i)
            assert kinds in (["B", "F"], ["F", "I", "W"]), (r, i, kinds)
    # one clock: a stage computes a microbatch after the stage that sends it its input began it
    # (activations forward, gradients back; the sender's event ends after its send returns, which
    # may be after the receiver's compute began)
    at = {(e.rank, "B" if e.kind == "I" else e.kind, e.mb): e for e in events if e.kind in "FBI"}
    for i in range(microbatches):
        assert at[1, "F", i].start >= at[0, "F", i].start, i
        assert at[0, "B", i].start >= at[1, "B", i].start, i
    png = (run_dir / "timeline.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 1000
    pipe = json.loads((run_dir / "metrics.json").read_text())["pipeline"]
    bf = bubble_fraction(events)
    assert 0 <= pipe["bubble_fraction"] < 1
    assert pipe["bubble_fraction"] == pytest.approx(bf, abs=1e-6)  # the trace keeps microseconds
    assert trace["otherData"]["bubble_fraction"] == pipe["bubble_fraction"]
    assert pipe["theory_bubble"] == pytest.approx(theory_bubble(2, microbatches))
    assert (
        pipe["step"] == STEPS and pipe["ranks"] == [0, 1] and pipe["microbatches"] == microbatches
    )
    return events


def test_timeline_merges_ranks_of_other_hosts_on_the_barrier():
    """Ranks that read the first rank's clock keep their times; another host's clock (another boot
    id) is shifted so that its barrier read lands on the first rank's."""
    from parallel.timeline import Event, align

    # one shift for all of host B
    parts = [
        ("host-a", 10.0, [Event(0, "F", 0, 0, 9.0, 9.5)]),  # barrier left at 10.0 on clock A
        ("host-a", 10.001, [Event(1, "F", 1, 0, 9.5, 9.8)]),  # same clock: kept as it is
        # clock B reads 500.0 at that barrier
        (
            "host-b",
            500.0,
            [Event(2, "F", 2, 0, 499.8, 499.9)],
        ),
        ("host-b", 500.002, [Event(3, "F", 3, 0, 499.9, 499.95)]),
    ]
    got = [(e.rank, round(e.start, 6), round(e.end, 6)) for e in align(parts)]
    assert got == [(0, 9.0, 9.5), (1, 9.5, 9.8), (2, 9.8, 9.9), (3, 9.9, 9.95)]


def _losses(run_dir) -> list[float]:
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [
        r["loss"]
        for r in rows
        if "loss" in r and "step" in r and not any(k.startswith(("val", "test")) for k in r)
    ]


def test_pipeline_config_rejections(tiny_world, tmp_path):
    """Unsupported combinations are named before any work."""
    cfg = compose(tiny_overrides(tiny_world, tmp_path, "parallel.pp=2", "parallel.microbatches=3"))
    with pytest.raises(
        ConfigError, match=r"parallel.microbatches \(3\) must divide data.batch_size"
    ):
        validate(cfg, world_size=2)
    validate(
        compose(tiny_overrides(tiny_world, tmp_path, "parallel.pp=2", "parallel.microbatches=2")),
        world_size=2,
    )
    validate(
        compose(
            tiny_overrides(
                tiny_world,
                tmp_path,
                "parallel.pp=2",
                "parallel.microbatches=2",
                "optim.precision=bf16",
            )
        ),
        world_size=2,
    )


@pytest.mark.multirank
def test_torchrun_pipeline_matches_one_process(tiny_world, tmp_path_factory, tmp_path):
    """Losses, test metrics and checkpoint of pp=2 as one process; the pipeline timeline of its
    last step in the run directory."""
    root, pipe = pp2_run(tiny_world, tmp_path_factory)
    single = tmp_path / "single"
    res = run_module(["-m", "rag_mm.train", *tiny_overrides(root, single, *COMMON)], timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    summary = json.loads((pipe / "metrics.json").read_text())
    assert summary["world_size"] == 2 and summary["step"] == STEPS
    assert summary["test"]["n"] == 24  # each test query counted once, not once per stage
    assert (pipe / "checkpoints" / f"step_{STEPS:08d}" / "manifest.json").is_file()
    a, b = _losses(single), _losses(pipe)
    assert len(a) == len(b) == STEPS
    assert b == pytest.approx(a, rel=2e-4, abs=2e-5), (a, b)
    ref = json.loads((single / "metrics.json").read_text())
    assert "pipeline" not in ref and not (single / "timeline.json").exists()
    assert summary["test"]["nll"] == pytest.approx(ref["test"]["nll"], rel=1e-3, abs=1e-4)
    # the blind prior (rank 0's table, broadcast) and the blanked-picture forward through the stages
    assert summary["test"]["blind_prior"] == ref["test"]["blind_prior"] is not None
    assert summary["test"]["acc_blank"] == pytest.approx(ref["test"]["acc_blank"], abs=1e-6)
    assert summary["test"]["by_type"]["other"]["n"] == 24
    check_run_timeline(pipe)


@pytest.mark.multirank
@pytest.mark.parametrize(
    "name,extra",
    [
        ("pp2", ["parallel.pp=2", "parallel.microbatches=2"]),
        # bf16 tensor parallel: parallel's own bf16 tests cover its step
        pytest.param("tp2", ["parallel.tp=2"], marks=pytest.mark.slow),
    ],
    ids=["pp2", "tp2"],
)
def test_torchrun_bf16_spread_matches_one_process(tiny_world, tmp_path, name, extra):
    """optim.precision=bf16 with the reader pipelined (pp=2) and, separately, tensor-parallel
    (tp=2): the trainer's autocast covers the spread step's forwards; the losses follow one bf16
    process, whose copy head on CPU this run also covers (CPU autocast leaves softmax in bf16; it
    crashed in scatter_add_ before). parallel's own test holds every stage's gradients to one
    process's autocast step, so bf16 is really computed on each stage."""
    common = [*COMMON, "optim.precision=bf16"]
    single = tmp_path / "single"
    res = run_module(
        ["-m", "rag_mm.train", *tiny_overrides(tiny_world, single, *common)], timeout=600
    )
    assert res.returncode == 0, res.stderr[-3000:]
    args = [
        "-m",
        "torch.distributed.run",
        "--nproc_per_node=2",
        f"--master_port={free_port()}",
        "-m",
        "rag_mm.train",
        *tiny_overrides(tiny_world, tmp_path / name, *common, *extra),
    ]
    res = run_module(args, timeout=600)
    assert res.returncode == 0, (name, res.stderr[-3000:])
    a, b = _losses(single), _losses(tmp_path / name)
    assert len(a) == len(b) == STEPS
    # bf16 rounds the whole batch's and the microbatches' products alike up to accumulation order
    assert b == pytest.approx(a, rel=1e-3), (name, a, b)


# the learned retriever as +experiment=demo trains it: the top 2 read with the retrieval prior; no
# pseudo-queries / bank negatives (random draws), so both runs see the same losses
LEARNED = [
    "retriever=learned",
    "retriever.top_k=2",
    "retriever.reader_prior=true",
    "retriever.embed_dim=16",
    "retriever.vision_width=32",
    "retriever.vision_layers=1",
    "retriever.text_width=32",
    "retriever.pseudo_queries=0",
    "retriever.bank_negatives=0",
    "retriever.refresh_every=2",
    "deterministic=true",
    f"max_steps={STEPS}",
    "log_every=1",
    "ckpt_every=0",
]


def _retriever_losses(run_dir) -> list[float]:
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["retriever_loss"] for r in rows if r.get("kind") == "train"]


@pytest.mark.multirank
@pytest.mark.parametrize(
    "split,loss",
    [
        (("parallel.pp=2", "parallel.microbatches=2"), "pdist"),
        # adist also runs in one process in the default tests (test_train.py)
        pytest.param(("parallel.pp=2", "parallel.microbatches=2"), "adist", marks=pytest.mark.slow),
        # the trainer's tp=2 (test_train_tp.py) and emdr (test_train.py) run in the default tests
        pytest.param(("parallel.tp=2",), "emdr", marks=pytest.mark.slow),
    ],
    ids=["pp2-pdist", "pp2-adist", "tp2-emdr"],
)
def test_torchrun_pipeline_learned_matches_one_process(tiny_world, tmp_path, split, loss):
    """The spread reader with the learned retriever: every rank of a replica runs the same search,
    the reader reads the retrieval prior, and the retriever loss is RagModel's own, reader-driven
    ones included (pdist / emdr: the reader with each document alone, a second input structure of
    the pipeline; adist: the last stage's copy attention); losses as one process."""
    single, pipe = tmp_path / "single", tmp_path / "spread"
    # the reader-driven term alone, its target sharpened: a wrong per-document NLL or attention
    # moves the retriever loss far beyond the tolerance (with the contrastive term on, a 1.3x NLL
    # passed). The contrastive term under pp runs in the copies test below, not compared here.
    learned = [
        *LEARNED,
        f"retriever.loss={loss}",
        "retriever.contrastive_weight=0",
        "retriever.gold_temperature=0.01",
    ]
    res = run_module(
        ["-m", "rag_mm.train", *tiny_overrides(tiny_world, single, *learned)], timeout=600
    )
    assert res.returncode == 0, res.stderr[-3000:]
    args = [
        "-m",
        "torch.distributed.run",
        "--nproc_per_node=2",
        f"--master_port={free_port()}",
        "-m",
        "rag_mm.train",
        *tiny_overrides(tiny_world, pipe, *learned, *split),
    ]
    res = run_module(args, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    a, b = _losses(single), _losses(pipe)
    assert len(a) == len(b) == STEPS
    assert b == pytest.approx(a, rel=1e-3, abs=1e-4), (a, b)
    ra, rb = _retriever_losses(single), _retriever_losses(pipe)
    assert len(ra) == STEPS and all(x > 0 for x in ra)
    assert rb == pytest.approx(ra, rel=1e-3, abs=1e-4), (ra, rb)


@pytest.mark.multirank
def test_torchrun_pipeline_retriever_copies_stay_one(tiny_world, tmp_path):
    """The demo's retriever under a pipeline: random draws in its loss (pseudo-queries, bank
    negatives) and BatchNorm statistics (the ResNet tower) that every forward moves, the index
    refresh's too, which embeds a different share of the memory on each rank. The copies must
    still take the same steps and read the same statistics, or the stages would search different
    documents; the trainer checks the parameters bit for bit at every index refresh."""
    run = tmp_path / "pp2"
    learned = [
        *LEARNED,
        "retriever.loss=pdist",
        "retriever.pseudo_queries=4",
        "retriever.bank_negatives=8",
        "retriever.vision_tower=resnet",
        "retriever.vision_width=16",
        "retriever.shared_towers=true",
        "retriever.fusion=image",
        # the centred index: the calibration queries' refresh is sharded like the documents'
        "retriever.centre=true",
        # the device search (here the CPU): its index, bank and store on each rank's device
        "retriever.search=device",
        "parallel.pp=2",
        "parallel.microbatches=2",
    ]
    args = [
        "-m",
        "torch.distributed.run",
        "--nproc_per_node=2",
        f"--master_port={free_port()}",
        "-m",
        "rag_mm.train",
        *tiny_overrides(tiny_world, run, *learned),
    ]
    res = run_module(args, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    assert len(_retriever_losses(run)) == STEPS


def _evaluate(run_dir) -> dict:
    res = run_module(["-m", "rag_mm.evaluate", str(run_dir), "split=test"], timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


# the default run covers FSDP inside pipeline stages in tests/parallel/test_3d.py (4 and 8 ranks),
# the app's pipeline under torchrun above, and its FSDP checkpoint read in one process in
# test_train_tp.py
@pytest.mark.slow
@pytest.mark.multirank
def test_torchrun_fsdp_under_pipeline_matches_replicated(tiny_world, tmp_path):
    """pp=2 x dp_shard=2 (FSDP2 inside each stage) against pp=2 x dp=2 (each stage replicated) on
    4 ranks: the same data split and the same arithmetic, so the same losses, with the learned
    retriever and pdist (the reader with each document alone runs forward-only over the sharded
    stages between training steps). The sharded run's checkpoint (FSDP's DTensor shards, written
    by DCP), evaluated in one process, reads as the replicated run's."""
    learned = [*LEARNED, "retriever.loss=pdist", "parallel.pp=2", "parallel.microbatches=2"]
    runs = {"sharded": ["parallel.dp_shard=2"], "replicated": ["parallel.dp_replicate=2"]}
    for name, extra in runs.items():
        args = [
            "-m",
            "torch.distributed.run",
            "--nproc_per_node=4",
            f"--master_port={free_port()}",
            "-m",
            "rag_mm.train",
            *tiny_overrides(tiny_world, tmp_path / name, *learned, *extra),
        ]
        res = run_module(args, timeout=600)
        assert res.returncode == 0, (name, res.stderr[-3000:])
    a, b = _losses(tmp_path / "replicated"), _losses(tmp_path / "sharded")
    assert len(a) == len(b) == STEPS
    assert b == pytest.approx(a, rel=1e-4, abs=1e-5), (a, b)
    ra, rb = _retriever_losses(tmp_path / "replicated"), _retriever_losses(tmp_path / "sharded")
    assert rb == pytest.approx(ra, rel=1e-4, abs=1e-5), (ra, rb)
    ea, eb = _evaluate(tmp_path / "replicated"), _evaluate(tmp_path / "sharded")
    assert eb["step"] == ea["step"] == STEPS and eb["n"] == ea["n"] == 24
    assert eb["nll"] == pytest.approx(ea["nll"], rel=1e-4), (ea, eb)
