"""Compile every CUDA source in ``csrc/`` through the project's own build, on any machine.

    python scripts/cuda_build.py                 # `make cuda-build`: nvcc from PyPI, cached
    python scripts/cuda_build.py --cuda-home auto  # the machine's own toolkit (CUDA_HOME / PATH)

No GPU is needed: the CUDA kernels are compiled and linked with ``parallel/kernels/_build.py``
(``torch.utils.cpp_extension.load``, the same call a GPU machine makes on first use), for the
architectures ``_build.cuda_archs()`` names (sm_80 and sm_90, sm_100 too when the toolkit has it;
``--archs`` or $RAG_MM_CUDA_ARCHS override), the compiler's output and warnings shown. Each
built library is then loaded into this process and its CUDA kernels must have reached torch's
dispatcher: the script lists every op of each library with the backends it has kernels for.

The toolkit: by default nvcc, NVVM, the CUDA C++ front-end headers (crt) and CCCL are installed
from PyPI (the wheels ``nvidia-cuda-nvcc``, ``nvidia-nvvm``, ``nvidia-cuda-crt``,
``nvidia-cuda-cccl`` of the CUDA version torch was built with, and the ``nvidia-cuda-runtime``
wheel torch itself depends on, for the runtime headers) with ``pip install --target`` into
``~/.cache/rag_mm/cuda-toolkit/`` ($RAG_MM_CUDA_TOOLKIT_CACHE overrides): the project's own
environment is not touched. A toolkit already there is reused without asking pip.

What is cached, and so what a second run costs: the toolkit (one folder per set of wheel
versions), and the builds under ``_build.cache_dir()``, one folder per extension and
architecture set, each reused while its ``_build.build_key`` (the contents of the sources and
of csrc/'s headers, the flags, torch, the compilers' versions) is unchanged, whatever the files'
times (a fresh clone); else ninja recompiles. An unchanged tree takes seconds.

Exit status: 0 when every CUDA source compiled and registered its kernels; 1 when one did not
(the extension, its sources and the first compiler error are named; without ``--quiet`` the
full compiler output is above it); 2 when there is nothing to build with (a CPU-only torch, no
toolkit, pip failed).
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script: the repository's packages, not an installed copy
    sys.path.insert(0, str(ROOT))

# The toolkit wheels, at the CUDA version torch was built with; the runtime headers come from the
# nvidia-cuda-runtime wheel at the version torch's own dependency installed.
TOOLKIT_WHEELS = ("nvidia-cuda-nvcc", "nvidia-nvvm", "nvidia-cuda-crt", "nvidia-cuda-cccl")
RUNTIME_WHEEL = "nvidia-cuda-runtime"
CACHE_ENV = "RAG_MM_CUDA_TOOLKIT_CACHE"
# TORCH_LIBRARY_IMPL(ns, CUDA, m) { m.impl("op", ...); ... } in a .cu file
IMPL_BLOCK = re.compile(
    r"TORCH_LIBRARY_IMPL\(\s*(\w+)\s*,\s*CUDA\s*,\s*\w+\s*\)\s*\{(.*?)\n\}", re.S
)
IMPL_OP = re.compile(r"\.impl\(\s*\"([\w.]+)\"")


class BuildError(Exception):
    """Nothing to build with (exit status 2): the message says what is missing."""


@dataclass
class Extension:
    """One extension of csrc/: its library name, sources (relative to csrc/) and extra nvcc
    flags."""

    name: str
    cpu_sources: list[str]
    cuda_sources: list[str]
    cuda_flags: list[str] = field(default_factory=list)


def extensions() -> list[Extension]:
    """The project's extensions with CUDA sources, as their Python faces declare them."""
    from parallel.kernels import _attention_ops, comm

    return [
        Extension(
            _attention_ops.EXT_NAME,
            _attention_ops.CPU_SOURCES,
            _attention_ops.CUDA_SOURCES,
            _attention_ops.CUDA_FLAGS,
        ),
        Extension("rmm_comm", comm.CPU_SOURCES, comm.CUDA_SOURCES),  # the name comm.load builds
    ]


def orphan_sources(exts: list[Extension], csrc: Path) -> list[str]:
    """The .cu files under csrc/ that no extension builds (they would never be compiled)."""
    owned = {s for e in exts for s in e.cuda_sources}
    return sorted(
        str(p.relative_to(csrc))
        for p in csrc.rglob("*.cu")
        if str(p.relative_to(csrc)) not in owned
    )


# ------------------------------------------------------------------------------------ toolkit
def wheel_specs() -> list[str]:
    """pip requirement strings of the toolkit matching the installed torch's CUDA runtime."""
    import torch

    if torch.version.cuda is None:
        raise BuildError(
            f"torch {torch.__version__} is a CPU-only build: CUDA sources cannot be built against "
            "it"
        )
    try:
        runtime = importlib.metadata.version(RUNTIME_WHEEL)
    except importlib.metadata.PackageNotFoundError:
        raise BuildError(
            f"torch {torch.__version__} (CUDA {torch.version.cuda}) did not come with the "
            f"{RUNTIME_WHEEL} wheel: point --cuda-home at a CUDA {torch.version.cuda} toolkit"
        ) from None
    major_minor = ".".join(runtime.split(".")[:2])
    if major_minor != ".".join(torch.version.cuda.split(".")[:2]):
        raise BuildError(
            f"{RUNTIME_WHEEL} {runtime} does not match torch's CUDA {torch.version.cuda}"
        )
    return [f"{w}=={major_minor}.*" for w in TOOLKIT_WHEELS] + [f"{RUNTIME_WHEEL}=={runtime}"]


def toolkit_cache() -> Path:
    root = os.environ.get(CACHE_ENV)
    if root:
        return Path(root)
    return (
        Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "rag_mm" / "cuda-toolkit"
    )


def _cuda_home_in(target: Path) -> Path | None:
    """The CUDA_HOME inside a ``pip install --target`` folder: ``nvidia/cu<major>``."""
    homes = sorted(target.glob("nvidia/cu*/bin/nvcc"))
    return homes[0].parents[1] if homes else None


def complete_layout(home: Path) -> None:
    """What the wheels leave out of a CUDA_HOME that nvcc and cpp_extension look for: nvcc.profile
    reads headers and libraries under targets/<arch>-linux/, the linker's ``-lcudart`` wants an
    unversioned libcudart.so, and cpp_extension links from lib64/ when it exists."""
    target = home / "targets" / ("x86_64-linux" if platform.machine() == "x86_64" else "sbsa-linux")
    target.mkdir(parents=True, exist_ok=True)
    for name in ("include", "lib"):
        if not (target / name).exists():
            (target / name).symlink_to(Path("..") / ".." / name)
    if not (home / "lib64").exists():
        (home / "lib64").symlink_to("lib")
    versioned = sorted((home / "lib").glob("libcudart.so.*"))
    if versioned and not (home / "lib" / "libcudart.so").exists():
        (home / "lib" / "libcudart.so").symlink_to(versioned[0].name)


def fetch_toolkit(cache: Path) -> Path:
    """CUDA_HOME of the PyPI toolkit under ``cache``, installed there first if needed."""
    specs = wheel_specs()
    tag = hashlib.sha256(" ".join(specs).encode()).hexdigest()[:10]
    folder = cache / f"cuda{specs[0].split('==')[1].rstrip('.*')}-{tag}"
    stamp = folder / "toolkit.json"
    if stamp.exists() and (home := _cuda_home_in(folder)) is not None:
        return home
    cache.mkdir(parents=True, exist_ok=True)
    tmp = cache / f".{folder.name}.{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    print(f"cuda_build: installing {' '.join(specs)} into {folder}", flush=True)
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "install",
        "--quiet",
        "--disable-pip-version-check",
        "--no-deps",
        "--no-compile",
        "--target",
        str(tmp),
        *specs,
    ]
    proc = subprocess.run(cmd, stdin=subprocess.DEVNULL)
    home = _cuda_home_in(tmp)
    if proc.returncode != 0 or home is None:
        shutil.rmtree(tmp, ignore_errors=True)
        raise BuildError(
            f"pip could not install the CUDA toolkit wheels ({' '.join(specs)}): exit status "
            f"{proc.returncode}; without network, pass --cuda-home with an installed toolkit"
        )
    complete_layout(home)
    versions = {
        d.metadata["Name"]: d.version for d in importlib.metadata.distributions(path=[str(tmp)])
    }
    (tmp / "toolkit.json").write_text(
        json.dumps(
            dict(specs=specs, cuda_home=str(home.relative_to(tmp)), installed=versions), indent=1
        )
    )
    try:
        tmp.rename(folder)  # atomic: a concurrent run that finished first keeps its folder
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
    found = _cuda_home_in(folder)
    if found is None:
        raise BuildError(f"{folder} holds no nvcc after installing the toolkit")
    return found


def resolve_toolkit(cuda_home: str | None) -> Path:
    """CUDA_HOME to build with: ``--cuda-home`` PATH, ``auto`` (what torch finds: $CUDA_HOME, nvcc
    on PATH, /usr/local/cuda) or, by default, the PyPI toolkit."""
    if cuda_home == "auto":
        from torch.utils.cpp_extension import CUDA_HOME

        if CUDA_HOME is None or not (Path(CUDA_HOME) / "bin" / "nvcc").exists():
            raise BuildError(
                "no CUDA toolkit on this machine (no $CUDA_HOME, no nvcc on PATH, no "
                "/usr/local/cuda)"
            )
        return Path(CUDA_HOME)
    if cuda_home:
        home = Path(cuda_home)
        if not (home / "bin" / "nvcc").exists():
            raise BuildError(f"--cuda-home {home}: no bin/nvcc there")
        return home
    return fetch_toolkit(toolkit_cache())


def nvcc_version(home: Path) -> str:
    proc = subprocess.run([str(home / "bin" / "nvcc"), "--version"], capture_output=True, text=True)
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        raise BuildError(
            f"{home / 'bin' / 'nvcc'} --version failed: "
            f"{(proc.stderr or proc.stdout).strip()[-500:]}"
        )
    return next((ln for ln in lines if "release" in ln), lines[-1]).strip()


# ------------------------------------------------------------------------------------- ops
def declared_cuda_ops(sources: list[Path]) -> list[str]:
    """``ns::op`` of every CUDA kernel the sources register (their TORCH_LIBRARY_IMPL blocks)."""
    ops = []
    for src in sources:
        for ns, body in IMPL_BLOCK.findall(src.read_text(errors="replace")):
            ops += [f"{ns}::{op}" for op in IMPL_OP.findall(body)]
    return sorted(set(ops))


def op_table(namespaces: set[str]) -> dict[str, list[str]]:
    """Every op of ``namespaces`` in torch's dispatcher and the backends it has kernels for."""
    import torch

    table = {}
    for op in sorted(
        n for n in torch._C._dispatch_get_all_op_names() if n.split("::")[0] in namespaces
    ):
        keys = [
            key
            for key in ("CPU", "CUDA")
            if torch._C._dispatch_has_kernel_for_dispatch_key(op, key)
        ]
        # a kernel for every backend (ops without tensor arguments, such as segment control)
        if torch._C._dispatch_has_kernel_for_dispatch_key(op, "CompositeImplicitAutograd"):
            keys.append("any")
        table[op] = keys
    return table


# ------------------------------------------------------------------------------------- main
def build_all(exts: list[Extension], *, verbose: bool = True) -> tuple[list[dict], int]:
    """Build and load each extension with its CUDA sources; (per-extension records, exit status)."""
    from parallel.kernels._build import CSRC, load_extension

    records, status = [], 0
    for ext in exts:
        print(f"\n== {ext.name}: {', '.join(ext.cpu_sources + ext.cuda_sources)}", flush=True)
        t0 = time.monotonic()
        res = load_extension(
            ext.name,
            ext.cpu_sources,
            ext.cuda_sources,
            extra_cuda_cflags=ext.cuda_flags,
            require_cuda=True,
            verbose=verbose,
        )
        rec = dict(
            name=ext.name,
            ok=res.ok,
            reason=res.reason,
            archs=res.archs,
            build_dir=res.build_dir,
            cuda_sources=ext.cuda_sources,
            wall_s=round(time.monotonic() - t0, 1),
        )
        if res.ok:
            want = declared_cuda_ops([CSRC / s for s in ext.cuda_sources])
            import torch

            have = set(torch._C._dispatch_get_registrations_for_dispatch_key("CUDA"))
            rec["cuda_ops"], rec["missing_cuda_ops"] = want, [op for op in want if op not in have]
            if not want:
                rec["missing_cuda_ops"] = [
                    "(the CUDA sources register no TORCH_LIBRARY_IMPL(..., CUDA, ...) kernel)"
                ]
            if rec["missing_cuda_ops"]:
                rec["ok"] = False
                rec["reason"] = (
                    "built, but CUDA kernels missing from the dispatcher: "
                    f"{', '.join(rec['missing_cuda_ops'])}"
                )
        if not rec["ok"]:
            status = 1
            print(
                f"cuda_build: FAILED: {ext.name} ({', '.join(ext.cuda_sources)}): {rec['reason']}",
                file=sys.stderr,
                flush=True,
            )
        else:
            print(
                f"cuda_build: {ext.name}: {res.reason} in {rec['wall_s']} s ({res.build_dir})",
                flush=True,
            )
        records.append(rec)
    return records, status


def plan_only(args: argparse.Namespace) -> int:
    """What a build would compile, and with which toolkit (none is not an error here); 1 only
    when a .cu file belongs to no extension."""
    from parallel.kernels import _build

    try:
        home = resolve_toolkit(args.cuda_home) if args.cuda_home else None
        version = nvcc_version(home) if home else None
        why = None if home else "the PyPI toolkit (not fetched by --plan-only)"
    except BuildError as e:
        home, version, why = None, None, str(e)
    if home:
        os.environ["CUDA_HOME"] = str(home)
    if args.archs:
        os.environ["RAG_MM_CUDA_ARCHS"] = args.archs
    exts = extensions()
    orphans = orphan_sources(exts, _build.CSRC)
    archs = _build.cuda_archs() if home else list(_build.DEFAULT_CUDA_ARCHS)
    print(
        f"cuda_build (plan only): toolkit {version or why}; architectures sm_{', sm_'.join(archs)}"
    )
    for e in exts:
        print(f"  {e.name}: CPU {', '.join(e.cpu_sources)}; CUDA {', '.join(e.cuda_sources)}")
    if orphans:
        print(f"cuda_build: FAILED: no extension builds {', '.join(orphans)}", file=sys.stderr)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(
            json.dumps(
                dict(
                    plan_only=True,
                    ok=not orphans,
                    nvcc=version,
                    toolkit_problem=why,
                    archs=archs,
                    orphan_sources=orphans,
                    extensions=[vars(e) for e in exts],
                    cuda_sources=[s for e in exts for s in e.cuda_sources],
                ),
                indent=1,
            )
        )
    return 1 if orphans else 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--cuda-home",
        default=None,
        help="a CUDA toolkit to build with instead of the PyPI one; 'auto': the one torch finds",
    )
    ap.add_argument(
        "--archs",
        default=None,
        help="comma-separated architectures, as 80,90 (default: _build.cuda_archs)",
    )
    ap.add_argument(
        "--quiet", action="store_true", help="hide the compiler commands (errors are still shown)"
    )
    ap.add_argument("--json", type=Path, default=None, help="also write the summary here")
    ap.add_argument(
        "--plan-only",
        action="store_true",
        help="resolve the toolkit (no download) and list what would be built; compile nothing",
    )
    args = ap.parse_args(argv)
    t0 = time.monotonic()
    # The build's logger filter (torch's "No CUDA runtime is found" note) before cpp_extension
    # loads.
    from parallel.kernels import _build

    if args.plan_only:
        return plan_only(args)
    try:
        home = resolve_toolkit(args.cuda_home)
        version = nvcc_version(home)
    except BuildError as e:
        print(f"cuda_build: {e}", file=sys.stderr)
        return 2
    # cpp_extension reads CUDA_HOME when it is first imported: set it before anything imports it.
    os.environ["CUDA_HOME"] = str(home)
    if args.archs:
        os.environ["RAG_MM_CUDA_ARCHS"] = args.archs
    if shutil.which("ninja") is None:  # torch's build runs `ninja`: the pip-installed one will do
        try:
            import ninja

            os.environ["PATH"] = os.pathsep.join(
                filter(None, [ninja.BIN_DIR, os.environ.get("PATH")])
            )
        except ImportError:
            print("cuda_build: ninja is not installed (pip install ninja)", file=sys.stderr)
            return 2
    from torch.utils import cpp_extension

    if Path(cpp_extension.CUDA_HOME or "") != home:
        print(
            f"cuda_build: torch.utils.cpp_extension was imported before CUDA_HOME was set "
            f"(it uses {cpp_extension.CUDA_HOME})",
            file=sys.stderr,
        )
        return 2
    exts = extensions()
    orphans = orphan_sources(exts, _build.CSRC)
    archs = _build.cuda_archs()
    print(
        f"cuda_build: nvcc {version} ({home}); architectures sm_{', sm_'.join(archs)}; cache "
        f"{_build.cache_dir()}",
        flush=True,
    )
    records, status = build_all(exts, verbose=not args.quiet)
    if orphans:
        status = 1
        print(
            f"cuda_build: FAILED: no extension builds {', '.join(orphans)} (add it to an "
            "extension's CUDA_SOURCES)",
            file=sys.stderr,
        )
    table = op_table({op.split("::")[0] for r in records for op in r.get("cuda_ops", [])})
    if table:
        print("\ncuda_build: ops loaded from the CUDA builds (backends with a kernel):")
        for op, keys in table.items():
            print(f"  {op:<32} {' '.join(keys)}")
    summary = dict(
        ok=status == 0,
        nvcc=version,
        cuda_home=str(home),
        archs=archs,
        extensions=records,
        orphan_sources=orphans,
        ops=table,
        wall_s=round(time.monotonic() - t0, 1),
    )
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(summary, indent=1))
    built = sum(r["ok"] for r in records)
    print(
        f"\ncuda_build: {'ok' if status == 0 else 'FAILED'}: {built}/{len(records)} extensions "
        f"with CUDA for sm_{', sm_'.join(archs)} in {summary['wall_s']} s",
        flush=True,
    )
    return status


if __name__ == "__main__":
    sys.exit(main())
