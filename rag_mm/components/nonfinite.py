"""Steps whose loss or gradient norm is not finite are skipped, on every rank alike; a run of too
many in a row aborts the run.

Where the step runs on the host, each step is decided at once (reading the flag is free there):
the trainer zeroes the gradients and draws the next batch, the step is not counted.

On an accelerator nothing is read back between log steps (a read is a host sync, which stalls the
launch queue every step). The flag stays on the device, and the optimizer's update skips itself
where it is set: fused Adam / AdamW read ``found_inf`` as ``torch.amp.GradScaler`` drives them,
leaving parameters, moments and step count as they were. The trainer counts the step and moves
on; each step's flag is kept in a small device buffer and read at the next log step (one sync),
which then logs every skipped step and aborts as the host path would, up to ``log_every`` steps
later. An optimizer that cannot skip itself falls back to the host decision, said once.
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)


def skips_on_device(opt: torch.optim.Optimizer) -> bool:
    """Whether ``opt.step()`` honours a device-side ``found_inf`` flag (fused Adam / AdamW only)."""
    return isinstance(opt, torch.optim.Adam | torch.optim.AdamW) and bool(opt.defaults.get("fused"))


class NonFiniteGuard:
    """``check`` after each step's backward (and clipping), before ``opt.step()``; ``flush`` at log
    steps and at the end of training."""

    def __init__(
        self, opt: torch.optim.Optimizer, device: torch.device, limit: int, window: int
    ) -> None:
        self.opt, self.device, self.limit = opt, torch.device(device), limit
        self.on_device = self.device.type != "cpu" and skips_on_device(opt)
        if self.device.type != "cpu" and not self.on_device:
            log.info(
                "non-finite check: %s does not skip its update on the device (fused Adam / AdamW "
                "do): one host sync per step",
                type(opt).__name__,
            )
        self.bad_run = 0  # consecutive non-finite steps, as far as the host has read them
        # (window,) step i bad
        self._flags = torch.zeros(max(1, window), dtype=torch.bool, device=self.device)
        self._steps: list[int] = []  # the step number of each flag written since the last flush

    def _bad(self, loss: torch.Tensor, gnorm: torch.Tensor) -> torch.Tensor:
        """() bool on the device: this step is not finite on some rank (a collective, no read)."""
        gnorm = torch.as_tensor(gnorm).to(self.device, non_blocking=True)
        ok = (torch.isfinite(loss) & torch.isfinite(gnorm)).to(torch.float32).reshape(1)
        if dist.is_initialized():  # every rank must take the same decision
            dist.all_reduce(ok, op=dist.ReduceOp.MIN)
        return ok[0] < 1

    def check(self, step: int, loss: torch.Tensor, gnorm: torch.Tensor) -> bool:
        """Whether to go on with ``opt.step()``. False (host path only): the step is skipped, the
        gradients are to be zeroed and the step not counted. Raises ``FloatingPointError`` after
        more than ``limit`` non-finite steps in a row."""
        bad = self._bad(loss, gnorm)
        if not self.on_device:
            if bool(bad):  # a sync on an accelerator; free on the host
                self._count(step, True)
                return False
            self.bad_run = 0
            return True
        if len(self._steps) == len(self._flags):  # more steps than a log window: read them now
            self.flush()
        self._flags[len(self._steps)] = bad  # a Python index: nothing read back
        self._steps.append(step)
        self.opt.found_inf = bad.to(torch.float32)  # the fused update skips itself where it is 1
        return True

    def flush(self) -> None:
        """Read the flags of the steps since the last flush (one sync), log each skipped step and
        abort on too many in a row."""
        if not self._steps:
            return
        flags = self._flags[: len(self._steps)].cpu().tolist()  # one copy back
        steps, self._steps = self._steps, []
        for s, bad in zip(steps, flags):
            self._count(s, bad)

    def _count(self, step: int, bad: bool) -> None:
        if not bad:
            self.bad_run = 0
            return
        self.bad_run += 1
        log.warning(
            "non-finite loss or gradient at step %d: step skipped (%d in a row)", step, self.bad_run
        )
        if self.bad_run > self.limit:
            raise FloatingPointError(
                f"{self.bad_run} consecutive non-finite steps: aborting (lower optim.lr?)"
            )
