"""Run every benchmark under scripts/bench/ (``make bench``), each in its own process.

    python scripts/bench/run_all.py [--full] [--only attention,comm] [--out runs/bench]

Each benchmark writes its own JSON (and log) under ``--out``; this script adds ``summary.json``
with the command, exit status and wall time of each. The default settings are the quick ones
(``summary.json`` has each one's wall time); ``--full`` uses each script's own defaults, the
settings BENCHMARKS.md quotes (the 1M-vector index benchmark alone is the longest of them).
Benchmarks time things; nothing here asserts a speed.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def commands(out: Path, full: bool) -> dict[str, list[str]]:
    """Benchmark name -> argument list (after the script path)."""
    quick = not full
    return {
        "partition": ["--skip-quality"] if quick else ["--markdown"],
        "attention": [
            "--out",
            str(out / "attention.json"),
            *(["--quick"] if quick else ["--backward"]),
        ],
        "comm": ["--out", str(out / "comm.json"), *(["--budget", "0.3"] if quick else [])],
        "index": [
            "--out",
            str(out / "index.json"),
            *(["--n", "100000", "--nq", "1000"] if quick else []),
        ],
        "pipeline": [
            "--out",
            str(out / "pipeline.json"),
            *(["--steps", "10", "--reader-reps", "1"] if quick else []),
        ],
        "search": ["--docs", "1000", "10000", "--reps", "5"] if quick else [],
        "memory": ["--json", str(out / "memory.json")],
        "train_throughput": ["--steps", "10" if quick else "20"],
        "accum_sync": ["--out", str(out / "accum_sync.json"), "--steps", "5" if quick else "20"],
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--full", action="store_true", help="each script's own (long) defaults")
    ap.add_argument("--only", default="", help="comma-separated subset of the benchmarks")
    ap.add_argument("--out", type=Path, default=Path("runs/bench"))
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    todo = commands(args.out, args.full)
    if args.only:
        names = args.only.split(",")
        unknown = sorted(set(names) - set(todo))
        if unknown:
            print(
                f"run_all: unknown benchmark(s) {unknown}; known: {sorted(todo)}", file=sys.stderr
            )
            return 2
        todo = {n: todo[n] for n in names}
    summary = {}
    for name, extra in todo.items():
        cmd = [sys.executable, str(HERE / f"{name}.py"), *extra]
        print(f"== {name}: {' '.join(cmd[1:])}", flush=True)
        t0 = time.perf_counter()
        with open(args.out / f"{name}.log", "w") as log:
            rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT).returncode
        summary[name] = {
            "cmd": cmd[1:],
            "returncode": rc,
            "wall_s": round(time.perf_counter() - t0, 1),
            "log": str(args.out / f"{name}.log"),
        }
        print(
            f"   rc={rc} in {summary[name]['wall_s']} s (log: {summary[name]['log']})", flush=True
        )
    (args.out / "summary.json").write_text(json.dumps(summary, indent=1, allow_nan=False))
    print(json.dumps(summary, indent=1, allow_nan=False))
    return 0 if all(v["returncode"] == 0 for v in summary.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
