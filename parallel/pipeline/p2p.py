"""Point-to-point messages between pipeline stages: a bundle of tensors with its structure.

One forward bundle (stage s -> s+1, one microbatch) is at most three messages and usually two:

1. a header, 4 int64: payload bytes, metadata id, metadata bytes (0 when cached), leaf count;
2. the pickled metadata (the output specs), only the first time the receiver sees it: a model
   with fixed shapes pays for it once, a variable-length one (the rag_mm reader) per new shape;
3. the payload: one tensor sent as is, or several packed into one byte buffer (16-byte aligned
   so the receiver can view each slice as its dtype without copying).

Gradients going back need no header: the receiver of a gradient bundle sent the forward bundle
and knows its layout. Every message has its own tag (stage, microbatch, kind), so schedules that
interleave directions between the same two ranks cannot mismatch them. Sends are non-blocking
(waited at the end of the step); receives block with a timeout and fail with a message that names
the peer, the stage and the microbatch - a dead rank raises here instead of hanging.
Stages on the same rank (interleaved, V schedules) hand bundles over in memory; ranks on one host
exchange messages up to a size limit through shared-memory rings (``lanes.py``: the p2p gate).
"""

from __future__ import annotations

import pickle
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from .tree import TensorSpec

ALIGN = 16  # bytes: any dtype can be viewed at a 16-byte aligned offset
KIND_HEADER, KIND_META, KIND_FWD, KIND_BWD = range(4)


class PipelineError(RuntimeError):
    """A pipeline peer failed, died or timed out."""


def _tag(stage: int, mb: int, kind: int) -> int:
    return ((stage * 4 + kind) << 20) + mb  # distinct per (sending stage, microbatch, kind)


def layout(specs: list[TensorSpec]) -> tuple[list[int], int]:
    """Byte offsets of each tensor in a packed buffer, and its total size."""
    offs, n = [], 0
    for s in specs:
        offs.append(n)
        nbytes = _numel(s.shape) * _itemsize(s.dtype)
        n += (nbytes + ALIGN - 1) // ALIGN * ALIGN
    return offs, n


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def pack(tensors: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    if len(tensors) == 1:
        return tensors[0].detach().contiguous()
    specs = [TensorSpec(tuple(t.shape), t.dtype, False) for t in tensors]
    offs, total = layout(specs)
    buf = torch.empty(total, dtype=torch.uint8, device=device)
    for t, o in zip(tensors, offs):
        if t.numel():
            buf[o : o + t.numel() * t.element_size()].copy_(
                t.detach().contiguous().reshape(-1).view(torch.uint8)
            )
    return buf


def alloc(specs: list[TensorSpec], device: torch.device) -> torch.Tensor:
    if len(specs) == 1:
        return torch.empty(specs[0].shape, dtype=specs[0].dtype, device=device)
    return torch.empty(layout(specs)[1], dtype=torch.uint8, device=device)


def unpack(buf: torch.Tensor, specs: list[TensorSpec]) -> list[torch.Tensor]:
    if len(specs) == 1:
        return [buf]
    offs, _ = layout(specs)
    out = []
    for s, o in zip(specs, offs):
        n = _numel(s.shape) * _itemsize(s.dtype)
        out.append(buf[o : o + n].view(s.dtype).view(s.shape))
    return out


class Transport:
    """Sends and receives bundles between stages; ``stage_rank[s]`` is the global rank of stage
    s."""

    def __init__(self, stage_rank: list[int], timeout_s: float, device: torch.device, group=None):
        self.stage_rank = stage_rank
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.timeout = timedelta(seconds=timeout_s)
        self.device = device
        self.group = group
        self.pending: list[Any] = []  # (work, buffer) of non-blocking sends, waited in flush()
        self.local: dict[tuple, Any] = {}  # same-rank handover
        self.sent_meta: dict[tuple[int, bytes], int] = {}  # (dst stage, pickled meta) -> id
        self.last_meta: dict[int, tuple[Any, int]] = {}  # dst stage -> (last meta sent, its id)
        self.recv_meta: dict[tuple[int, int], Any] = {}  # (src stage, id) -> meta
        self.wait_s = 0.0  # seconds spent blocked in receives this step (for the timeline)
        self.lanes: dict[
            tuple, Any
        ] = {}  # (peer, outgoing, kind, sending stage) -> ShmChannel (lanes.py)
        # one forward header buffer per edge for headers that go through a ring: a ring
        # send copies at once and a received header is read at once, so the buffer can be reused;
        # written and read through its numpy view. Why: a step has m headers each way, and every
        # torch call after a microbatch's compute is slow (its code and data left the cache),
        # several times a numpy access (benchmarks/pipeline_cpu_*.md)
        self._headers: dict[tuple, tuple[torch.Tensor, Any]] = {}

    def _header(self, edge: tuple) -> tuple[torch.Tensor, Any] | None:
        """(reusable int64 header tensor, its numpy view) for a ring edge, else None."""
        if self._lane(edge, 32, False) is None:
            return None
        got = self._headers.get(edge)
        if got is None:
            t = torch.zeros(4, dtype=torch.int64)
            got = self._headers[edge] = (t, t.numpy())
        return got

    def _lane(self, edge: tuple, nbytes: int, small: bool):
        """The ring for this message of ``edge`` (peer, outgoing, kind, sending stage), or None for
        gloo (the same answer on both sides: both know ``nbytes``). Metadata (``small``) uses the
        ring only up to one slot, as the ring is sized."""
        ch = self.lanes.get(edge)
        if ch is None or nbytes > (min(ch.limit, ch.slot_bytes) if small else ch.limit):
            return None
        return ch

    # --- low level
    def _isend(
        self, t: torch.Tensor, dst_stage: int, tag: int, edge: tuple, small: bool = False
    ) -> None:
        ch = self._lane(edge, t.numel() * t.element_size(), small)
        if ch is not None:  # a copy into the ring, which has room for the whole step (lanes.py)
            try:
                ch.send(t)
            except RuntimeError as e:
                raise PipelineError(
                    f"rank {self.rank}: a shared-memory pipeline send failed: {e}"
                ) from e
            return
        self.pending.append(
            (dist.isend(t, self.stage_rank[dst_stage], group=self.group, tag=tag), t)
        )

    def _recv(
        self, t: torch.Tensor, src_stage: int, tag: int, what: str, edge: tuple, small: bool = False
    ) -> None:
        peer = self.stage_rank[src_stage]
        t0 = time.perf_counter()
        ch = self._lane(edge, t.numel() * t.element_size(), small)
        try:
            if ch is not None:
                ch.recv(t)
                self.wait_s += time.perf_counter() - t0
                return
            work = dist.irecv(t, peer, group=self.group, tag=tag)
            if not work.wait(self.timeout):
                raise TimeoutError(f"no message within {self.timeout.total_seconds():.0f} s")
        except Exception as e:  # noqa: BLE001 - re-raised with the pipeline context
            raise PipelineError(
                f"rank {self.rank}: receiving {what} from rank {peer} (stage {src_stage}) failed - "
                f"the peer died, hung or raised: {type(e).__name__}: {e}"
            ) from e
        self.wait_s += time.perf_counter() - t0

    def flush(self) -> None:
        """Wait for every send of this step (their buffers must live until then)."""
        pending, self.pending = self.pending, []
        for work, _ in pending:
            try:
                work.wait(self.timeout)
            except Exception as e:  # noqa: BLE001
                raise PipelineError(
                    f"rank {self.rank}: a pipeline send failed: {type(e).__name__}: {e}"
                ) from e
        for ch in self.lanes.values():  # this rank's messages of the step are all through
            ch.rewind()

    # --- bundles
    def send_fwd(self, src: int, dst: int, mb: int, meta: Any, tensors: list[torch.Tensor]) -> None:
        if self.stage_rank[dst] == self.rank:
            self.local[("f", dst, mb)] = (meta, [t.detach() for t in tensors])
            return
        last = self.last_meta.get(dst)
        if (
            last is not None and last[0] == meta
        ):  # the usual case: same structure as the last bundle
            blob, new, meta_id = b"", False, last[1]
        else:  # pickle only when the structure changed (a comparison costs far less than pickling)
            blob = pickle.dumps(meta, protocol=pickle.HIGHEST_PROTOCOL)
            key = (dst, blob)
            new = key not in self.sent_meta
            if new:
                self.sent_meta[key] = len(self.sent_meta)
            meta_id = self.sent_meta[key]
            self.last_meta[dst] = (meta, meta_id)
        payload = pack(tensors, self.device) if tensors else None
        fields = (
            payload.numel() * payload.element_size() if payload is not None else 0,
            meta_id,
            len(blob) if new else 0,
            len(tensors),
        )
        edge = (self.stage_rank[dst], True, "f", src)
        reuse = self._header(edge)
        if reuse is not None:
            header, view = reuse
            view[:] = fields
        else:  # over gloo the buffer must live until the send completes: a fresh one
            header = torch.tensor(fields, dtype=torch.int64)
        self._isend(header, dst, _tag(src, mb, KIND_HEADER), edge)
        if new:
            self._isend(
                torch.frombuffer(bytearray(blob), dtype=torch.uint8),
                dst,
                _tag(src, mb, KIND_META),
                edge,
                small=True,
            )
        if payload is not None:
            self._isend(payload, dst, _tag(src, mb, KIND_FWD), edge)

    def recv_fwd(self, src: int, dst: int, mb: int, specs_of) -> tuple[Any, list[torch.Tensor]]:
        """``specs_of(meta)`` gives the TensorSpecs of the payload's tensors."""
        if self.stage_rank[src] == self.rank:
            meta, tensors = self.local.pop(("f", dst, mb))
            return meta, tensors
        edge = (self.stage_rank[src], False, "f", src)
        reuse = self._header(edge)
        header, view = reuse if reuse is not None else (torch.empty(4, dtype=torch.int64), None)
        self._recv(
            header, src, _tag(src, mb, KIND_HEADER), f"the forward header of microbatch {mb}", edge
        )
        _, meta_id, meta_len, n = view.tolist() if view is not None else header.tolist()
        if meta_len:
            blob = torch.empty(meta_len, dtype=torch.uint8)
            self._recv(
                blob,
                src,
                _tag(src, mb, KIND_META),
                f"the forward metadata of microbatch {mb}",
                edge,
                small=True,
            )
            self.recv_meta[(src, meta_id)] = pickle.loads(blob.numpy().tobytes())
        meta = self.recv_meta[(src, meta_id)]
        specs = specs_of(meta)
        if len(specs) != n:
            raise PipelineError(
                f"stage {dst}: expected {len(specs)} tensors from stage {src}, header says {n}"
            )
        if not specs:
            return meta, []
        buf = alloc(specs, self.device)
        self._recv(buf, src, _tag(src, mb, KIND_FWD), f"activations of microbatch {mb}", edge)
        return meta, unpack(buf, specs)

    def send_bwd(self, src: int, dst: int, mb: int, grads: list[torch.Tensor]) -> None:
        if not grads:
            return
        if self.stage_rank[dst] == self.rank:
            self.local[("b", dst, mb)] = grads
            return
        self._isend(
            pack(grads, self.device),
            dst,
            _tag(src, mb, KIND_BWD),
            (self.stage_rank[dst], True, "b", src),
        )

    def recv_bwd(self, src: int, dst: int, mb: int, specs: list[TensorSpec]) -> list[torch.Tensor]:
        if not specs:
            return []
        if self.stage_rank[src] == self.rank:
            return self.local.pop(("b", dst, mb))
        buf = alloc(specs, self.device)
        self._recv(
            buf,
            src,
            _tag(src, mb, KIND_BWD),
            f"gradients of microbatch {mb}",
            (self.stage_rank[src], False, "b", src),
        )
        return unpack(buf, specs)
