"""The training job end to end on a tiny world: config errors, corrupt data, resume, DDP."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import numpy as np
import pytest
import torch

from rag_mm.config import compose
from rag_mm.trainer import Trainer
from tests.distributed import free_port
from tests.rag_mm.conftest import tiny_overrides

REPO = Path(__file__).resolve().parents[2]


def run_module(
    args: list[str], env_extra: dict | None = None, timeout: int = 300
) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HYDRA_FULL_ERROR": "0", **(env_extra or {})}
    return subprocess.run(
        [sys.executable, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout
    )


def test_bad_config_is_rejected_before_work(tmp_path):
    """Every bad key is named in one message; the job exits non-zero before doing anything."""
    bad = {
        "model.layers=0": "model.layers must be positive",
        "model.heads=3": "model.heads (3) must divide model.dim (128)",
        "retriever.mode=psychic": "retriever.mode must be one of",
        "parallel.dp_replicate=3": "does not match the world size 1",
        "optim.precision=fp8": "optim.precision must be one of",
        "model.mlp=relu": "model.mlp must be one of",
    }
    res = run_module(["-m", "rag_mm.train", "+experiment=demo", f"run_dir={tmp_path}/run", *bad])
    assert res.returncode == 2
    for message in bad.values():
        assert message in res.stderr
    assert "Traceback" not in res.stderr + res.stdout
    assert not (tmp_path / "run" / "checkpoints").exists()  # nothing started


def test_unknown_key_and_missing_data_are_rejected(tmp_path):
    res = run_module(
        ["-m", "rag_mm.train", "+experiment=demo", f"run_dir={tmp_path}/run", "model.widht=3"]
    )
    assert res.returncode != 0 and "widht" in res.stderr and "Traceback" not in res.stderr
    res = run_module(
        [
            "-m",
            "rag_mm.train",
            "+experiment=demo",
            f"run_dir={tmp_path}/run",
            f"data.root={tmp_path}/nowhere",
        ]
    )
    assert res.returncode == 2 and "data.corpus" in res.stderr and "knowledge_world" in res.stderr
    assert "Traceback" not in res.stderr


def _final_loss(root, run_dir, *extra):
    cfg = compose(tiny_overrides(root, run_dir, "deterministic=true", *extra))
    t = Trainer(cfg)
    try:
        t.restore()
        restored_at = t.step
        out = t.fit()
    finally:
        t.close()
    return {**out, "restored_at": restored_at}, t


def _trained_steps(run_dir) -> list[int]:
    """The steps a run directory's metrics.jsonl records training for, in the order written."""
    recs = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    return [r["step"] for r in recs if r.get("kind") == "train"]


def test_resume_after_checkpoint_matches_uninterrupted_run(tiny_world, tmp_path):
    full, t_full = _final_loss(tiny_world, tmp_path / "full")
    part, _ = _final_loss(tiny_world, tmp_path / "split", "stop_after_steps=3")
    assert part["stopped_at"] == 3
    resumed, t_res = _final_loss(tiny_world, tmp_path / "split")
    # the second run started from the checkpoint at step 3, not over from step 0 (a deterministic
    # rerun from scratch reaches the same parameters, so equal weights alone prove nothing)
    assert resumed["restored_at"] == 3
    assert _trained_steps(tmp_path / "split") == [2, 4, 6], (
        "steps 1-3 were trained again after the restart"
    )
    assert resumed["step"] == full["step"] == 6
    assert abs(resumed["final_train_loss"] - full["final_train_loss"]) <= 1e-6
    for (n, a), (_, b) in zip(t_full.model.state_dict().items(), t_res.model.state_dict().items()):
        assert torch.equal(a, b), n
    summary = json.loads((tmp_path / "split" / "metrics.json").read_text())
    assert {"val", "test", "skipped_samples"} <= set(summary)


def _corrupt_copy(src: Path, dst: Path) -> None:
    """Copy the tiny world, then damage it in every way the pipeline must survive."""
    import shutil

    shutil.copytree(src, dst)
    shard = dst / "train" / "train-000000.tar"
    members = []
    with tarfile.open(shard) as t:
        for m in t:
            members.append((m, t.extractfile(m).read()))
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w") as t:
        for i, (m, data) in enumerate(members):
            if i == 0 and m.name.endswith(".json"):
                data = b"{not json"
            if m.name.endswith(".png") and i in (3, 4, 5):
                data = b"\x89PNG broken"
            if i in (6, 7, 8) and m.name.endswith(".txt"):
                continue  # a sample without its question
            m.size = len(data)
            t.addfile(m, io.BytesIO(data))
    shard.write_bytes(out.getvalue())
    other = dst / "train" / "train-000001.tar"
    other.write_bytes(other.read_bytes()[: other.stat().st_size // 2 + 100])  # truncated mid-member


def test_corrupt_shards_are_skipped_and_counted(tiny_world, tmp_path):
    bad = tmp_path / "bad_world"
    _corrupt_copy(tiny_world, bad)
    out, _ = _final_loss(bad, tmp_path / "run", "max_steps=12", "ckpt_every=0")
    assert out["step"] == 12  # training went on
    skipped = out["skipped_samples"]
    assert (
        skipped.get("bad_json", 0) >= 1
        and skipped.get("bad_image", 0) >= 1
        and skipped.get("missing_key", 0) >= 1
    )
    assert any(k.startswith("tar:") for k in skipped)
    saved = json.loads((tmp_path / "run" / "metrics.json").read_text())["skipped_samples"]
    assert saved == skipped


@pytest.mark.multirank
def test_torchrun_two_nodes_ddp_hier_int8(tiny_world, tmp_path):
    """Data parallel over two "nodes" on localhost (two torchrun invocations, --nnodes=2, one rank
    each; RAG_MM_HOST_ID gives each its own host identity) with parallel.grad_reduce=hier_int8:
    gradients cross the simulated hosts as block-wise int8, the run trains, checkpoints and
    evaluates every test query once."""
    run_dir, port = tmp_path / "ddp", free_port()
    procs = []
    for node in range(2):
        args = [
            "-m",
            "torch.distributed.run",
            "--nnodes=2",
            f"--node-rank={node}",
            "--nproc-per-node=1",
            "--master-addr=127.0.0.1",
            f"--master-port={port}",
            "-m",
            "rag_mm.train",
            *tiny_overrides(
                tiny_world, run_dir, "max_steps=4", "ckpt_every=2", "parallel.grad_reduce=hier_int8"
            ),
        ]
        env = {
            **os.environ,
            "OMP_NUM_THREADS": "1",
            "HYDRA_FULL_ERROR": "0",
            "RAG_MM_HOST_ID": f"node{node}",
        }
        procs.append(
            subprocess.Popen(
                [sys.executable, *args],
                cwd=REPO,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    outs = []
    for p in procs:
        try:
            outs.append(p.communicate(timeout=600)[0])
        except subprocess.TimeoutExpired:
            p.kill()
            outs.append(p.communicate()[0])
    assert all(p.returncode == 0 for p in procs), "\n".join(o[-3000:] for o in outs)
    summary = json.loads((run_dir / "metrics.json").read_text())
    assert summary["world_size"] == 2 and summary["step"] == 4
    assert summary["test"]["n"] == 24  # both ranks' shares of the test split were counted once
    assert (
        summary["grad_reduce"]["kind"] == "hier_int8"
        and summary["grad_reduce"]["inter_host_bytes"] > 0
    )
    assert (run_dir / "checkpoints" / "step_00000004" / "manifest.json").is_file()
    assert (run_dir / ".hydra" / "config.yaml").is_file() and (run_dir / "metrics.jsonl").is_file()


@pytest.mark.parametrize(
    "extra",
    [
        ("retriever.loss=pdist",),
        ("retriever.loss=emdr", "retriever.refresh_background=true"),
        ("retriever.loss=adist", "retriever.contrastive_steps=2"),
        (
            "retriever.loss=contrastive",
            "retriever.query_side_only=true",
            "retriever.contrastive_steps=2",
        ),
    ],
    ids=["pdist", "emdr-background", "adist", "contrastive-query-side"],
)
def test_learned_retrieval_trains_both_towers(tiny_world, tmp_path, extra):
    overrides = [
        "retriever=learned",
        "retriever.top_k=3",
        "retriever.refresh_every=2",
        "max_steps=4",
        "retriever.embed_dim=16",
        "retriever.vision_width=32",
        "retriever.vision_layers=1",
        "retriever.text_width=32",
        *extra,
    ]
    cfg = compose(tiny_overrides(tiny_world, tmp_path / "run", *overrides))
    t = Trainer(cfg)
    before = {n: p.detach().clone() for n, p in t.rag.retriever.named_parameters()}
    try:
        out = t.fit()
    finally:
        t.close()
    after = dict(t.rag.retriever.named_parameters())
    changed = {n for n in before if not torch.equal(before[n], after[n])}
    assert any(n.startswith("query.") for n in changed)
    doc_changed = any(n.startswith("doc.") for n in changed)
    assert doc_changed == ("retriever.query_side_only=true" not in extra)
    assert {"recall@1", "recall@5", "recall@10"} <= set(out["test"])
    assert out["index_refreshes"] == (1 if "retriever.query_side_only=true" in extra else 2)
    records = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert all(np.isfinite(r["retriever_loss"]) for r in records if r["kind"] == "train")
    if "retriever.loss=contrastive" in extra:  # its only term, on for the first 2 steps
        r_loss = {r["step"]: r["retriever_loss"] for r in records if r["kind"] == "train"}
        assert r_loss[2] > 0 and r_loss[4] == 0, r_loss
    examples = json.loads((tmp_path / "run" / "retrieved_examples.json").read_text())
    assert examples and len(examples[0]["retrieved"]) == 3 and examples[0]["query_image"]


WARMUP = [
    "retriever=learned",
    "retriever.top_k=2",
    "retriever.embed_dim=16",
    "retriever.shared_towers=true",
    "retriever.vision_tower=resnet",
    "retriever.vision_width=16",
    "retriever.vision_layers=1",
    "retriever.fusion=image",
    "retriever.warmup_steps=3",
    "retriever.bank_negatives=8",
    "retriever.pseudo_queries=4",
    "retriever.refresh_every=2",
    "max_steps=2",
    "ckpt_every=0",
]


def _train_rank(rank, world, overrides):
    t = Trainer(compose(overrides), log_metrics=rank == 0)
    try:
        out = t.fit()
    finally:
        t.close()
    # numpy arrays: torch tensors would cross the process boundary as shared-memory handles
    return {n: p.detach().numpy().copy() for n, p in t.rag.retriever.named_parameters()}, out


def test_retriever_warmup_then_joint_training(tiny_world, tmp_path):
    """Warm-up steps train the retriever alone (logged as kind=warmup) at their own rate, falling
    by a cosine to warmup_min_lr_ratio of it, and refresh the index; joint training then reads
    the top-k with the retrieval prior."""
    over = tiny_overrides(
        tiny_world,
        tmp_path / "run",
        *WARMUP,
        "retriever.warmup_lr=1e-3",
        "retriever.warmup_min_lr_ratio=0.5",
    )
    params, out = _train_rank(0, 1, over)
    records = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    warm = [r for r in records if r["kind"] == "warmup"]
    assert [r["step"] for r in warm] == [2, 3] and all(np.isfinite(r["loss"]) for r in warm)
    # the rate after steps 2 and 3 of 3: 0.5 + 0.5 * (1 + cos(pi * s / 3)) / 2 of the peak
    assert [r["lr"] for r in warm] == pytest.approx([1e-3 * 0.625, 1e-3 * 0.5])
    assert out["retriever_warmup_time_s"] > 0 and out["step"] == 2
    assert out["index_refreshes"] == 3  # the first build, then after warm-up steps 2 and 3
    assert 0 < out["refresh_fraction"] < 1
    # refresh_every=2: step 1 searched a fresh index, step 2 the same one a step older
    fresh, stale = out["train_recall@2_fresh_index"], out["train_recall@2_stale_index"]
    assert (
        0 <= fresh <= 1 and 0 <= stale <= 1 and out["recall_drift"] == pytest.approx(fresh - stale)
    )


def test_retriever_warmup_average_replaces_its_weights(tiny_world, tmp_path, monkeypatch):
    """``retriever.warmup_average_from=0.34`` of 3 warm-up steps: the joint phase starts from the
    mean of the weights after steps 2 and 3 (those after the first third), not the last step's."""
    from rag_mm.ft import faults

    over = tiny_overrides(
        tiny_world, tmp_path / "run", *WARMUP, "retriever.warmup_average_from=0.34", "max_steps=1"
    )
    t = Trainer(compose(over), log_metrics=True)
    seen: dict[tuple[str, int], dict] = {}

    def snapshot(point: str, step: int, rank: int, path: str = "") -> None:
        # ("warmup", i): after warm-up step i, before it is averaged; ("step", 0): before the
        # first joint step. Parameters only: the batch norms' running statistics are averaged
        # too, then moved by the last refresh's pass over the memory, as every refresh does
        if point in ("warmup", "step"):
            named = t.rag.retriever.named_parameters()
            seen[point, step] = {k: v.detach().clone() for k, v in named}

    monkeypatch.setattr(faults, "inject", snapshot)
    try:
        t.fit()
    finally:
        t.close()
    steps = [seen["warmup", i] for i in (2, 3)]
    start = seen["step", 0]
    for k in start:
        torch.testing.assert_close(start[k], (steps[0][k] + steps[1][k]) / 2, msg=k)
    assert any(not torch.equal(start[k], steps[-1][k]) for k in start)


@pytest.mark.multirank
def test_retriever_warmup_keeps_ranks_identical(tiny_world, tmp_path):
    """Two gloo ranks draw different batches; the warm-up's hand-made gradient average (and DDP
    afterwards) must leave every rank with the same retriever."""
    from tests.distributed import run_ranks

    (p0, out0), (p1, _) = run_ranks(
        _train_rank, 2, tiny_overrides(tiny_world, tmp_path / "run", *WARMUP), timeout_s=300
    )
    assert out0["world_size"] == 2
    assert all(np.array_equal(p0[n], p1[n]) for n in p0)


def test_closed_book_needs_no_corpus_and_custom_data_gets_the_converter_hint(tmp_path, tiny_world):
    # retriever=none with data.corpus=null: no memory is read, and training runs
    over = tiny_overrides(
        tiny_world,
        tmp_path / "run",
        "retriever=none",
        "data.corpus=null",
        "max_steps=2",
        "ckpt_every=2",
    )
    res = run_module(["-m", "rag_mm.train", *over])
    assert res.returncode == 0, res.stderr[-2000:]
    # a retriever that reads documents cannot run without them: named before any work
    res = run_module(
        [
            "-m",
            "rag_mm.train",
            *tiny_overrides(tiny_world, tmp_path / "r2", "retriever=oracle", "data.corpus=null"),
        ]
    )
    assert (
        res.returncode == 2
        and "data.corpus is needed" in res.stderr
        and "Traceback" not in res.stderr
    )
    # custom data whose shards are missing: the hint names the converter, not the demo world
    res = run_module(
        [
            "-m",
            "rag_mm.train",
            "+experiment=vqa",
            f"run_dir={tmp_path}/r3",
            f"data.root={tmp_path}/nowhere",
        ]
    )
    assert res.returncode == 2 and "data.train" in res.stderr and "scripts/convert.py" in res.stderr
    assert "knowledge_world" not in res.stderr and "data.corpus" not in res.stderr


def test_rerank_reads_the_live_towers_top_k(tiny_world, tmp_path):
    """Between refreshes the index holds the embeddings of the last one. Over-retrieving the whole
    memory and reranking with the document tower as it is now gives the live towers' exact top-k;
    the index alone gives the stale one."""
    cfg = compose(
        tiny_overrides(
            tiny_world,
            tmp_path / "run",
            "retriever=learned",
            "retriever.top_k=2",
            "retriever.embed_dim=16",
            "retriever.rerank=24",
        )
    )
    t = Trainer(cfg)
    try:
        t.refresh.ensure(0)
        t.rag.eval()
        with torch.no_grad():  # the towers move on; the index keeps their old embeddings
            torch.manual_seed(0)
            for p in t.rag.retriever.parameters():
                p.add_(torch.randn_like(p) * 0.5)
        g = torch.Generator().manual_seed(0)
        B, size = 16, cfg.model.image_size
        q = dict(
            image=torch.rand(B, 3, size, size, generator=g),
            q_ids=torch.randint(1, 1000, (B, 4), generator=g),
            q_len=torch.full((B,), 4),
            a_ids=torch.full((B, 1), 49407),
            a_len=torch.ones(B, dtype=torch.long),
        )
        _, ids, (q_emb, *_) = t.rag.reader_inputs(q, grad=False)
        live = t.memory.embed()  # (N, E) every document by the live tower
        exact = torch.from_numpy(t.memory.doc_ids)[(q_emb @ live.T).topk(2).indices]  # (B, 2)
        assert torch.equal(ids[:, :2], exact)
        t.rag.rcfg.rerank = 0
        _, stale, _ = t.rag.reader_inputs(q, grad=False)
        # the test can tell a stale top-k from a live one
        assert not torch.equal(stale[:, :2], exact)
    finally:
        t.close()
