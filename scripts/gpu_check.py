"""Every GPU check of the project in one command, on a machine with a CUDA GPU (or a CPU dry run).

    python scripts/gpu_check.py --out runs/gpu_check        # on a GPU machine (`make gpu-check`)
    python scripts/gpu_check.py --dry-run --out runs/gpu_check_dry   # anywhere: same steps, CPU

Run it with the python that holds the machine's CUDA build of torch and the project's other
packages (``make gpu-check GPU_PY=...``). ``scripts/gpu_verify.py`` verifies the figures.

Steps (``--only`` picks some):

* ``cuda_build``: ``scripts/cuda_build.py --cuda-home auto``: every CUDA source of csrc/ compiled
  with the machine's own nvcc for its GPU, loaded, its ops listed -> ``cuda_build.json``. Later
  steps reuse that build (same ``--ext-cache``). A machine without nvcc fails this step, saying
  so; the steps after it still run, on the PyTorch fallbacks (the fused-kernel tests then fail).
  The dry run only resolves the toolkit and lists what would be built (``--plan-only``).
* ``pytest``: ``pytest -m gpu`` over the test files that use the ``gpu`` marker (found by scanning
  tests/, so collection needs only their imports) -> ``pytest_gpu.xml`` (JUnit).
* ``attention``: ``scripts/bench/attention.py --device cuda`` (``--backward`` unless ``--quick``)
  -> ``bench_attention.json``.
* ``mfu_demo``: ``scripts/bench/train_throughput.py --device cuda`` on the demo reader, bf16,
  batch 32 -> ``mfu_demo.json`` (MFU against the datasheet's dense bf16 peak).
* ``mfu_1b``: the same on the ~1B Hugging Face reader preset (``model=llama3_2_1b``, 2 documents
  per query, batch 8, block checkpointing; ``--compile`` compiles each block) -> ``mfu_1b.json``.
* ``demo``: ``python -m torch.distributed.run --nproc_per_node=1 -m rag_mm.train +experiment=demo
  device=cuda launch.backend=nccl``: the demo trained in one process through a NCCL process
  group (its data generated first unless ``make demo``'s is there; the run under
  runs/gpu_check_work) -> ``demo_metrics.json``.

Every step runs this interpreter (``sys.executable``; torchrun as ``-m torch.distributed.run``):
nothing is looked up on PATH, where a venv's scripts are missing unless it is activated.

A bench under scripts/bench that gains a ``--device`` option is reported as not run until it is
added to ``BENCHES`` and given a step.

Outputs under ``--out`` (8 files): the six above, ``gpu_check.log`` (every step's output)
and ``gpu_check.json``: the machine (device, capability, torch, CUDA, nvcc, ninja, missing
modules) and per step its command, exit status, wall seconds and parsed figures (JUnit counts,
failures and skip reasons; the bench's own JSON).

Exit status: 0 when every step passed, 1 when one failed, timed out or had no time left, 2 when
there is no CUDA device and no ``--dry-run`` (nothing is run; it says so). ``--dry-run`` runs the
same steps with ``--device cpu`` and the bench's smallest settings: a smoke test of the plumbing.

No step can hang: each runs in its own process group, killed after ``--timeout`` seconds or
whatever is left of ``--budget``. The steps can be split over several calls with ``--only``: CUDA
extensions are cached under ``--ext-cache``, inside the repository, so a later call reuses the
``cuda_build`` step's build.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import re
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
import xml.etree.ElementTree as ET
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

ROOT = Path(__file__).resolve().parents[1]
BENCH_DIR = ROOT / "scripts" / "bench"
# Modules the project imports at run time besides torch; the checks need the first three.
MODULES = (
    "numpy",
    "faiss",
    "pytest",
    "yaml",
    "omegaconf",
    "hydra",
    "webdataset",
    "ftfy",
    "regex",
    "safetensors",
    "tokenizers",
    "huggingface_hub",
    "transformers",
    "timm",
    "open_clip",
    "torchvision",
    "PIL",
    "matplotlib",
)
# scripts/bench/*.py run with --device; each has a Step in plan()
BENCHES = (
    "attention",
    "train_throughput",
)
STEPS = ("cuda_build", "pytest", "attention", "mfu_demo", "mfu_1b", "demo")
KILL_GRACE_S = 10


@dataclass
class Step:
    """One check: its command, the file it writes under --out and how to read that file."""

    name: str
    argv: list[str]
    artefact: str
    parse: Callable[[Path], dict[str, Any]]
    headline: Callable[[dict[str, Any]], str]


def junit_figures(path: Path) -> dict[str, Any]:
    """Counts, failures (test, kind, message) and skip reasons of a pytest JUnit XML file."""
    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    figures: dict[str, Any] = {
        k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")
    }
    figures["problems"], skips = [], Counter()
    for case in root.iter("testcase"):
        test = f"{case.get('classname')}::{case.get('name')}"
        for kind in ("failure", "error"):
            for el in case.findall(kind):
                figures["problems"].append(
                    dict(test=test, kind=kind, message=(el.get("message") or "")[:500])
                )
        for el in case.findall("skipped"):
            skips[el.get("message") or ""] += 1
    figures["skip_reasons"] = dict(skips)
    return figures


def junit_headline(f: dict[str, Any]) -> str:
    passed = f["tests"] - f["failures"] - f["errors"] - f["skipped"]
    return f"{passed} passed, {f['failures']} failed, {f['errors']} errors, {f['skipped']} skipped"


def json_figures(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text())


def attention_headline(f: dict[str, Any]) -> str:
    if "ratio_median" in f:  # --device cuda
        return (
            f"median fused / flash x{f['ratio_median']:.2f} over {len(f['results'])} points "
            f"({f['target']})"
        )
    ratios = ", ".join(f"{case} x{r['fused']:.2f}" for case, r in f["ratio_summary"].items())
    return f"CPU: {len(f['results'])} points; median fused / SDPA time: {ratios}"


def cuda_build_headline(f: dict[str, Any]) -> str:
    if f.get("plan_only"):
        return (
            f"plan: {len(f['extensions'])} extensions, CUDA sources "
            f"{', '.join(f['cuda_sources'])}, toolkit {f.get('nvcc') or 'none'}"
        )
    bad = [e["name"] for e in f["extensions"] if not e["ok"]]
    cuda = sorted(op for op, keys in f["ops"].items() if "CUDA" in keys)
    return (
        f"nvcc {f['nvcc']}, sm_{', sm_'.join(f['archs'])}: "
        f"{len(f['extensions']) - len(bad)}/{len(f['extensions'])} "
        f"built{' (FAILED: ' + ', '.join(bad) + ')' if bad else ''}; CUDA ops: {', '.join(cuda)}"
    )


def mfu_headline(f: dict[str, Any]) -> str:
    mfu = "n/a" if f["mfu"] is None else f"{f['mfu']:.1%}"
    return (
        f"{f['model']} {f['precision']} batch {f['batch']}: MFU {mfu} of "
        f"{f['peak_datasheet_TFLOPs']} TFLOP/s ({f['part']}), "
        f"{f['mfu_measured_peak']:.1%} of the measured {f['matmul_TFLOPs']}, "
        f"{f['samples_per_s']} samples/s, {f['step_ms']} ms/step"
    )


def demo_headline(f: dict[str, Any]) -> str:
    t = f["test"]

    def num(x) -> str:  # metrics.json writes null for a mean over no queries
        return "n/a" if x is None else f"{x:.3f}"

    return (
        f"{f['step']} steps, test exact match {num(t['acc'])} (held-out "
        f"{num(t.get('acc_heldout'))}), recall@5 {num(t.get('recall@5'))}, "
        f"{f['samples_per_s']:.1f} samples/s, world {f['world_size']}"
    )


def demo_command(args: argparse.Namespace, out: Path) -> list[str]:
    """The demo in one process through a NCCL process group (torchrun, one rank): the demo's data
    (``make demo``'s when present, else generated under the work folder), the run there, and its
    metrics.json copied to ``out``. The dry run: gloo, CPU, two steps on a small world.

    Every program is this interpreter (``python -m torch.distributed.run`` is torchrun): the
    command assumes nothing about PATH, where a venv's ``torchrun`` is missing unless the venv is
    activated. The three actions run in one small Python program, one step for the timeout."""
    work = ROOT / "runs" / "gpu_check_work"
    data = ROOT / "data" / "knowledge_world"
    world: list[str] = []
    if (
        args.dry_run
    ):  # the plumbing only: a small world (its generation and final evaluation take seconds)
        data = work / "data_small"
        world = [
            "num_entities=32",
            "train_queries_per_entity=4",
            "val_queries_per_entity=1",
            "test_queries_per_entity=1",
        ]
    elif not (data / "corpus").is_dir():
        data = work / "data"
    py = sys.executable
    train = [
        py,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=1",
        "-m",
        "rag_mm.train",
        "+experiment=demo",
        f"data.root={data}",
        f"run_dir={work / 'demo'}",
        "resume=never",
    ]
    if args.dry_run:
        # the one shard
        train += [
            "device=cpu",
            "launch.backend=gloo",
            "max_steps=2",
            "retriever.warmup_steps=2",
            "eval_every=0",
            "ckpt_every=0",
            "data.train=train/train-000000.tar",
        ]
    else:
        train += ["device=cuda", "launch.backend=nccl"]
    gen = [py, "-m", "rag_mm.data.knowledge_world", f"out={data}", *world]
    program = "\n".join(
        [
            "import pathlib, shutil, subprocess, sys",
            f"if not pathlib.Path({str(data / 'corpus')!r}).is_dir():",
            f"    rc = subprocess.run({gen!r}).returncode",
            "    if rc: sys.exit(rc)",
            f"rc = subprocess.run({train!r}).returncode",
            "if rc: sys.exit(rc)",
            f"shutil.copy({str(work / 'demo' / 'metrics.json')!r}, "
            f"{str(out / 'demo_metrics.json')!r})",
        ]
    )
    return [py, "-c", program]


def gpu_test_files() -> list[str]:
    """Test files that use the gpu marker (``@pytest.mark.gpu`` or a module-level pytestmark)."""
    marker = re.compile(r"\bmark\.gpu\b")
    return sorted(
        str(p.relative_to(ROOT))
        for p in (ROOT / "tests").rglob("test_*.py")
        if marker.search(p.read_text(errors="replace"))
    )


def benches_with_device() -> list[str]:
    """Bench scripts whose argparse has a --device option."""
    return sorted(
        p.stem for p in BENCH_DIR.glob("*.py") if '"--device"' in p.read_text(errors="replace")
    )


def plan(args: argparse.Namespace, out: Path) -> list[Step]:
    """The steps for this run, in order."""
    py = sys.executable
    if args.dry_run:
        attention = [
            "--device",
            "cpu",
            "--quick",
            "--no-flex",
            "--dtypes",
            "float32",
            "--head-dims",
            "64",
            "--reps",
            "1",
        ]
    else:
        attention = ["--device", "cuda", "--quick" if args.quick else "--backward"]
    throughput = [py, str(BENCH_DIR / "train_throughput.py")]
    if args.dry_run:  # the plumbing on the CPU: one step of the demo reader and of a tiny HF reader
        mfu_demo = ["--device", "cpu", "--steps", "1", "--batch", "2"]
        mfu_1b = [
            "--device",
            "cpu",
            "--steps",
            "1",
            "--batch",
            "2",
            "--checkpointing",
            "model=hf_tiny",
        ]
    else:  # the demo reader, and the ~1B HF reader preset in bf16 with block checkpointing
        mfu_demo = ["--device", "cuda", "--precision", "bf16", "--steps", "20", "--batch", "32"]
        mfu_1b = [
            "--device",
            "cuda",
            "--precision",
            "bf16",
            "--steps",
            "10",
            "--batch",
            "8",
            "--checkpointing",
            *(["--compile"] if args.compile else []),
            "model=llama3_2_1b",
            "retriever.top_k=2",
        ]
    cuda_build = [
        py,
        str(ROOT / "scripts" / "cuda_build.py"),
        "--cuda-home",
        "auto",
        "--quiet",
        "--json",
        str(out / "cuda_build.json"),
        *(["--plan-only"] if args.dry_run else []),
    ]
    steps = [
        Step("cuda_build", cuda_build, "cuda_build.json", json_figures, cuda_build_headline),
        Step(
            "pytest",
            [
                py,
                "-m",
                "pytest",
                "-m",
                "gpu",
                "-p",
                "no:cacheprovider",
                "-q",
                f"--junitxml={out / 'pytest_gpu.xml'}",
                *gpu_test_files(),
            ],
            "pytest_gpu.xml",
            junit_figures,
            junit_headline,
        ),
        Step(
            "attention",
            [
                py,
                str(BENCH_DIR / "attention.py"),
                *attention,
                "--out",
                str(out / "bench_attention.json"),
            ],
            "bench_attention.json",
            json_figures,
            attention_headline,
        ),
        Step(
            "mfu_demo",
            [*throughput, "--out", str(out / "mfu_demo.json"), *mfu_demo],
            "mfu_demo.json",
            json_figures,
            mfu_headline,
        ),
        Step(
            "mfu_1b",
            [*throughput, "--out", str(out / "mfu_1b.json"), *mfu_1b],
            "mfu_1b.json",
            json_figures,
            mfu_headline,
        ),
        Step("demo", demo_command(args, out), "demo_metrics.json", json_figures, demo_headline),
    ]
    return [s for s in steps if not args.only or s.name in args.only]


def output_lines(argv: list[str]) -> list[str]:
    """Output lines of a quick command; empty when it is missing, fails or takes over 20 s."""
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return []
    return proc.stdout.strip().splitlines() if proc.returncode == 0 else []


def machine() -> dict[str, Any]:
    """What the checks run on; importing torch here also proves it imports."""
    import torch
    from torch.utils.cpp_extension import CUDA_HOME

    info: dict[str, Any] = dict(
        host=platform.node(),
        python=platform.python_version(),
        executable=sys.executable,
        torch=torch.__version__,
        torch_cuda=torch.version.cuda,
        cuda_available=torch.cuda.is_available(),
    )
    if info["cuda_available"]:
        props = torch.cuda.get_device_properties(0)
        info.update(
            device=props.name,
            capability=".".join(map(str, torch.cuda.get_device_capability(0))),
            memory_gib=round(props.total_memory / 2**30, 1),
            device_count=torch.cuda.device_count(),
            cudnn=torch.backends.cudnn.version(),
            driver=(
                output_lines(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"])
                or [None]
            )[0],
        )
    nvcc = Path(CUDA_HOME or "/usr/local/cuda") / "bin" / "nvcc"
    info.update(
        nvcc=(output_lines([str(nvcc), "--version"]) or [None])[-1],
        ninja=shutil.which("ninja"),
        cxx=shutil.which(os.environ.get("CXX", "c++")),
        missing_modules=[m for m in MODULES if importlib.util.find_spec(m) is None],
    )
    return info


def child_env(ext_cache: Path) -> dict[str, str]:
    """The steps' environment: the repository on PYTHONPATH (no install needed), the extension
    cache, and the pip-installed ninja's directory on PATH when no ninja is there already."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env.setdefault("RAG_MM_EXT_CACHE", str(ext_cache))
    if shutil.which("ninja") is None and importlib.util.find_spec("ninja") is not None:
        import ninja

        env["PATH"] = os.pathsep.join(filter(None, [ninja.BIN_DIR, env.get("PATH")]))
    return env


def _tee(src: IO[str], log: IO[str]) -> None:
    for line in src:
        sys.stdout.write(line)
        sys.stdout.flush()
        log.write(line)
    log.flush()


def run_step(
    step: Step, env: dict[str, str], timeout: float, out: Path, log: IO[str]
) -> dict[str, Any]:
    """Run one step in its own process group under ``timeout`` seconds; its figures if it wrote
    them."""
    cmd = shlex.join(step.argv)
    banner = f"\n== {step.name} (timeout {timeout:.0f} s): {cmd}\n"
    sys.stdout.write(banner)
    log.write(banner)
    path = out / step.artefact
    path.unlink(missing_ok=True)  # figures must come from this run
    t0 = time.monotonic()
    proc = subprocess.Popen(
        step.argv,
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        text=True,
        errors="replace",
        start_new_session=True,
    )
    tee = threading.Thread(target=_tee, args=(proc.stdout, log), daemon=True)
    tee.start()
    timed_out = False
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        timed_out = True
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(proc.pid, sig)
                proc.wait(timeout=KILL_GRACE_S)
                break
            except (ProcessLookupError, subprocess.TimeoutExpired):
                continue
    tee.join(timeout=KILL_GRACE_S)
    res: dict[str, Any] = dict(
        name=step.name,
        command=cmd,
        rc=proc.returncode,
        timed_out=timed_out,
        wall_s=round(time.monotonic() - t0, 1),
        artefact=step.artefact,
        figures=None,
    )
    if path.exists():
        try:
            res["figures"] = step.parse(path)
            res["headline"] = step.headline(res["figures"])
        except (OSError, ValueError, KeyError, TypeError, ET.ParseError) as e:
            res["parse_error"] = f"{type(e).__name__}: {e}"
    res["ok"] = proc.returncode == 0 and not timed_out and res["figures"] is not None
    return res


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--out",
        type=Path,
        default=Path(os.environ.get("OUT") or ROOT / "runs" / "gpu_check"),
        help="folder for the results (default: $OUT, else runs/gpu_check)",
    )
    ap.add_argument(
        "--dry-run",
        action="store_true",
        help="run the steps on the CPU (--device cpu, smallest settings) to test the plumbing",
    )
    ap.add_argument(
        "--quick", action="store_true", help="attention bench: seq 512 and 1024, forward only"
    )
    ap.add_argument("--compile", action="store_true", help="mfu_1b: torch.compile each block")
    ap.add_argument(
        "--only",
        type=lambda s: s.split(","),
        default=None,
        help=f"comma-separated steps to run, of {', '.join(STEPS)} (default: all)",
    )
    ap.add_argument(
        "--timeout", type=float, default=540, help="seconds per step before it is killed"
    )
    ap.add_argument(
        "--budget",
        type=float,
        default=560,
        help="seconds for all steps together; a step gets at most what is left",
    )
    ap.add_argument(
        "--ext-cache",
        type=Path,
        default=ROOT / "build" / "gpu_ext",
        help="where C++/CUDA extensions are built (RAG_MM_EXT_CACHE, unless already set)",
    )
    args = ap.parse_args()
    if args.only and not set(args.only) <= set(STEPS):
        ap.error(
            f"--only: unknown step(s) {sorted(set(args.only) - set(STEPS))}; known: "
            f"{', '.join(STEPS)}"
        )
    deadline = time.monotonic() + args.budget
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)

    info = machine()
    print(
        f"python {info['python']}  torch {info['torch']} (CUDA {info['torch_cuda']})  "
        f"nvcc: {info['nvcc']}  ninja: {info['ninja']}  c++: {info['cxx']}"
    )
    if info["cuda_available"]:
        print(
            f"device: {info['device']}  capability {info['capability']}  {info['memory_gib']} GiB  "
            f"driver {info['driver']}  cudnn {info['cudnn']}"
        )
    else:
        print("device: none (torch.cuda.is_available() is False)")
    if info["missing_modules"]:
        print(f"missing modules: {', '.join(info['missing_modules'])}")
    unregistered = sorted(set(benches_with_device()) - set(BENCHES))
    if unregistered:
        print(
            "note: bench(es) with a --device option that this script does not run: "
            f"{', '.join(unregistered)}"
        )
    summary: dict[str, Any] = dict(
        mode="dry-run (CPU)" if args.dry_run else "gpu",
        machine=info,
        benches_not_run=unregistered,
        steps=[],
    )

    if not info["cuda_available"] and not args.dry_run:
        summary |= dict(error="no CUDA device: the GPU checks were not run")
        (out / "gpu_check.json").write_text(json.dumps(summary, indent=1))
        print(
            "gpu_check: no CUDA device (torch.cuda.is_available() is False): the GPU checks were "
            "not run; --dry-run runs the same steps on the CPU",
            file=sys.stderr,
        )
        return 2

    env = child_env(args.ext_cache.resolve())
    with open(out / "gpu_check.log", "w") as log:
        for step in plan(args, out):
            left = deadline - time.monotonic()
            if left < 1:
                summary["steps"].append(
                    dict(
                        name=step.name,
                        command=shlex.join(step.argv),
                        rc=None,
                        ok=False,
                        skipped="budget exhausted",
                    )
                )
                continue
            summary["steps"].append(run_step(step, env, min(args.timeout, left), out, log))
    summary["ok"] = all(s["ok"] for s in summary["steps"])
    (out / "gpu_check.json").write_text(json.dumps(summary, indent=1))

    print(f"\n== summary ({summary['mode']}; {out})")
    for s in summary["steps"]:
        detail = s.get("skipped") or s.get("headline") or s.get("parse_error") or "no output file"
        state = "ok" if s["ok"] else ("TIMEOUT" if s.get("timed_out") else "FAILED")
        print(f"{s['name']:<10} {state:<8} rc={s['rc']}  {s.get('wall_s', 0):>6.1f} s  {detail}")
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
