"""The ``parallel`` group is the runtime's own ``ParallelConfig``: every field of it is a command-
line key that reaches ``parallel.parallelize`` (through ``rag_mm.config.parallel_config``, which
``SpreadRag`` hands it), the app's own keys live under ``launch``, and a key the schema lacks is
named in Hydra's message, with no traceback."""

from __future__ import annotations

import dataclasses

import pytest

from parallel.config import ParallelConfig
from rag_mm.config import (
    ConfigError,
    compose,
    parallel_config,
    validate,
)
from tests.rag_mm.test_train import run_module

DEFAULT = ParallelConfig()
# a value unlike the default for every field, in three layouts the runtime accepts together:
# a pipeline with tp and FSDP on 8 ranks, HSDP with bf16 parameters and CPU offload on 4, and
# one process compiling the whole model
PIPELINE = {
    "pp": 2,
    "tp": 2,
    "dp_shard": 2,
    "microbatches": 4,
    "schedule": "interleaved_1f1b",
    "stages_per_rank": 2,
    "partition": "uniform",
    "objective": "memory",
    "memory_cap_bytes": 123456789,
    "sequence_parallel": True,
    "activation_checkpointing": "every_n",
    "ac_every": 2,
    "ac_skip": ["vision", "copy"],
    "activation_offload": True,
    "grad_reduce": "shm",
    "p2p": "gloo",
    "gc_pause": False,
    "steady_malloc": False,
    "split_drain": False,
    "bind_cores": True,
}
HSDP = {
    "dp_replicate": 2,
    "dp_shard": 2,
    "mixed_precision": "bf16",
    "cpu_offload": True,
    "stage_path": "graph",
    "compile": True,
    "compile_backend": "aot_eager",
}
# and one process compiling the whole model as CUDA graphs (no pipeline, TP or FSDP hooks)
WHOLE = {
    "compile": True,
    "compile_scope": "model",
    "compile_mode": "reduce-overhead",
}


def _line(values: dict) -> list[str]:
    return [
        f"parallel.{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in values.items()
    ]


def test_every_runtime_field_is_a_command_line_key_that_reaches_the_runtime():
    fields = {f.name for f in dataclasses.fields(ParallelConfig)}
    # a new runtime field needs a value here
    assert set(PIPELINE) | set(HSDP) | set(WHOLE) == fields
    for layout, world in ((PIPELINE, 8), (HSDP, 4), (WHOLE, 1)):
        assert all(v != getattr(DEFAULT, k) for k, v in layout.items() if k != "dp_replicate")
        cfg = compose(_line(layout))
        validate(cfg, world)
        runtime = parallel_config(cfg, world)  # what SpreadRag passes to parallel.parallelize
        assert type(runtime) is ParallelConfig
        assert {k: getattr(runtime, k) for k in layout} == layout
        assert runtime.world_size == world
    # the questions the one check answers
    pipe = parallel_config(compose(_line(PIPELINE)), 8)
    assert (
        pipe.pp_enabled
        and pipe.tp_enabled
        and pipe.dp_shard_enabled
        and not pipe.dp_replicate_enabled
    )
    assert pipe.dp == 2 and not pipe.whole_model


def test_the_default_layout_replicates_over_the_world_and_launch_keys_are_apart():
    cfg = compose(["launch.backend=gloo", "launch.timeout_s=30"])
    assert (cfg.launch.backend, cfg.launch.timeout_s, cfg.launch.auto_layout) == ("gloo", 30, False)
    runtime = parallel_config(cfg, 4)
    assert (runtime.dp_replicate, runtime.dp_shard, runtime.dp) == (4, 1, 4)
    assert cfg.parallel.dp_replicate == -1  # the config node keeps its -1: the copy is resolved
    assert compose(["parallel=auto"]).launch.auto_layout
    with pytest.raises(ConfigError) as err:
        validate(compose(["parallel.dp_shard=-1", "launch.backend=mpi", "parallel.p2p=tcp"]), 4)
    msg = str(err.value)
    assert "parallel.dp_replicate and dp_shard are both -1" in msg
    assert "launch.backend must be one of" in msg and "parallel.p2p must be one of" in msg


def test_a_key_the_schema_lacks_is_named_without_a_traceback():
    res = run_module(["-m", "rag_mm.train", "parallel.dp=2"], timeout=120)
    assert res.returncode != 0
    assert "Key 'dp' not in 'ParallelConfig'" in res.stderr + res.stdout
    assert "Traceback" not in res.stderr + res.stdout
