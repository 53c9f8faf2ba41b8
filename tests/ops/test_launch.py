"""Launching the same job on several "nodes" (torchrun c10d rendezvous on localhost) and through
Hydra's submitit launcher (the local executor: SLURM's code path without a cluster)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.distributed import free_port
from tests.ops.helpers import FT_ARGS, REPO, assert_same_params, env, final_state, valid_checkpoints
from tests.rag_mm.conftest import tiny_overrides


def _two_nodes(root, run_dir, tmp_path, tag: str, fault: str = "") -> list[tuple[int, str]]:
    """Two torchrun agents, one process each, meeting through c10d rendezvous on 127.0.0.1."""
    port = free_port()
    procs, logs = [], []
    for node in (0, 1):
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nnodes=2",
            f"--node_rank={node}",
            "--nproc_per_node=1",
            "--rdzv_backend=c10d",
            f"--rdzv_endpoint=127.0.0.1:{port}",
            f"--rdzv_id=rag_mm-{tag}",
            "-m",
            "rag_mm.train",
            *tiny_overrides(root, run_dir, *FT_ARGS),
        ]
        log = open(tmp_path / f"{tag}-node{node}.err", "w+")
        procs.append(
            subprocess.Popen(
                cmd,
                cwd=REPO,
                env=env(**({"RAG_MM_FAULT": fault} if fault else {})),
                stdout=subprocess.DEVNULL,
                stderr=log,
            )
        )
        logs.append(log)
    out = []
    for p, log in zip(procs, logs):
        try:
            p.wait(timeout=600)
        finally:
            if p.poll() is None:
                p.kill()
        log.seek(0)
        out.append((p.returncode, log.read()))
        log.close()
    return out


@pytest.mark.multirank
def test_two_nodes_on_localhost_stop_together_on_sigterm_and_resume(
    tiny_world, tmp_path, reference
):
    """Node 1's rank gets SIGTERM at step 3: both nodes stop after step 4, checkpoint, exit 0.
    Relaunched, the two-node job resumes and ends with the parameters of an uninterrupted run."""
    run_dir = tmp_path / "run"
    first = _two_nodes(tiny_world, run_dir, tmp_path, "first", fault="term:step=3:rank=1")
    for node, (rc, err) in enumerate(first):
        assert rc == 0, f"node {node}:\n{err[-3000:]}"
    err = first[0][1] + first[1][1]
    assert "fault injection: term rank 1 at step=3" in err and "received signal 15" in err
    assert "rank 0 | WARNING | rag_mm.trainer | stopping at step 4 (signal)" in err  # rank 0 agreed
    assert [p.name for p in valid_checkpoints(run_dir)][-1] == "step_00000004"
    assert not (run_dir / "metrics.json").exists()

    second = _two_nodes(tiny_world, run_dir, tmp_path, "second")
    for node, (rc, err) in enumerate(second):
        assert rc == 0, f"node {node}:\n{err[-3000:]}"
    assert "resumed from" in second[0][1] + second[1][1]
    summary = json.loads((run_dir / "metrics.json").read_text())
    assert summary["world_size"] == 2 and summary["step"] == 8
    step, params = final_state(tiny_world, run_dir)
    assert step == 8
    assert_same_params(params, reference[0], "two nodes, stopped by SIGTERM and resumed")


@pytest.mark.multirank
def test_submitit_local_launcher_two_tasks(tiny_world, tmp_path):
    """`--multirun hydra/launcher=local`: submitit starts 2 tasks, which become 2 gloo ranks."""
    run_dir, sweep = tmp_path / "run", tmp_path / "sweep"
    cmd = [
        sys.executable,
        "-m",
        "rag_mm.train",
        "--multirun",
        "hydra/launcher=local",
        "hydra.launcher.tasks_per_node=2",
        f"hydra.sweep.dir={sweep}",
        *tiny_overrides(tiny_world, run_dir, "max_steps=4", "ckpt_every=2"),
    ]
    res = subprocess.run(
        cmd,
        cwd=REPO,
        env=env(RAG_MM_MASTER_PORT=str(free_port())),
        capture_output=True,
        text=True,
        timeout=600,
    )
    logs = "\n".join(p.read_text() for p in sweep.glob(".submitit/*/*.err"))
    assert res.returncode == 0, res.stderr[-3000:] + logs[-3000:]
    assert "Submitit 'local' sweep output dir" in res.stderr + res.stdout
    summary = json.loads((run_dir / "metrics.json").read_text())
    assert summary["world_size"] == 2 and summary["step"] == 4
    # the two submitit tasks formed one group
    assert "rank 0/2 joined the gloo process group" in logs
    assert [p.name for p in valid_checkpoints(run_dir)][-1] == "step_00000004"
