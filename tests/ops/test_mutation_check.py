"""scripts/mutation_check.py stays in step with the code it breaks: every mutation's text is in its
file exactly once (moved code makes the check fail there, not in a later mutation run that tests
nothing), and every test it names exists."""

from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))

import mutation_check  # noqa: E402


def test_every_mutation_finds_its_code_once_and_its_tests():
    problems = []
    for m in mutation_check.MUTATIONS:
        for rel, old, _ in m.edits:
            path = ROOT / rel
            n = path.read_text().count(old) if path.is_file() else -1
            if n != 1:
                problems.append(f"{m.name}: {rel} holds its text {n} times: {old[:60]!r}")
        for node in m.tests:
            rel, _, name = node.partition("::")
            name = name.split("[")[0]  # a parametrized case: its function
            path = ROOT / rel
            if not path.is_file():
                problems.append(f"{m.name}: no test file {rel}")
            elif name and not re.search(rf"^def {re.escape(name)}\(", path.read_text(), re.M):
                problems.append(f"{m.name}: no test {node}")
    assert not problems, "\n".join(problems)


def test_a_moved_text_fails_the_mutation_loudly(tmp_path):
    """``apply`` refuses a mutation whose text is gone and leaves the files as they were."""
    (tmp_path / "a.py").write_text("x = 1\n")
    (tmp_path / "b.py").write_text("y = 2\n")
    m = mutation_check.Mutation(
        "gone", "a text that moved", (("a.py", "x = 1", "x = 2"), ("b.py", "z", "w")), ()
    )
    try:
        mutation_check.apply(tmp_path, m)
    except ValueError as exc:
        assert "not in b.py" in str(exc)
    else:
        raise AssertionError("apply accepted a text that is not there")
    assert (tmp_path / "a.py").read_text() == "x = 1\n"
