"""rag_mm's model-agnostic parallel runtime. Never imports rag_mm or retriever.

Names are resolved lazily so ``import parallel.kernels`` does not pull in the partitioner.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "auto_partition": "parallel.partition",
    "partition_trace": "parallel.partition",
    "baseline_partition": "parallel.partition",
    "Partition": "parallel.partition",
    "InfeasiblePartition": "parallel.balance",
    "CostConfig": "parallel.cost",
    "trace_model": "parallel.trace",
    "TraceResult": "parallel.trace",
    "build_mesh": "parallel.mesh",
    "parallelize_spmd": "parallel.spmd",
    "apply_tp": "parallel.tp",
    "register_tp_rule": "parallel.tp",
    "vocab_parallel_cross_entropy": "parallel.tp",
    "apply_fsdp": "parallel.fsdp",
    "clip_grad_norm_": "parallel.fsdp",
    "meta_init": "parallel.memory",
    "materialize": "parallel.memory",
    "parallelize": "parallel.api",
    "ParallelConfig": "parallel.config",
    "ParallelModel": "parallel.model",
    "PipelineError": "parallel.pipeline.p2p",
    "plan_layout": "parallel.planner",
    "Cluster": "parallel.cluster",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'parallel' has no attribute {name!r}")
