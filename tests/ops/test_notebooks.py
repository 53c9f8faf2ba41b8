"""The evaluation notebooks execute headless (nbclient, this venv's ipykernel) on tiny runs and
save their figures as PNG files; the timeline panel draws a pipelined run's own timeline.json."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from rag_mm import evaluate
from rag_mm.config import compose
from rag_mm.eval import runs
from rag_mm.trainer import Trainer
from tests.rag_mm.conftest import tiny_overrides
from tests.rag_mm.test_train_pipeline import check_run_timeline, pp2_run

REPO = Path(__file__).resolve().parents[2]
NOTEBOOKS = REPO / "notebooks"


def _train(root, run_dir, *extra) -> None:
    t = Trainer(compose(tiny_overrides(root, run_dir, "eval_every=2", *extra)))
    try:
        t.restore()
        t.fit()
    finally:
        t.close()


@pytest.fixture(scope="module")
def run_dirs(tiny_world, tmp_path_factory):
    """A learned-retriever run (recall@k, retrieved examples) and a closed-book one to compare."""
    base = tmp_path_factory.mktemp("nb_runs")
    learned, closed = base / "learned", base / "closed_book"
    _train(tiny_world, learned, "retriever=learned", "retriever.refresh_every=2", "name=learned")
    _train(tiny_world, closed, "retriever=none", "name=closed_book")
    return learned, closed


@pytest.fixture
def pipelined_run(tiny_world, tmp_path_factory) -> Path:
    """The pp=2 torchrun run test_train_pipeline compares with one process (run once a session)."""
    return pp2_run(tiny_world, tmp_path_factory)[1]


def _kernel_env(tmp_path: Path) -> dict:
    """A python3 kernelspec that runs this interpreter, found before any user-installed one."""
    spec = tmp_path / "jupyter" / "kernels" / "python3"
    spec.mkdir(parents=True)
    (spec / "kernel.json").write_text(
        json.dumps(
            {
                "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
                "display_name": "rag_mm venv",
                "language": "python",
            }
        )
    )
    return {
        "JUPYTER_PATH": str(tmp_path / "jupyter"),
        "MPLBACKEND": "module://matplotlib_inline.backend_inline",
    }


def _execute(name: str, tmp_path: Path, **env: str):
    import nbclient
    import nbformat

    nb = nbformat.read(NOTEBOOKS / name, as_version=4)
    old = dict(os.environ)
    os.environ.update({**_kernel_env(tmp_path), "OMP_NUM_THREADS": "1", **env})
    try:
        nbclient.NotebookClient(
            nb, kernel_name="python3", timeout=300, resources={"metadata": {"path": str(NOTEBOOKS)}}
        ).execute()
    finally:
        os.environ.clear()
        os.environ.update(old)
    return nb


def _outputs(nb) -> str:
    return "\n".join(
        o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])
    )


def _check_pngs(figures: Path, names: list[str]) -> None:
    for name in names:
        png = figures / f"{name}.png"
        assert png.is_file() and png.stat().st_size > 1000, f"{png} missing or empty"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_evaluate_run_notebook(run_dirs, tiny_world, tmp_path):
    learned, _ = run_dirs
    # closed book / learned / oracle on the run's checkpoint, written into its metrics.json (the
    # fixture trained in this process: its config is saved where Hydra's job would have put it)
    cfg = compose(
        tiny_overrides(
            tiny_world,
            learned,
            "eval_every=2",
            "retriever=learned",
            "retriever.refresh_every=2",
            "name=learned",
        )
    )
    (learned / ".hydra").mkdir(exist_ok=True)
    OmegaConf.save(cfg, learned / ".hydra" / "config.yaml")
    assert evaluate.main([str(learned), "split=test", "modes=all"]) == 0
    figures = tmp_path / "figures"
    nb = _execute(
        "evaluate_run.ipynb", tmp_path, RAG_MM_RUN_DIR=str(learned), RAG_MM_FIGURES=str(figures)
    )
    _check_pngs(figures, ["loss", "accuracy", "recall_at_k", "timeline", "gallery"])
    text = _outputs(nb)
    assert "run 'learned'" in text and "step_00000006" in text and "'recall@5'" not in text
    # does the reader use the picture: accuracy, blind prior, blanked accuracy per split and answer
    # type
    test = runs.load_run(learned).summary["test"]
    assert "split | answer type | n | accuracy | blind prior | blanked | image drop" in text
    assert (
        f"test | all | {test['n']} | {test['acc']:.3f} | {test['blind_prior']:.3f} | "
        f"{test['acc_blank']:.3f} | {test['image_drop']:.3f}"
    ) in text
    # what retrieval adds: the trained mode per split, then the three modes side by side
    assert "split | mode | n | acc seen | acc held out | answer match | InfoSeek | recall@1" in text
    assert f"test | learned (trained) | {test['n']} | {test['acc_seen']:.3f}" in text
    assert f"| {test['recall@1']:.3f} |" in text
    for mode in ("closed_book", "learned", "oracle"):
        assert f"test | {mode} | {test['n']} |" in text, mode
    assert "test: retrieval_gain" in text and "oracle_gap" in text
    # figures are shown inline too
    assert any(
        o.get("output_type") == "display_data" and "image/png" in o.get("data", {})
        for c in nb.cells
        for o in c.get("outputs", [])
    )


def test_compare_runs_notebook(run_dirs, tmp_path):
    figures = tmp_path / "figures"
    nb = _execute(
        "compare_runs.ipynb",
        tmp_path,
        RAG_MM_RUNS=os.pathsep.join(map(str, run_dirs)),
        RAG_MM_FIGURES=str(figures),
    )
    _check_pngs(figures, ["compare_loss", "compare_accuracy", "compare_recall_at_k"])
    text = _outputs(nb)
    assert "2 runs: ['learned', 'closed_book']" in text
    assert "learned | learned" in text and "closed_book | none" in text  # one table row per run


def test_run_reader_keeps_the_last_record_of_a_replayed_step(tmp_path):
    """After a restart, steps past the last checkpoint are logged twice: the later record counts."""
    recs = [
        {"kind": "train", "step": 2, "loss": 5.0},
        {"kind": "train", "step": 4, "loss": 4.0},
        {"kind": "train", "step": 4, "loss": 3.0},
        {"kind": "val", "step": 4, "acc": 0.5},
    ]
    # cut by a kill
    (tmp_path / "metrics.jsonl").write_text("\n".join(map(json.dumps, recs)) + '\n{"kind": "tra')
    run = runs.load_run(tmp_path)
    assert run.series("train", "loss") == ([2, 4], [5.0, 3.0])
    assert run.summary is None and run.examples is None and run.trace is None
    for plot in (
        runs.plot_loss([run]),
        runs.plot_accuracy([run]),
        runs.plot_recall([run]),
        runs.plot_timeline(run),
        runs.plot_gallery(run),
    ):  # absent parts draw a note, not an error
        assert plot is not None


@pytest.mark.multirank
def test_evaluate_run_notebook_draws_the_runs_timeline(pipelined_run, tmp_path):
    """A pp=2 run writes its last step's timeline; the notebook's panel draws that file: the
    figure's title carries the bubble fraction of the file's events, which the run recorded."""
    from parallel import timeline

    events = check_run_timeline(pipelined_run)
    run = runs.load_run(pipelined_run)
    assert [(e.rank, e.kind, e.mb) for e in timeline.from_chrome_trace(run.trace)] == [
        (e.rank, e.kind, e.mb) for e in events
    ]
    title = f"pipeline timeline, 2 ranks: bubble {timeline.bubble_fraction(events):.1%}"
    assert runs.plot_timeline(run).axes[0].get_title() == title
    figures = tmp_path / "figures"
    nb = _execute(
        "evaluate_run.ipynb",
        tmp_path,
        RAG_MM_RUN_DIR=str(pipelined_run),
        RAG_MM_FIGURES=str(figures),
    )
    _check_pngs(figures, ["timeline"])
    text = _outputs(nb)
    assert (
        title in text
        and f"bubble fraction {run.summary['pipeline']['bubble_fraction']:.3f}" in text
    )
