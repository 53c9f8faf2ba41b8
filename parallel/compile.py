"""torch.compile: step 3 of the runtime's order (TP -> activation checkpointing -> compile ->
FSDP, torchtitan's ``apply_compile``).

By default (``compile_scope=blocks``) each block is compiled on its own (``Module.compile``: the
module keeps its name and parameters, so checkpoints and FSDP see the model as before). Blocks of
one class share their compiled code: parameters are graph inputs (dynamo's default of inlining
built-in nn modules), so a 16-layer LM compiles one layer. ``fullgraph=True`` makes a graph break
an error at the first call instead of a silent split into smaller graphs.

``compile_scope=model`` compiles the whole module as one graph instead (forward, and through
AOTAutograd its backward): the code between the blocks (embeddings, the layout, the loss) fuses
too, which is what a small model whose step is bound by kernel launches lacks. With
``compile_mode=reduce-overhead`` Inductor records that graph as CUDA graphs and a step replays
in one launch; its outputs live in memory the next replay reuses, so ``ParallelModel`` starts
each step with ``cudagraph_mark_step_begin`` and copies what it keeps past a call.
"""

from __future__ import annotations

import logging

from torch import nn

log = logging.getLogger("parallel.compile")

BACKENDS = ("inductor", "aot_eager", "eager")  # aot_eager: traced and partitioned, no code written
MODES = ("default", "reduce-overhead")  # reduce-overhead: CUDA graphs (Inductor)


def apply_compile(
    blocks: list[nn.Module], backend: str = "inductor", fullgraph: bool = True
) -> int:
    """Compile every block in place; returns how many."""
    if backend not in BACKENDS:
        raise ValueError(f"compile backend must be one of {BACKENDS} (got {backend!r})")
    for b in blocks:
        b.compile(backend=backend, fullgraph=fullgraph)
    log.info("torch.compile: %d blocks (%s, fullgraph=%s)", len(blocks), backend, fullgraph)
    return len(blocks)


def apply_compile_model(
    model: nn.Module, backend: str = "inductor", mode: str = "default", fullgraph: bool = True
) -> None:
    """Compile ``model`` as one graph, in place (its names and parameters unchanged)."""
    if backend not in BACKENDS:
        raise ValueError(f"compile backend must be one of {BACKENDS} (got {backend!r})")
    if mode not in MODES:
        raise ValueError(f"compile mode must be one of {MODES} (got {mode!r})")
    if mode != "default" and backend != "inductor":
        raise ValueError(f"compile mode {mode!r} is Inductor's (got backend {backend!r})")
    model.compile(
        backend=backend, fullgraph=fullgraph, **({"mode": mode} if mode != "default" else {})
    )
    log.info(
        "torch.compile: the whole %s as one graph (%s, mode %s, fullgraph=%s)",
        type(model).__name__,
        backend,
        mode,
        fullgraph,
    )
