"""The extension cache of parallel/kernels/_build.py: a library is reused when what it was built
from is unchanged (also from another clone of the tree, whose files are all newer), and rebuilt
when a source, a header under csrc/ or a flag changes."""

from __future__ import annotations

import shutil

import pytest
from torch.utils import cpp_extension

from parallel.kernels import _build


def _tree(root):
    (root / "k").mkdir(parents=True)
    (root / "k" / "a.cpp").write_text('#include "a.h"\nint rag_mm_cache_test = A;\n')
    (root / "k" / "a.h").write_text("#define A 1\n")
    return root


def test_key_follows_contents_not_paths_or_times(tmp_path, monkeypatch):
    one, two = _tree(tmp_path / "one"), tmp_path / "two"
    shutil.copytree(one, two)  # another clone: other paths, other file times
    keys = {}
    for root in (one, two):
        monkeypatch.setattr(_build, "CSRC", root)
        keys[root] = _build.build_key([str(root / "k" / "a.cpp")], [["-O3"]], False)
    assert keys[one] == keys[two]
    (two / "k" / "a.h").write_text("#define A 2\n")  # a header the source includes
    assert _build.build_key([str(two / "k" / "a.cpp")], [["-O3"]], False) != keys[one]
    monkeypatch.setattr(_build, "CSRC", one)
    assert _build.build_key([str(one / "k" / "a.cpp")], [["-O2"]], False) != keys[one]


def test_unchanged_sources_load_the_cached_library_without_building(tmp_path, monkeypatch):
    ok, why = _build.compiler_available()
    if not ok:
        pytest.skip(why)
    src = _tree(tmp_path / "csrc")
    monkeypatch.setattr(_build, "CSRC", src)
    monkeypatch.setenv("RAG_MM_EXT_CACHE", str(tmp_path / "ext"))
    monkeypatch.setattr(_build, "_RESULTS", {})
    first = _build.load_extension("rag_mm_cache_test", ["k/a.cpp"])
    assert first.ok and first.reason == "built (CPU)", first.reason

    def no_build(**kwargs):
        raise RuntimeError("error: torch's build was asked to compile")

    monkeypatch.setattr(cpp_extension, "load", no_build)
    monkeypatch.setattr(_build, "_RESULTS", {})
    again = _build.load_extension("rag_mm_cache_test", ["k/a.cpp"])
    assert again.ok and again.reason == "cached build (CPU)", again.reason

    (src / "k" / "a.h").write_text("#define A 2\n")
    monkeypatch.setattr(_build, "_RESULTS", {})
    changed = _build.load_extension("rag_mm_cache_test", ["k/a.cpp"])
    assert not changed.ok and "torch's build was asked to compile" in changed.reason
