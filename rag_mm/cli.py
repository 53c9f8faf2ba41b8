"""``rag_mm COMMAND ...``: one command for every entry point, as ``git`` or ``torchrun`` users
expect. Each subcommand hands the rest of the line to the program it names, unchanged, so
``rag_mm evaluate RUN split=test`` and ``python -m rag_mm.evaluate RUN split=test`` are the same
run. Commands that read a config take ``key=value`` overrides (Hydra's grammar: ``train``'s are
Hydra's own; ``evaluate``, ``export``, ``plan`` and ``build-index`` merge theirs into the run's
saved config or their own typed one); ``ask`` and ``convert``, which read a user's files rather
than a config, take ``--flags``.

    rag_mm train +experiment=demo
    rag_mm evaluate runs/demo split=test
    rag_mm ask runs/demo --image q.png --question "what is the name?"
"""

from __future__ import annotations

import importlib
import runpy
import sys

# command -> (module whose main(argv) runs it, what it does); imported only when run, so that
# ``rag_mm --help`` does not load torch
COMMANDS: dict[str, tuple[str, str]] = {
    "train": ("rag_mm.train", "train a reader and its retriever (Hydra: +experiment=NAME ...)"),
    "evaluate": ("rag_mm.evaluate", "score a run's checkpoint on a split: RUN [split=...]"),
    "ask": ("rag_mm.ask", "answer questions about pictures with a trained run: RUN --question"),
    "plan": ("rag_mm.plan", "choose a parallel layout for a model and a cluster: key=value"),
    "export": (
        "rag_mm.export",
        "a trained HF reader to Hugging Face files, a learned retriever to open_clip: RUN OUT_DIR",
    ),
    "build-index": ("rag_mm.build_index", "encode a corpus and build a faiss index: key=value"),
    "convert": ("rag_mm.data.convert_cli", "your own data as rag_mm shards: vqa | corpus | ..."),
}


def usage() -> str:
    width = max(map(len, COMMANDS))
    lines = [f"  {name:<{width}}  {about}" for name, (_, about) in COMMANDS.items()]
    return (
        "usage: rag_mm COMMAND [ARGS ...]\n\ncommands:\n"
        + "\n".join(lines)
        + "\n\n`rag_mm COMMAND --help` for a command's own arguments."
    )


def _train(argv: list[str]) -> int:
    """``python -m rag_mm.train ARGS``, run in this process: Hydra reads the command line and finds
    its config tree from the module run as ``__main__``, so the arguments after ``train`` become
    the command line and the module runs as it does under ``-m``."""
    sys.argv = [sys.argv[0], *argv]
    runpy.run_module("rag_mm.train", run_name="__main__", alter_sys=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(usage())
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"rag_mm: error: unknown command {name!r}\n\n{usage()}", file=sys.stderr)
        return 2
    if name == "train":
        return _train(rest)
    return int(importlib.import_module(COMMANDS[name][0]).main(rest) or 0)


if __name__ == "__main__":
    raise SystemExit(main())
