"""Reading run directories and drawing them: what the evaluation notebooks call.

A run directory (``run_dir``) holds ``metrics.jsonl`` (one record per log / evaluation, ``kind`` =
train | val | test), ``metrics.json`` (the final summary), ``.hydra/config.yaml``,
``checkpoints/``, ``blind_prior.json`` (the blind prior's table, ``rag_mm.eval.blind_prior``), and,
when they were produced, ``retrieved_examples.json`` (queries with the documents the retriever
returned) and, from runs with ``parallel.pp > 1``, ``timeline.json`` and ``timeline.png`` (the
pipeline's Chrome trace of the last step and its chart; the step's bubble fraction is in
metrics.json under "pipeline").
After a restart, steps after the last checkpoint are trained and logged again: the last record
of each (kind, step) is the one that counts.
"""

from __future__ import annotations

import base64
import io
import json
from dataclasses import dataclass, field
from pathlib import Path

RECALL_KS = (1, 5, 10)  # the recall@k keys rag_mm.evaluate reports


@dataclass
class Run:
    path: Path
    name: str
    records: list[dict]  # metrics.jsonl, deduplicated, in step order per kind
    summary: dict | None  # metrics.json (None while running or after a stop)
    config: dict | None  # .hydra/config.yaml as a plain dict
    examples: list[dict] | None  # retrieved_examples.json
    trace: list[dict] | None  # timeline.json trace events
    # name -> None if valid, else why not
    checkpoints: dict[str, str | None] = field(default_factory=dict)

    def series(self, kind: str, key: str) -> tuple[list[int], list[float]]:
        pts = [
            (r["step"], r[key])
            for r in self.records
            if r.get("kind") == kind and isinstance(r.get(key), (int, float))
        ]
        return [s for s, _ in pts], [v for _, v in pts]

    def last(self, kind: str) -> dict | None:
        recs = [r for r in self.records if r.get("kind") == kind]
        return recs[-1] if recs else None


def load_run(path: str | Path, verify_checkpoints: bool = True) -> Run:
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"{path} is not a run directory")
    latest: dict[tuple[str, int], dict] = {}
    jl = path / "metrics.jsonl"
    if jl.is_file():
        for line in jl.read_text().splitlines():
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:  # a line cut short by a kill
                continue
            latest[(rec.get("kind", "train"), rec.get("step", 0))] = rec
    records = sorted(latest.values(), key=lambda r: (r.get("kind", ""), r.get("step", 0)))

    def _json(name):
        p = path / name
        return json.loads(p.read_text()) if p.is_file() else None

    config = None
    cfg_path = path / ".hydra" / "config.yaml"
    if cfg_path.is_file():
        from omegaconf import OmegaConf

        config = OmegaConf.to_container(OmegaConf.load(cfg_path), resolve=False)
    trace = _json("timeline.json")
    ckpts = {}
    if verify_checkpoints and (path / "checkpoints").is_dir():
        from rag_mm.components.checkpoint import verify

        for c in sorted((path / "checkpoints").glob("step_*")):
            ckpts[c.name] = "unfinished save" if c.name.endswith(".tmp") else verify(c)
    name = (config or {}).get("name") or path.name
    return Run(
        path,
        str(name),
        records,
        _json("metrics.json"),
        config,
        _json("retrieved_examples.json"),
        trace["traceEvents"] if isinstance(trace, dict) else trace,
        ckpts,
    )


def _image(src, run_dir: Path):
    """A picture given as a base64 PNG, a data URI, or a path (relative to the run directory)."""
    from PIL import Image

    if src is None:
        return None
    if (
        isinstance(src, str) and len(src) < 1024 and not src.startswith("data:")
    ):  # a path, not base64
        for p in (run_dir / src, Path(src)):
            try:
                if p.is_file():
                    return Image.open(p)
            except OSError:
                pass
    data = src.split(",", 1)[1] if isinstance(src, str) and src.startswith("data:") else src
    try:
        return Image.open(io.BytesIO(base64.b64decode(data)))
    except Exception:
        return None


# ---------------------------------------------------------------------------------- figures
def _note(ax, text: str) -> None:
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes, fontsize=9, wrap=True)
    ax.set_xticks([])
    ax.set_yticks([])


def plot_loss(runs: list[Run]):
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for run in runs:
        s, v = run.series("train", "loss")
        ax.plot(s, v, label=run.name)
        s, v = run.series("val", "nll")
        if s:
            ax.plot(s, v, "--", label=f"{run.name} (val NLL)")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (answer NLL)")
    ax.set_title("training loss")
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def plot_accuracy(runs: list[Run]):
    """Exact-match accuracy over steps: seen entities vs held-out (only retrieval can answer
    those)."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    any_points = False
    for i, run in enumerate(runs):
        color = f"C{i}"
        for key, style in (("acc_seen", "-"), ("acc_heldout", "--")):
            s, v = run.series("val", key)
            t = run.last("test")
            if t is not None and isinstance(t.get(key), (int, float)):
                s, v = s + [t["step"]], v + [t[key]]
            if s:
                any_points = True
                ax.plot(
                    s,
                    v,
                    style,
                    marker="o",
                    ms=3,
                    color=color,
                    label=f"{run.name}: {key.replace('acc_', '')}",
                )
        chance = (run.summary or {}).get("chance_accuracy")
        if isinstance(chance, float) and chance == chance:
            ax.axhline(chance, color=color, lw=0.8, ls=":", label=f"{run.name}: chance")
    if not any_points:
        _note(ax, "no validation or test records yet (eval_every=0 and the run has not finished)")
    ax.set_xlabel("step")
    ax.set_ylabel("exact-match accuracy")
    ax.set_ylim(-0.02, 1.02)
    ax.set_title("answer accuracy: seen vs held-out entities (val, then test at the end)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def plot_recall(runs: list[Run]):
    """recall@k of the gold document: over steps (val) and at the end (test)."""
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    found = False
    for i, run in enumerate(runs):
        for j, k in enumerate(RECALL_KS):
            s, v = run.series("val", f"recall@{k}")
            if s:
                found = True
                ax1.plot(
                    s,
                    v,
                    marker="o",
                    ms=3,
                    color=f"C{i}",
                    alpha=1 - 0.25 * j,
                    label=f"{run.name} @{k}",
                )
        t = run.last("test") or {}
        ks = [k for k in RECALL_KS if isinstance(t.get(f"recall@{k}"), (int, float))]
        if ks:
            found = True
            w = 0.8 / len(runs)
            xs = [x + i * w for x in range(len(ks))]
            ax2.bar(xs, [t[f"recall@{k}"] for k in ks], width=w, color=f"C{i}", label=run.name)
            ax2.set_xticks([x + 0.4 - w / 2 for x in range(len(ks))], [f"@{k}" for k in ks])
    if not found:
        for ax in (ax1, ax2):
            _note(
                ax,
                "no recall@k in these runs\n(retriever.mode=oracle or none: nothing is retrieved)",
            )
    ax1.set_title("val recall@k over training")
    ax1.set_xlabel("step")
    ax2.set_title("test recall@k (final)")
    for ax in (ax1, ax2):
        ax.set_ylim(0, 1.02)
        if found:
            ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def plot_timeline(run: Run):
    """The pipeline timeline (timeline.json, Chrome trace events): one row per rank."""
    from parallel import timeline  # torch comes with it: imported only to draw

    events = timeline.from_chrome_trace(run.trace or [])
    if not events:
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(11, 2.5))
        _note(
            ax,
            "no timeline.json in this run (the pipeline runtime writes one when parallel.pp > 1)",
        )
        return fig
    ranks = len({e.rank for e in events})
    return timeline.figure(events, f"pipeline timeline, {ranks} ranks:")


def plot_gallery(run: Run, n: int = 6):
    """Queries with their retrieved documents (picture + passage) and the reader's answer."""
    import matplotlib.pyplot as plt

    examples = (run.examples or [])[:n]
    if not examples:
        fig, ax = plt.subplots(figsize=(8, 1.5))
        _note(
            ax,
            "no retrieved_examples.json in this run (written by evaluations with "
            "retriever.mode=learned)",
        )
        return fig
    k = max(len(e.get("retrieved", [])) for e in examples)
    fig, axes = plt.subplots(
        len(examples), k + 1, figsize=(2.6 * (k + 1), 2.6 * len(examples)), squeeze=False
    )
    for row, ex in zip(axes, examples):
        gold = ex.get("gold_doc_id")
        ok = str(ex.get("prediction", "")).strip() == str(ex.get("answer", "")).strip()
        img = _image(ex.get("query_image"), run.path)
        if img is not None:
            row[0].imshow(img)
        row[0].set_title(
            f"Q: {ex.get('question', '')}\ngold: {ex.get('answer', '')} | pred: "
            f"{ex.get('prediction', '')}{' (held-out)' if ex.get('heldout') else ''}",
            fontsize=7,
            color="green" if ok else "red",
            wrap=True,
        )
        for j in range(k):
            ax = row[j + 1]
            docs = ex.get("retrieved", [])
            if j >= len(docs):
                ax.axis("off")
                continue
            d = docs[j]
            img = _image(d.get("image"), run.path)
            if img is not None:
                ax.imshow(img)
            score = f" {d['score']:.2f}" if isinstance(d.get("score"), (int, float)) else ""
            hit = d.get("doc_id") == gold
            passage = str(d.get("passage", ""))
            ax.set_title(
                f"#{j + 1} doc {d.get('doc_id')}{score}{' (gold)' if hit else ''}\n{passage[:60]}"
                f"{'...' if len(passage) > 60 else ''}",
                fontsize=6,
                color="green" if hit else "black",
                wrap=True,
            )
        for ax in row:
            ax.set_xticks([])
            ax.set_yticks([])
    fig.suptitle(
        f"{run.name}: queries and retrieved documents (green = gold document / correct answer)",
        fontsize=9,
    )
    fig.tight_layout()
    return fig


def comparison_table(runs: list[Run]) -> list[dict]:
    """One row per run: the final numbers side by side."""
    rows = []
    for run in runs:
        s = run.summary or {}
        t = s.get("test") or run.last("test") or {}
        cfg = run.config or {}
        rows.append(
            {
                "run": run.name,
                "retrieval": (cfg.get("retriever") or {}).get("mode", s.get("retrieval")),
                "steps": s.get("step", max((r.get("step", 0) for r in run.records), default=0)),
                "world_size": s.get("world_size"),
                "test_acc": t.get("acc"),
                "acc_seen": t.get("acc_seen"),
                "acc_heldout": t.get("acc_heldout"),
                **{f"recall@{k}": t.get(f"recall@{k}") for k in RECALL_KS},
                "samples_per_s": s.get("samples_per_s"),
                "finished": run.summary is not None,
            }
        )
    return rows


PICTURE_COLUMNS = ("split", "answer type", "n", "accuracy", "blind prior", "blanked", "image drop")


def picture_table(run: Run) -> list[dict]:
    """Does the reader use the picture? One row per final split (val, test) and per VQA answer type
    in it (metrics.json): its accuracy (the VQA accuracy where the queries had human answers, else
    exact match), the blind prior (answering from the question alone), the accuracy with every
    picture blanked and the difference (``image_drop``). None where metrics.json has no number
    (an older run, or a run that did not finish)."""
    rows = []
    for split in ("val", "test"):
        m = (run.summary or {}).get(split)
        if not isinstance(m, dict):
            continue
        for name, t in [("all", m), *(m.get("by_type") or {}).items()]:
            vqa = t.get("vqa_acc") is not None
            rows.append(
                {
                    "split": split,
                    "answer type": name,
                    "n": t.get("n"),
                    "accuracy": t.get("vqa_acc") if vqa else t.get("acc"),
                    "blind prior": t.get("blind_prior"),
                    "blanked": t.get("vqa_acc_blank") if vqa else t.get("acc_blank"),
                    "image drop": t.get("image_drop"),
                }
            )
    return rows


def save(fig, figures: Path, name: str) -> Path:
    figures.mkdir(parents=True, exist_ok=True)
    out = figures / f"{name}.png"
    fig.savefig(out, dpi=100)
    return out
