"""Typed configuration: one dataclass per Hydra group, registered in Hydra's ConfigStore.

YAML files under ``conf/`` only choose and override; every field is declared (with its reason)
here, in ``retriever/config.py`` (``retriever``) or in the runtime's ``parallel/config.py``
(``parallel``: the reader's layout is the runtime's own ``ParallelConfig``, every field a key), so
a typo in a key is rejected by Hydra and a bad value by ``validate`` before any work. The layout
is checked by the runtime (``ParallelConfig.problems``); ``validate`` adds the reader's rules.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, OmegaConf

from parallel.config import ParallelConfig
from retriever.config import RetrieverConfig
from retriever.config import validate as validate_retriever

log = logging.getLogger(__name__)


class ConfigError(ValueError):
    """A config value that cannot work; the message names the key."""


@dataclass
class ModelConfig:
    """The reader: an open_clip vision tower feeding a joint text-image transformer, either
    rag_mm's own (``family: native``) or a Hugging Face causal LM (``family: hf``)."""

    name: str = "small"  # label for logs and run names
    # native: rag_mm's transformer (dim, layers, heads, ... below) | hf: any decoder that
    # transformers' AutoModelForCausalLM builds, from ``pretrained`` or from ``lm`` / ``lm_config``
    # | hf_vlm: a vision-language model (AutoModelForImageTextToText), its own tower and
    # projector, from ``pretrained`` or ``vlm_config``
    family: str = "native"
    # hf: a local directory saved by save_pretrained (config.json + safetensors, tokenizer
    # optional), loaded offline; its weights are the reader's starting point
    pretrained: str | None = None
    # hf, random init: the LM's config, ``model_type`` plus the fields that family's config takes
    # (a preset in conf/model/ fills it); ignored when ``pretrained`` or ``lm_config`` is set
    lm: dict[str, Any] = field(default_factory=dict)
    # hf, random init: a local config.json (or its directory) instead of ``lm``
    lm_config: str | None = None
    # hf, random init: the LM embeds the tokenizer's ids only (a Llama preset's 128,256 rows for a
    # 49,408-token tokenizer are 161 M dead parameters with gradients and AdamW state); false keeps
    # the preset's vocabulary (a checkpoint saved with it)
    trim_vocab: bool = True
    # hf_vlm, random init (ignored when ``pretrained`` is set): a VLM family built at the size
    # fields (llava | paligemma), a public preset (llava-1.5-7b | paligemma-3b-pt-224; see
    # rag_mm.model.vlm_presets), or a local config.json (or its directory)
    vlm_config: str | None = None
    # a local Hugging Face tokenizer directory; None: ``pretrained``'s own tokenizer when it holds
    # one, else the bundled CLIP BPE (randomly initialised readers)
    tokenizer: str | None = None
    # picture tokens -> the reader's width: linear (one map) | mlp2x_gelu (LLaVA-1.5's two-layer
    # MLP with GELU: each patch gets a nonlinear map of its own before the blocks mix patches with
    # words). None: the family's own, linear for native, mlp2x_gelu for hf (hf_vlm: its own)
    projector: str | None = None
    # hf: the reader's own weights (projector, rank and type embeddings, copy head) as
    # ``python -m rag_mm.export`` writes them (adapter.safetensors); None: freshly initialised
    adapter: str | None = None
    # transformer width; the demo needs little capacity, and a narrow model trains it on a CPU in
    # minutes
    dim: int = 128
    layers: int = 4  # transformer blocks: 2 to find the fact's slot, 2 to copy it is the minimum
    heads: int = 4  # attention heads; must divide dim
    mlp_ratio: float = 4.0  # MLP hidden size = mlp_ratio * dim, as in GPT-2 / ViT
    # native: the blocks' MLP. gelu: GPT-2's fc -> GELU -> proj. swiglu: Llama's
    # SiLU(gate x) * (up x) -> down, whose product of two projections of one token lets a block
    # compare two things that token has gathered (a word of the question, the picture's colour)
    mlp: str = "gelu"
    dropout: float = 0.0  # off: the demo data is clean and deterministic tests need no RNG here
    vision_width: int = 128  # open_clip ViT width
    vision_layers: int = 2  # open_clip ViT depth; pictures are simple shapes
    vision_head_width: int = 32  # open_clip uses head width rather than head count
    patch_size: int = 8  # 32 px pictures -> 4 x 4 = 16 patch tokens per image
    image_size: int = 32  # must match the data's pictures
    vision_checkpoint: str | None = None  # local path of pretrained open_clip visual weights
    # SimCLR steps of the vision tower on the training split's pictures alone before the reader
    # trains (rag_mm.model.vision_ssl; a fresh run only, not checkpointed). Trained on question-
    # answer pairs alone, a reader can tell its training pictures apart by colour, size and place
    # and memorise the rest per picture; two views differing in those share only the thing's form.
    # 0: off (the demo's facts come from documents, not from form)
    vision_ssl_steps: int = 0
    # the SimCLR phase's peak learning rate (the run's AdamW at its own rate, cosine to a tenth)
    vision_ssl_lr: float = 1e-3
    # pictures per SimCLR step on each rank (0: data.batch_size): every other picture of the batch
    # is a negative, and SimCLR's features improve with more of them
    vision_ssl_batch: int = 0
    # the largest turn of a SimCLR view, degrees either way (180: any), and whether half the views
    # are mirrored. What the views vary, the tower learns to ignore: small turns and no mirror keep
    # the orientation that a digit's class or a left / right question needs, and a tower that
    # sees orientation still tells shapes apart, so they are the default; any turn and mirror
    # only for pictures whose answers never depend on orientation
    vision_ssl_rotate: float = 15.0
    vision_ssl_mirror: bool = False
    max_doc_text: int = 40  # document text tokens kept per document (the demo's passages are ~21)
    max_question: int = 24  # question tokens kept
    max_answer: int = 8  # answer tokens kept, EOT included
    max_segment_len: int = 128  # learned positions within a segment (doc or query)
    # the query segment's order (causal): false reads the picture, then the question, as LLaVA-style
    # VLMs are trained to; true reads the question first, so every picture patch attends to the
    # question's words (question-conditioned vision) and a word can be matched against what each
    # patch shows. A pretrained VLM keeps false
    question_first: bool = False
    # the query's picture and question attend to each other both ways and the answer reads them
    # causally (a prefix-LM, as PaliGemma reads its prefix): a word can query every patch and every
    # patch every word, whatever the order. The prefix is laid out as one more bidirectional
    # segment of the retrieval layout, which does not read the documents, so it is for closed-book
    # readers (retriever.mode=none); false: the query segment is causal throughout
    query_prefix: bool = False
    max_docs: int = 16  # learned retrieval-rank embeddings: documents per query the reader accepts
    # auto | fused | sdpa | flex | reference (see parallel.kernels.attention)
    attention_backend: str = "auto"
    # LM head shares the token embedding (GPT-2 style), halves vocab params
    tie_embeddings: bool = True
    # pointer-generator answer head (See et al. 2017): copying a fact from a document is learned far
    # faster than generating it
    copy_head: bool = True
    # weight of the copy head's pointer supervision (rag_mm/model/copy_head.py): where the answer
    # token is in a document or the question, the copy distribution alone must name it and the
    # gate must copy. Without it the reader memorises training answers and never copies a name it
    # was not trained to say. 0: the head learns from the answer NLL alone
    copy_supervision: float = 1.0
    # share of training examples whose copyable answer tokens are renamed to random tokens wherever
    # the example shows them (rag_mm/model/anonymize.py): the reader learns to copy and stop
    # whatever a span's tokens are, so it copies a name it never saw trained; 0: answers as given
    copy_anonymize: float = 0.25


@dataclass
class DataConfig:
    """Where the shards are and how they are read."""

    root: str = "data/knowledge_world"  # base directory; the patterns below are relative to it
    # document memory shards (brace expansion); None: no memory, for a closed-book run
    # (retriever.mode=none), which reads no document
    corpus: str | None = "corpus/corpus-{000000..000000}.tar"
    train: str = "train/train-{000000..000005}.tar"  # training query shards
    val: str = "val/val-{000000..000000}.tar"  # periodic evaluation
    test: str = "test/test-{000000..000000}.tar"  # final evaluation
    batch_size: int = 32  # queries per data-parallel replica per micro-step
    # queries per micro-step over all data-parallel replicas; > 0: each replica takes
    # global_batch_size / dp and batch_size is derived from it (resolve_batch), so a run trains
    # with the same batch whatever its layout; 0: batch_size per replica, the global batch grows
    # with dp
    global_batch_size: int = 0
    eval_batch_size: int = 128  # larger: no backward pass in evaluation
    # loader processes per rank: one decodes ahead of the step; more take cores from the ranks on a
    # small host
    num_workers: int = 1
    shuffle_buffer: int = 1000  # sample-level shuffle within a rank's stream
    # training shards each loader worker reads at once, every next sample from one of them at
    # random (before the shuffle buffer): shards written in label order (one class each) still
    # give batches of many labels; each is an open file (or download); 1 reads shards one after
    # another
    shard_interleave: int = 16
    augment: bool = True  # random crop (and colour_jitter) on training query pictures
    # per-channel brightness shift of augmented pictures, uniform in +-colour_jitter (normalised
    # units, ~0.27 of the 0..1 range per unit): an invariance for pictures whose colours carry no
    # answer; 0 keeps colours exact, as a data set that asks about colours needs
    colour_jitter: float = 0.1
    # replicated border (px) the random crop may shift a training picture by; 2 px at 32 px keeps
    # a picture's layout, a quarter of it moves things anywhere
    crop_pad: int = 2
    # largest crop side over the picture's side (1: shift only). > 1 also shrinks the content by
    # up to 1/zoom_out, so a thing's size and place stop naming the training picture it is in: a
    # reader that sees each picture with many questions otherwise memorises per-picture answers
    # it cannot generalise (see the VQA recipe)
    zoom_out: float = 1.0
    # beta of answer balancing (rag_mm/data/balance.py): within each question text the training
    # answers come in proportion to count ** (1 - beta); 0 as the data has them, 1 evenly. For
    # sets whose question texts have a few answers, one of them most of the time (yes/no)
    balance_answers: float = 0.0
    # seed of the query stream: shard order, shuffle, crop and colour augmentation, which samples
    # answer balancing keeps. None: the run's ``seed``. Set apart from it, one run's data order
    # can be tried with another run's initial weights (and the reverse), to tell which of the two
    # a result depends on
    seed: int | None = None


@dataclass
class OptimConfig:
    """AdamW with linear warm-up and cosine decay (the GPT-3 / Chinchilla recipe)."""

    lr: float = 1e-3  # peak learning rate; small model, short run
    min_lr_ratio: float = 0.1  # cosine decays to lr * min_lr_ratio
    weight_decay: float = 0.01  # applied to matrices only, not norms, biases or embeddings
    beta1: float = 0.9  # AdamW first-moment decay
    beta2: float = 0.98  # shorter second-moment memory than 0.999: stabler on short runs
    eps: float = 1e-8  # AdamW denominator guard
    warmup_steps: int = 100  # linear warm-up from 0
    grad_clip: float = 1.0  # global-norm clipping threshold (0 disables)
    grad_accum: int = 1  # micro-steps per optimizer step
    precision: str = "fp32"  # fp32 | bf16 (bf16 autocast on matmuls, fp32 master weights)
    # the vision tower's learning rate over ``lr`` (rag_mm's open_clip tower of the native and hf
    # readers, a VLM's own tower). 1: trained as the rest; 0: frozen (LLaVA's recipe for a
    # pretrained tower). A tower the vision warm-up gave form features loses them again when
    # answers can be memorised per picture at the full rate (BENCHMARKS.md)
    vision_lr_scale: float = 1.0


@dataclass
class LaunchConfig:
    """How the app starts its ranks: the keys only the app reads (the layout itself is the
    ``parallel`` group, the runtime's own ``parallel.ParallelConfig``)."""

    # torch.distributed backend: auto (nccl on GPU, gloo on CPU) | gloo | nccl
    backend: str = "auto"
    # collective timeout: a dead rank fails the job instead of hanging it (the process group's, the
    # mesh's sub-groups', the pipeline's receives and the watchdog's)
    timeout_s: int = 600
    # plan the layout at start-up (rag_mm.plan.resolve_auto; conf/parallel/auto.yaml sets it): the
    # best fitting layout for the run's world replaces the ``parallel`` degrees before validation
    auto_layout: bool = False


@dataclass
class TrainConfig:
    """The whole run. Groups are filled by conf/config.yaml's defaults list."""

    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    # the reader's layout (the runtime's schema); checkpointing never recomputes the vision tower:
    # its activations are small next to the LM's, its recompute is not (``ac_skip``)
    parallel: ParallelConfig = field(default_factory=lambda: ParallelConfig(ac_skip=["vision"]))
    launch: LaunchConfig = field(default_factory=LaunchConfig)
    retriever: RetrieverConfig = field(default_factory=RetrieverConfig)

    name: str = "default"  # run name; the run directory is runs/<name> unless run_dir is set
    run_dir: str = MISSING  # where config, logs, checkpoints and metrics go
    # global seed: model init and the SimCLR warm-up's views; also the data order and
    # augmentation unless data.seed is set
    seed: int = 0
    max_steps: int = 1000  # optimizer steps
    log_every: int = 20  # steps between console / TensorBoard lines
    eval_every: int = 250  # steps between validation passes (0 = only at the end)
    ckpt_every: int = 250  # steps between checkpoints (0 = only at the end)
    keep_checkpoints: int = 2  # newest checkpoints kept on disk
    # before training: can run_dir's file system hold keep_checkpoints + 1 checkpoints (the kept
    # ones and the one being written, estimated from the model)? warn: say so with the numbers and
    # train (free space changes while a run goes on) | stop: refuse to start (exit 2) | off
    disk_check: str = "warn"
    resume: str = "auto"  # auto (newest valid checkpoint in run_dir) | never | <checkpoint path>
    deterministic: bool = False  # deterministic algorithms and seeded workers (bitwise resumable)
    device: str = "auto"  # auto | cpu | cuda
    threads: int = 0  # intra-op threads per rank (0 = torch default)
    progress: bool = True  # rich progress bar on rank 0 when attached to a terminal
    stop_after_steps: int = 0  # testing aid: exit cleanly after this many steps (0 = never)


ATTENTION_BACKENDS = ("auto", "fused", "sdpa", "flex", "reference")
MLPS = ("gelu", "swiglu")
PRECISIONS = ("fp32", "bf16")
BACKENDS = ("auto", "gloo", "nccl")
DISK_CHECKS = ("warn", "stop", "off")


def _positive(errors: list[str], key: str, value: Any) -> None:
    if value is None or value <= 0:
        errors.append(f"{key} must be positive (got {value})")


def validate(cfg: TrainConfig, world_size: int = 1) -> None:
    """Reject values that cannot work, naming every bad key at once. Runs before any work."""
    e: list[str] = []
    m, d, o, r = cfg.model, cfg.data, cfg.optim, cfg.retriever
    for key in (
        "dim",
        "layers",
        "heads",
        "mlp_ratio",
        "vision_width",
        "vision_layers",
        "vision_head_width",
        "patch_size",
        "image_size",
        "max_doc_text",
        "max_question",
        "max_answer",
        "max_segment_len",
        "max_docs",
    ):
        _positive(e, f"model.{key}", getattr(m, key))
    if m.dim > 0 and m.heads > 0 and m.dim % m.heads:
        e.append(f"model.heads ({m.heads}) must divide model.dim ({m.dim})")
    if m.image_size > 0 and m.patch_size > 0 and m.image_size % m.patch_size:
        e.append(f"model.patch_size ({m.patch_size}) must divide model.image_size ({m.image_size})")
    if m.vision_width > 0 and m.vision_head_width > 0 and m.vision_width % m.vision_head_width:
        e.append(
            f"model.vision_head_width ({m.vision_head_width}) must divide model.vision_width "
            f"({m.vision_width})"
        )
    e += _model_family_problems(cfg)
    if m.vision_ssl_steps < 0:
        e.append(f"model.vision_ssl_steps must be >= 0 (got {m.vision_ssl_steps})")
    if m.vision_ssl_batch < 0 or m.vision_ssl_batch == 1:
        e.append(
            "model.vision_ssl_batch must be 0 (data.batch_size) or >= 2 (got "
            f"{m.vision_ssl_batch}): SimCLR needs other pictures as negatives"
        )
    if not 0 <= m.vision_ssl_rotate <= 180:
        e.append(
            f"model.vision_ssl_rotate must be within 0-180 degrees (got {m.vision_ssl_rotate})"
        )
    if m.vision_ssl_steps and m.vision_ssl_lr <= 0:
        e.append(f"model.vision_ssl_lr must be > 0 (got {m.vision_ssl_lr})")
    if o.vision_lr_scale < 0:
        e.append(f"optim.vision_lr_scale must be >= 0 (got {o.vision_lr_scale})")
    if m.attention_backend not in ATTENTION_BACKENDS:
        e.append(
            f"model.attention_backend must be one of {ATTENTION_BACKENDS} (got "
            f"{m.attention_backend!r})"
        )
    if m.mlp not in MLPS:
        e.append(f"model.mlp must be one of {MLPS} (got {m.mlp!r})")
    if m.max_answer < 2:
        e.append(
            f"model.max_answer must be >= 2: one answer token plus end-of-text (got {m.max_answer})"
        )
    for key in ("batch_size", "eval_batch_size", "shuffle_buffer", "shard_interleave"):
        _positive(e, f"data.{key}", getattr(d, key))
    if d.global_batch_size < 0:
        e.append(f"data.global_batch_size must be >= 0 (got {d.global_batch_size})")
    if d.num_workers < 0:
        e.append(f"data.num_workers must be >= 0 (got {d.num_workers})")
    if d.colour_jitter < 0:
        e.append(f"data.colour_jitter must be >= 0 (got {d.colour_jitter})")
    if d.crop_pad < 0:
        e.append(f"data.crop_pad must be >= 0 (got {d.crop_pad})")
    if not 0.0 <= d.balance_answers <= 1.0:
        e.append(f"data.balance_answers is a strength in [0, 1] (got {d.balance_answers})")
    if d.zoom_out < 1.0:
        e.append(
            f"data.zoom_out must be >= 1 (got {d.zoom_out}): it is the largest crop side over the "
            "picture's"
        )
    if m.query_prefix and r.mode != "none":
        e.append(
            f"model.query_prefix=true reads closed book (retriever.mode=none; got "
            f"retriever.mode={r.mode}): the query's prefix does not attend to documents"
        )
    if not d.corpus and r.mode != "none":
        e.append(
            f"data.corpus is needed: retriever.mode={r.mode} reads documents (only retriever=none "
            "runs without one)"
        )
    _positive(e, "optim.lr", o.lr)
    _positive(e, "optim.grad_accum", o.grad_accum)
    if o.warmup_steps < 0:
        e.append(f"optim.warmup_steps must be >= 0 (got {o.warmup_steps})")
    if o.grad_clip < 0:
        e.append(f"optim.grad_clip must be >= 0 (got {o.grad_clip})")
    if not 0.0 <= o.min_lr_ratio <= 1.0:
        e.append(f"optim.min_lr_ratio must be in [0, 1] (got {o.min_lr_ratio})")
    if o.precision not in PRECISIONS:
        e.append(f"optim.precision must be one of {PRECISIONS} (got {o.precision!r})")
    e += validate_retriever(r)
    if r.top_k > m.max_docs:
        e.append(f"retriever.top_k ({r.top_k}) must be <= model.max_docs ({m.max_docs})")
    if r.rerank and r.rerank < r.top_k:
        e.append(
            f"retriever.rerank ({r.rerank}) must be 0 or >= retriever.top_k ({r.top_k}): the "
            "candidates the top-k is chosen from"
        )
    if r.mode == "learned" and r.patch_size > 0 and m.image_size % r.patch_size:
        e.append(
            f"retriever.patch_size ({r.patch_size}) must divide model.image_size ({m.image_size})"
        )
    for key in ("max_steps", "log_every"):
        _positive(e, key, getattr(cfg, key))
    for key in ("eval_every", "ckpt_every", "stop_after_steps", "threads"):
        if getattr(cfg, key) < 0:
            e.append(f"{key} must be >= 0 (got {getattr(cfg, key)})")
    _positive(e, "keep_checkpoints", cfg.keep_checkpoints)
    if cfg.disk_check not in DISK_CHECKS:
        e.append(f"disk_check must be one of {DISK_CHECKS} (got {cfg.disk_check!r})")
    if cfg.device not in ("auto", "cpu", "cuda"):
        e.append(f"device must be auto, cpu or cuda (got {cfg.device!r})")
    e += _launch_problems(cfg.launch) + layout_problems(cfg, world_size)
    if e:
        raise ConfigError("invalid config:\n  - " + "\n  - ".join(e))


FAMILIES = ("native", "hf", "hf_vlm")
PROJECTORS = ("mlp2x_gelu", "linear")


def _model_family_problems(cfg: TrainConfig) -> list[str]:
    """What is wrong with the reader family's own keys (paths are checked for existence here)."""
    from pathlib import Path

    m, e = cfg.model, []
    if m.family not in FAMILIES:
        return [f"model.family must be one of {FAMILIES} (got {m.family!r})"]
    if m.projector is not None and m.projector not in PROJECTORS:
        e.append(f"model.projector must be one of {PROJECTORS} (got {m.projector!r})")
    if m.family == "native":
        for key in ("pretrained", "lm_config", "adapter", "vlm_config"):
            if getattr(m, key):
                e.append(
                    f"model.{key} needs model.family={'hf_vlm' if key == 'vlm_config' else 'hf'} "
                    "(got model.family=native)"
                )
        return e
    if m.family == "hf_vlm":
        return e + _vlm_problems(m) + _tokenizer_fusion_problems(cfg)
    if m.vlm_config:
        e.append("model.vlm_config needs model.family=hf_vlm (model=hf_vlm)")
    if not (m.pretrained or m.lm_config or m.lm):
        e.append(
            "model.family=hf needs model.pretrained (a local directory), model.lm_config "
            "(a config.json) or model.lm (a preset, e.g. model=hf_tiny)"
        )
    if m.pretrained and not (Path(m.pretrained) / "config.json").is_file():
        e.append(
            f"model.pretrained={m.pretrained!r} is not a directory holding config.json "
            "(save one with save_pretrained; nothing is downloaded)"
        )
    if m.lm_config and not (
        Path(m.lm_config).is_file() or (Path(m.lm_config) / "config.json").is_file()
    ):
        e.append(f"model.lm_config={m.lm_config!r}: no such config.json")
    if m.lm and not m.pretrained and not m.lm_config:
        if "model_type" not in m.lm:
            e.append("model.lm needs a model_type (e.g. llama, qwen2, gpt2)")
        elif not known_model_type(m.lm["model_type"]):
            e.append(
                f"model.lm.model_type={m.lm['model_type']!r} is no model type of transformers "
                f"{transformers_version()}"
            )
    for key in ("adapter", "vision_checkpoint"):
        if getattr(m, key) and not Path(getattr(m, key)).is_file():
            e.append(f"model.{key}={getattr(m, key)!r}: no such file")
    if m.tokenizer and not Path(m.tokenizer).is_dir():
        e.append(f"model.tokenizer={m.tokenizer!r} is not a directory")
    return e + _tokenizer_fusion_problems(cfg)


def _tokenizer_fusion_problems(cfg: TrainConfig) -> list[str]:
    """A learned retriever that reads text reads CLIP BPE ids: the reader's tokenizer must be
    CLIP's."""
    m = cfg.model
    if reader_tokenizer(m) and cfg.retriever.mode == "learned" and cfg.retriever.fusion != "image":
        return [
            "the retriever's text tower reads CLIP BPE ids, and the reader's tokenizer is "
            f"{reader_tokenizer(m)!r}: set retriever.fusion=image"
        ]
    return []


def _vlm_problems(m: ModelConfig) -> list[str]:
    """What is wrong with a vision-language reader's keys (``model.family=hf_vlm``)."""
    from pathlib import Path

    from rag_mm.model.vlm_presets import names

    e = []
    if not (m.pretrained or m.vlm_config):
        e.append(
            f"model.family=hf_vlm needs model.pretrained (a local directory) or model.vlm_config "
            f"(one of {names()} or a config.json)"
        )
    if m.pretrained and not (Path(m.pretrained) / "config.json").is_file():
        e.append(
            f"model.pretrained={m.pretrained!r} is not a directory holding config.json "
            "(save one with save_pretrained; nothing is downloaded)"
        )
    v = m.vlm_config
    if (
        v
        and not m.pretrained
        and v not in names()
        and not (Path(v).is_file() or (Path(v) / "config.json").is_file())
    ):
        e.append(f"model.vlm_config={v!r} is none of {names()} and no config.json")
    for key in ("lm_config", "adapter", "vision_checkpoint"):
        if getattr(m, key):
            e.append(
                f"model.{key} is not read by model.family=hf_vlm (the VLM brings its own tower "
                "and projector)"
            )
    if m.tokenizer and not Path(m.tokenizer).is_dir():
        e.append(f"model.tokenizer={m.tokenizer!r} is not a directory")
    return e


def known_model_type(model_type: Any) -> bool:
    """Whether the installed transformers builds configs of ``model_type`` (imports
    transformers)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    return isinstance(model_type, str) and model_type in CONFIG_MAPPING


def transformers_version() -> str:
    import transformers

    return transformers.__version__


def reader_tokenizer(m: ModelConfig) -> str | None:
    """The local tokenizer directory the reader (and the data it reads) uses; None: CLIP BPE."""
    from rag_mm.data.tokenizer import has_tokenizer

    if m.tokenizer:
        return m.tokenizer
    if m.family in ("hf", "hf_vlm") and has_tokenizer(m.pretrained):
        return m.pretrained
    return None


def _launch_problems(launch: LaunchConfig) -> list[str]:
    e = []
    if launch.backend not in BACKENDS:
        e.append(f"launch.backend must be one of {BACKENDS} (got {launch.backend!r})")
    _positive(e, "launch.timeout_s", launch.timeout_s)
    return e


def layout_problems(cfg: TrainConfig, world_size: int) -> list[str]:
    """What is wrong with the run's layout on ``world_size`` ranks: the runtime's own check
    (``ParallelConfig.problems``: degrees against the world, names, option x layout), then the
    reader's and the data's rules on top of it."""
    m, d = cfg.model, cfg.data
    layout = runtime_config(cfg)
    e = [
        f"parallel.{x}"
        if x.split(" ", 1)[0].split("=", 1)[0] in PARALLEL_KEYS
        else f"parallel: {x}"
        for x in layout.problems(world_size)
    ]
    tp = layout.tp
    if tp > 1 and m.family == "native" and m.heads > 0 and m.heads % tp:
        e.append(f"parallel.tp ({tp}) must divide model.heads ({m.heads})")
    vh = m.vision_width // m.vision_head_width if m.vision_head_width > 0 else 0
    if tp > 1 and vh and vh % tp:
        e.append(
            f"parallel.tp ({tp}) must divide the vision heads (model.vision_width / "
            f"model.vision_head_width = {vh})"
        )
    if e:
        return e
    layout.validate(world_size)
    if d.global_batch_size > 0 and d.global_batch_size % layout.dp:
        e.append(
            f"data.global_batch_size ({d.global_batch_size}) must be divisible by the {layout.dp} "
            "data-parallel replicas"
        )
    if not layout.whole_model:  # the runtime splits each batch into parallel.microbatches
        for key in ("batch_size", "eval_batch_size"):
            if getattr(d, key) % layout.microbatches:
                e.append(
                    f"parallel.microbatches ({layout.microbatches}) must divide data.{key} "
                    f"({getattr(d, key)})"
                )
    return e


PARALLEL_KEYS = frozenset(f.name for f in dataclasses.fields(ParallelConfig))


def runtime_config(cfg: TrainConfig) -> ParallelConfig:
    """The run's ``parallel`` group as the runtime's ``ParallelConfig`` (a copy; -1 not
    resolved)."""
    p = cfg.parallel
    if isinstance(p, ParallelConfig):
        return dataclasses.replace(p)
    obj = OmegaConf.to_object(p)
    return obj if isinstance(obj, ParallelConfig) else ParallelConfig(**obj)


def parallel_config(cfg: TrainConfig, world_size: int) -> ParallelConfig:
    """The runtime's ``parallel.ParallelConfig`` for the reader: the run's ``parallel`` group,
    validated for ``world_size`` ranks (-1 resolved)."""
    return runtime_config(cfg).validate(world_size)


def data_parallel_degree(cfg: TrainConfig, world_size: int) -> int | None:
    """Data-parallel replicas of the run (``dp_replicate x dp_shard``, -1 resolved); None when the
    layout does not fit the world (``validate`` says why)."""
    try:
        return parallel_config(cfg, world_size).dp
    except (ValueError, TypeError):
        return None


def resolve_batch(cfg: TrainConfig, world_size: int) -> None:
    """``data.global_batch_size`` > 0: set ``data.batch_size`` to its share per data-parallel
    replica (left as it is when the replicas do not divide it: ``validate`` says so, with every
    other bad key)."""
    g = cfg.data.global_batch_size
    dp = data_parallel_degree(cfg, world_size)
    if g <= 0 or dp is None or g % dp:  # (validate names a global batch the replicas do not divide)
        return
    if cfg.data.batch_size != g // dp:
        log.info("data.batch_size = data.global_batch_size / %d replicas = %d", dp, g // dp)
    cfg.data.batch_size = g // dp


def _data_hint(cfg: TrainConfig, split: str) -> str:
    """How the missing shards of ``data.<split>`` are made: the demo world, or a user's data through
    the converter (``corpus`` for the document memory, ``vqa`` / ``hf`` for the query splits)."""
    if (
        cfg.data.train == DataConfig.train
    ):  # the knowledge world's layout (conf/data/knowledge_world.yaml)
        return (
            "generate the demo data with `python -m rag_mm.data.knowledge_world "
            f"out={cfg.data.root}`"
        )
    if split == "corpus":
        return (
            "write the document memory with `python scripts/convert.py corpus --docs DIR --out "
            f"{cfg.data.root}`, which prints the data.corpus override; a closed-book run needs "
            "none: retriever=none data.corpus=null"
        )
    return (
        f"write the {split} queries with `python scripts/convert.py vqa|hf ... --split {split} "
        f"--out {cfg.data.root}`, which prints the data.* overrides"
    )


def data_splits(cfg: TrainConfig) -> tuple[str, ...]:
    """The ``data.*`` shard keys a run reads: the corpus only when it retrieves or reads
    documents."""
    needs_corpus = cfg.data.corpus and cfg.retriever.mode != "none"
    return ("corpus", "train", "val", "test") if needs_corpus else ("train", "val", "test")


def shard_problems(cfg: TrainConfig) -> list[str]:
    """Local shard patterns that match a missing file, a directory or an unreadable file."""
    from rag_mm.data.urls import expand_urls, missing_local_shards, unusable_local_shards

    e = []
    for split in data_splits(cfg):
        urls = expand_urls(cfg.data.root, getattr(cfg.data, split))
        missing = missing_local_shards(urls)
        if missing:
            e.append(
                f"data.{split}: {len(missing)} of {len(urls)} shards not found, e.g. {missing[0]} "
                f"(data.root={cfg.data.root!r}; {_data_hint(cfg, split)})"
            )
        unusable = unusable_local_shards(urls)
        if unusable:
            e.append(
                f"data.{split}: {len(unusable)} of {len(urls)} shards unusable, e.g. {unusable[0]}"
            )
    return e


def register_configs() -> None:
    """Register the schema so conf/config.yaml (and its groups) are type-checked by Hydra."""
    # One schema node for the whole tree: group YAMLs merge into its typed sub-nodes, so an
    # unknown key or a wrongly typed value in any group is rejected by Hydra itself.
    ConfigStore.instance().store(name="train_schema", node=TrainConfig)


def compose(
    overrides: list[str] | None = None,
    config_dir: str | None = None,
    return_hydra_config: bool = False,
):
    """The config ``python -m rag_mm.train <overrides>`` would run with (for scripts, tests,
    notebooks); with ``return_hydra_config`` its ``hydra`` node too (the output directory Hydra
    would create)."""
    from pathlib import Path

    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    register_configs()
    conf = config_dir or str(Path(__file__).resolve().parents[1] / "conf")
    with initialize_config_dir(config_dir=conf, version_base="1.3"):
        return hydra_compose(
            config_name="config",
            overrides=list(overrides or []),
            return_hydra_config=return_hydra_config,
        )
