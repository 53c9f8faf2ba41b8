"""How a process joins its group (rag_mm.distributed.env), checked without a GPU by recording the
call that would be made."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from rag_mm.distributed import env


@pytest.fixture
def recorded(monkeypatch):
    calls = []
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(
        dist, "init_process_group", lambda backend, **kw: calls.append((backend, kw))
    )
    monkeypatch.setattr(torch.cuda, "set_device", lambda i: None)
    return calls


def test_nccl_group_carries_gloo_for_host_tensors(recorded):
    """Under NCCL the group also has a gloo backend: the stop flag, counts and object broadcasts
    are host tensors, which NCCL alone refuses ("No backend type associated with device type
    cpu")."""
    e = env.init_distributed(device="cuda", backend="nccl", timeout_s=30)
    ((backend, kw),) = recorded
    assert backend == "cpu:gloo,cuda:nccl"
    assert kw["device_id"] == torch.device("cuda", 0) and e.device == torch.device("cuda", 0)


def test_gloo_group_stays_plain(recorded):
    env.init_distributed(device="cpu", backend="gloo", timeout_s=30)
    ((backend, kw),) = recorded
    assert backend == "gloo" and kw["device_id"] is None
