"""The main job.

    python -m rag_mm.train +experiment=demo                         # one process
    torchrun --nproc_per_node=2 -m rag_mm.train +experiment=demo    # data parallel, one node
    python -m rag_mm.train --multirun hydra/launcher=slurm +experiment=demo   # SLURM via submitit
"""

from __future__ import annotations

import json
import logging
import os
import sys

import hydra
from omegaconf import DictConfig, OmegaConf

from rag_mm.config import ConfigError, check_shards, register_configs, validate

register_configs()


def _setup_logging() -> None:
    rank = os.environ.get("RANK", "0")
    logging.basicConfig(
        level=logging.INFO if rank == "0" else logging.WARNING,
        format=f"%(asctime)s | rank {rank} | %(levelname)s | %(name)s | %(message)s",
        force=True,
    )
    logging.getLogger("faiss").setLevel(logging.WARNING)  # its loader logs every CPU-feature probe


@hydra.main(version_base="1.3", config_path="../conf", config_name="config")
def main(cfg: DictConfig) -> None:
    from rag_mm import preemption

    preemption.from_submitit()  # SLURM tasks started by submitit: set torchrun's RANK, WORLD_SIZE, ...
    _setup_logging()
    from rag_mm.distributed import world_size_from_env

    try:  # reject bad values before any heavy import or work
        validate(cfg, world_size_from_env())
        check_shards(cfg)
    except ConfigError as exc:
        print(f"rag_mm.train: {exc}", file=sys.stderr)
        sys.exit(2)
    from rag_mm.trainer import Trainer

    trainer = Trainer(cfg)
    requeue = preemption.SubmititRequeue(trainer._on_sigterm)  # submitit's USR2: checkpoint, then requeue
    try:
        trainer.restore()
        summary = trainer.fit()
    except Exception as exc:
        if trainer.env.world_size > 1:  # name the stuck rank and the operation, not only gloo's message
            logging.getLogger(__name__).error("%s", trainer.watch.explain(exc))
        trainer.metrics.close()  # no close(): its final barrier would wait on the dead or stuck peer
        trainer.watch.close()
        raise
    trainer.close()
    requeue.hand_over()
    if trainer.env.is_main:
        print(json.dumps(summary, indent=1))
    logging.getLogger(__name__).info("run directory: %s", OmegaConf.select(cfg, "run_dir"))


if __name__ == "__main__":
    main()
