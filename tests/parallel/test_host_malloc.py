"""steady_malloc (parallel/host_malloc.py) stops the page-fault churn of a CPU training loop."""

from __future__ import annotations

import statistics
import subprocess
import sys
import textwrap

import pytest

LOOP = textwrap.dedent("""
    import sys, torch
    from torch import nn
    torch.set_num_threads(1)
    if sys.argv[1] == "steady":
        from parallel.host_malloc import steady_malloc
        print(steady_malloc(), file=sys.stderr)
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(512, 512), nn.ReLU()) for _ in range(8)])
    x, y = torch.randn(256, 512), torch.randn(256, 512)

    def step():  # 16 microbatches with gradient accumulation: 1 MiB weight gradients freed each time
        for xi, yi in zip(x.tensor_split(16), y.tensor_split(16)):
            (torch.nn.functional.mse_loss(model(xi), yi) / 16).backward()
        model.zero_grad()

    def faults():
        return int(open("/proc/self/stat").read().rsplit(")", 1)[1].split()[7])

    for _ in range(5):
        step()
    per_step = []
    for _ in range(11):
        f0 = faults()
        step()
        per_step.append(faults() - f0)
    print(*per_step)
""")  # noqa: E501


def _faults(mode: str) -> float:
    """The median page faults of a training step, over 11 steps after 5 to warm up.

    The median, not the mean: the count of single steps moves with the host's memory management
    (a step with fixed thresholds now and then faults a few hundred fresh heap pages in; glibc's
    dynamic thresholds churn thousands on most steps and none on some), and the mean of a few
    steps mixes the two."""
    out = subprocess.run(
        [sys.executable, "-c", LOOP, mode],
        capture_output=True,
        text=True,
        check=True,
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": ".", "OMP_NUM_THREADS": "1"},
    )
    return statistics.median(int(n) for n in out.stdout.split())


@pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="glibc malloc and /proc are Linux's"
)
def test_steady_malloc_stops_page_fault_churn():
    churn, steady = _faults("default"), _faults("steady")
    # per-step medians on the dev box: hundreds to thousands with glibc's dynamic thresholds (a
    # busy host lowers them), 0-1 with them fixed; a no-op steady_malloc reads as the default does.
    # A step that hands one 1 MiB weight gradient back to the OS faults its 256 pages in again:
    # fixed thresholds keep the median step under a quarter of that
    if churn < 100:
        pytest.skip(f"this libc's default thresholds do not churn ({churn:.0f} faults a step)")
    assert steady < min(64, churn / 4), (
        f"a median {steady:.0f} faults a step with steady_malloc vs {churn:.0f} without"
    )


def test_steady_malloc_respects_the_environment():
    code = "from parallel.host_malloc import steady_malloc; print(steady_malloc())"
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": ".", "MALLOC_TRIM_THRESHOLD_": "1"},
    )
    assert "environment" in out.stdout
