"""``ParallelConfig`` checks a layout in one place (``problems`` / ``validate``) and then answers
the questions the runtime asks of it, as torchtitan's ``ParallelDims`` does."""

from __future__ import annotations

import pytest

from parallel.config import ParallelConfig


def test_every_problem_is_named_at_once():
    bad = ParallelConfig(
        pp=0, dp_shard=-2, schedule="round_robin", p2p="tcp", partition="evenly", memory_cap_bytes=0
    )
    problems = bad.problems(4)
    for key in (
        "pp must be >= 1",
        "dp_shard must be >= 1 or -1",
        "schedule must be one of",
        "p2p must be one of",
        "partition must be one of",
        "memory_cap_bytes must be positive",
    ):
        assert any(p.startswith(key) for p in problems), (key, problems)
    with pytest.raises(ValueError, match="invalid ParallelConfig: pp must be >= 1"):
        bad.validate(4)
    assert ParallelConfig(partition="runs/a/partition.json").problems(1) == []  # a saved partition


def test_minus_one_takes_the_ranks_left_over_on_either_data_parallel_dimension():
    replicas = ParallelConfig(dp_replicate=-1, tp=2)
    # resolved() copies
    assert replicas.resolved(8).dp_replicate == 4 and replicas.dp_replicate == -1
    shards = ParallelConfig(pp=2, dp_shard=-1).validate(8)
    assert (shards.dp_replicate, shards.dp_shard, shards.dp, shards.world_size) == (1, 4, 4, 8)
    assert (
        shards.pp_enabled
        and shards.dp_shard_enabled
        and shards.fsdp_enabled
        and not shards.tp_enabled
    )
    assert ParallelConfig(dp_replicate=-1, dp_shard=-1).problems(4) == [
        "dp_replicate and dp_shard are both -1: at most one takes the ranks left over "
        "(dp_replicate=1 with dp_shard=-1 shards over them with FSDP2, dp_replicate=-1 with "
        "dp_shard=1 replicates)"
    ]
    assert ParallelConfig(dp_replicate=-1, tp=3).problems(8) == [
        "world size 8 is not divisible by pp*dp_shard*tp = 3"
    ]
    with pytest.raises(
        ValueError, match=r"dp_replicate=-1 is not resolved yet: call validate\(world_size\)"
    ):
        ParallelConfig(dp_replicate=-1).dp  # noqa: B018  (a question before the check)
    # an option x layout rule sees the resolved degree: FSDP over the left-over ranks
    assert any(
        "stage_path='graph' with tp=1, dp_shard=2" in p
        for p in ParallelConfig(pp=2, dp_shard=-1, stage_path="graph").problems(4)
    )


def test_the_mesh_checks_through_the_config():
    from parallel.mesh import layout_of

    with pytest.raises(ValueError, match="does not match the world size 1"):
        layout_of(ParallelConfig(tp=2))  # one process: the world is 1
    cfg = ParallelConfig(dp_replicate=-1)
    lay = layout_of(cfg)
    assert cfg.dp_replicate == 1 and (lay.dp_size, lay.pp_size, lay.tp_size) == (1, 1, 1)
