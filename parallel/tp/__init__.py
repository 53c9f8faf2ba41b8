"""Tensor parallelism on DTensor: a registry of rules, plan discovery from the traced dataflow,
a self-check that keeps replicated whatever the sharded plan does not reproduce, vocabulary-parallel
embedding / LM head / cross-entropy, and sequence parallel."""

from parallel.tp.loss import vocab_parallel_cross_entropy
from parallel.tp.plan import (
    TPEntry,
    TPPlan,
    apply_plan,
    discover_plan,
    find_block_lists,
    tied_modules,
)
from parallel.tp.registry import (
    LinearKind,
    register_linear_kind,
    register_tp_rule,
    unregister_tp_rule,
)
from parallel.tp.rules import TPContext
from parallel.tp.verify import (
    CapturedInputs,
    apply_tp,
    capture_inputs,
    sharded_share,
    verify_and_apply,
    verify_plan,
)

__all__ = [
    "CapturedInputs",
    "LinearKind",
    "TPContext",
    "TPEntry",
    "TPPlan",
    "apply_plan",
    "apply_tp",
    "capture_inputs",
    "discover_plan",
    "find_block_lists",
    "register_linear_kind",
    "register_tp_rule",
    "sharded_share",
    "tied_modules",
    "unregister_tp_rule",
    "verify_and_apply",
    "verify_plan",
    "vocab_parallel_cross_entropy",
]
