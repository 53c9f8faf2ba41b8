"""Launching the same job on several "nodes" (torchrun c10d rendezvous on localhost) and through
Hydra's submitit launcher (the local executor: SLURM's code path without a cluster)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.distributed import free_port
from tests.ops.helpers import FT_ARGS, REPO, assert_same_params, env, final_state, valid_checkpoints
from tests.rag_mm.conftest import tiny_overrides


def _listens(pid: int, port: int) -> bool:
    """Whether process `pid` holds a socket listening on TCP `port` (Linux /proc)."""
    sockets = set()
    for table in (Path("/proc/net/tcp"), Path("/proc/net/tcp6")):
        if table.exists():
            for line in table.read_text().splitlines()[1:]:
                f = line.split()
                if int(f[1].rsplit(":", 1)[1], 16) == port and f[3] == "0A":  # 0A: LISTEN
                    sockets.add(f"socket:[{f[9]}]")  # f[9]: the socket's inode
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:  # the process has gone
        return False
    for fd in fds:
        try:
            if os.readlink(f"/proc/{pid}/fd/{fd}") in sockets:
                return True
        except OSError:
            continue
    return False


def _start_node(root, run_dir, tmp_path, tag: str, node: int, port: int, fault: str):
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
        # who hosts the rendezvous store, said rather than found by binding first
        f"--rdzv_conf=is_host={int(node == 0)}",
        "-m",
        "rag_mm.train",
        *tiny_overrides(root, run_dir, *FT_ARGS),
    ]
    log = open(tmp_path / f"{tag}-node{node}.err", "w+")
    proc = subprocess.Popen(
        cmd,
        cwd=REPO,
        env=env(**({"RAG_MM_FAULT": fault} if fault else {})),
        stdout=subprocess.DEVNULL,
        stderr=log,
    )
    return proc, log


def _two_nodes(root, run_dir, tmp_path, tag: str, fault: str = "") -> list[tuple[int, str]]:
    """Two torchrun agents, one process each, meeting through c10d rendezvous on 127.0.0.1.

    Node 0's agent hosts the store and starts first; node 1 starts once node 0 listens on the
    port. The port comes from `free_port()`, so another test's process may take it before node 0
    binds it: then node 0 stops at once and the pair starts again on a new port, where node 1
    would otherwise join the other process's store and fail when that process ends."""
    for attempt in range(3):
        port = free_port()
        node0, log0 = _start_node(root, run_dir, tmp_path, tag, 0, port, fault)
        deadline = time.monotonic() + 120
        while node0.poll() is None and not _listens(node0.pid, port):
            if time.monotonic() > deadline:
                node0.kill()
                pytest.fail("node 0 never listened on its rendezvous port")
            time.sleep(0.2)
        if node0.poll() is None:
            break
        log0.seek(0)
        err = log0.read()
        log0.close()
        if "RendezvousConnectionError" not in err or attempt == 2:
            return [(node0.returncode, err), (-1, "not started: node 0 ended first")]
    procs = [(node0, log0), _start_node(root, run_dir, tmp_path, tag, 1, port, fault)]
    out = []
    for p, log in procs:
        try:
            p.wait(timeout=600)
        finally:
            if p.poll() is None:
                p.kill()
        log.seek(0)
        out.append((p.returncode, log.read()))
        log.close()
    return out


def _logs(nodes: list[tuple[int, str]]) -> str:
    """Both nodes' exit codes and log tails: a node's failure often shows first on the other."""
    return "\n".join(f"node {n} (exit {rc}):\n{err[-3000:]}" for n, (rc, err) in enumerate(nodes))


@pytest.mark.multirank
def test_two_nodes_on_localhost_stop_together_on_sigterm_and_resume(
    tiny_world, tmp_path, reference
):
    """Node 1's rank gets SIGTERM at step 3: both nodes stop after step 4, checkpoint, exit 0.
    Relaunched, the two-node job resumes and ends with the parameters of an uninterrupted run."""
    run_dir = tmp_path / "run"
    first = _two_nodes(tiny_world, run_dir, tmp_path, "first", fault="term:step=3:rank=1")
    assert [rc for rc, _ in first] == [0, 0], _logs(first)
    err = first[0][1] + first[1][1]
    assert "fault injection: term rank 1 at step=3" in err and "received signal 15" in err
    assert "rank 0 | WARNING | rag_mm.trainer | stopping at step 4 (signal)" in err  # rank 0 agreed
    assert [p.name for p in valid_checkpoints(run_dir)][-1] == "step_00000004"
    assert not (run_dir / "metrics.json").exists()

    second = _two_nodes(tiny_world, run_dir, tmp_path, "second")
    assert [rc for rc, _ in second] == [0, 0], _logs(second)
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
