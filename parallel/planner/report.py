"""The planner's results: one modelled candidate (``Estimate``: the ``ParallelConfig`` that runs
it, and what it costs), and the ranked ``Plan`` with its table and JSON form."""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from typing import Any

from ..cluster import Cluster
from ..config import ParallelConfig

GiB = float(2**30)
# the degrees and options of a candidate, as its JSON form and table show them (besides ``config``)
LAYOUT_KEYS = (
    "pp",
    "tp",
    "dp_replicate",
    "dp_shard",
    "microbatches",
    "schedule",
    "stages_per_rank",
    "activation_checkpointing",
    "cpu_offload",
)


@dataclass
class Estimate:
    """One candidate layout (the runtime's ``ParallelConfig`` that runs it, the compute dtype and
    the gradient-accumulation steps it assumes) and what the cost model says about it."""

    config: (
        ParallelConfig  # what ``parallel.parallelize`` runs; validated against the cluster's world
    )
    # compute dtype the estimate assumes: fp32 | bf16. bf16 is the step under torch.autocast (fp32
    # master weights and Adam); ``config.mixed_precision`` (FSDP2's bf16 parameters) stays fp32, and
    # a caller may turn it on where pp == 1
    precision: str = "fp32"
    # gradient-accumulation steps per optimizer step (pp == 1; a pipeline's are config.microbatches)
    grad_accum: int = 1
    microbatch_size: int = 0  # samples per microbatch on one data-parallel replica
    fits: bool = False  # True if memory (device and host) and every constraint allow it
    memory_bytes_per_device: float = 0.0  # modelled peak on the fullest device
    # that rank's memory by kind (params, grads, optimizer, gathered, activations): the peak is
    # their sum, less the smaller of grads and activations where the two do not peak together
    memory: dict[str, float] = field(default_factory=dict)
    # modelled peak of each pipeline rank, first first
    memory_by_rank: list[float] = field(default_factory=list)
    # and each one's memory by kind
    memory_kinds_by_rank: list[dict[str, float]] = field(default_factory=list)
    step_time_s: float = math.inf  # modelled seconds per optimizer step
    breakdown: dict[str, float] = field(default_factory=dict)  # step seconds by where they go
    mfu: float = 0.0  # model FLOPs (no recompute) / (step time x world x peak of the dtype)
    reasons: list[str] = field(default_factory=list)  # why it was rejected, or what dominates it

    # the layout's degrees and options, read off ``config`` (the one place they are kept)
    @property
    def pp(self) -> int:
        return self.config.pp

    @property
    def tp(self) -> int:
        return self.config.tp

    @property
    def dp_replicate(self) -> int:
        return self.config.dp_replicate

    @property
    def dp_shard(self) -> int:
        return self.config.dp_shard

    @property
    def microbatches(self) -> int:
        """Microbatches per optimizer step: the pipeline's, or the accumulation steps without
        one."""
        return self.config.microbatches if self.config.pp > 1 else self.grad_accum

    @property
    def schedule(self) -> str:
        """The pipeline schedule; "-" without a pipeline."""
        return self.config.schedule if self.config.pp > 1 else "-"

    @property
    def stages_per_rank(self) -> int:
        return self.config.stages_per_rank

    @property
    def activation_checkpointing(self) -> bool:
        return self.config.activation_checkpointing != "none"

    @property
    def cpu_offload(self) -> bool:
        return self.config.cpu_offload

    @property
    def key(self) -> str:
        s = f"pp{self.pp} tp{self.tp} dpr{self.dp_replicate} dps{self.dp_shard}"
        if self.pp > 1:
            s += f" m{self.microbatches} {self.schedule}"
        elif self.microbatches > 1:
            s += f" accum{self.microbatches}"
        return (
            s
            + (" ac" if self.activation_checkpointing else "")
            + (" " + self.precision)
            + (" offload" if self.cpu_offload else "")
        )


@dataclass
class Plan:
    """Every layout considered, fitting ones first (fastest first), then the rejected ones."""

    cluster: Cluster  # where the layouts run
    parameters: int  # parameter count of the model
    param_bytes: float  # their bytes in the trace's dtype
    global_batch: int  # samples per optimizer step
    layouts: list[Estimate]  # ranked
    planner: Any = field(default=None, repr=False)  # the _Planner, for estimate()
    seconds: float = 0.0  # time the planning took

    @property
    def best(self) -> Estimate | None:
        return self.layouts[0] if self.layouts and self.layouts[0].fits else None

    @property
    def fitting(self) -> list[Estimate]:
        return [lay for lay in self.layouts if lay.fits]

    def estimate(self, **layout: Any) -> Estimate:
        """Model one layout (any degrees, tp across nodes included): the keywords of
        ``Planner.estimate`` (pp, tp, dp_replicate, dp_shard, microbatches, schedule, ...)."""
        return self.planner.estimate(**layout)

    def to_dict(self, top: int | None = 20) -> dict[str, Any]:
        lays = self.layouts if top is None else self.layouts[:top]
        return {
            "cluster": self.cluster.name,
            "world": self.cluster.world,
            "parameters": self.parameters,
            "device_memory_bytes": self.cluster.device_memory_bytes,
            "global_batch": self.global_batch,
            "considered": len(self.layouts),
            "fitting": len(self.fitting),
            "layouts": [_layout_dict(lay) for lay in lays],
        }

    def to_json(self, top: int | None = 20) -> str:
        return json.dumps(self.to_dict(top), indent=1)

    def table(self, top: int = 10, rejected: int = 3) -> str:
        c = self.cluster
        lines = [
            f"{self.parameters / 1e9:.3g} B parameters on {c.name}: {c.nodes} x "
            f"{c.devices_per_node} devices of {c.device_memory_bytes / GiB:.0f} GiB, global batch "
            f"{self.global_batch}; {len(self.fitting)} of {len(self.layouts)} layouts fit "
            f"({self.seconds:.1f} s)"
        ]
        # times in milliseconds: small models' steps are sub-millisecond
        head = (
            f"{'#':>3} {'pp':>3} {'tp':>3} {'dpr':>4} {'dps':>4} {'m':>4} {'schedule':<16} "
            f"{'ac':>3} {'prec':>5} {'off':>4} {'GiB':>6} {'step ms':>8} {'mfu':>5} "
            f"{'compute':>8} {'bubble':>7} {'tp':>7} {'dp':>7} {'pp':>7}  reasons"
        )
        lines += [head, "-" * len(head)]
        rows = self.fitting[:top] + [lay for lay in self.layouts if not lay.fits][:rejected]
        for i, lay in enumerate(rows):
            b = lay.breakdown
            lines.append(
                f"{i + 1 if lay.fits else 'x':>3} {lay.pp:>3} {lay.tp:>3} {lay.dp_replicate:>4} "
                f"{lay.dp_shard:>4} {lay.microbatches:>4} {lay.schedule:<16} "
                f"{'y' if lay.activation_checkpointing else 'n':>3} {lay.precision:>5} "
                f"{'y' if lay.cpu_offload else 'n':>4} {lay.memory_bytes_per_device / GiB:>6.1f} "
                f"{1e3 * lay.step_time_s:>8.4g} {lay.mfu:>5.2f} {1e3 * b.get('compute', 0):>8.4g} "
                f"{1e3 * b.get('bubble', 0):>7.4g} {1e3 * b.get('tp_comm', 0):>7.4g} "
                f"{1e3 * b.get('dp_comm', 0):>7.4g} {1e3 * b.get('pp_comm', 0):>7.4g}  "
                f"{'; '.join(lay.reasons)}"
            )
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()


def _layout_dict(lay: Estimate) -> dict[str, Any]:
    d = dataclasses.asdict(lay)
    return {**{k: getattr(lay, k) for k in LAYOUT_KEYS}, **d}
