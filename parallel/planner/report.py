"""The planner's results: one modelled ``Layout``, the ranked ``Plan`` with its table and JSON
form, and the rag_mm overrides that run a layout."""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from typing import Any

from ..cluster import Cluster

GiB = float(2**30)

@dataclass
class Layout:
    """One candidate layout and what the model says about it."""

    pp: int  # pipeline ranks
    tp: int  # tensor-parallel degree (inside a node)
    dp_replicate: int  # data-parallel replicas
    dp_shard: int  # FSDP shard degree
    microbatches: int  # pipeline microbatches per step; without a pipeline, gradient-accumulation steps
    schedule: str  # pipeline schedule (parallel.config name); "-" without a pipeline
    stages_per_rank: int  # virtual stages per pipeline rank
    activation_checkpointing: bool  # every block checkpointed (recomputed in backward)
    mixed_precision: str  # fp32 | bf16 (compute dtype; master weights and Adam stay fp32)
    cpu_offload: bool  # FSDP2 keeps params, grads and Adam state on the host
    microbatch_size: int = 0  # samples per microbatch on one data-parallel replica
    fits: bool = False  # True if memory (device and host) and every constraint allow it
    memory_bytes_per_device: float = 0.0  # modelled peak on the fullest device
    # that rank's memory by kind (params, grads, optimizer, gathered, activations): the peak is their
    # sum, less the smaller of grads and activations where the two do not peak together
    memory: dict[str, float] = field(default_factory=dict)
    memory_by_rank: list[float] = field(default_factory=list)  # modelled peak of each pipeline rank, first first
    memory_kinds_by_rank: list[dict[str, float]] = field(default_factory=list)  # and each one's memory by kind
    step_time_s: float = math.inf  # modelled seconds per optimizer step
    breakdown: dict[str, float] = field(default_factory=dict)  # step seconds by where they go
    mfu: float = 0.0  # model FLOPs (no recompute) / (step time x world x peak of the dtype)
    reasons: list[str] = field(default_factory=list)  # why it was rejected, or what dominates it
    overrides: list[str] = field(default_factory=list)  # rag_mm Hydra overrides that run it
    runtime: dict[str, Any] = field(default_factory=dict)  # parallel.ParallelConfig fields rag_mm lacks

    @property
    def key(self) -> str:
        s = f"pp{self.pp} tp{self.tp} dpr{self.dp_replicate} dps{self.dp_shard}"
        if self.pp > 1:
            s += f" m{self.microbatches} {self.schedule}"
        elif self.microbatches > 1:
            s += f" accum{self.microbatches}"
        return s + (" ac" if self.activation_checkpointing else "") + (" " + self.mixed_precision) + \
            (" offload" if self.cpu_offload else "")


@dataclass
class Plan:
    """Every layout considered, fitting ones first (fastest first), then the rejected ones."""

    cluster: Cluster  # where the layouts run
    parameters: int  # parameter count of the model
    param_bytes: float  # their bytes in the trace's dtype
    global_batch: int  # samples per optimizer step
    layouts: list[Layout]  # ranked
    planner: Any = field(default=None, repr=False)  # the _Planner, for estimate()
    seconds: float = 0.0  # time the planning took

    @property
    def best(self) -> Layout | None:
        return self.layouts[0] if self.layouts and self.layouts[0].fits else None

    @property
    def fitting(self) -> list[Layout]:
        return [lay for lay in self.layouts if lay.fits]

    def estimate(self, **layout: Any) -> Layout:
        """Model one layout (any degrees, tp across nodes included): keyword fields of ``Layout``."""
        return self.planner.estimate(**layout)

    def to_dict(self, top: int | None = 20) -> dict[str, Any]:
        lays = self.layouts if top is None else self.layouts[:top]
        return {"cluster": self.cluster.name, "world": self.cluster.world, "parameters": self.parameters,
                "device_memory_bytes": self.cluster.device_memory_bytes, "global_batch": self.global_batch,
                "considered": len(self.layouts), "fitting": len(self.fitting),
                "layouts": [_layout_dict(lay) for lay in lays]}

    def to_json(self, top: int | None = 20) -> str:
        return json.dumps(self.to_dict(top), indent=1)

    def table(self, top: int = 10, rejected: int = 3) -> str:
        c = self.cluster
        lines = [f"{self.parameters / 1e9:.3g} B parameters on {c.name}: {c.nodes} x {c.devices_per_node} devices "
                 f"of {c.device_memory_bytes / GiB:.0f} GiB, global batch {self.global_batch}; "
                 f"{len(self.fitting)} of {len(self.layouts)} layouts fit ({self.seconds:.1f} s)"]
        head = (f"{'#':>3} {'pp':>3} {'tp':>3} {'dpr':>4} {'dps':>4} {'m':>4} {'schedule':<16} {'ac':>3} {'prec':>5} "
                f"{'off':>4} {'GiB':>6} {'step ms':>8} {'mfu':>5} {'compute':>8} {'bubble':>7} {'tp':>7} {'dp':>7} "
                f"{'pp':>7}  reasons")  # times in milliseconds: small models' steps are sub-millisecond
        lines += [head, "-" * len(head)]
        rows = self.fitting[:top] + [lay for lay in self.layouts if not lay.fits][:rejected]
        for i, lay in enumerate(rows):
            b = lay.breakdown
            lines.append(
                f"{i + 1 if lay.fits else 'x':>3} {lay.pp:>3} {lay.tp:>3} {lay.dp_replicate:>4} {lay.dp_shard:>4} "
                f"{lay.microbatches:>4} {lay.schedule:<16} {'y' if lay.activation_checkpointing else 'n':>3} "
                f"{lay.mixed_precision:>5} {'y' if lay.cpu_offload else 'n':>4} "
                f"{lay.memory_bytes_per_device / GiB:>6.1f} {1e3 * lay.step_time_s:>8.4g} {lay.mfu:>5.2f} "
                f"{1e3 * b.get('compute', 0):>8.4g} {1e3 * b.get('bubble', 0):>7.4g} {1e3 * b.get('tp_comm', 0):>7.4g} "
                f"{1e3 * b.get('dp_comm', 0):>7.4g} {1e3 * b.get('pp_comm', 0):>7.4g}  {'; '.join(lay.reasons)}")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()


def _layout_dict(lay: Layout) -> dict[str, Any]:
    return {k: v for k, v in dataclasses.asdict(lay).items()}


def overrides(lay: Layout) -> tuple[list[str], dict[str, Any]]:
    """rag_mm overrides (``parallel.dp`` counts every data-parallel rank, of which ``dp_shard``
    shard; ``data.batch_size`` is per data-parallel rank) and the runtime fields rag_mm has no key
    for (``parallel.ParallelConfig``'s activation_checkpointing, cpu_offload, mixed_precision)."""
    dp = lay.dp_replicate * lay.dp_shard
    per_rank = lay.microbatch_size * lay.microbatches
    o = [f"parallel.pp={lay.pp}", f"parallel.tp={lay.tp}", f"parallel.dp={dp}", f"parallel.dp_shard={lay.dp_shard}"]
    if lay.pp > 1:
        o += [f"parallel.microbatches={lay.microbatches}", f"parallel.schedule={lay.schedule}"]
    else:  # without a pipeline, microbatches are accumulation steps of microbatch_size samples
        o += ["parallel.microbatches=1", f"optim.grad_accum={lay.microbatches}"]
        per_rank = lay.microbatch_size
    if per_rank:
        # the eval batch must split into the microbatches too: the training batch per rank does
        o += [f"data.batch_size={per_rank}", f"data.eval_batch_size={per_rank}"]
    o.append(f"optim.precision={lay.mixed_precision}")
    rt: dict[str, Any] = {"activation_checkpointing": "full" if lay.activation_checkpointing else "none",
                          "cpu_offload": lay.cpu_offload}
    # the runtime's own bf16 casts FSDP's parameters, which a pipeline cannot carry; under a
    # pipeline bf16 is autocast, which is what optim.precision=bf16 selects
    rt["mixed_precision"] = lay.mixed_precision if lay.pp == 1 else "fp32"
    if lay.pp > 1:
        rt["stages_per_rank"] = lay.stages_per_rank
    return o, rt


