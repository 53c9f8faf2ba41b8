"""Break the code on purpose and check that the tests meant to guard it fail.

    python scripts/mutation_check.py                  # every mutation, a table and JSON
    python scripts/mutation_check.py --only restore   # one (a name, or a prefix of one)
    python scripts/mutation_check.py --list           # what each mutation breaks

Each mutation is an exact text replacement in one or more source files (Python or C++). The
script copies the working tree (tracked and untracked, not ignored: no .venv, no data) to a
scratch directory once, then for each mutation applies it there, runs the tests that should
catch it with the default ``make test`` selection (``-m "not gpu and not slow"``), and restores
the file. The working tree is never touched. A mutation is

- ``caught``: the tests fail (pytest exit 1);
- ``MISSED``: they pass, so the tests do not guard what they claim;
- ``error``: pytest could not run them (collection error, no test selected, timeout).

Before any mutation the same tests run unmutated (``--no-baseline`` skips it): a test that fails
without a mutation catches nothing. C++ mutations build their extension into a fresh cache
(``RAG_MM_EXT_CACHE``), so the cached build of the real sources is never replaced.
Exit status: 0 when every mutation is caught and the baseline passes, 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SELECTION = "not gpu and not slow"  # the default `make test` selection


@dataclass(frozen=True)
class Mutation:
    name: str  # short handle for --only
    breaks: str  # the capability it breaks, in words
    # (path, exact old text, new text): every occurrence replaced
    edits: tuple[tuple[str, str, str], ...]
    tests: tuple[str, ...]  # pytest node ids that must fail
    native: bool = False  # C++ source: the extension is rebuilt in a fresh cache


MUTATIONS = (
    Mutation(
        "question-first-ignored",
        "layout: the query segment keeps the picture first whatever model.question_first says",
        (
            (
                "rag_mm/model/layout.py",
                "= (question, picture) if self.question_first else (picture, question)",
                "= (picture, question)",
            ),
        ),
        ("tests/rag_mm/test_reader.py::test_question_first_lets_the_picture_read_the_question",),
    ),
    Mutation(
        "restore",
        "checkpoint restore disabled: resume=auto starts over",
        (
            (
                "rag_mm/components/checkpoint.py",
                '        if self.resume == "never":\n            return None',
                "        if True:\n            return None",
            ),
        ),
        ("tests/rag_mm/test_train.py::test_resume_after_checkpoint_matches_uninterrupted_run",),
    ),
    Mutation(
        "vision-ssl-sync",
        "vision warm-up: gradients not averaged over the ranks (towers drift apart)",
        (
            (
                "rag_mm/components/vision_warmup.py",
                "grad_sync=_mean_over_ranks if distributed else None",
                "grad_sync=None",
            ),
        ),
        ("tests/rag_mm/test_vision_ssl.py::test_warmup_keeps_ranks_identical",),
    ),
    Mutation(
        "vision-ssl-colour",
        "vision warm-up: the views keep each picture's colours (colour is memorisable)",
        (
            (
                "rag_mm/model/vision_ssl.py",
                "    x = x.gather(1, perm[:, :, None, None].expand_as(x))\n",
                "",
            ),
        ),
        (
            "tests/rag_mm/test_vision_ssl.py::test_views_keep_the_background_and_move_and_recolour_the_thing",
        ),
    ),
    Mutation(
        "skip-count",
        "skipped samples not counted (undecodable pictures dropped silently)",
        (
            (
                "rag_mm/data/pipeline.py",
                'counter.counts["bad_image"] += 1',
                'counter.counts["bad_image"] += 0',
            ),
        ),
        ("tests/rag_mm/test_train.py::test_corrupt_shards_are_skipped_and_counted",),
    ),
    Mutation(
        "pp-grad",
        "pipeline: the first stage's parameter gradients dropped",
        (
            (
                "parallel/pipeline/eager.py",
                "        roots, grads = self._roots(mb)\n        if roots:\n            "
                "torch.autograd.backward(roots, grads)",
                "        roots, grads = self._roots(mb)\n        if roots and not self.is_first:\n"
                "            torch.autograd.backward(roots, grads)",
            ),
        ),
        ("tests/parallel/test_pipeline.py::test_pipeline_matches_single_process",),
    ),
    Mutation(
        "tp-dim",
        "tensor parallel: the row-parallel rule shards the weight's output dimension",
        (
            (
                "parallel/tp/rules.py",
                'self.shard_param(m, "weight", 1 - kind.out_dim)',
                'self.shard_param(m, "weight", kind.out_dim)',
            ),
        ),
        ("tests/parallel/test_tp.py::test_tp2_matches_one_process",),
    ),
    Mutation(
        "attn-mask",
        "fused attention: the causal mask lets each row see one key past itself",
        (
            (
                "csrc/attention/cpu/common.h",
                "std::max<int64_t>(row - kb + 1, 0)",
                "std::max<int64_t>(row - kb + 2, 0)",
            ),
        ),
        ("tests/kernels/test_attention.py",),
        native=True,
    ),
    Mutation(
        "shm-twice",
        "shared-memory all-reduce: rank 0's buffer summed twice, rank 1's never",
        (
            (
                "csrc/comm/cpu/shm_collectives.cpp",
                "for (int r = 0; r < W; ++r) srcs[r] = reinterpret_cast<const T*>(g.buf(r, b));",
                "for (int r = 0; r < W; ++r) srcs[r] = reinterpret_cast<const T*>(g.buf(r == 1 ? "
                "0 : r, b));",
            ),
        ),
        ("tests/kernels/test_comm_shm.py::test_collectives_match_gloo",),
        native=True,
    ),
    Mutation(
        "partition-cost",
        "partitioning ignores measured costs (FLOPs only)",
        (
            (
                "parallel/cost.py",
                "[u.time if timed else u.flops / cfg.flops_per_s for u in units]",
                "[u.flops / cfg.flops_per_s for u in units]",
            ),
        ),
        ("tests/parallel/test_partition.py::test_partition_follows_measured_costs_not_flops",),
    ),
    Mutation(
        "index-meta",
        "faiss index metadata check disabled (an index of other documents is served)",
        (
            (
                "retriever/index_io.py",
                "    if bad:\n        raise IndexMismatchError(str(path), bad)",
                "    if False:\n        raise IndexMismatchError(str(path), bad)",
            ),
        ),
        ("tests/retriever/test_index.py", "tests/retriever/test_retriever.py"),
    ),
    Mutation(
        "sigterm",
        "SIGTERM not handled: the job dies without a checkpoint",
        (
            (
                "rag_mm/trainer.py",
                "prev = signal.signal(signal.SIGTERM, self._on_sigterm)",
                "prev = signal.getsignal(signal.SIGTERM)",
            ),
        ),
        ("tests/ops/test_fault_tolerance.py::test_sigterm_checkpoints_exits_cleanly_and_resumes",),
    ),
    Mutation(
        "refresh",
        "the retriever's index never refreshed during training",
        (
            (
                "rag_mm/components/refresh.py",
                "        return self.in_training and step % self.rcfg.refresh_every == 0",
                "        return False and step % self.rcfg.refresh_every == 0",
            ),
        ),
        ("tests/rag_mm/test_train.py::test_learned_retrieval_trains_both_towers",),
    ),
    Mutation(
        "fsdp-rs",
        "FSDP under a pipeline: the once-per-step gradient reduce-scatter left off",
        (
            (
                "parallel/fsdp.py",
                "            u.set_requires_gradient_sync(reduce, recurse=False)",
                "            u.set_requires_gradient_sync(False, recurse=False)",
            ),
        ),
        ("tests/parallel/test_3d.py::test_fsdp_under_pipeline_matches_one_process",),
    ),
    Mutation(
        "tp-selfcheck",
        "tensor-parallel self-check accepts any error",
        (
            (
                "parallel/tp/verify.py",
                "    if len(y) != len(y_ref) or not y or y[0].shape != y_ref[0].shape:",
                "    return 0.0, ''\n    if len(y) != len(y_ref) or not y or y[0].shape != "
                "y_ref[0].shape:",
            ),
        ),
        ("tests/parallel/test_tp.py::test_self_check_leaves_misread_modules_replicated",),
    ),
    Mutation(
        "timeline",
        "a pipelined run's timeline holds the first pipeline rank's events only",
        (
            (
                "parallel/timeline.py",
                "    merged = align(parts)\n",
                "    merged = align(parts[:1])\n",
            ),
        ),
        ("tests/rag_mm/test_train_pipeline.py::test_torchrun_pipeline_matches_one_process",),
    ),
    Mutation(
        "ckpt-verify",
        "checkpoint verification off: a truncated checkpoint is resumed from",
        (
            ("rag_mm/components/checkpoint.py", "def verify(", "def _verify_unused("),
            (
                "rag_mm/components/checkpoint.py",
                "\ndef load(",
                "\ndef verify(path):\n    return None\n\n\ndef load(",
            ),
        ),
        (
            "tests/ops/test_fault_tolerance.py::test_truncated_newest_checkpoint_is_skipped_for_the_previous_one",
        ),
    ),
    Mutation(
        "hf-layout",
        "Hugging Face reader: rag_mm's attention ignores the retrieval layout (plain causal)",
        (("rag_mm/model/hf_attention.py", "    if seg_offsets is None:\n", "    if True:\n"),),
        ("tests/rag_mm/test_hf_reader.py::test_documents_follow_the_retrieval_layout",),
    ),
    Mutation(
        "unit-split",
        "partitioning keeps a decoder whole when its wrapper calls its token embedding first",
        (
            (
                "parallel/units.py",
                "all(nested(c) or called_from_outside(c) for c in kids)",
                "all(nested(c) for c in kids)",
            ),
        ),
        (
            "tests/parallel/test_partition.py::test_child_called_before_its_parent_is_placed_where_it_runs",
        ),
    ),
    Mutation(
        "flops-bwd",
        "traced FLOPs take the module tracker's backward attribution",
        (
            (
                "parallel/trace.py",
                "            loss_fn(out)\n    except Exception:",
                "            loss_fn(out).backward()\n    except Exception:",
            ),
        ),
        ("tests/parallel/test_partition.py::test_trace_dataflow_pairs_llama_linears",),
    ),
    Mutation(
        "blank-off",
        "image ablation: the blanked forward reads the real pictures (image_drop always 0)",
        (
            (
                "rag_mm/evaluate.py",
                'return {**batch, "image": img.mean(dim=(0, 2, 3), '
                "keepdim=True).expand_as(img).contiguous()}",
                "return dict(batch)",
            ),
        ),
        (
            "tests/rag_mm/test_blind_prior.py::test_blanking_the_picture_costs_a_reader_that_looks_and_not_one_that_does_not",
        ),
    ),
    Mutation(
        "picture-off",
        "reader: the picture's patch tokens blanked before the transformer reads them",
        (
            (
                "rag_mm/model/layout.py",
                "patches = self.encode_images(pics)  # (B*k + B, P, D)",
                "patches = self.encode_images(pics) * 0  # (B*k + B, P, D)",
            ),
        ),
        ("tests/rag_mm/test_reader_sees.py",),
    ),
    Mutation(
        "prior-cache",
        "blind prior: a cached table is reused after the training shards changed",
        (("rag_mm/eval/blind_prior.py", 'data.get("fingerprint") == fp', "True"),),
        (
            "tests/rag_mm/test_blind_prior.py::test_blind_prior_cache_is_reused_and_rebuilt_when_the_shards_change",
        ),
    ),
    Mutation(
        "answer-type",
        "accuracy by answer type ignores the annotation's answer_type (always inferred)",
        (("rag_mm/evaluate.py", "answer_type(t, g)", "answer_type(None, g)"),),
        (
            "tests/rag_mm/test_blind_prior.py::test_accuracy_by_answer_type_takes_the_annotated_type_first",
        ),
    ),
    Mutation(
        "gold-check",
        "settings that need gold documents are not checked against the data (oracle fails mid-run)",
        (
            (
                "rag_mm/checks/gold.py",
                "    train = peek(expand_urls(cfg.data.root, cfg.data.train))",
                "    train = None",
            ),
        ),
        (
            "tests/rag_mm/test_gold.py::test_oracle_on_queries_without_gold_documents_is_refused_before_work",
        ),
    ),
    Mutation(
        "pseudo-warmup",
        "without gold documents the warm-up embeds the queries instead of pseudo-queries alone",
        (
            (
                "rag_mm/model/rag.py",
                "        if not self.gold_queries:\n            q_emb = torch.zeros",
                "        if False:\n            q_emb = torch.zeros",
            ),
        ),
        (
            "tests/rag_mm/test_gold.py::test_warmup_trains_on_pseudo_queries_alone_without_gold_documents",
        ),
    ),
    Mutation(
        "strict-jsonl",
        "metrics.jsonl written with Python's NaN for a mean over no queries",
        (
            (
                "rag_mm/components/metrics.py",
                "self._jsonl.write(strict_dumps(record)",
                "self._jsonl.write(json.dumps(record)",
            ),
        ),
        ("tests/rag_mm/test_strict_json.py::test_every_json_of_a_run_is_strict",),
    ),
    Mutation(
        "cuda-note",
        "torch's 'No CUDA runtime is found' note printed by every CPU run",
        (
            (
                "parallel/kernels/_build.py",
                'logging.getLogger("torch.utils.cpp_extension").addFilter(_no_cuda_runtime_note)',
                "pass",
            ),
        ),
        ("tests/rag_mm/test_quiet.py::test_one_process_run_prints_no_third_party_warning",),
    ),
    Mutation(
        "dcp-note",
        "DCP's 'assuming the intent is to save in a single process' printed at every checkpoint",
        (
            (
                "rag_mm/components/checkpoint_safety.py",
                "        if not dist.is_initialized():\n            warnings.filterwarnings",
                "        if False:\n            warnings.filterwarnings",
            ),
        ),
        ("tests/rag_mm/test_quiet.py::test_one_process_run_prints_no_third_party_warning",),
    ),
    Mutation(
        "partial-ckpt",
        "a checkpoint write that fails for space leaves its partial .tmp directory",
        (
            (
                "rag_mm/components/checkpoint.py",
                "removed = _remove(tmp) if is_main else None",
                "removed = None",
            ),
        ),
        ("tests/ops/test_disk.py::test_full_disk_stops_with_one_message_and_resume_goes_on",),
    ),
    Mutation(
        "disk-message",
        "a full or read-only disk ends in a traceback instead of one message",
        (
            (
                "rag_mm/train.py",
                "        if found is not None:  # a full or read-only disk",
                "        if False:  # a full or read-only disk",
            ),
        ),
        (
            "tests/ops/test_disk.py::test_read_only_run_directory_mid_run_stops_with_one_message_and_resume_goes_on",
        ),
    ),
    Mutation(
        "ckpt-estimate",
        "one checkpoint's bytes estimated without the optimizer's second moment",
        (
            (
                "rag_mm/ft/disk.py",
                "def checkpoint_bytes(model, optimizer_moments: int = 2)",
                "def checkpoint_bytes(model, optimizer_moments: int = 1)",
            ),
        ),
        ("tests/ops/test_disk.py::test_estimate_matches_a_written_checkpoint",),
    ),
    Mutation(
        "eval-stop",
        "SIGTERM during an evaluation waits for the whole split",
        (("rag_mm/evaluate.py", "            if halt:", "            if False:"),),
        (
            "tests/ops/test_preemption.py::test_sigterm_in_each_phase_stops_within_a_batch_with_a_checkpoint[eval]",
            "tests/ops/test_preemption.py::test_sigterm_in_each_phase_stops_within_a_batch_with_a_checkpoint[final_eval]",
        ),
    ),
    Mutation(
        "refresh-stop",
        "SIGTERM during an index refresh waits for the whole memory to be re-embedded",
        (
            (
                "retriever/sharded.py",
                "        if should_stop is not None and should_stop():",
                "        if should_stop is not None and should_stop() and False:",
            ),
        ),
        (
            "tests/ops/test_preemption.py::test_sigterm_in_each_phase_stops_within_a_batch_with_a_checkpoint[refresh]",
        ),
    ),
    Mutation(
        "copy-rename",
        "training answers never renamed: the reader stops after no span it never saw",
        (
            (
                "rag_mm/model/anonymize.py",
                "    if share <= 0:\n        return x",
                "    if True:\n        return x",
            ),
        ),
        (
            "tests/rag_mm/test_copy_unseen.py::test_the_reader_copies_answers_it_never_saw_and_stops",
        ),
    ),
    Mutation(
        "picture-size",
        "the converter recommends the pictures' own size: 8 px digits through 1-px patches",
        (
            (
                "rag_mm/data/picture_recipe.py",
                "    return LARGEST, LARGEST // GRID",
                "    return side, max(1, side // GRID)",
            ),
        ),
        ("tests/rag_mm/test_reader_vs_pixels.py::test_reader_reaches_the_pixel_classifier",),
    ),
    Mutation(
        "rerank",
        "retriever.rerank ignored: the reader reads the stale index's top-k",
        (("rag_mm/model/rag.py", "        if self.rcfg.rerank:\n", "        if False:\n"),),
        ("tests/rag_mm/test_train.py::test_rerank_reads_the_live_towers_top_k",),
    ),
    Mutation(
        "recall-drift",
        "recall drift between refreshes not counted",
        (
            (
                "rag_mm/components/refresh.py",
                "        self.drift[half][0] += done.hits",
                "        self.drift[half][0] += 0",
            ),
        ),
        (
            "tests/rag_mm/test_refresh_cadence.py::"
            "test_recall_drift_counts_steps_by_the_age_of_their_index",
            "tests/rag_mm/test_train.py::test_retriever_warmup_then_joint_training",
        ),
    ),
    Mutation(
        "reader-shuffle",
        "the shuffled training queries keep the retriever's prior",
        (
            (
                "rag_mm/model/rag.py",
                "prior if blind is None else unranked_prior(prior, blind)",
                "prior",
            ),
        ),
        (
            "tests/rag_mm/test_reading_order.py::"
            "test_training_reads_a_share_shuffled_and_unranked_evaluation_never",
        ),
    ),
    Mutation(
        "pseudo-tone",
        "the tone curve a brightness shift: one offset for every level",
        (
            (
                "retriever/augment.py",
                "    at_hi = offsets.gather(2, lo + 1).view_as(images)\n",
                "    at_hi = offsets.gather(2, lo + 1).view_as(images)\n"
                "    at_lo = at_hi = offsets[..., :1, None].expand_as(images)\n",
            ),
        ),
        ("tests/retriever/test_retriever.py::test_random_tone_moves_each_colour_on_its_own",),
    ),
    Mutation(
        "pseudo-surface",
        "the surface's wave left out: the picture moves rigidly",
        (
            (
                "retriever/augment.py",
                "    grid = grid + offset.permute(0, 2, 3, 1)\n",
                "",
            ),
        ),
        (
            "tests/retriever/test_retriever.py::"
            "test_random_surface_bends_stretches_and_lights_the_picture_but_keeps_it",
        ),
    ),
    Mutation(
        "retriever-export",
        "rag_mm.export writes the document tower instead of the query tower",
        (
            (
                "rag_mm/export.py",
                "retriever.query.clip.state_dict()",
                "retriever.doc.clip.state_dict()",
            ),
        ),
        (
            "tests/rag_mm/test_export_retriever.py::"
            "test_export_writes_the_query_tower_and_the_overrides_that_load_it",
        ),
    ),
    Mutation(
        "vlm-picture-tower",
        "a VLM's vision warm-up reads the projector's output, not what the projector reads",
        (
            (
                "rag_mm/model/hf_vlm.py",
                "toks = caught[0]  # (N, P, W)",
                "toks = self._encode(pics)  # (N, P, W)",
            ),
        ),
        (
            "tests/rag_mm/test_hf_vlm.py::test_picture_tower_is_what_the_projector_reads_and_trains_every_tower_layer",
        ),
    ),
    Mutation(
        "vlm-tower-rate",
        "optim.vision_lr_scale leaves a VLM's tower at the full rate",
        (
            (
                "rag_mm/components/optim.py",
                'or ".vision." in name or ".vision_tower." in name',
                'or ".vision." in name',
            ),
        ),
        (
            "tests/rag_mm/test_vision_ssl.py::test_vision_lr_scale_sets_the_towers_rate_or_freezes_it",
        ),
    ),
    Mutation(
        "centred-index",
        "a centred memory searches with the raw query (its offset kept)",
        (
            (
                "retriever/memory.py",
                "q = F.normalize(q - mean_q, dim=-1)",
                "q = F.normalize(q, dim=-1)",
            ),
        ),
        (
            "tests/retriever/test_centred_index.py",
            "tests/rag_mm/test_centred_retrieval.py",
        ),
    ),
    Mutation(
        "watchdog-join",
        "the watchdog's close leaves its publisher running",
        (
            (
                "rag_mm/ft/watchdog.py",
                "self._thread.join(timeout=STORE_TIMEOUT_S + PUBLISH_EVERY_S)",
                "pass",
            ),
        ),
        ("tests/ops/test_watchdog_exit.py",),
    ),
    Mutation(
        "device-search-ties",
        "the device search breaks ties by the highest document id",
        (
            (
                "retriever/exact.py",
                "rev = (self.ntotal - 1) - torch.arange(self.ntotal, device=self.device)",
                "rev = torch.arange(self.ntotal, device=self.device)",
            ),
        ),
        ("tests/retriever/test_exact.py",),
    ),
    Mutation(
        "device-search-host",
        "the device search sends its queries through the host",
        (
            (
                "retriever/memory.py",
                "q = q if self.on_device else q.cpu()",
                "q = q.cpu()",
            ),
        ),
        ("tests/gpu_fake/test_device_search.py",),
    ),
    Mutation(
        "gold-hits-unnamed",
        "the training recall counts queries that name no gold document",
        (
            (
                "rag_mm/model/rag.py",
                "return ((ids == g[:, None]).any(1) & named).sum(), named.sum()",
                "return (ids == g[:, None]).any(1).sum(), named.sum()",
            ),
        ),
        ("tests/rag_mm/test_search_device.py",),
    ),
    Mutation(
        "contrastive-mask",
        "a query left out of the contrastive terms still counts as another's positive",
        (("retriever/losses.py", "        pos = pos * both\n", ""),),
        ("tests/retriever/test_retriever.py",),
    ),
    Mutation(
        "learned-step-host",
        "the reading-order shuffle hashes the retrieved ids on the host",
        (
            (
                "rag_mm/model/rag.py",
                "order, blind = shuffled_reads(top, self.rcfg.reader_shuffle)",
                "order, blind = shuffled_reads(top.cpu(), self.rcfg.reader_shuffle)\n"
                "            order = order.to(top.device, non_blocking=True)",
            ),
        ),
        ("tests/gpu_fake/test_learned_step.py",),
    ),
    Mutation(
        "whole-model-layout",
        "a reader compiled whole keeps the host's packed layout (a length read back)",
        (("rag_mm/distributed/spread.py", "rag.reader.packed_devices = ()", "pass"),),
        ("tests/parallel/test_compile_model.py",),
    ),
    Mutation(
        "pipeline-tensor-broadcast",
        "a pipeline's ranks keep their own per-document NLL, not the last stage's",
        (
            (
                "parallel/model.py",
                "dist.broadcast(t, src=self._last_rank(), group=self.layout.pp_group)",
                "pass",
            ),
        ),
        (
            "tests/rag_mm/test_train_pipeline.py::test_torchrun_pipeline_learned_matches_one_process",
        ),
    ),
)


@dataclass
class Outcome:
    name: str
    status: str  # caught | MISSED | error | pass (baseline) | fail (baseline)
    seconds: float
    detail: str = ""
    tests: list[str] = field(default_factory=list)


def copy_tree(dst: Path) -> None:
    """The files git would commit (tracked and untracked, not ignored), as they are on disk."""
    out = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=REPO,
        capture_output=True,
        check=True,
    ).stdout.decode()
    for rel in filter(None, out.split("\0")):
        src = REPO / rel
        if src.is_file():
            (dst / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst / rel)


def run_tests(
    root: Path, tests: tuple[str, ...], ext_cache: Path, timeout: int
) -> tuple[int, float, str]:
    env = {
        **os.environ,
        "PYTHONPATH": str(root),
        "RAG_MM_EXT_CACHE": str(ext_cache),
        "OMP_NUM_THREADS": "1",
        "PYTHONHASHSEED": "0",
    }
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "-x",
        "-q",
        "-p",
        "no:cacheprovider",
        "-m",
        SELECTION,
        *tests,
    ]
    t0 = time.perf_counter()
    try:
        res = subprocess.run(
            cmd, cwd=root, env=env, capture_output=True, text=True, timeout=timeout
        )
    except subprocess.TimeoutExpired:
        return -1, time.perf_counter() - t0, f"timed out after {timeout} s"
    lines = [ln for ln in (res.stdout + res.stderr).splitlines() if ln.strip()]
    summary = next(
        (
            ln
            for ln in reversed(lines)
            if " in " in ln and ("passed" in ln or "failed" in ln or "error" in ln)
        ),
        lines[-1] if lines else "",
    )
    first_fail = next((ln for ln in lines if ln.startswith(("FAILED", "ERROR"))), "")
    return (
        res.returncode,
        time.perf_counter() - t0,
        (first_fail + " | " if first_fail else "") + summary.strip("= "),
    )


def apply(root: Path, m: Mutation) -> dict[Path, str]:
    """Apply ``m`` in ``root``; returns the original texts. Each old text must occur in its file
    (a source that moved on makes the mutation fail loudly rather than test nothing)."""
    saved: dict[Path, str] = {}
    for rel, old, new in m.edits:
        path = root / rel
        current = path.read_text()
        saved.setdefault(path, current)  # the first edit of a file sees its original text
        if old not in current:
            for p, t in saved.items():
                p.write_text(t)
            raise ValueError(f"{m.name}: the text to mutate is not in {rel}: {old[:80]!r}")
        path.write_text(current.replace(old, new))
    return saved


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--only", action="append", default=[], help="mutation name or prefix (repeatable)"
    )
    ap.add_argument("--list", action="store_true", help="list the mutations and exit")
    ap.add_argument(
        "--no-baseline", action="store_true", help="skip the unmutated run of the tests"
    )
    ap.add_argument("--timeout", type=int, default=900, help="seconds per pytest run")
    ap.add_argument("--json", type=Path, help="also write the results here")
    args = ap.parse_args(argv)
    chosen = [m for m in MUTATIONS if not args.only or any(m.name.startswith(o) for o in args.only)]
    if args.list or not chosen:
        for m in MUTATIONS:
            print(f"{m.name:15s} {m.breaks}\n{'':15s} tests: {' '.join(m.tests)}")
        return 0 if chosen else 2

    outcomes: list[Outcome] = []
    with tempfile.TemporaryDirectory(prefix="rag_mm_mutants_") as tmp:
        root, base_cache = Path(tmp) / "tree", Path(tmp) / "ext-base"
        copy_tree(root)
        for m in chosen:  # every edit must apply to the current sources before anything runs
            try:
                saved = apply(root, m)
            except ValueError as e:
                print(f"mutation_check: {e}", file=sys.stderr)
                return 2
            for p, t in saved.items():
                p.write_text(t)
        if not args.no_baseline:
            tests = tuple(dict.fromkeys(t for m in chosen for t in m.tests))
            rc, dt, detail = run_tests(root, tests, base_cache, args.timeout * 2)
            outcomes.append(
                Outcome("(baseline)", "pass" if rc == 0 else "fail", dt, detail, list(tests))
            )
            print(f"baseline: {outcomes[-1].status} in {dt:.0f} s ({detail})", flush=True)
        for m in chosen:
            saved = apply(root, m)
            try:
                cache = Path(tmp) / f"ext-{m.name}" if m.native else base_cache
                rc, dt, detail = run_tests(root, m.tests, cache, args.timeout)
            finally:
                for p, t in saved.items():
                    p.write_text(t)
            status = {0: "MISSED", 1: "caught"}.get(rc, "error")
            outcomes.append(Outcome(m.name, status, dt, detail, list(m.tests)))
            print(f"{m.name}: {status} in {dt:.0f} s ({detail})", flush=True)

    print()
    print(f"| {'mutation':15s} | {'what it breaks':78s} | {'result':7s} | {'s':>5s} |")
    print(f"|{'-' * 17}|{'-' * 80}|{'-' * 9}|{'-' * 7}|")
    breaks = {m.name: m.breaks for m in MUTATIONS}
    for o in outcomes:
        print(
            f"| {o.name:15s} | {breaks.get(o.name, 'the tests below, unmutated'):78s} | "
            f"{o.status:7s} | {o.seconds:5.0f} |"
        )
    report = {"selection": SELECTION, "results": [o.__dict__ for o in outcomes]}
    print(json.dumps(report, indent=1))
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    ok = all(o.status in ("caught", "pass") for o in outcomes)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
