"""Which parallel layout to run the reader with: ``parallel.plan_layout`` on the run's own reader.

    python -m rag_mm.plan +experiment=demo cluster=p4d cluster.nodes=2            # ranked table
    python -m rag_mm.plan +experiment=demo cluster=h100 cluster.nodes=4 global_batch=1024 \\
        format=json
    python -m rag_mm.train +experiment=demo parallel=auto                         # plan at start-up

Arguments of the command line: ``cluster=<preset>`` (``conf/cluster/<preset>.yaml``, default
``local``), ``cluster.<field>=<value>`` (any ``parallel.Cluster`` field: ``nodes``,
``devices_per_node``, ``device_memory_bytes``, ...), ``global_batch=<samples per optimizer step>``
(default: ``data.global_batch_size``, or ``data.batch_size x`` the cluster's devices, the batch
plain data parallel would train with, ``x optim.grad_accum``), ``format=table|json``,
``top=<rows>``. Every other argument is a training override, composed as ``python -m rag_mm.train``
composes it.

What is planned: only the reader (``rag_mm.distributed.spread`` spreads the reader alone; the
retriever stays whole on every rank), traced on the meta device (no weights: any preset plans on any
machine) on an example batch shaped like the run's: ``retriever.top_k``
documents per query, ``model.image_size`` pictures, ``model.max_*`` text lengths (the longest, so
the activation memory is an upper bound). Activation checkpointing and CPU offload are the run's
own (``parallel.activation_checkpointing``, ``parallel.cpu_offload``): the planner prices them, it
does not choose them.

The planner returns the runtime's ``ParallelConfig`` of each candidate; ``layout_overrides``
turns one into rag_mm's command line: ``parallel.<field>`` for its degrees and every field it sets
otherwise than the run, plus the batch, accumulation and precision keys that keep the planned
global batch.

``parallel=auto`` (``launch.auto_layout``, ``resolve_auto``): the plan for the world the run has
(the ``local`` preset with ``WORLD_SIZE`` ranks, ``LOCAL_WORLD_SIZE`` per node; the device memory of
the GPU on CUDA), in the run's ``optim.precision``, for the run's global batch. Every rank plans on
its own and all pick the same layout: the estimates come from the trace's FLOPs and saved-activation
bytes (the planner balances stages on FLOPs and never reads timings, so the trace runs no timed
pass), which do not depend on the rank or on the machine's load, and the ranking is a stable sort of
a fixed enumeration.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import shlex
import sys
from typing import Any

import torch
import yaml
from omegaconf import OmegaConf

from parallel.cluster import Cluster
from parallel.config import DEGREES
from rag_mm.config import ConfigError, TrainConfig, compose, runtime_config, validate

log = logging.getLogger(__name__)

# samples in the traced batch: the planner scales per-sample FLOPs and bytes to any batch
SAMPLES = 2
# command-line keys that are not training overrides
OWN_KEYS = (
    "cluster",
    "global_batch",
    "format",
    "top",
)
FORMATS = ("table", "json")
AUTO_TOP = 3  # layouts the start-up log shows


def example_inputs(cfg: TrainConfig, samples: int = SAMPLES) -> dict[str, torch.Tensor]:
    """A reader batch shaped like the run's, on the CPU: full-length texts, ``retriever.top_k``
    documents per query (none in closed-book mode)."""
    m, k = cfg.model, cfg.retriever.top_k
    img, lq, la, lt = m.image_size, m.max_question, m.max_answer, m.max_doc_text
    x = {
        "image": torch.zeros(samples, 3, img, img),  # (B, 3, H, W)
        "q_ids": torch.zeros(samples, lq, dtype=torch.long),
        "q_len": torch.full((samples,), lq),
        "a_ids": torch.zeros(samples, la, dtype=torch.long),
        "a_len": torch.full((samples,), la),
    }
    if k > 0:
        x |= {
            "doc_image": torch.zeros(samples, k, 3, img, img),  # (B, k, 3, H, W)
            "doc_ids": torch.zeros(samples, k, lt, dtype=torch.long),
            "doc_len": torch.full((samples, k), lt),
        }
    return x


def tp_divisor(cfg: TrainConfig) -> int:
    """tp must divide the reader's attention heads (the query heads of a Hugging Face LM: key/value
    heads tp does not divide are replicated) and its vision tower's (``validate``'s rule)."""
    m = cfg.model
    if m.family == "hf_vlm":  # the VLM's own language model and tower
        from rag_mm.model.hf_vlm import tp_divisor as vlm_tp_divisor

        return vlm_tp_divisor(m)
    vision_heads = m.vision_width // m.vision_head_width
    if m.family == "hf":
        from rag_mm.model.hf_reader import lm_config

        text = lm_config(m).get_text_config()
        return math.gcd(text.num_attention_heads, vision_heads)
    return math.gcd(m.heads, vision_heads)


def plan(
    cfg: TrainConfig,
    cluster: Cluster,
    global_batch: int,
    precisions: tuple[str, ...] = ("bf16", "fp32"),
):
    """``parallel.Plan`` of the run's reader on ``cluster`` for ``global_batch`` samples per
    step."""
    from parallel import plan_layout
    from rag_mm.config import reader_tokenizer
    from rag_mm.data.tokenizer import get_tokenizer
    from rag_mm.model.factory import build_reader

    model_cfg = OmegaConf.to_object(cfg.model) if OmegaConf.is_config(cfg.model) else cfg.model
    # on the meta device: no weight is allocated or initialised (an 8B preset plans on a laptop),
    # and the planner reads only the trace's FLOPs and bytes, which the meta device gives
    reader = build_reader(
        model_cfg, get_tokenizer(reader_tokenizer(model_cfg)).vocab_size, meta=True
    )
    example = {k: v.to("meta") for k, v in example_inputs(cfg).items()}
    run = runtime_config(cfg)  # the fields the planner does not choose stay the run's
    return plan_layout(
        reader,
        example,
        cluster,
        global_batch=global_batch,
        tp_divisor=tp_divisor(cfg),
        precisions=precisions,
        checkpointing=(run.activation_checkpointing != "none",),
        offload=(run.cpu_offload,),
        passes=0,
        base=run,
    )


def default_global_batch(cfg: TrainConfig, world: int) -> int:
    """Samples per optimizer step: ``data.global_batch_size`` (or ``data.batch_size`` on every
    rank, the batch plain data parallel would take) x ``optim.grad_accum``."""
    per_step = cfg.data.global_batch_size or cfg.data.batch_size * world
    return per_step * cfg.optim.grad_accum


def _split(override: str) -> tuple[str, str]:
    key, _, value = override.partition("=")
    return key.lstrip("+~"), value


def _yaml(value: Any) -> str:
    """A value as a Hydra override writes it (true / false / null, names and numbers as they
    are)."""
    return yaml.safe_dump(value, default_flow_style=True).removesuffix("\n...\n").strip()


def layout_overrides(cfg: TrainConfig, est) -> list[str]:
    """The command line that runs the planner's candidate ``est`` (a ``parallel.planner.Estimate``)
    as the run ``cfg`` is configured: ``parallel.<degree>`` for its four degrees and
    ``parallel.<field>`` for every other field its ``ParallelConfig`` sets otherwise than the run;
    ``data.batch_size`` (per data-parallel replica: the microbatches of one optimizer micro-step),
    ``data.eval_batch_size`` only where the run's does not split into the pipeline's microbatches,
    ``optim.grad_accum`` and ``optim.precision`` (bf16: autocast)."""
    c, run = est.config, runtime_config(cfg)
    o = [f"parallel.{d}={getattr(c, d)}" for d in DEGREES]
    o += [
        f"parallel.{f.name}={_yaml(getattr(c, f.name))}"
        for f in dataclasses.fields(c)
        if f.name not in DEGREES and getattr(c, f.name) != getattr(run, f.name)
    ]
    per_replica = est.microbatch_size * c.microbatches
    if per_replica:
        o.append(f"data.batch_size={per_replica}")
        if cfg.data.eval_batch_size % c.microbatches:
            o.append(f"data.eval_batch_size={per_replica}")
    return o + [f"optim.grad_accum={est.grad_accum}", f"optim.precision={est.precision}"]


def apply(cfg: TrainConfig, overrides: list[str]) -> None:
    """Set ``key=value`` overrides on a composed config (values read as YAML, like Hydra's)."""
    for o in overrides:
        key, value = _split(o)
        OmegaConf.update(cfg, key, yaml.safe_load(value), merge=False)


def rag_mm_problem(cfg: TrainConfig, overrides: list[str], world: int) -> str | None:
    """Why rag_mm would reject the config with ``overrides`` on ``world`` ranks, or None."""
    trial = cfg.copy()
    apply(trial, overrides)
    try:
        validate(trial, world)
    except ConfigError as exc:
        return str(exc).replace("invalid config:\n  - ", "").replace("\n  - ", "; ")
    return None


def runnable(cfg: TrainConfig, p, world: int, n: int) -> list[tuple[Any, list[str]]]:
    """The first ``n`` fitting layouts of plan ``p`` that rag_mm validates, with their overrides."""
    out = []
    for lay in p.fitting:
        o = layout_overrides(cfg, lay)
        why = rag_mm_problem(cfg, o, world)
        if why is None:
            out.append((lay, o))
            if len(out) == n:
                break
        else:
            log.debug("layout %s skipped: %s", lay.key, why)
    return out


# ------------------------------------------------------------------------------ parallel=auto


def auto_cluster(world: int, local_world: int | None = None) -> Cluster:
    """The run's own machines: the ``local`` preset with ``world`` ranks, ``local_world`` per node
    (torchrun's LOCAL_WORLD_SIZE), and the GPU's memory per device on CUDA."""
    dpn = local_world if local_world and world % local_world == 0 else world
    c = Cluster.preset("local", nodes=world // dpn, devices_per_node=dpn)
    if torch.cuda.is_available():
        c.device_memory_bytes = float(torch.cuda.get_device_properties(0).total_memory)
    return c


def resolve_auto(cfg: TrainConfig, world: int, local_world: int | None = None):
    """``launch.auto_layout``: plan the reader for ``world`` ranks and set the best fitting layout's
    overrides (parallel degrees, microbatches, schedule, the per-rank batch that keeps the run's
    global batch, accumulation) on ``cfg``; log the top layouts and why. Returns the candidate
    chosen (None when ``launch.auto_layout`` is off); ``ConfigError`` when none fits."""
    if not cfg.launch.auto_layout:
        return None
    validate(cfg, world)  # the reader is built from cfg.model: reject bad values before building it
    cluster = auto_cluster(world, local_world)
    gb = default_global_batch(cfg, world)
    p = plan(cfg, cluster, gb, precisions=(cfg.optim.precision,))
    best = runnable(cfg, p, world, 1)
    if not best:
        why = "; ".join(f"{lay.key}: {', '.join(lay.reasons)}" for lay in p.layouts[:3])
        raise ConfigError(
            f"parallel=auto: no layout of the reader fits {world} rank(s) of {cluster.name} "
            f"(global batch {gb}): {why or 'none considered'}"
        )
    lay, overrides = best[0]
    apply(cfg, overrides)
    log.info(
        "parallel=auto: %s for %d rank(s), global batch %d (%s)\n%s\nparallel=auto overrides: %s",
        lay.key,
        world,
        gb,
        "; ".join(lay.reasons),
        p.table(AUTO_TOP, rejected=0),
        " ".join(overrides),
    )
    return lay


# ------------------------------------------------------------------------------ command line


class UsageError(ValueError):
    """A bad command-line argument; the message says which."""


def parse(argv: list[str]) -> tuple[list[str], str, dict[str, Any], dict[str, Any]]:
    """argv -> (training overrides, cluster preset, cluster field overrides, options)."""
    train, preset, fields, opts = (
        [],
        "local",
        {},
        {"global_batch": None, "format": "table", "top": 10},
    )
    known = {f.name for f in dataclasses.fields(Cluster)} - {"name", "peak_flops"}
    for a in argv:
        if "=" not in a:
            raise UsageError(f"expected key=value, got {a!r}")
        key, value = a.split("=", 1)
        if key == "cluster":
            preset = value
        elif key.startswith("cluster."):
            f = key.removeprefix("cluster.")
            if f not in known:
                raise UsageError(f"unknown key {key!r}; cluster keys: {', '.join(sorted(known))}")
            fields[f] = yaml.safe_load(value)
        elif key in ("global_batch", "top"):
            try:
                opts[key] = int(value)
            except ValueError:
                raise UsageError(f"{key} must be an integer (got {value!r})") from None
            if opts[key] <= 0:
                raise UsageError(f"{key} must be positive (got {value})")
        elif key == "format":
            if value not in FORMATS:
                raise UsageError(f"format must be one of {FORMATS} (got {value!r})")
            opts[key] = value
        else:
            train.append(a)
    return train, preset, fields, opts


def make_cluster(preset: str, fields: dict[str, Any]) -> Cluster:
    try:
        c = Cluster.preset(preset, **fields)
    except (TypeError, ValueError) as exc:  # an unknown preset, or a value of the wrong type
        raise UsageError(str(exc)) from None
    for key in ("nodes", "devices_per_node"):
        if getattr(c, key) <= 0:
            raise UsageError(f"cluster.{key} must be positive (got {getattr(c, key)})")
    return c


def command(train: list[str], overrides: list[str], cluster: Cluster) -> str:
    """The launch line of a layout: the training overrides (those the layout sets dropped) and its
    own."""
    keys = {_split(o)[0] for o in overrides}
    args = [a for a in train if _split(a)[0] not in keys] + overrides
    launch = (
        "python -m rag_mm.train"
        if cluster.world == 1
        else (
            f"torchrun --nnodes={cluster.nodes} --nproc_per_node={cluster.devices_per_node} -m "
            "rag_mm.train"
        )
    )
    return f"{launch} {shlex.join(args)}"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if any(a in ("-h", "--help") for a in argv):
        print(__doc__)
        return 0
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    try:
        train, preset, fields, opts = parse(argv)
        cluster = make_cluster(preset, fields)
        try:
            cfg = compose(train)
        except (HydraException, OmegaConfBaseException) as exc:
            raise UsageError(str(exc)) from None
        validate(cfg, cluster.world)
    except (UsageError, ConfigError) as exc:
        print(f"rag_mm.plan: {exc}", file=sys.stderr)
        return 2
    gb = opts["global_batch"] or default_global_batch(cfg, cluster.world)
    p = plan(cfg, cluster, gb)
    if opts["format"] == "json":  # with each layout's command line, as rag_mm runs it
        out = p.to_dict(opts["top"])
        for d, lay in zip(out["layouts"], p.layouts):
            d["overrides"] = layout_overrides(cfg, lay)
        print(json.dumps(out, indent=1))
        return 0
    print(p.table(opts["top"]))
    best = runnable(cfg, p, cluster.world, 3)
    print(
        "\nbest layouts, as rag_mm runs them:"
        if best
        else "\nno fitting layout that rag_mm accepts"
    )
    for i, (lay, o) in enumerate(best, 1):
        print(f"{i}. {lay.key} ({'; '.join(lay.reasons)})\n   {command(train, o, cluster)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
