"""Can the working tree and the downloaded wheels travel to a lent GPU machine together?

    python scripts/dev/carry_check.py [--wheels .gpu_wheels]

The team's GPU machines have torch but no network, and are carried the working tree plus at most
64 MiB. This checks that ``--wheels`` (filled by ``scripts/dev/gpu_wheels.sh download``) holds a
wheel for every package the GPU checks import besides torch, and that those wheels and the
working tree (git's tracked and untracked-not-ignored files) fit the limit together. Exit status
0 when they do, 1 naming what is missing or too large. Team tooling: see scripts/dev/README.md.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TRANSFER_LIMIT = 64 * 2**20  # bytes the device tool carries: working tree plus carried folders
# distribution name stems (PEP 427, lower case) that must be among the carried wheels
REQUIRED_WHEELS = (
    "numpy",
    "faiss_cpu",
    "pytest",
    "ninja",
    "hydra_core",
    "omegaconf",
    "antlr4_python3_runtime",
    "webdataset",
    "braceexpand",
    "open_clip_torch",
    "ftfy",
    "regex",
    "safetensors",
    "tokenizers",
    "huggingface_hub",
    "transformers",
    "timm",
    "pyyaml",
    "rich",
)


def tree_bytes(root: Path = ROOT) -> int:
    """Bytes of the working tree as the device tool carries it."""
    listed = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard", "-z"],
        cwd=root,
        capture_output=True,
        check=True,
    )
    names = [f for f in listed.stdout.decode().split("\0") if f]
    return sum((root / f).stat().st_size for f in names if (root / f).is_file())


def wheel_problems(folder: Path) -> tuple[list[str], dict[str, int]]:
    """What keeps ``folder``'s wheels from reaching a GPU machine: missing ones, or too many bytes
    together with the working tree."""
    wheels = sorted(folder.glob("*.whl")) if folder.is_dir() else []
    have = {w.name.split("-")[0].lower() for w in wheels}
    tree = tree_bytes()
    sizes = dict(
        wheels=len(wheels), wheel_bytes=sum(w.stat().st_size for w in wheels), tree_bytes=tree
    )
    problems = []
    fetch = "run `make -f scripts/dev/Makefile gpu-wheels`"
    if not wheels:
        problems.append(f"no wheels in {folder}: {fetch}")
    elif missing := [r for r in REQUIRED_WHEELS if r not in have]:
        problems.append(f"{folder} lacks wheels for {', '.join(missing)}: {fetch}")
    if sizes["wheel_bytes"] + tree > TRANSFER_LIMIT:
        problems.append(
            f"wheels {sizes['wheel_bytes'] / 2**20:.1f} MiB + working tree "
            f"{tree / 2**20:.1f} MiB exceed the {TRANSFER_LIMIT / 2**20:.0f} MiB "
            "the device tool carries"
        )
    return problems, sizes


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--wheels",
        type=Path,
        default=ROOT / ".gpu_wheels",
        help="the folder of wheels to carry (default: .gpu_wheels)",
    )
    args = ap.parse_args()
    problems, sizes = wheel_problems(args.wheels)
    print(
        f"carry_check: {sizes['wheels']} wheels in {args.wheels}, "
        f"{sizes['wheel_bytes'] / 2**20:.1f} MiB + working tree "
        f"{sizes['tree_bytes'] / 2**20:.1f} MiB of {TRANSFER_LIMIT / 2**20:.0f} MiB"
    )
    for line in problems:
        print(f"carry_check: {line}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
