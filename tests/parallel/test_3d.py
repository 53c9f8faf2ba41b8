"""3-D composition: pipeline x tensor parallel through ``parallel.parallelize`` on 4 gloo ranks
(pp=2 stages, each stage's part tensor-parallel over 2 ranks) against one process (fp32): the
step loss and every gradient, on GPT-2 (tied embeddings across the cut) and the rag_mm reader;
layouts that cannot work fail before training. (uniform partitions: the auto one follows
measured times, and may leave a stage with nothing to shard.)"""

from __future__ import annotations

import pytest
import torch

from tests.distributed import run_ranks
from tests.parallel import tp_cases

RTOL = 1e-4
CASES = [("gpt2", dict(pp=2, tp=2, partition="uniform")), ("reader", dict(pp=2, tp=2, partition="uniform"))]


@pytest.mark.multirank
def test_pp2_tp2_matches_one_process():
    res = run_ranks(tp_cases.pp_tp_suite, 4, CASES, timeout_s=300)
    assert sorted(next(iter(r.values()))["pp_rank"] for r in res) == [0, 0, 1, 1]
    for rank, per in enumerate(res):
        for case, r in per.items():
            for loss in r["losses"]:  # two steps: gradients accumulate like plain autograd after zero_grad
                assert abs(loss - r["ref"]) <= RTOL * abs(r["ref"]), (rank, case, r["losses"], r["ref"])
            assert r["n"] > 0 and r["err"] < RTOL, (rank, case, r["err"])
            assert r["dtensors"], f"rank {rank} {case}: nothing was tensor-parallel on this stage"
    for case, _ in CASES:  # the two tp ranks of a stage hold the same parameter names; stages split the model
        names = [{k: v["names"] for k, v in r.items() if k.startswith(case)} for r in res]
        assert names[0] == names[1] and names[2] == names[3] and names[0] != names[2]


def test_3d_layout_errors_before_training():
    from parallel import ParallelConfig
    from parallel.spmd import discover_tp_plan

    with pytest.raises(ValueError, match=r"pp\*dp_replicate\*dp_shard\*tp = 2\*1\*1\*2 = 4 does not match the world size 2"):
        ParallelConfig(pp=2, tp=2).validate(2)
    torch.manual_seed(0)
    model, inputs = tp_cases.factory("gpt2")
    with pytest.raises(ValueError, match=r"tp=3 does not divide the head count"):
        discover_tp_plan(model, ParallelConfig(pp=2, tp=3), inputs)
    with pytest.raises(NotImplementedError, match="sequence_parallel with pp > 1"):
        discover_tp_plan(model, ParallelConfig(pp=2, tp=2, sequence_parallel=True), inputs)
