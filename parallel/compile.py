"""torch.compile per block: step 3 of the runtime's order (TP -> activation checkpointing ->
compile -> FSDP, torchtitan's ``apply_compile``).

Each block is compiled on its own (``Module.compile``: the module keeps its name and parameters,
so checkpoints and FSDP see the model as before). Blocks of one class share their compiled code:
parameters are graph inputs (dynamo's default of inlining built-in nn modules), so a 16-layer LM
compiles one layer. ``fullgraph=True`` makes a graph break an error at the first call instead of
a silent split into smaller graphs.
"""

from __future__ import annotations

import logging

from torch import nn

log = logging.getLogger("parallel.compile")

BACKENDS = ("inductor", "aot_eager", "eager")  # aot_eager: traced and partitioned, no code written


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
