"""Shared fixtures: every test starts from the same global state and leaves it as it found it."""

from __future__ import annotations

import os
import random

import numpy as np
import pytest
import torch

# One intra-op thread per process: multi-rank tests run several processes on a few cores.
os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(autouse=True)
def _restore_global_torch_state():
    dtype = torch.get_default_dtype()
    threads = torch.get_num_threads()
    torch.manual_seed(0)
    random.seed(0)
    np.random.seed(0)
    yield
    torch.set_default_dtype(dtype)
    torch.set_num_threads(threads)
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
