"""ParallelConfig: the one description of how a model is spread over ranks.

The device mesh has the dimensions (pp, dp_replicate, dp_shard, tp), outermost first; their
product is the world size (``dp_shard=-1`` or ``dp_replicate=-1`` takes the ranks left over).
``parallelize`` applies them in a fixed order: tensor parallel, then activation checkpointing,
then FSDP, then the pipeline stages are built over what remains.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

DEGREES = ("pp", "dp_replicate", "dp_shard", "tp")  # the mesh's dimensions, outermost first
SCHEDULES = (
    "gpipe",
    "1f1b",
    "eager_1f1b",
    "interleaved_1f1b",
    "looped_bfs",
    "zero_bubble",
    "zbv",
    "dualpipev",
)
OBJECTIVES = ("speed", "memory")
PARTITIONS = ("auto", "uniform", "parameters", "time")  # or the path of a saved partition (JSON)
# the allowed values of every field that takes a name
CHOICES = {
    "schedule": SCHEDULES,
    "objective": OBJECTIVES,
    "activation_checkpointing": ("none", "full", "every_n"),
    "mixed_precision": ("fp32", "bf16"),
    "compile_backend": ("inductor", "aot_eager", "eager"),
    "compile_scope": ("blocks", "model"),
    "compile_mode": ("default", "reduce-overhead"),
    "grad_reduce": ("pg", "auto", "shm", "hier_int8"),
    "p2p": ("auto", "shm", "gloo"),
    "stage_path": ("auto", "graph", "eager"),
}


@dataclass
class ParallelConfig:
    """Degrees of each kind of parallelism and the knobs of each. ``validate(world_size)`` is the
    one check of a layout (every caller, the planner included, goes through it); afterwards the
    config answers ``world_size``, ``dp``, ``pp_enabled``, ``dp_shard_enabled``, ... as
    torchtitan's ``ParallelDims`` does. Plain typed fields only, so an application can register
    the class as a config schema as it is (every field a command-line key)."""

    pp: int = 1  # pipeline stages (ranks along the pipeline dimension)
    # replicas of the (sharded) model: HSDP's replicate dimension / plain data parallel; -1 =
    # whatever the other degrees leave of the world
    dp_replicate: int = 1
    # FSDP2 shard degree; -1 = whatever the other degrees leave (one of the two at most)
    dp_shard: int = 1
    tp: int = 1  # tensor-parallel degree (DTensor, one mesh dimension)
    microbatches: int = 1  # pipeline microbatches per step; >= pp keeps every stage busy
    schedule: str = "1f1b"  # pipeline schedule (see SCHEDULES)
    stages_per_rank: int = 1  # virtual stages per rank for interleaved / V schedules (2 for zbv)
    partition: str = "auto"  # auto (traced + balanced) | uniform | parameters | time | a JSON path
    objective: str = "speed"  # partition objective: speed | memory (SageMaker's memory weight)
    memory_cap_bytes: int | None = None  # per-device cap the partition must respect
    sequence_parallel: bool = False  # shard norms / dropout over the sequence dimension under TP
    activation_checkpointing: str = "none"  # none | full | every_n (see ac_every)
    ac_every: int = 1  # with every_n: checkpoint every n-th block
    # module-name prefixes never checkpointed (an application names the parts whose recompute costs
    # more than their activations save, e.g. a vision tower); leaf blocks never are either
    ac_skip: list[str] = field(default_factory=list)
    activation_offload: bool = False  # keep saved activations in host memory until backward
    # torch.compile each block (fullgraph) after TP and checkpointing, before FSDP: fused
    # elementwise kernels, fewer launches; off by default: the first step pays the compilation
    compile: bool = False
    compile_backend: str = "inductor"  # inductor | aot_eager (traced, no code generated) | eager
    # what one compiled graph holds: blocks (each block, any layout) | model (the whole module,
    # forward and backward as one graph: fewer, larger fused kernels for a small model whose step
    # is bound by kernel launches; one process or plain data parallel, see problems())
    compile_scope: str = "blocks"
    # default | reduce-overhead: Inductor records the whole model's graph as CUDA graphs and
    # replays a step as one launch (CUDA, compile_scope=model, shapes fixed from step to step)
    compile_mode: str = "default"
    mixed_precision: str = "fp32"  # fp32 | bf16 (bf16 parameters and compute, fp32 reductions)
    cpu_offload: bool = False  # FSDP2: keep sharded parameters and optimizer state on the host
    grad_reduce: str = "pg"  # data-parallel gradient reduction: pg | auto | shm | hier_int8
    # pipeline messages: auto (shared-memory rings between ranks of one host) | shm | gloo
    p2p: str = "auto"
    # pipeline stages: eager (replay the model's Python; any model) | graph (torch.export split at
    # the partition's cuts; fixed shapes, tensor inputs/outputs) | auto (graph where export
    # succeeds). eager by default: the path measured and tested on every model of the grid (reader,
    # HF models)
    stage_path: str = "eager"
    # no automatic garbage collection inside a pipelined step: a collection pauses one rank for up
    # to ~100 ms (a full one over a process with torch imported), and every rank waiting on it
    # stalls too; collections that fall due run between steps (torchtitan and Megatron do the same)
    gc_pause: bool = True
    # fix glibc malloc's mmap / trim thresholds (host_malloc.py): with its dynamic ones, buffers
    # freed every microbatch went back to the OS and were faulted in again (thousands of faults per
    # step)
    steady_malloc: bool = True
    # GPipe / 1F1B / eager 1F1B: every rank but the first runs its last two backwards of a step as
    # input gradients, their weight gradients after both (schedule.split_last_backward), so the
    # step's drain moves on to the upstream rank while the weight gradients are done
    split_drain: bool = True
    # CPU ranks: bind each local rank to its own slice of the host's cores (cpu_affinity.py), as
    # numactl / taskset at launch would. Off by default: right only when this job owns the cores
    # (two jobs side by side would both bind to the first ones)
    bind_cores: bool = False

    def problems(self, world_size: int | None = None) -> list[str]:
        """Every reason this layout cannot run, each naming its key (``[]``: it can). With
        ``world_size``, the degrees are checked against it too (-1 resolved as ``validate``
        would)."""
        e = []
        for key in ("pp", "tp", "microbatches", "stages_per_rank", "ac_every"):
            if getattr(self, key) < 1:
                e.append(f"{key} must be >= 1 (got {getattr(self, key)})")
        for key in ("dp_replicate", "dp_shard"):
            if getattr(self, key) == 0 or getattr(self, key) < -1:
                e.append(
                    f"{key} must be >= 1 or -1 for 'the ranks the other degrees leave' (got "
                    f"{getattr(self, key)})"
                )
        if self.dp_replicate == -1 and self.dp_shard == -1:
            e.append(
                "dp_replicate and dp_shard are both -1: at most one takes the ranks left over "
                "(dp_replicate=1 with dp_shard=-1 shards over them with FSDP2, dp_replicate=-1 "
                "with dp_shard=1 replicates)"
            )
        for key, allowed in CHOICES.items():
            if getattr(self, key) not in allowed:
                e.append(f"{key} must be one of {allowed} (got {getattr(self, key)!r})")
        if self.partition not in PARTITIONS and not str(self.partition).endswith(".json"):
            e.append(
                f"partition must be one of {PARTITIONS} or a partition's JSON file (got "
                f"{self.partition!r})"
            )
        if self.memory_cap_bytes is not None and self.memory_cap_bytes <= 0:
            e.append(f"memory_cap_bytes must be positive or None (got {self.memory_cap_bytes})")
        degrees = None
        if not e and world_size is not None:
            degrees, why = self._resolve(world_size)
            e += [why] if why else []
        shard = (degrees or {}).get("dp_shard", self.dp_shard)
        if self.pp > 1 and self.mixed_precision != "fp32":
            e.append(
                f"mixed_precision={self.mixed_precision!r} with pp={self.pp}: FSDP's bf16 "
                "parameters would change the dtype of the tensors crossing the pipeline cuts; run "
                "the step under torch.autocast instead (train_step keeps it on the forwards)"
            )
        if self.pp > 1 and self.cpu_offload:
            e.append(
                f"cpu_offload with pp={self.pp}: a pipeline rank keeps its part gathered for the "
                "whole step, so offloading between microbatches would only copy; use cpu_offload "
                "with pp=1"
            )
        fsdp = shard != 1 or self.cpu_offload or self.mixed_precision != "fp32"
        if self.compile_scope == "model" and (self.pp > 1 or self.tp > 1 or fsdp):
            e.append(
                f"compile_scope='model' with pp={self.pp}, tp={self.tp}, dp_shard={shard}, "
                f"cpu_offload={self.cpu_offload}, mixed_precision={self.mixed_precision!r}: one "
                "graph of the whole module needs all of it in this process, without the "
                "pipeline's, TP's or FSDP's hooks (FSDP wraps for a shard, an offload or bf16 "
                "parameters); use compile_scope='blocks', or autocast for bf16 compute"
            )
        if self.compile_mode != "default" and (
            self.compile_scope != "model" or self.compile_backend != "inductor"
        ):
            e.append(
                f"compile_mode={self.compile_mode!r} records CUDA graphs of a whole compiled "
                f"model: it needs compile_scope='model' and compile_backend='inductor' (got "
                f"{self.compile_scope!r}, {self.compile_backend!r})"
            )
        if self.pp > 1 and self.stage_path == "graph" and (self.tp > 1 or shard != 1):
            e.append(
                f"stage_path='graph' with tp={self.tp}, dp_shard={shard}: the exported stage "
                "graphs do not carry tensor-parallel or FSDP modules; use stage_path='eager'"
            )
        return e

    def _resolve(self, world_size: int) -> tuple[dict[str, int], str | None]:
        """The degrees with -1 replaced by what the others leave of ``world_size``, and why they
        do not fit it (None: they do)."""
        degrees = {d: getattr(self, d) for d in DEGREES}
        free = [d for d in DEGREES if degrees[d] == -1]
        fixed = math.prod(v for v in degrees.values() if v != -1)
        if free:
            if world_size % fixed:
                named = "*".join(d for d in DEGREES if d not in free)
                return degrees, f"world size {world_size} is not divisible by {named} = {fixed}"
            degrees[free[0]] = world_size // fixed
        if math.prod(degrees.values()) != world_size:
            return degrees, (
                f"pp*dp_replicate*dp_shard*tp = {'*'.join(str(v) for v in degrees.values())} "
                f"= {math.prod(degrees.values())} does not match the world size {world_size}"
            )
        return degrees, None

    def validate(self, world_size: int) -> ParallelConfig:
        """The one check of a layout: reject what cannot run on ``world_size`` ranks (every problem
        named at once), then resolve -1 in place. Returns ``self``, whose questions (``pp_enabled``,
        ``dp``, ``world_size``, ...) are answered from then on."""
        errors = self.problems(world_size)
        if errors:
            raise ValueError("invalid ParallelConfig: " + "; ".join(errors))
        for d, v in self._resolve(world_size)[0].items():
            setattr(self, d, v)
        return self

    def resolved(self, world_size: int) -> ParallelConfig:
        """A validated copy for ``world_size`` ranks (this one is left as it is: a config node of
        the command line keeps its -1)."""
        return dataclasses.replace(self).validate(world_size)

    # ------------------------------------------------------------- questions (after validate)
    def _degree(self, key: str) -> int:
        value = getattr(self, key)
        if value == -1:
            raise ValueError(f"{key}=-1 is not resolved yet: call validate(world_size) first")
        return value

    @property
    def world_size(self) -> int:
        """Ranks the layout spans: pp x dp_replicate x dp_shard x tp."""
        return math.prod(self._degree(d) for d in DEGREES)

    @property
    def dp(self) -> int:
        """Data-parallel ranks (replicas x shards): how many shares the data is split into."""
        return self._degree("dp_replicate") * self._degree("dp_shard")

    @property
    def pp_enabled(self) -> bool:
        return self.pp > 1

    @property
    def tp_enabled(self) -> bool:
        return self.tp > 1

    @property
    def dp_replicate_enabled(self) -> bool:
        return self._degree("dp_replicate") > 1

    @property
    def dp_shard_enabled(self) -> bool:
        return self._degree("dp_shard") > 1

    @property
    def fsdp_enabled(self) -> bool:
        """FSDP2 wraps the model: it shards it, or offloads it, or casts its parameters to bf16."""
        return self.dp_shard_enabled or self.cpu_offload or self.mixed_precision != "fp32"

    @property
    def whole_model(self) -> bool:
        """Every rank holds the whole, unsharded model (one process or plain data parallel)."""
        return not (self.pp_enabled or self.tp_enabled or self.dp_shard_enabled)
