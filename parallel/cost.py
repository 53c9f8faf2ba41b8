"""Cost model: what a pipeline stage covering units [i, j) costs in time and memory.

- compute: measured forward+backward seconds of its units (FLOPs / ``flops_per_s`` when the trace
  ran on the meta device), plus the time to send and receive the activations crossing its two
  cuts forward and their gradients backward: ``2 * (bytes_in + bytes_out) / bandwidth``;
  a container's own code (a "self" unit: mask set-up, token packing, the loop over blocks) is
  charged to *every* stage that enters the container, i.e. every stage ending after the self
  unit, because the eager pipeline replays the containers' Python on each stage up to the
  stage's last call (pipeline/eager.py);
- memory: ``params * (1 + grad_factor + optimizer_factor) + buffers + activations * in-flight
  microbatches`` for the stage's rank under the chosen schedule;
- the objective mixes them as SageMaker's library does:
  ``cost = (1 - w) * time / total_time + w * memory / total_memory``, with ``w`` the memory weight.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from .units import Unit

SCHEDULES = ("gpipe", "1f1b", "eager_1f1b", "interleaved", "zbv")


@dataclass
class CostConfig:
    """Knobs of the cost model; defaults describe Adam in fp32 on a PCIe-class link."""

    # gpipe | 1f1b | eager_1f1b | interleaved | zbv (V-shaped, two stages per rank)
    schedule: str = "1f1b"
    microbatches: int = 8  # microbatches per step; the example batch is taken as one microbatch
    stages_per_rank: int = 1  # v: >1 for interleaved (round-robin) or zbv (v must be 2)
    grad_factor: float = 1.0  # gradient bytes per parameter byte (1: same dtype as the params)
    optimizer_factor: float = 2.0  # optimizer-state bytes per parameter byte (Adam: m and v)
    bandwidth: float = 25e9  # bytes/s between neighbouring stages (PCIe 4.0 x16 ~ 25 GB/s)
    flops_per_s: float = 100e12  # converts FLOPs to seconds when nothing was timed (meta trace)
    memory_weight: float = 0.0  # w in the objective: 0 = pure time, SageMaker uses 0.2 / 0.8
    memory_cap: float | None = None  # bytes per rank; a stage over it is infeasible

    def __post_init__(self) -> None:
        if self.schedule not in SCHEDULES:
            raise ValueError(f"unknown schedule {self.schedule!r}; choose one of {SCHEDULES}")
        if self.schedule == "zbv" and self.stages_per_rank != 2:
            raise ValueError("the V-shaped schedule places exactly 2 stages per rank")
        if self.schedule in ("gpipe", "1f1b", "eager_1f1b") and self.stages_per_rank != 1:
            raise ValueError(f"{self.schedule} runs one stage per rank; use 'interleaved' or 'zbv'")


def rank_of_stage(stage: int, num_ranks: int, cfg: CostConfig) -> int:
    """Interleaved schedules deal stages round-robin (Megatron's virtual stages); the V shape goes
    down the ranks and back up, so rank 0 holds the first and the last stage (ZB-V, DualPipeV)."""
    if cfg.schedule == "zbv":
        return stage if stage < num_ranks else 2 * num_ranks - 1 - stage
    return stage % num_ranks


def inflight(stage: int, num_ranks: int, cfg: CostConfig) -> float:
    """Microbatches whose activations a stage holds at peak:
    GPipe all m; 1F1B min(m, p - r) on rank r, eager 1F1B min(m, 2 (p - r) - 1), at least 2 on a
    rank after the first (the split drain's deferred weight gradients); interleaved
    1F1B: Megatron's warm-up of 2(p - r - 1) + (v - 1)p chunk-microbatches plus one, spread over
    the v chunks of the rank;
    ZB-V: about p per chunk on every rank (the V's point: equal memory on all ranks)."""
    m, p, v = cfg.microbatches, num_ranks, cfg.stages_per_rank
    r = rank_of_stage(stage, num_ranks, cfg)
    if cfg.schedule == "gpipe":
        return float(m)
    # split drain (pipeline/schedule.py, DRAIN_DEPTH) holds a second microbatch's weight-gradient
    # inputs on the last rank at the end of the step
    tail = 2 if r > 0 else 1
    if cfg.schedule == "1f1b":
        return float(min(m, max(p - r, tail)))
    if cfg.schedule == "eager_1f1b":
        return float(min(m, max(2 * (p - r) - 1, tail)))
    if cfg.schedule == "interleaved":
        return float(min(m, math.ceil((2 * (p - r - 1) + (v - 1) * p + 1) / v)))
    return float(min(m, p))


class StageCosts:
    """Prefix sums over a unit sequence so any stage [i, j) costs O(1) (or O(n) for all i)."""

    def __init__(
        self, units: list[Unit], cut: list[int], cfg: CostConfig, timed: bool, num_stages: int
    ):
        self.units, self.cfg, self.num_stages = units, cfg, num_stages
        self.num_ranks = num_stages // cfg.stages_per_rank
        t = np.array(
            [u.time if timed else u.flops / cfg.flops_per_s for u in units], dtype=np.float64
        )
        own = np.array([u.kind == "self" for u in units], dtype=bool)
        is_mod = np.array([u.kind == "module" for u in units], dtype=np.float64)
        state = 1.0 + cfg.grad_factor + cfg.optimizer_factor
        pm = np.array([u.param_bytes * state + u.buffer_bytes for u in units], dtype=np.float64)
        act = np.array([u.act_bytes for u in units], dtype=np.float64)
        self.unit_time, self.unit_static, self.unit_act = t, pm, act
        # time of ordinary units in [i, j) plus the replayed container code entered before j
        self.PT = np.concatenate([[0.0], np.cumsum(np.where(own, 0.0, t))])
        self.PS = np.concatenate([[0.0], np.cumsum(np.where(own, t, 0.0))])
        # module units in [i, j): a stage without one runs no module call (an idle rank)
        self.PC = np.concatenate([[0.0], np.cumsum(is_mod)])
        self.PM = np.concatenate([[0.0], np.cumsum(pm)])
        self.PA = np.concatenate([[0.0], np.cumsum(act)])
        # (n + 1,) bytes crossing the cut before unit j
        self.cut = np.asarray(cut, dtype=np.float64)
        self.comm_time = 2.0 * self.cut / cfg.bandwidth  # activations forward + gradients backward
        self.inflight = np.array([inflight(s, self.num_ranks, cfg) for s in range(num_stages)])
        # normalisers for mixing time and memory (SageMaker normalises both before weighting)
        self.total_time = max(float(self.PT[-1] + self.PS[-1]), 1e-30)
        self.total_mem = max(float(self.PM[-1] + self.PA[-1] * self.inflight.max()), 1e-30)

    def compute_time(self, i: int, j: int) -> float:
        """Forward+backward seconds of a stage on units [i, j), replayed container code included."""
        return float(self.PT[j] - self.PT[i] + self.PS[j])

    def time(self, i: int, j: int) -> float:
        return self.compute_time(i, j) + float(self.comm_time[i] + self.comm_time[j])

    def memory(self, s: int, i: int, j: int) -> float:
        return float(self.PM[j] - self.PM[i] + (self.PA[j] - self.PA[i]) * self.inflight[s])

    def cost(self, s: int, i: int, j: int, cap: float | None = None) -> float:
        """Objective of stage ``s`` covering units [i, j); inf if over the memory cap or if the
        stage holds no module call."""
        if self.PC[j] - self.PC[i] < 1:
            return math.inf
        mem = self.memory(s, i, j)
        cap = self.cfg.memory_cap if cap is None else cap
        if cap is not None and mem > cap:
            return math.inf
        w = self.cfg.memory_weight
        return (1 - w) * self.time(i, j) / self.total_time + w * mem / self.total_mem

    def cost_all_i(self, s: int, j: int, cap: float | None) -> np.ndarray:
        """``cost(s, i, j)`` for every i in [0, j), vectorised: shape (j,)."""
        t = self.PT[j] - self.PT[:j] + self.PS[j] + self.comm_time[:j] + self.comm_time[j]
        mem = self.PM[j] - self.PM[:j] + (self.PA[j] - self.PA[:j]) * self.inflight[s]
        w = self.cfg.memory_weight
        c = (1 - w) * t / self.total_time + w * mem / self.total_mem
        if cap is not None:
            c = np.where(mem > cap, np.inf, c)
        return np.where(self.PC[j] - self.PC[:j] < 1, np.inf, c)

    def unit_memory(self, k: int, s: int = 0) -> float:
        return float(self.unit_static[k] + self.unit_act[k] * self.inflight[s])
