"""ParallelConfig: the one description of how a model is spread over ranks.

The device mesh has the dimensions (pp, dp_replicate, dp_shard, tp), outermost first; their
product is the world size (``dp_shard=-1`` takes the ranks left over). ``parallelize`` applies
them in a fixed order: tensor parallel, then activation checkpointing, then FSDP, then the
pipeline stages are built over what remains.
"""

from __future__ import annotations

from dataclasses import dataclass

SCHEDULES = ("gpipe", "1f1b", "eager_1f1b", "interleaved_1f1b", "looped_bfs", "zero_bubble", "zbv", "dualpipev")
OBJECTIVES = ("speed", "memory")


@dataclass
class ParallelConfig:
    """Degrees of each kind of parallelism and the knobs of each."""

    pp: int = 1  # pipeline stages (ranks along the pipeline dimension)
    dp_replicate: int = 1  # replicas of the (sharded) model: HSDP's replicate dimension / plain data parallel
    dp_shard: int = 1  # FSDP2 shard degree; -1 = whatever the other degrees leave of the world
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
    activation_offload: bool = False  # keep saved activations in host memory until backward
    mixed_precision: str = "fp32"  # fp32 | bf16 (bf16 parameters and compute, fp32 reductions)
    cpu_offload: bool = False  # FSDP2: keep sharded parameters and optimizer state on the host
    grad_reduce: str = "pg"  # data-parallel gradient reduction: pg | auto | shm | hier_int8
    p2p: str = "auto"  # pipeline messages: auto (shared-memory rings between ranks of one host) | shm | gloo
    # pipeline stages: eager (replay the model's Python; any model) | graph (torch.export split at the
    # partition's cuts; fixed shapes, tensor inputs/outputs) | auto (graph where export succeeds).
    # eager by default: the path measured and tested on every model of the grid (reader, HF models)
    stage_path: str = "eager"
    # no automatic garbage collection inside a pipelined step: a collection pauses one rank for up to
    # ~100 ms (a full one over a process with torch imported), and every rank waiting on it stalls
    # too; collections that fall due run between steps (torchtitan and Megatron do the same)
    gc_pause: bool = True
    # fix glibc malloc's mmap / trim thresholds (host_malloc.py): with its dynamic ones, buffers freed
    # every microbatch went back to the OS and were faulted in again (thousands of faults per step)
    steady_malloc: bool = True
    # GPipe / 1F1B / eager 1F1B: every rank but the first runs its last two backwards of a step as
    # input gradients, their weight gradients after both (schedule.split_last_backward), so the
    # step's drain moves on to the upstream rank while the weight gradients are done
    split_drain: bool = True
    # CPU ranks: bind each local rank to its own slice of the host's cores (cpu_affinity.py), as
    # numactl / taskset at launch would. Off by default: right only when this job owns the cores
    # (two jobs side by side would both bind to the first ones)
    bind_cores: bool = False

    def validate(self, world_size: int) -> ParallelConfig:
        """Resolve -1 and reject layouts that cannot work, with a message naming the key."""
        errors = []
        for key in ("pp", "dp_replicate", "tp", "microbatches", "stages_per_rank", "ac_every"):
            if getattr(self, key) < 1:
                errors.append(f"{key} must be >= 1 (got {getattr(self, key)})")
        if self.dp_shard == 0 or self.dp_shard < -1:
            errors.append(f"dp_shard must be >= 1 or -1 (got {self.dp_shard})")
        if self.schedule not in SCHEDULES:
            errors.append(f"schedule must be one of {SCHEDULES} (got {self.schedule!r})")
        if self.objective not in OBJECTIVES:
            errors.append(f"objective must be one of {OBJECTIVES} (got {self.objective!r})")
        if self.activation_checkpointing not in ("none", "full", "every_n"):
            errors.append(f"activation_checkpointing must be none, full or every_n (got {self.activation_checkpointing!r})")
        if self.stage_path not in ("auto", "graph", "eager"):
            errors.append(f"stage_path must be auto, graph or eager (got {self.stage_path!r})")
        if self.p2p not in ("auto", "shm", "gloo"):
            errors.append(f"p2p must be auto, shm or gloo (got {self.p2p!r})")
        if self.grad_reduce not in ("pg", "auto", "shm", "hier_int8"):
            errors.append(f"grad_reduce must be pg, auto, shm or hier_int8 (got {self.grad_reduce!r})")
        if self.mixed_precision not in ("fp32", "bf16"):
            errors.append(f"mixed_precision must be fp32 or bf16 (got {self.mixed_precision!r})")
        if self.pp > 1 and self.mixed_precision != "fp32":
            errors.append(f"mixed_precision={self.mixed_precision!r} with pp={self.pp}: FSDP's bf16 parameters would "
                          "change the dtype of the tensors crossing the pipeline cuts; run the step under "
                          "torch.autocast instead (train_step keeps it on the forwards)")
        if self.pp > 1 and self.cpu_offload:
            errors.append(f"cpu_offload with pp={self.pp}: a pipeline rank keeps its part gathered for the whole "
                          "step, so offloading between microbatches would only copy; use cpu_offload with pp=1")
        if self.pp > 1 and self.stage_path == "graph" and (self.tp > 1 or self.dp_shard > 1):
            errors.append(f"stage_path='graph' with tp={self.tp}, dp_shard={self.dp_shard}: the exported stage "
                          "graphs do not carry tensor-parallel or FSDP modules; use stage_path='eager'")
        if errors:
            raise ValueError("invalid ParallelConfig: " + "; ".join(errors))
        fixed = self.pp * self.dp_replicate * self.tp
        if self.dp_shard == -1:
            if world_size % fixed:
                raise ValueError(f"world size {world_size} is not divisible by pp*dp_replicate*tp = {fixed}")
            self.dp_shard = world_size // fixed
        if fixed * self.dp_shard != world_size:
            raise ValueError(
                f"pp*dp_replicate*dp_shard*tp = {self.pp}*{self.dp_replicate}*{self.dp_shard}*{self.tp} "
                f"= {fixed * self.dp_shard} does not match the world size {world_size}"
            )
        return self
