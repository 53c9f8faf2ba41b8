"""Fault tolerance of the real job: SIGKILL + torchrun restarts, SIGTERM, damaged checkpoints,
non-finite losses, stuck ranks.

Kill points are injected with ``RAG_MM_FAULT`` (rag_mm/ft/faults.py): a real SIGKILL of one rank
process at an exact step, or inside a checkpoint save. The default suite draws one point with a
seeded generator (RAG_MM_TEST_KILL_SEED picks another draw, RAG_MM_TEST_KILL names a point to
replay); the slow suite walks through all of them.
"""

from __future__ import annotations

import json
import logging
import os
import random
import signal
import subprocess
import sys
import time

import pytest
import torch

from rag_mm import trainer as trainer_mod
from rag_mm.components import checkpoint
from rag_mm.config import compose
from rag_mm.trainer import Trainer
from tests.ops.helpers import (
    REPO,
    assert_same_params,
    env,
    final_state,
    torchrun,
    train_losses,
    valid_checkpoints,
)
from tests.rag_mm.conftest import tiny_overrides

# Every place a rank can die: as it begins step k (1..7 of 8) or inside the save of checkpoint k
# (after its DCP shard is written, before the manifest), on either rank.
STEP_KILLS = [f"kill:step={k}:rank={r}" for k in range(1, 8) for r in (0, 1)]
SAVE_KILLS = [f"kill:save={k}:rank={r}" for k in (2, 4, 6) for r in (0, 1)]
CKPT_EVERY = 2  # tests.ops.helpers.FT_ARGS


def _resume_step(fault: str) -> int:
    """The step the restarted group must resume from: the newest checkpoint complete at the kill
    (0: none yet, it starts over). ``step=k`` fires with k steps done, after checkpoint k if k is
    a checkpoint step; ``save=k`` dies inside checkpoint k, so k - 2 is the newest complete one."""
    point, k = fault.split(":")[1].split("=")
    k = int(k)
    return (k // CKPT_EVERY) * CKPT_EVERY if point == "step" else k - CKPT_EVERY


def _check_killed_run_matches(tiny_world, run_dir, fault: str, reference) -> None:
    res = torchrun(tiny_world, run_dir, launcher=("--standalone", "--max-restarts=1"), fault=fault)
    where = f"[{fault}] (replay with RAG_MM_TEST_KILL='{fault}')"
    assert res.returncode == 0, f"{where}\n{res.stderr[-4000:]}"
    assert f"fault injection: kill rank {fault.rsplit('=', 1)[1]}" in res.stderr, (
        f"{where}: the fault did not fire"
    )
    assert res.stderr.count("rank 0/2 joined") == 2, f"{where}: the worker group was not restarted"
    resume_at = _resume_step(fault)
    if resume_at:  # the restart loaded the newest complete checkpoint rather than starting over
        assert f"step_{resume_at:08d} at step {resume_at}" in res.stderr, (
            f"{where}: did not resume from step {resume_at}"
        )
    else:
        assert "starting fresh" in res.stderr, (
            f"{where}: no checkpoint was complete, yet it did not start over"
        )
    step, params = final_state(tiny_world, run_dir)
    assert step == 8, where
    ref_params, ref_losses = reference
    assert_same_params(params, ref_params, where)
    assert train_losses(run_dir) == ref_losses, (
        f"{where}: per-step losses differ (data order not replayed exactly?)"
    )
    assert json.loads((run_dir / "metrics.json").read_text())["step"] == 8
    assert not list((run_dir / "checkpoints").glob("*.tmp")), (
        f"{where}: an unfinished save was left behind"
    )


@pytest.mark.multirank
def test_sigkill_one_rank_at_a_random_point_restart_matches_uninterrupted(
    tiny_world, tmp_path, reference
):
    """torchrun --max-restarts=1 brings the group back; resume=auto from the newest complete
    checkpoint; same final parameters. Drawn among the points with a checkpoint to resume from."""
    seed = int(os.environ.get("RAG_MM_TEST_KILL_SEED", "0"))
    resumable = [f for f in STEP_KILLS + SAVE_KILLS if _resume_step(f)]
    fault = os.environ.get("RAG_MM_TEST_KILL") or random.Random(seed).choice(resumable)
    print(f"kill point: {fault} (RAG_MM_TEST_KILL_SEED={seed})")
    _check_killed_run_matches(tiny_world, tmp_path / "run", fault, reference)


@pytest.mark.multirank
@pytest.mark.slow
@pytest.mark.parametrize("fault", STEP_KILLS + SAVE_KILLS)
def test_sigkill_every_point_restart_matches_uninterrupted(tiny_world, tmp_path, reference, fault):
    _check_killed_run_matches(tiny_world, tmp_path / "run", fault, reference)


def test_sigterm_checkpoints_exits_cleanly_and_resumes(tiny_world, tmp_path):
    """A real SIGTERM mid-training to every process of the job (as SLURM and container runtimes
    send it; a DataLoader worker included): exit 0, a valid checkpoint at the stop step."""
    run_dir = tmp_path / "run"
    args = [
        sys.executable,
        "-m",
        "rag_mm.train",
        *tiny_overrides(
            tiny_world,
            run_dir,
            "max_steps=500",
            "log_every=1",
            "ckpt_every=0",
            "deterministic=true",
            "data.num_workers=1",
        ),
    ]
    err_path = tmp_path / "stderr.txt"
    with open(err_path, "w") as err:
        proc = subprocess.Popen(
            args,
            cwd=REPO,
            env=env(),
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
            start_new_session=True,
        )
        metrics = run_dir / "metrics.jsonl"
        deadline = time.monotonic() + 300
        while not (metrics.is_file() and len(metrics.read_text().splitlines()) >= 2):
            assert proc.poll() is None, err_path.read_text()[-3000:]
            assert time.monotonic() < deadline, "training never started"
            time.sleep(0.05)
        os.killpg(proc.pid, signal.SIGTERM)
        out, _ = proc.communicate(timeout=300)
    stderr = err_path.read_text()
    assert proc.returncode == 0, stderr[-3000:]
    assert "received signal 15" in stderr
    stopped = json.loads(out[out.index("{") :])["stopped_at"]
    assert 2 <= stopped < 500
    ckpts = valid_checkpoints(run_dir)
    assert ckpts and ckpts[-1].name == f"step_{stopped:08d}"
    assert not (run_dir / "metrics.json").exists()  # stopped, not finished
    resume = [
        sys.executable,
        "-m",
        "rag_mm.train",
        *tiny_overrides(
            tiny_world,
            run_dir,
            f"max_steps={stopped + 2}",
            "log_every=1",
            "ckpt_every=0",
            "deterministic=true",
        ),
    ]
    res = subprocess.run(resume, cwd=REPO, env=env(), capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    assert f"at step {stopped}" in res.stderr and "resumed from" in res.stderr
    assert json.loads((run_dir / "metrics.json").read_text())["step"] == stopped + 2


def _fit(root, run_dir, *extra) -> Trainer:
    t = Trainer(compose(tiny_overrides(root, run_dir, "deterministic=true", *extra)))
    try:
        t.restore()
        t.fit()
    finally:
        t.close()
    return t


def test_truncated_newest_checkpoint_is_skipped_for_the_previous_one(tiny_world, tmp_path, caplog):
    run_dir = tmp_path / "run"
    full = {
        k: v.clone()
        for k, v in _fit(tiny_world, run_dir, "max_steps=6", "ckpt_every=3")
        .model.state_dict()
        .items()
    }
    newest = run_dir / "checkpoints" / "step_00000006"
    shard = max(
        (p for p in newest.iterdir() if p.suffix == ".distcp"), key=lambda p: p.stat().st_size
    )
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])  # a write cut short
    with caplog.at_level(logging.WARNING, logger="rag_mm.components.checkpoint"):
        assert (
            checkpoint.latest_valid(run_dir / "checkpoints")
            == run_dir / "checkpoints" / "step_00000003"
        )
    assert "skipping damaged checkpoint" in caplog.text and "truncated" in caplog.text
    with pytest.raises(
        RuntimeError, match="failed verification"
    ):  # an explicit path is refused too
        checkpoint.load(newest, {})
    resumed = _fit(tiny_world, run_dir, "max_steps=6", "ckpt_every=3")  # resume=auto: from step 3
    assert resumed.step == 6
    assert_same_params(resumed.model.state_dict(), full, "resumed past a truncated checkpoint")


def test_nonfinite_losses_skip_the_step_then_abort(tiny_world, tmp_path, caplog):
    def poisoned(t: Trainer, calls: set[int] | None):
        forward, n = t.model.forward, [0]  # the reader: its loss turned NaN

        def fwd(*a, **k):
            out = forward(*a, **k)
            if t.model.training and (calls is None or n[0] in calls):
                out.loss = out.loss * float("nan")
            n[0] += t.model.training
            return out

        t.model.forward = fwd

    t = Trainer(compose(tiny_overrides(tiny_world, tmp_path / "a", "max_steps=4", "ckpt_every=0")))
    poisoned(t, {1, 2})
    with caplog.at_level(logging.WARNING, logger="rag_mm.trainer"):
        out = t.fit()
    t.close()
    assert out["step"] == 4 and caplog.text.count("non-finite loss or gradient") == 2
    assert all(torch.isfinite(p).all() for p in t.model.parameters())

    t = Trainer(compose(tiny_overrides(tiny_world, tmp_path / "b", "max_steps=40", "ckpt_every=0")))
    poisoned(t, None)
    with pytest.raises(FloatingPointError, match="consecutive non-finite steps"):
        t.fit()
    t.close()
    assert t.step == 0 and t.consumed == trainer_mod.MAX_NONFINITE_STEPS + 1


@pytest.mark.multirank
def test_collective_timeout_names_the_stuck_rank_and_operation(tiny_world, tmp_path):
    """Rank 1 hangs at step 2; rank 0's gradient all_reduce times out; the error says who and
    where."""
    res = torchrun(
        tiny_world, tmp_path / "run", "launch.timeout_s=15", fault="hang:step=2:rank=1", timeout=300
    )
    assert res.returncode != 0
    err = res.stderr
    assert "rank 0 failed in 'forward/backward (gradient reduction)' at step 2" in err, err[-4000:]
    assert "stuck rank(s): 1" in err
    # what rank 1 last did: step 2's checkpoint save (ckpt_every=2), then it hung
    assert (
        "rank 1: step 2, in 'checkpoint save (DCP write + barriers)'" in err and "<- behind" in err
    )
    # and the watchdog said so before the timeout fired
    assert "rank 0 has waited" in err
