"""Build-on-first-use for the C++/CUDA sources in ``csrc/``, with a cache and a logged gate.

``torch.utils.cpp_extension.load`` already caches by source hash inside ``build_directory``;
this module only decides *whether* to build (compiler present? CUDA sources wanted?), where the
cache lives, and remembers why a build failed so callers can say so once and fall back.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch

log = logging.getLogger(__name__)

CSRC = Path(__file__).resolve().parents[2] / "csrc"


def _no_cuda_runtime_note(record: logging.LogRecord) -> bool:
    """False for torch's "No CUDA runtime is found, using CUDA_HOME=..." (logged once, when
    ``torch.utils.cpp_extension`` is imported on a machine with a CUDA toolkit or CUDA_HOME and no
    GPU driver). Every CPU run imports that module here, to build or load its CPU kernels, so
    the note would open every run's log; whether CUDA kernels are built, and why not, is logged
    by ``load_extension`` itself. Any other cpp_extension message passes."""
    return not str(record.msg).startswith("No CUDA runtime is found")


# A filter on torch's logger, installed before any import of cpp_extension (all of them are lazy,
# below): the note is printed at that import, so it cannot be caught around a later call.
logging.getLogger("torch.utils.cpp_extension").addFilter(_no_cuda_runtime_note)


def cache_dir() -> Path:
    """Where built extensions live: $RAG_MM_EXT_CACHE, else ~/.cache/rag_mm/ext/<torch tag>."""
    root = os.environ.get("RAG_MM_EXT_CACHE")
    if root:
        base = Path(root)
    else:
        base = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "rag_mm" / "ext"
    tag = (
        f"torch{torch.__version__.split('+')[0]}-py{sys.version_info.major}{sys.version_info.minor}"
    )
    path = base / tag
    path.mkdir(parents=True, exist_ok=True)
    return path


def cuda_build_possible() -> tuple[bool, str]:
    """True when .cu sources can be compiled: a CUDA build of torch and nvcc on PATH/CUDA_HOME."""
    if os.environ.get("RAG_MM_SKIP_CUDA_BUILD"):
        return False, "RAG_MM_SKIP_CUDA_BUILD is set"
    if torch.version.cuda is None:
        return False, "torch is a CPU-only build"
    from torch.utils.cpp_extension import CUDA_HOME

    if CUDA_HOME is None or not (Path(CUDA_HOME) / "bin" / "nvcc").exists():
        return False, "nvcc not found (CUDA_HOME unset)"
    return True, "nvcc and a CUDA build of torch are present"


# Architectures compiled when no GPU is visible (the build-only check): Ampere (A100, sm_80) and
# Hopper (H100/H200, sm_90) as machine code, Blackwell (B200, sm_100) too when the toolkit knows
# it. No PTX is embedded: a newer GPU rebuilds for itself on first use. RAG_MM_CUDA_ARCHS="80,90"
# overrides; with a GPU visible, only its architectures are built (one build per machine is enough).
DEFAULT_CUDA_ARCHS = ("80", "90")
OPTIONAL_CUDA_ARCHS = ("100",)
ARCHS_ENV = "RAG_MM_CUDA_ARCHS"


def toolkit_archs() -> set[str]:
    """The real architectures (``sm_XX`` -> ``"XX"``) the CUDA_HOME nvcc can compile; empty when
    there is no nvcc or it does not answer."""
    from torch.utils.cpp_extension import CUDA_HOME

    if CUDA_HOME is None:
        return set()
    try:
        proc = subprocess.run(
            [str(Path(CUDA_HOME) / "bin" / "nvcc"), "--list-gpu-code"],
            capture_output=True,
            text=True,
            timeout=60,
        )
    except (OSError, subprocess.TimeoutExpired):
        return set()
    return set(re.findall(r"\bsm_(\d+)\b", proc.stdout)) if proc.returncode == 0 else set()


def cuda_archs() -> list[str]:
    """Architectures to compile CUDA sources for, as ``["80", "90"]`` (see DEFAULT_CUDA_ARCHS)."""
    env = os.environ.get(ARCHS_ENV)
    if env:
        return sorted(
            {a.strip().replace(".", "").removeprefix("sm_") for a in env.split(",") if a.strip()},
            key=int,
        )
    if torch.cuda.is_available():
        caps = {torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())}
        return sorted((f"{major}{minor}" for major, minor in caps), key=int)
    known = toolkit_archs()
    return list(DEFAULT_CUDA_ARCHS) + [a for a in OPTIONAL_CUDA_ARCHS if a in known]


def arch_flags(archs: list[str]) -> list[str]:
    """nvcc flags for machine code of each architecture (cpp_extension adds none when these are
    given, whatever TORCH_CUDA_ARCH_LIST says)."""
    return [f"-gencode=arch=compute_{a},code=sm_{a}" for a in archs]


def compiler_available() -> tuple[bool, str]:
    cxx = os.environ.get("CXX", "c++")
    if shutil.which(cxx) is None:
        return False, f"no C++ compiler ({cxx!r} not on PATH)"
    return True, f"{cxx} found"


@dataclass
class BuildResult:
    """Outcome of one extension build: ``ok`` and, when not ok, the reason."""

    name: str
    ok: bool
    reason: str
    with_cuda: bool = False
    sources: list[str] = field(default_factory=list)
    archs: list[str] = field(default_factory=list)  # CUDA architectures compiled, as "90"
    build_dir: str = ""


_RESULTS: dict[str, BuildResult] = {}


# A compiler's or linker's error line: gcc "f.cpp:3:1: error: ...", nvcc "f.cu(3): error: ...",
# "fatal error", "undefined reference" (ld).
_ERROR_LINE = re.compile(r"(:\s*(fatal )?error\b|\berror\s*:|undefined reference)", re.I)


def _first_error(exc: Exception) -> str:
    """The first compiler ``error`` line of a failed build (ninja's last line says nothing, and
    torch's "Error building extension ..." line carries the first command instead)."""
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    for pick in (lambda ln: _ERROR_LINE.search(ln), lambda ln: "error" in ln.lower()):
        for ln in lines:
            if (
                pick(ln)
                and "ninja" not in ln.lower()
                and not ln.startswith("Error building extension")
            ):
                return ln[:500]
    return lines[-1][:500] if lines else repr(exc)


HEADER_SUFFIXES = (".h", ".hpp", ".cuh")
KEY_FILE = "rag_mm_build_key"  # beside the built library: the key it was built for


def _first_line(argv: list[str]) -> str:
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    lines = [ln for ln in proc.stdout.splitlines() if ln.strip()]
    return next((ln for ln in lines if "release" in ln), lines[0] if lines else "")


def _cpu_signature() -> str:
    """Model and instruction-set flags of this CPU (the CPU sources build with -march=native)."""
    try:
        info = Path("/proc/cpuinfo").read_text(errors="replace").splitlines()
    except OSError:
        return platform.processor()
    return "\n".join(
        next((ln for ln in info if ln.startswith(k)), "") for k in ("model name", "flags")
    )


def build_key(sources: list[str], flags: list, with_cuda: bool) -> str:
    """What a built library depends on, hashed: the contents of its sources and of every header
    under csrc/ (by path relative to csrc/, so another clone of the same tree matches), the flags,
    torch, the C++ compiler, nvcc's version when CUDA is built, and the CPU (-march=native).

    torch's ninja build decides by file times, so a fresh clone (new times) would recompile an
    unchanged tree: a library whose key matches is loaded without asking ninja."""
    h = hashlib.sha256()
    files = [Path(s) for s in sources] + sorted(
        p for p in CSRC.rglob("*") if p.suffix in HEADER_SUFFIXES
    )
    for path in files:
        rel = str(path.relative_to(CSRC)) if path.is_relative_to(CSRC) else str(path)
        h.update(rel.encode() + b"\0" + path.read_bytes() + b"\0")
    cxx = os.environ.get("CXX", "c++")
    env = dict(
        flags=flags,
        with_cuda=with_cuda,
        torch=torch.__version__,
        torch_cuda=torch.version.cuda,
        cxx=_first_line([cxx, "--version"]),
        cpu=_cpu_signature(),
    )
    if with_cuda:
        from torch.utils.cpp_extension import CUDA_HOME

        env["nvcc"] = _first_line([str(Path(CUDA_HOME or "") / "bin" / "nvcc"), "--version"])
    h.update(json.dumps(env, sort_keys=True).encode())
    return h.hexdigest()


def load_extension(
    name: str,
    cpu_sources: list[str],
    cuda_sources: list[str] | None = None,
    *,
    extra_cflags: list[str] | None = None,
    extra_cuda_cflags: list[str] | None = None,
    extra_ldflags: list[str] | None = None,
    require_cuda: bool = False,
    verbose: bool | None = None,
) -> BuildResult:
    """Compile (or reuse the cached build of) a TORCH_LIBRARY extension and load it.

    ``*_sources`` are paths relative to ``csrc/``. The extension is loaded as a plain shared
    library (``is_python_module=False``): the ops register themselves with the dispatcher.
    CUDA sources are added only when ``cuda_build_possible()``; set ``require_cuda`` to build
    them regardless (``scripts/cuda_build.py``: the build check on machines without a GPU).
    The CUDA build is compiled for ``cuda_archs()`` into its own folder per architecture set, so
    a GPU machine's build and the check's do not rebuild each other; torch's ninja build rebuilds
    what changed (sources, included headers, flags, the nvcc path) and nothing else; a library
    whose ``build_key`` matches is loaded as it is (a fresh clone of an unchanged tree). ``verbose``
    (default: $RAG_MM_VERBOSE_BUILD) shows the compiler commands and warnings.
    """
    if name in _RESULTS:
        return _RESULTS[name]
    ok, why = compiler_available()
    if not ok:
        res = BuildResult(name, False, why)
        _RESULTS[name] = res
        return res

    sources = [str(CSRC / s) for s in cpu_sources]
    with_cuda = False
    if cuda_sources:
        can, why_cuda = cuda_build_possible()
        if can or require_cuda:
            sources += [str(CSRC / s) for s in cuda_sources]
            with_cuda = True
        else:
            log.info("%s: building CPU kernels only (%s)", name, why_cuda)

    from torch.utils.cpp_extension import load

    archs = cuda_archs() if with_cuda else []
    build_dir = cache_dir() / (name + (f"_cuda_sm{'-'.join(archs)}" if with_cuda else ""))
    build_dir.mkdir(parents=True, exist_ok=True)
    # No -std flag: cpp_extension passes the standard the installed torch headers need
    # (C++17 up to torch 2.9, C++20 from 2.10 on); forcing c++17 breaks the 2.10+ headers.
    cflags = ["-O3", "-fopenmp", "-march=native"] + (extra_cflags or [])
    # --threads=0: nvcc compiles the architectures in parallel, one per core
    cuda_cflags = (
        ["-O3", "--use_fast_math", "--threads=0"] + arch_flags(archs) + (extra_cuda_cflags or [])
    )
    ldflags = ["-fopenmp"] + (extra_ldflags or [])
    lib_name = name + ("_cuda" if with_cuda else "")
    library, key_file = build_dir / f"{lib_name}.so", build_dir / KEY_FILE
    verbose = bool(os.environ.get("RAG_MM_VERBOSE_BUILD")) if verbose is None else verbose
    what = f" with CUDA (sm_{', sm_'.join(archs)})" if with_cuda else " (CPU)"
    try:
        key = build_key(sources, [cflags, cuda_cflags if with_cuda else [], ldflags], with_cuda)
        if library.exists() and key_file.exists() and key_file.read_text() == key:
            torch.ops.load_library(str(library))
            if verbose:
                print(
                    f"{lib_name}: sources, headers, flags and compilers unchanged: loaded "
                    f"{library}",
                    flush=True,
                )
            res = BuildResult(
                name, True, "cached build" + what, with_cuda, sources, archs, str(build_dir)
            )
        else:
            key_file.unlink(missing_ok=True)
            load(
                name=lib_name,
                sources=sources,
                extra_cflags=cflags,
                extra_cuda_cflags=cuda_cflags,
                extra_ldflags=ldflags,
                build_directory=str(build_dir),
                with_cuda=with_cuda,
                is_python_module=False,
                verbose=verbose,
            )
            key_file.write_text(key)
            res = BuildResult(name, True, "built" + what, with_cuda, sources, archs, str(build_dir))
    except Exception as exc:  # compiler errors, missing headers, linker errors
        res = BuildResult(
            name,
            False,
            f"build failed: {_first_error(exc)}",
            with_cuda,
            sources,
            archs,
            str(build_dir),
        )
        log.warning("%s: %s", name, res.reason)
    _RESULTS[name] = res
    return res
