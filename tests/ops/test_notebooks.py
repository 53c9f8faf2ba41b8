"""The evaluation notebooks execute headless (nbclient, this venv's ipykernel) on tiny runs and
save their figures as PNG files."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from rag_mm import runs
from rag_mm.config import compose
from rag_mm.trainer import Trainer
from tests.rag_mm.conftest import tiny_overrides

REPO = Path(__file__).resolve().parents[2]
NOTEBOOKS = REPO / "notebooks"


def _train(root, run_dir, *extra) -> None:
    t = Trainer(compose(tiny_overrides(root, run_dir, "eval_every=2", *extra)))
    try:
        t.restore()
        t.fit()
    finally:
        t.close()


def _timeline(path: Path) -> list:
    """A pipeline trace in the format parallel.timeline writes (2 stages, 1F1B, 4 microbatches)."""
    from parallel.timeline import Event, to_chrome_trace

    order = {0: ["F0", "F1", "B0", "F2", "B1", "F3", "B2", "B3"], 1: ["F0", "B0", "F1", "B1", "F2", "B2", "F3", "B3"]}
    events, t = [], {0: 0.0, 1: 0.001}
    for rank, ops in order.items():
        for op in ops:
            dur = 0.001 if op[0] == "F" else 0.002
            events.append(Event(rank, op[0], rank, int(op[1]), t[rank], t[rank] + dur))
            t[rank] += dur + 0.0002
    to_chrome_trace(events, str(path))
    return events


@pytest.fixture(scope="module")
def run_dirs(tiny_world, tmp_path_factory):
    """A learned-retriever run (recall@k, retrieved examples) and a closed-book one to compare."""
    base = tmp_path_factory.mktemp("nb_runs")
    learned, closed = base / "learned", base / "closed_book"
    _train(tiny_world, learned, "retriever=learned", "retriever.refresh_every=2", "name=learned")
    _train(tiny_world, closed, "retriever=none", "name=closed_book")
    _timeline(learned / "timeline.json")
    return learned, closed


def _kernel_env(tmp_path: Path) -> dict:
    """A python3 kernelspec that runs this interpreter, found before any user-installed one."""
    spec = tmp_path / "jupyter" / "kernels" / "python3"
    spec.mkdir(parents=True)
    (spec / "kernel.json").write_text(json.dumps({
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "rag_mm venv", "language": "python"}))
    return {"JUPYTER_PATH": str(tmp_path / "jupyter"), "MPLBACKEND": "module://matplotlib_inline.backend_inline"}


def _execute(name: str, tmp_path: Path, **env: str):
    import nbclient
    import nbformat

    nb = nbformat.read(NOTEBOOKS / name, as_version=4)
    old = dict(os.environ)
    os.environ.update({**_kernel_env(tmp_path), "OMP_NUM_THREADS": "1", **env})
    try:
        nbclient.NotebookClient(nb, kernel_name="python3", timeout=300,
                                resources={"metadata": {"path": str(NOTEBOOKS)}}).execute()
    finally:
        os.environ.clear()
        os.environ.update(old)
    return nb


def _outputs(nb) -> str:
    return "\n".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []))


def _check_pngs(figures: Path, names: list[str]) -> None:
    for name in names:
        png = figures / f"{name}.png"
        assert png.is_file() and png.stat().st_size > 1000, f"{png} missing or empty"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_evaluate_run_notebook(run_dirs, tmp_path):
    learned, _ = run_dirs
    figures = tmp_path / "figures"
    nb = _execute("evaluate_run.ipynb", tmp_path, RAG_MM_RUN_DIR=str(learned), RAG_MM_FIGURES=str(figures))
    _check_pngs(figures, ["loss", "accuracy", "recall_at_k", "timeline", "gallery"])
    text = _outputs(nb)
    assert "run 'learned'" in text and "step_00000006" in text and "'recall@5'" not in text
    assert any(o.get("output_type") == "display_data" and "image/png" in o.get("data", {})
               for c in nb.cells for o in c.get("outputs", []))  # figures are shown inline too


def test_compare_runs_notebook(run_dirs, tmp_path):
    figures = tmp_path / "figures"
    nb = _execute("compare_runs.ipynb", tmp_path, RAG_MM_RUNS=os.pathsep.join(map(str, run_dirs)),
                  RAG_MM_FIGURES=str(figures))
    _check_pngs(figures, ["compare_loss", "compare_accuracy", "compare_recall_at_k"])
    text = _outputs(nb)
    assert "2 runs: ['learned', 'closed_book']" in text
    assert "learned | learned" in text and "closed_book | none" in text  # one table row per run


def test_run_reader_keeps_the_last_record_of_a_replayed_step(tmp_path):
    """After a restart, steps past the last checkpoint are logged twice: the later record counts."""
    recs = [{"kind": "train", "step": 2, "loss": 5.0}, {"kind": "train", "step": 4, "loss": 4.0},
            {"kind": "train", "step": 4, "loss": 3.0}, {"kind": "val", "step": 4, "acc": 0.5}]
    (tmp_path / "metrics.jsonl").write_text("\n".join(map(json.dumps, recs)) + '\n{"kind": "tra')  # cut by a kill
    run = runs.load_run(tmp_path)
    assert run.series("train", "loss") == ([2, 4], [5.0, 3.0])
    assert run.summary is None and run.examples is None and run.trace is None
    for plot in (runs.plot_loss([run]), runs.plot_accuracy([run]), runs.plot_recall([run]),
                 runs.plot_timeline(run), runs.plot_gallery(run)):  # absent parts draw a note, not an error
        assert plot is not None


def test_run_timeline_is_the_runtime_timeline_read_back(tmp_path):
    """plot_timeline draws parallel.timeline's chart from timeline.json: the same events come back."""
    from parallel import timeline

    events = _timeline(tmp_path / "timeline.json")
    run = runs.load_run(tmp_path)
    back = timeline.from_chrome_trace(run.trace)
    assert [(e.rank, e.kind, e.stage, e.mb) for e in back] == [(e.rank, e.kind, e.stage, e.mb) for e in events]
    assert all(abs((b.end - b.start) - (e.end - e.start)) < 1e-9 for b, e in zip(back, events))
    assert abs(timeline.bubble_fraction(back) - timeline.bubble_fraction(events)) < 1e-9
    fig = runs.plot_timeline(run)
    assert fig.axes[0].get_title() == f"pipeline timeline, 2 ranks: bubble {timeline.bubble_fraction(events):.1%}"
