"""Stopping together on a preemption notice, and running under SLURM through submitit.

- ``any_rank(flag)``: a spot reclaim may reach one node before another (or one rank only, when a
  user sends SIGTERM by hand). Every rank must stop after the *same* step, or the checkpoint save
  (a collective) would pair with another rank's training step. So the stop decision is all-reduced.
- ``Stopped``: a phase that would outlast a scheduler's grace period (an evaluation, an index
  refresh, the retriever warm-up, the blind prior's table) is abandoned at its next batch instead
  of finished; every rank raises it at the same point, and the trainer then checkpoints the last
  completed step and exits.
- ``from_submitit()``: Hydra's submitit launcher starts one process per SLURM task; it sets
  torchrun's variables (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT) from submitit's
  job environment so ``init_distributed`` works unchanged.
- ``SubmititRequeue``: submitit sends USR2 ``signal_delay_s`` before the time limit (or on
  preemption) and its handler requeues the job right away. We first save a checkpoint: the
  trainer treats USR2 like SIGTERM, and after it stopped, rank 0 hands over to submitit's handler,
  which requeues the job; the requeued job resumes with ``resume=auto``.
"""

from __future__ import annotations

import logging
import os
import signal

import torch

from rag_mm.distributed.env import all_reduce_sum

log = logging.getLogger(__name__)
# MASTER_PORT = base + job id % 20000: distinct jobs on one node rarely clash
SUBMITIT_PORT_BASE = 20000


class Stopped(Exception):
    """A stop signal ended a phase between two of its batches; the message says which and where."""


def any_rank(flag: bool) -> bool:
    """True on every rank if ``flag`` is true on any rank (a collective when distributed)."""
    return bool(all_reduce_sum(torch.tensor([float(flag)])).item() > 0)


def under_submitit() -> bool:
    return "SUBMITIT_EXECUTOR" in os.environ or "SUBMITIT_FOLDER" in os.environ


def from_submitit() -> None:
    """Under submitit with several tasks, describe the job the way torchrun would."""
    if not under_submitit() or "RANK" in os.environ:
        return
    import submitit

    env = submitit.JobEnvironment()
    if env.num_tasks <= 1:
        return
    os.environ.update(
        RANK=str(env.global_rank),
        WORLD_SIZE=str(env.num_tasks),
        LOCAL_RANK=str(env.local_rank),
        LOCAL_WORLD_SIZE=str(env.num_tasks // max(env.num_nodes, 1)),
        MASTER_ADDR=env.hostnames[0],
        # RAG_MM_MASTER_PORT: a port known to be free (sbatch exports the login shell's MASTER_PORT,
        # if any)
        MASTER_PORT=os.environ.get(
            "RAG_MM_MASTER_PORT",
            str(SUBMITIT_PORT_BASE + int(str(env.job_id).split("_")[0]) % 20000),
        ),
    )
    log.info(
        "submitit task %d/%d on %s: master %s:%s",
        env.global_rank,
        env.num_tasks,
        env.hostname,
        os.environ["MASTER_ADDR"],
        os.environ["MASTER_PORT"],
    )


class SubmititRequeue:
    """Under submitit: its requeue signal asks the trainer to checkpoint and stop; ``hand_over``
    then lets submitit requeue the job. Outside submitit it does nothing."""

    def __init__(self, on_signal) -> None:
        self.signum = None
        self.previous = None
        if not under_submitit():
            return
        self.sig = getattr(signal, "SIG" + os.environ.get("SUBMITIT_PREEMPT_SIGNAL", "USR2"))

        def handler(signum, frame):
            self.signum = signum
            on_signal(signum, frame)

        self.previous = signal.signal(self.sig, handler)

    def hand_over(self) -> None:
        """After the checkpoint: submitit's own handler requeues the job (rank 0) and exits."""
        if self.signum is None or not callable(self.previous):
            return
        log.warning(
            "checkpoint saved after signal %d: handing over to submitit to requeue the job",
            self.signum,
        )
        self.previous(self.signum, None)
