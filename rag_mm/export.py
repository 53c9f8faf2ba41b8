"""Export a trained run's reader and retriever for the libraries they came from, and say how to
import them.

    python -m rag_mm.export RUN_DIR OUT_DIR [key=value ...]

loads RUN_DIR's newest valid checkpoint (DCP, the training format) into the model its saved
config builds and writes OUT_DIR. For a Hugging Face reader (``model.family=hf``):

- ``lm/``: the language model as a Hugging Face directory (``config.json``, safetensors weights,
  and the tokenizer when the run read with a Hugging Face one):
  ``AutoModelForCausalLM.from_pretrained`` loads it;
- ``open_clip_visual.pt``: the vision tower as an open_clip CLIP state dict (``visual.*`` keys);
- ``adapter.safetensors``: the reader's own weights (projector, retrieval-rank and token-type
  embeddings, copy head).

For a learned retriever (``retriever.mode=learned``, any reader):

- ``retriever.pt``: the dual encoder's query tower as an open_clip CLIP state dict (plus ``mix``,
  its image / text fusion weights, and with ``retriever.side_norm`` ``side_norm_doc``, the
  document side's batch-norm statistics, open_clip's keys holding the query side's), which
  ``retriever.checkpoint`` loads into both towers of a new run: a retriever trained on one
  knowledge set (say a larger one with gold links) starts the retriever of another.

And ``import.json``: the overrides that build the same parts from these files, e.g.
``python -m rag_mm.train +experiment=demo_hf $(jq -r '.overrides|join(" ")' OUT/import.json)``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from retriever.config import TOWER_SIZES
from retriever.side_norm import split_doc_stats

USAGE = __doc__.split("\n\n")[1]
VISION_FIELDS = ("vision_width", "vision_layers", "vision_head_width", "patch_size", "image_size")
# what shapes the dual encoder's towers: a checkpoint loads only into the same
RETRIEVER_FIELDS = (*TOWER_SIZES, "vision_tower", "fusion")


def export_reader(reader, out: Path, model_cfg, tokenizer=None) -> list[str]:
    """Write ``reader`` (an ``HFReader``) to ``out`` as described above; returns the import
    overrides."""
    from safetensors.torch import save_file

    from rag_mm.data.tokenizer import HFTokenizer

    out.mkdir(parents=True, exist_ok=True)
    reader.lm.save_pretrained(out / "lm", safe_serialization=True)
    if isinstance(tokenizer, HFTokenizer):
        tokenizer._tok.save_pretrained(out / "lm")
    torch.save(
        {f"visual.{k}": v.detach().cpu() for k, v in reader.vision.state_dict().items()},
        out / "open_clip_visual.pt",
    )
    save_file(
        {k: v.detach().cpu().contiguous() for k, v in reader.adapter_state().items()},
        out / "adapter.safetensors",
    )
    overrides = [
        f"model.pretrained={out / 'lm'}",
        f"model.vision_checkpoint={out / 'open_clip_visual.pt'}",
        f"model.adapter={out / 'adapter.safetensors'}",
        f"model.projector={model_cfg.projector or 'mlp2x_gelu'}",
        f"model.copy_head={str(bool(model_cfg.copy_head)).lower()}",
        f"model.max_docs={model_cfg.max_docs}",
        *(f"model.{f}={getattr(model_cfg, f)}" for f in VISION_FIELDS),
    ]
    (out / "import.json").write_text(
        json.dumps({"overrides": overrides}, indent=1, allow_nan=False) + "\n"
    )
    return overrides


def export_retriever(retriever, out: Path, retriever_cfg) -> list[str]:
    """Write ``retriever`` (a ``DualEncoder``)'s query tower to ``out/retriever.pt`` as an open_clip
    CLIP state dict; returns the overrides that build a retriever it loads into (besides
    ``model.image_size``, the pictures' size)."""
    out.mkdir(parents=True, exist_ok=True)
    path = out / "retriever.pt"
    state = {k: v.detach().cpu() for k, v in retriever.query.clip.state_dict().items()}
    # a tower with batch-norm statistics per side (retriever.side_norm): open_clip's keys hold the
    # query side's, the document side's travel apart (a retriever built with side_norm reads them)
    state, doc_stats = split_doc_stats(state)
    if doc_stats:
        state["side_norm_doc"] = doc_stats
    state["mix"] = retriever.query.mix.detach().cpu()  # the image / text fusion weights
    tmp = path.with_name(path.name + ".tmp")  # never a half-written file under the final name
    torch.save(state, tmp)
    tmp.replace(path)
    return [
        f"retriever.checkpoint={path}",
        *(f"retriever.{f}={getattr(retriever_cfg, f)}" for f in RETRIEVER_FIELDS),
    ]


def run(run_dir: Path, out: Path, overrides: list[str]) -> list[str]:
    from rag_mm.build import build_rag
    from rag_mm.components import checkpoint
    from rag_mm.evaluate import EvalError, load_config, load_model_state

    cfg = load_config(run_dir, overrides)
    hf, learned = cfg.model.family == "hf", cfg.retriever.mode == "learned"
    if not (hf or learned):
        raise EvalError(
            f"{run_dir}: model.family={cfg.model.family} and retriever.mode={cfg.retriever.mode}: "
            "nothing to export (a Hugging Face reader, model.family=hf, exports to Hugging Face "
            "and open_clip files; a learned retriever, retriever.mode=learned, to an open_clip one)"
        )
    ckpt = checkpoint.latest_valid(run_dir / "checkpoints")
    if ckpt is None:
        raise EvalError(f"no valid checkpoint in {run_dir / 'checkpoints'}")
    parts = build_rag(cfg, torch.device("cpu"))
    load_model_state(parts.rag, ckpt)
    if parts.memory is not None:
        parts.memory.close()
    done = export_reader(parts.reader, out, cfg.model, parts.tok) if hf else []
    if learned:
        done += export_retriever(parts.retriever, out, cfg.retriever)
        if not hf:  # (the reader's overrides carry it otherwise)
            done.append(f"model.image_size={cfg.model.image_size}")
        (out / "import.json").write_text(
            json.dumps({"overrides": done}, indent=1, allow_nan=False) + "\n"
        )
    return done


def main(argv: list[str] | None = None) -> int:
    from rag_mm.evaluate import EvalError

    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] in (["-h"], ["--help"]) or len(argv) < 2:
        print(USAGE, file=sys.stderr if len(argv) < 2 else sys.stdout)
        return 0 if argv[:1] in (["-h"], ["--help"]) else 2
    try:
        overrides = run(Path(argv[0]), Path(argv[1]), argv[2:])
    except (EvalError, ValueError, OSError) as exc:
        print(f"export: error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps({"out": argv[1], "overrides": overrides}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
