"""Shared by the operations tests: the tiny world, and one uninterrupted 2-rank run to compare
with."""

import pytest

from tests.ops.helpers import final_state, torchrun, train_losses
from tests.rag_mm.conftest import tiny_world  # noqa: F401  (a fixture: pytest finds it by name)


@pytest.fixture(scope="session")
def reference(tiny_world, tmp_path_factory):  # noqa: F811
    """An uninterrupted 2-rank torchrun run: its final parameters and per-step losses."""
    run_dir = tmp_path_factory.mktemp("reference") / "run"
    res = torchrun(tiny_world, run_dir)
    assert res.returncode == 0, res.stderr[-3000:]
    step, params = final_state(tiny_world, run_dir)
    assert step == 8
    return params, train_losses(run_dir)
