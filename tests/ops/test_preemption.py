"""SIGTERM at any point of a run ends it within one step or one batch (of an evaluation, an index
refresh, the retriever warm-up), plus the checkpoint: exit 0, a valid checkpoint of the last
completed step, and resume=auto goes on (the final evaluation included). The process signals
itself at the phase (``RAG_MM_FAULT=term:<phase>=<step>``); SIGTERM mid-training from outside is
``tests/ops/test_fault_tolerance.py::test_sigterm_checkpoints_exits_cleanly_and_resumes``."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from datetime import datetime

import pytest

from tests.ops.helpers import REPO, env, valid_checkpoints
from tests.rag_mm.conftest import tiny_overrides

# signal to exit: one batch and a checkpoint of the tiny model, with room for a loaded host
BOUND_S = 30.0
# 24 documents: 6 forward passes per refresh
LEARNED = (
    "retriever=learned",
    "retriever.top_k=2",
    "retriever.embed_dim=16",
    "retriever.shared_towers=true",
    "retriever.vision_tower=resnet",
    "retriever.vision_width=16",
    "retriever.vision_layers=1",
    "retriever.fusion=image",
    "retriever.bank_negatives=8",
    "retriever.pseudo_queries=4",
    "retriever.encode_batch_size=4",
)
# phase -> (fault, overrides, the log line that says where it stopped, the step checkpointed or
# None)
PHASES = {
    "warmup": (
        "term:warmup=1",
        (*LEARNED, "retriever.warmup_steps=3"),
        "the retriever warm-up stopped after step 1 of 3",
        None,
    ),
    "refresh": (
        "term:refresh=2",
        (*LEARNED, "retriever.refresh_every=2"),
        "index refresh at step 2 stopped after 1 of its 6 passes",
        2,
    ),
    "eval": (
        "term:eval=2",
        ("eval_every=2",),
        "evaluation of val at step 2 stopped after 1 batch",
        2,
    ),
    "final_eval": ("term:eval=4", (), "evaluation of val at step 4 stopped after 1 batch", 4),
    "final_write": ("term:save=4", (), "the final evaluation was not run", 4),
}


def _run(
    root, run_dir, *extra: str, fault: str = "", nproc: int = 1
) -> tuple[subprocess.CompletedProcess, float]:
    """The run and the time it exited (epoch seconds)."""
    launcher = (
        ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
        if nproc > 1
        else []
    )
    args = [
        sys.executable,
        *launcher,
        "-m",
        "rag_mm.train",
        *tiny_overrides(
            root, run_dir, "max_steps=4", "ckpt_every=0", "data.eval_batch_size=4", *extra
        ),
    ]
    res = subprocess.run(
        args,
        cwd=REPO,
        env=env(**({"RAG_MM_FAULT": fault} if fault else {})),
        capture_output=True,
        text=True,
        timeout=600,
    )
    return res, time.time()


def _signal_time(stderr: str) -> float:
    """When the handler logged the signal (the log's own clock)."""
    line = next(x for x in stderr.splitlines() if "received signal 15" in x)
    return datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f").timestamp()


# an evaluation's and a refresh's stop on one process: the slow run; the default run stops in them
# on two ranks (the test below)
@pytest.mark.parametrize(
    "phase",
    # eval and refresh: the 2-rank test below; final_write: the default run kills ranks inside
    # checkpoint writes (test_fault_tolerance.py) and signals the final evaluation here
    [
        pytest.param(p, marks=pytest.mark.slow) if p in ("eval", "refresh", "final_write") else p
        for p in PHASES
    ],
)
def test_sigterm_in_each_phase_stops_within_a_batch_with_a_checkpoint(tiny_world, tmp_path, phase):
    fault, extra, where, saved = PHASES[phase]
    run_dir = tmp_path / "run"
    res, ended = _run(tiny_world, run_dir, *extra, fault=fault)
    assert res.returncode == 0, res.stderr[-3000:]
    assert where in res.stderr, res.stderr[-3000:]
    assert ended - _signal_time(res.stderr) < BOUND_S
    assert json.loads(res.stdout[res.stdout.index("{") :])["stopped_at"] == (saved or 0)
    ckpts = (
        [p.name for p in valid_checkpoints(run_dir)] if (run_dir / "checkpoints").is_dir() else []
    )
    assert ckpts == ([f"step_{saved:08d}"] if saved else [])
    assert not (run_dir / "metrics.json").exists()  # stopped, not finished
    records = (
        [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
        if saved
        else []
    )
    assert not [r for r in records if r["kind"] == "val"]  # an abandoned evaluation reports nothing
    # resume=auto: the rest of the run, the final evaluation included
    res, _ = _run(tiny_world, run_dir, *extra)
    assert res.returncode == 0, res.stderr[-3000:]
    assert (
        (f"resumed from {run_dir / 'checkpoints' / f'step_{saved:08d}'}" in res.stderr)
        if saved
        else True
    )
    assert json.loads((run_dir / "metrics.json").read_text())["step"] == 4


@pytest.mark.multirank
@pytest.mark.parametrize("phase", ["eval", "refresh"])
def test_sigterm_to_one_rank_stops_every_rank_after_the_same_batch(tiny_world, tmp_path, phase):
    """Rank 1 alone is signalled in an evaluation or an index refresh (whose passes are split over
    the ranks): both ranks leave it after the same batch, checkpoint and exit 0."""
    fault, extra, where, saved = PHASES[phase]
    run_dir = tmp_path / "run"
    res, _ = _run(tiny_world, run_dir, *extra, fault=f"{fault}:rank=1", nproc=2)
    assert res.returncode == 0, res.stderr[-3000:]
    assert where in res.stderr
    assert [p.name for p in valid_checkpoints(run_dir)] == [f"step_{saved:08d}"]
