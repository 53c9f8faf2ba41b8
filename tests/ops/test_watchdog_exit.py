"""A rank whose work is done exits 0 even when its watchdog thread is inside a store call: the
publisher is joined at close, not left to be killed in C++ frames as the interpreter finalises
(which aborts the process: "terminate called without an active exception")."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# A store whose writes hang (a slow or loaded store host): the publisher's write blocks in C++,
# with the GIL released, for the client's timeout. The main thread closes the watchdog and exits.
SCRIPT = textwrap.dedent(
    """
    import os, time
    from datetime import timedelta
    import torch.distributed as dist
    from rag_mm.ft import watchdog

    host = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(host.port))
    w = watchdog.Watchdog(rank=1, world_size=2, timeout_s=60)


    class SlowStore:
        def __init__(self):
            self.c = dist.TCPStore("127.0.0.1", host.port, is_master=False,
                                   timeout=timedelta(seconds=2), wait_for_workers=False)

        def set(self, key, value):
            try:
                self.c.wait(["never-set"])  # blocks in the store client for its timeout
            except Exception:
                pass


    w._pub = SlowStore()
    w.at("close (final barrier)")
    time.sleep(2 * watchdog.PUBLISH_EVERY_S)  # the publisher is now inside the slow write
    w.close()
    print("closed", flush=True)
    """
)


def test_exit_after_close_with_the_publisher_inside_a_store_call():
    res = subprocess.run(
        [sys.executable, "-c", SCRIPT], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert res.returncode == 0, (res.returncode, res.stderr[-2000:])
    assert "closed" in res.stdout and "terminate called" not in res.stderr
