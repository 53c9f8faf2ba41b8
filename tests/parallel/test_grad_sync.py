"""Gradient accumulation syncs once per optimizer step: ``train_step(sync=False)`` on the earlier
micro-steps sends nothing, the last one reduces everything accumulated, one collective per bucket
(plain data parallel: one flat all-reduce; FSDP2: one reduce-scatter per unit), and the gradients
are still one process's gradients of the whole accumulated batch."""

from __future__ import annotations

import pytest
import torch

from tests.distributed import run_ranks

ACCUM = 4
LAYOUTS = {  # name -> ParallelConfig fields (2 ranks)
    "dp": dict(dp_replicate=2),  # plain data parallel: the grad reducer's flat all-reduce
    "fsdp": dict(dp_shard=2),  # FSDP2's own hooks run the step
    "fsdp_microbatches": dict(dp_shard=2, microbatches=2),  # FSDP units driven by StepSync
}


def _mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))


def _data(world: int, accum: int, rows: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    """(accum, world * rows, 8) inputs and (accum, world * rows, 4) targets, alike on every rank."""
    g = torch.Generator().manual_seed(1)
    return torch.randn(accum, world * rows, 8, generator=g), torch.randn(
        accum, world * rows, 4, generator=g
    )


def _full(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def count_case(rank: int, world: int) -> dict:
    """Per layout: the gradient collectives of one optimizer step with accumulation 1 and with
    ``ACCUM``, and the accumulated gradients (whole) after the ``ACCUM`` step."""
    import torch.distributed as dist

    import parallel

    calls: list[str] = []
    originals = {
        name: getattr(dist, name)
        for name in ("all_reduce", "reduce_scatter_single", "reduce_scatter_tensor")
    }

    def counting(name):
        def wrapped(*args, **kwargs):
            # what is reduced: all_reduce(tensor), reduce_scatter_*(output, input)
            key, at = ("tensor", 0) if name == "all_reduce" else ("input", 1)
            t = kwargs[key] if key in kwargs else args[at]
            if (
                t.numel() > 1
            ):  # the step loss shared over the ranks is one number: not a gradient bucket
                calls.append(name)
            return originals[name](*args, **kwargs)

        return wrapped

    out = {}
    for layout, fields in LAYOUTS.items():
        pm = parallel.parallelize(_mlp(), parallel.ParallelConfig(**fields), (torch.zeros(4, 8),))
        for name in originals:
            setattr(dist, name, counting(name))
        counts = {}
        try:
            for accum in (1, ACCUM):
                x, y = _data(world, accum)
                mine = slice(rank * 4, rank * 4 + 4)  # this rank's share of each micro-step's batch
                pm.zero_grad()
                calls.clear()
                for i in range(accum):
                    pm.train_step(
                        (x[i, mine],),
                        target=y[i, mine],
                        sync=i == accum - 1,
                        loss_fn=lambda o, t, a=accum: torch.nn.functional.mse_loss(o, t) / a,
                    )
                counts[accum] = list(calls)
        finally:
            for name, fn in originals.items():
                setattr(dist, name, fn)
        grads = {n: _full(p.grad).detach().clone() for n, p in pm.named_parameters()}
        out[layout] = {"counts": counts, "grads": grads}
    return out


def _reference() -> dict[str, torch.Tensor]:
    """One process, the whole accumulated batch: the mean of the micro-steps' mean losses."""
    model = _mlp()
    x, y = _data(2, ACCUM)
    loss = sum(torch.nn.functional.mse_loss(model(x[i]), y[i]) for i in range(ACCUM)) / ACCUM
    loss.backward()
    return {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.multirank
def test_accumulation_syncs_gradients_once_per_optimizer_step():
    ref = _reference()
    for r in run_ranks(count_case, 2, timeout_s=240):
        for layout, got in r.items():
            one, four = got["counts"][1], got["counts"][ACCUM]
            assert one, f"{layout}: no gradient collective at all"
            if layout == "dp":
                assert one == ["all_reduce"], one  # one flat bucket
            # as many collectives for 4 accumulated micro-steps as for one: one per bucket
            assert four == one, (
                f"{layout}: {len(four)} gradient collectives with accumulation {ACCUM}, "
                f"{len(one)} without"
            )
            for n, g in ref.items():
                torch.testing.assert_close(
                    got["grads"][n], g, rtol=1e-5, atol=1e-6, msg=f"{layout} {n}"
                )
