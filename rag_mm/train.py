"""The main job.

python -m rag_mm.train +experiment=demo                         # one process
torchrun --nproc_per_node=2 -m rag_mm.train +experiment=demo    # data parallel, one node
python -m rag_mm.train --multirun hydra/launcher=slurm +experiment=demo   # SLURM via submitit
"""

from __future__ import annotations

import logging
import os
import sys
from typing import NoReturn

import hydra
from omegaconf import DictConfig, OmegaConf

from rag_mm.checks.paths import check_paths, data_key, run_dir_problems
from rag_mm.components.metrics import strict_dumps
from rag_mm.config import ConfigError, register_configs, resolve_batch, validate

register_configs()


def _fail(exc: ConfigError, cfg=None) -> NoReturn:
    """Bad input (a config value, a path, data that cannot feed the run): one message, exit 2.
    A data error raised in the data layer names its shards; the config key is added here."""
    urls = getattr(exc, "urls", None)
    key = data_key(cfg, urls) if cfg is not None and urls else ""
    print(f"rag_mm.train: {key + ': ' if key else ''}{exc}", file=sys.stderr)
    sys.exit(2)


def _check_output_dir(argv: list[str]) -> None:
    """Hydra creates the run's output directory (``hydra.run.dir``, which is ``run_dir``) and
    writes ``.hydra/`` into it before ``main`` runs: a file in its place or a read-only parent
    would end in Hydra's traceback. The overrides are composed once here to check it first; a
    command line Hydra itself would reject (or a sweep, or a flag) is left to Hydra."""
    if any(a.startswith("-") for a in argv):
        return
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from rag_mm.config import compose

    try:
        cfg = compose(argv, return_hydra_config=True)
        run_dir, out_dir = str(cfg.run_dir), str(cfg.hydra.run.dir)
    except (HydraException, OmegaConfBaseException):
        return
    problems = run_dir_problems("run_dir", run_dir)
    if out_dir != run_dir:
        problems += run_dir_problems("hydra.run.dir", out_dir)
    if problems:
        _fail(ConfigError("invalid paths:\n  - " + "\n  - ".join(problems)))


def _close_after_disk_fault(trainer) -> None:
    """Close what can be closed once the run directory refused a write (closing writes too: the
    metrics file and TensorBoard's events flush, and fail again on that disk)."""
    for close in (trainer.metrics.close, trainer.watch.close):
        try:
            close()
        except OSError:
            pass
    if trainer.memory is not None:
        trainer.memory.cancel()
        trainer.memory.close()


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
    from rag_mm.ft import preemption

    # SLURM tasks started by submitit: set torchrun's RANK, WORLD_SIZE, ...
    preemption.from_submitit()
    _setup_logging()
    from rag_mm.distributed.env import world_size_from_env

    try:  # reject bad values and paths before any heavy import or work
        if (
            cfg.launch.auto_layout
        ):  # plan the layout for this world and set it on cfg (every rank picks the same)
            from rag_mm.plan import resolve_auto

            resolve_auto(
                cfg, world_size_from_env(), int(os.environ.get("LOCAL_WORLD_SIZE", "0")) or None
            )
        else:  # (parallel=auto sets the per-replica batch that keeps the global one itself)
            resolve_batch(cfg, world_size_from_env())
        validate(cfg, world_size_from_env())
        check_paths(cfg)
    except ConfigError as exc:
        _fail(exc)
    from rag_mm.trainer import Trainer

    try:  # the document memory is read here: a corpus without a readable document stops the run
        trainer = Trainer(cfg)
    except ConfigError as exc:
        _fail(exc, cfg)
    # submitit's USR2: checkpoint, then requeue
    requeue = preemption.SubmititRequeue(trainer._on_sigterm)
    try:
        trainer.restore()
        summary = trainer.fit()
    except (
        ConfigError
    ) as exc:  # a split whose every shard or sample is unreadable (rag_mm.data.DataError)
        trainer.metrics.close()
        trainer.watch.close()
        _fail(exc, cfg)
    except Exception as exc:
        from rag_mm.ft import disk

        found = disk.fault(exc)
        if found is not None:  # a full or read-only disk: one message, no traceback
            _close_after_disk_fault(trainer)
            if trainer.env.is_main:
                print(
                    f"rag_mm.train: {disk.failure_message(found, trainer.run_dir, trainer.ckpt.dir, trainer.ckpt_bytes, cfg.keep_checkpoints, exc)}",  # noqa: E501
                    file=sys.stderr,
                    flush=True,
                )
            if isinstance(
                exc, disk.WriteFailed
            ):  # raised on every rank: wait for rank 0's message and clean-up
                from rag_mm.distributed.env import barrier

                barrier()  # (a launcher stops the other ranks as soon as one exits)
            sys.exit(1)
        if (
            trainer.env.world_size > 1
        ):  # name the stuck rank and the operation, not only gloo's message
            logging.getLogger(__name__).error("%s", trainer.watch.explain(exc))
        # no close(): its final barrier would wait on the dead or stuck peer
        trainer.metrics.close()
        trainer.watch.close()
        raise
    trainer.close()
    requeue.hand_over()
    if trainer.env.is_main:
        print(strict_dumps(summary, indent=1))
    logging.getLogger(__name__).info("run directory: %s", OmegaConf.select(cfg, "run_dir"))


if __name__ == "__main__":
    _check_output_dir(sys.argv[1:])
    main()
