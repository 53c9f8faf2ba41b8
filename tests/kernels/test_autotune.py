"""``auto`` chosen by measurement (parallel/kernels/autotune.py): the fastest correct candidate
wins, the choice is cached on disk per key (thread count included) and reused by the next process,
``RAG_MM_ATTN_AUTOTUNE=0`` keeps the fixed rule, nothing is timed on fake tensors or under
compilation, and under torch.distributed every rank runs rank 0's choice.

Small shapes (S 64, head size 64): a key measures in tens of milliseconds.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from parallel.kernels import _attention_ops, _build
from parallel.kernels import attention as A
from parallel.kernels import autotune as T

ROOT = Path(__file__).resolve().parents[2]


def _need_fused():
    ok, why = A.fused_available()
    if not ok:
        if _build.compiler_available()[0] and _attention_ops.DISABLE_ENV not in os.environ:
            pytest.fail(f"compiler present but the attention extension did not build: {why}")
        pytest.skip(f"fused attention unavailable: {why}")


@pytest.fixture
def tuner(tmp_path, monkeypatch):
    """A fresh tuner with its cache in tmp_path; the kernel ISA restored afterwards."""
    _need_fused()
    monkeypatch.setenv(T.CACHE_ENV, str(tmp_path / "autotune.json"))
    monkeypatch.delenv(T.ENV, raising=False)
    T.reset()
    before = torch.ops.rag_attn.cpu_isa()
    torch.set_num_threads(1)
    yield tmp_path / "autotune.json"
    T.reset()
    torch.ops.rag_attn.cpu_set_isa(before)


def _q(S=64, D=64):
    return torch.randn(1, 2, S, D)


_REAL_CANDIDATES = T.candidates


def _burn(seconds: float = 0.01) -> None:
    """Busy for ``seconds`` of CPU time (a sleep would not count: one thread is timed by CPU
    time)."""
    t = time.thread_time()
    while time.thread_time() - t < seconds:
        pass


def _only(monkeypatch, keep, slow=None, wrong=None):
    """Restrict the candidates to ``keep``; ``slow`` burns 10 ms per call, ``wrong`` returns zeros
    at once (the fastest candidate, and a wrong one)."""
    real = _REAL_CANDIDATES

    def fake(names, call):
        cands = {n: f for n, f in real(names, call).items() if n in keep}
        if slow in cands:
            f = cands[slow]
            cands[slow] = lambda f=f: (_burn(), f())[1]
        if wrong in cands:
            shapes = [t.shape for t in cands[wrong]()]
            cands[wrong] = lambda: [torch.zeros(s) for s in shapes]
        return cands

    monkeypatch.setattr(T, "candidates", fake)


def test_picks_the_faster_candidate(tuner, monkeypatch):
    pair = ("sdpa", "fused:generic")
    for slow in pair:
        T.reset()
        tuner.unlink(missing_ok=True)
        _only(monkeypatch, pair, slow=slow)
        choice, reason = A.select_backend("auto", _q(), "dense")
        assert choice == next(n for n in pair if n != slow), reason
        assert "measured fastest" in reason and T.stats["measured"] == 1


def test_wrong_candidate_is_never_chosen(tuner, monkeypatch):
    _only(monkeypatch, ("sdpa", "fused:generic"), wrong="fused:generic")
    choice, _ = A.select_backend("auto", _q(), "causal")
    assert choice == "sdpa"
    rec = json.loads(tuner.read_text())
    (section,) = rec["machines"].values()
    (entry,) = section["choices"].values()
    assert "fused:generic" in entry["rejected"] and "fused:generic" not in entry["ms"]


def test_close_candidates_get_a_run_off(monkeypatch):
    """Two kernels a few percent apart are ranked by more calls than the first rounds: ``late``
    runs 2.15 ms in its check call and first MIN_REPS timed calls (a busy neighbour, a cold cache)
    and 1.9 ms after, ``steady`` always 2.0 ms; the first rounds alone would pick ``steady``. A
    candidate twice as slow is not timed past the first rounds."""
    monkeypatch.setattr(T, "BUDGET_S", 0.0)  # the first phase: exactly MIN_REPS rounds
    ref = [torch.zeros(1)]
    calls = {"steady": 0, "late": 0, "slow": 0}

    def cand(name, ms):
        def run():
            calls[name] += 1
            _burn(ms(calls[name]) / 1e3)
            return ref

        return run

    cands = {
        "steady": cand("steady", lambda n: 2.0),
        "late": cand("late", lambda n: 2.15 if n <= 1 + T.MIN_REPS else 1.9),
        "slow": cand("slow", lambda n: 4.0),
    }
    key = T.Key("fwd", "dense", "float32", 64, 64, 1, "cpu")
    rec = T.measure(key, cands, ref, 1e-3)
    assert rec["choice"] == "late", rec
    assert calls["slow"] == 1 + T.MIN_REPS  # check call + the first rounds only
    assert calls["late"] >= 1 + T.MIN_REPS + T.RUNOFF_MIN_REPS


def test_fused_isa_choice_matches_reference_and_restores_isa(tuner):
    """A measured ``fused:<isa>`` choice runs forward and backward at that ISA and restores the
    process ISA afterwards."""
    q, k, v = (_q(70, 40).requires_grad_(True) for _ in range(3))
    key = A._tune_key(q, "causal", True)
    T.pin(
        {key.shape_id(): {"choice": "fused:generic", "ms": {"fused:generic": 1.0}, "rejected": {}}}
    )
    before = torch.ops.rag_attn.cpu_isa()
    assert A.select_backend("auto", q, "causal", grad=True)[0] == "fused:generic"
    out = A.attention(q, k, v, causal=True)
    grads = torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
    ref_in = [t.detach().double().requires_grad_(True) for t in (q, k, v)]
    ref = A.reference_attention(*ref_in, causal=True)
    ref_grads = torch.autograd.grad(ref, ref_in, torch.ones_like(ref))
    for got, want in zip((out, *grads), (ref, *ref_grads)):
        torch.testing.assert_close(got.double(), want, atol=2e-5, rtol=1e-4)
    assert torch.ops.rag_attn.cpu_isa() == before


def test_cache_written_and_reused_by_the_next_process(tuner):
    choice, _ = A.select_backend("auto", _q(), "dense")
    assert T.stats["measured"] == 1
    data = json.loads(tuner.read_text())
    keys = [k for sec in data["machines"].values() for k in sec["choices"]]
    assert keys == ["fwd/dense/float32/d64/s64/t1/cpu"]
    assert [p.name for p in tuner.parent.iterdir()] == [tuner.name]  # atomic: no temporary left
    code = (
        "import torch; torch.set_num_threads(1)\n"
        "from parallel.kernels import attention as A, autotune as T\n"
        "c, _ = A.select_backend('auto', torch.randn(1, 2, 64, 64), 'dense')\n"
        "print(c, T.stats['measured'])\n"
    )
    env = dict(os.environ, PYTHONPATH=str(ROOT), **{T.CACHE_ENV: str(tuner)})
    res = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300, cwd=ROOT
    )
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.split() == [choice, "0"], res.stdout  # same choice, nothing measured


def test_key_separates_thread_counts(tuner):
    A.select_backend("auto", _q(), "dense")
    torch.set_num_threads(2)
    A.select_backend("auto", _q(), "dense")
    assert T.stats["measured"] == 2
    torch.set_num_threads(1)
    A.select_backend("auto", _q(), "dense")
    assert T.stats["measured"] == 2  # t1 is cached
    data = json.loads(tuner.read_text())
    keys = sorted(k for sec in data["machines"].values() for k in sec["choices"])
    assert keys == ["fwd/dense/float32/d64/s64/t1/cpu", "fwd/dense/float32/d64/s64/t2/cpu"]


def test_key_separates_op_layout_and_length_bucket():
    k = lambda S, lay="dense", grad=False: str(A._tune_key(torch.empty(1, 1, S, 64), lay, grad))  # noqa: E731
    assert k(100) == k(128) != k(129)
    assert k(100) != k(100, "causal") and k(100) != k(100, grad=True)


def test_env_switch_keeps_the_fixed_rule(tuner, monkeypatch):
    monkeypatch.setenv(T.ENV, "0")
    q = _q()
    assert A.select_backend("auto", q, "dense") == A._cpu_fixed_rule(q, "dense")
    assert T.stats["measured"] == 0 and not tuner.exists()


def test_nothing_timed_on_fake_tensors_or_while_compiling(tuner, monkeypatch):
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        fake = torch.empty(1, 2, 64, 64)
        choice, reason = A.select_backend("auto", fake, "dense")
    assert choice == A._cpu_fixed_rule(fake, "dense")[0] and "not measured" in reason
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    choice, reason = A.select_backend("auto", _q(), "causal")
    assert "not measured: inside torch.compile" in reason
    assert T.stats["measured"] == 0 and not tuner.exists()


def test_nothing_timed_under_a_flop_counter(tuner):
    """A FLOP counter around a step saw every tuning call as the step's own work (a 2.8x
    overcount on the demo reader) and cached a choice timed under its Python dispatch."""
    from torch.utils.flop_counter import FlopCounterMode

    q = _q().requires_grad_()
    with FlopCounterMode(display=False) as fc:
        choice, reason = A.select_backend("auto", q, "retrieval", grad=True)
    assert "not measured: inside a dispatch mode (" in reason, reason
    assert "FlopCounterMode" in reason, reason
    assert choice == A._cpu_fixed_rule(q, "retrieval")[0]
    assert fc.get_total_flops() == 0 and T.stats["measured"] == 0 and not tuner.exists()
    assert A.select_backend("auto", q, "retrieval", grad=True)[1].startswith("measured fastest")


def test_tuning_inside_a_checkpointed_block_keeps_to_itself(tuner):
    """The first ``auto`` call of a key can come inside an activation-checkpointed block: the
    candidates' backwards must not reach the block's saved-tensor hooks (each would recompute the
    block; on CUDA the recompute runs on the autograd device thread and waits on the tuner's lock).
    The block runs twice (forward, one recompute), the step ends, the gradient is the plain one."""
    from torch.utils.checkpoint import checkpoint

    calls = [0]

    def block(q):
        calls[0] += 1
        return A.attention(q, q, q, causal=True, backend="auto").sum()

    q = _q().requires_grad_()
    done = {}

    def step():
        loss = checkpoint(block, q, use_reentrant=False)
        loss.backward()
        done["grad"] = q.grad.clone()

    import threading

    t = threading.Thread(target=step, daemon=True)
    t.start()
    t.join(timeout=120)
    assert not t.is_alive(), "the checkpointed step with a first tuning call did not finish"
    assert T.stats["measured"] == 1 and calls[0] == 2, (T.stats, calls)
    q2 = q.detach().requires_grad_()
    A.attention(q2, q2, q2, causal=True, backend="reference").sum().backward()
    torch.testing.assert_close(done["grad"], q2.grad, rtol=1e-4, atol=1e-4)


def test_unwritable_cache_keeps_the_choice_in_memory(tuner, monkeypatch, tmp_path, caplog):
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv(T.CACHE_ENV, str(blocker / "autotune.json"))  # a directory that cannot exist
    first = A.select_backend("auto", _q(), "dense")[0]
    assert A.select_backend("auto", _q(), "dense")[0] == first and T.stats["measured"] == 1
    assert any("cannot write" in r.getMessage() for r in caplog.records)


# ----------------------------------------------------------------------------- torch.distributed
def _ranks_use_rank0_choice(rank, world, cache_dir):
    """Rank 0 makes sdpa slow, rank 1 makes the fused kernel slow: measured alone they would
    disagree; after ``autotune`` both run rank 0's choice (the fused kernel)."""
    os.environ[T.CACHE_ENV] = os.path.join(cache_dir, f"rank{rank}.json")
    pair = ("sdpa", "fused:generic")
    real = T.candidates

    def fake(names, call):
        cands = {n: f for n, f in real(names, call).items() if n in pair}
        f = cands[pair[rank]]
        cands[pair[rank]] = lambda: (_burn(), f())[1]
        return cands

    T.candidates = fake
    # the same on both ranks
    q = torch.randn(1, 2, 64, 64, generator=torch.Generator().manual_seed(0))
    before = A.select_backend("auto", q, "dense")  # no lazy timing under torch.distributed
    chosen = A.autotune([A.TuneSpec("dense", 64, 64, grad=False)])
    after = A.select_backend("auto", q, "dense")
    out = A.attention(q, q, q)
    return before, chosen, after, T.stats["measured"], out


@pytest.mark.multirank
def test_every_rank_runs_rank0_choice(tmp_path):
    _need_fused()
    from tests.distributed import run_ranks

    res = run_ranks(_ranks_use_rank0_choice, 2, str(tmp_path), timeout_s=240)
    for rank, (before, chosen, after, measured, _) in enumerate(res):
        assert "not measured: torch.distributed" in before[1]
        assert chosen == {"fwd/dense/float32/d64/s64/cpu": "fused:generic"}, (rank, chosen)
        assert after[0] == "fused:generic", (rank, after)
        assert measured == (1 if rank == 0 else 0)
    torch.testing.assert_close(res[0][4], res[1][4], atol=0, rtol=0)  # the same kernel, bit for bit
