"""Shared-memory collectives, point-to-point channels and int8 block quantisation.

The Python face of ``csrc/comm`` (ops in the ``rmm_comm`` namespace). Three things live here:

* ``ShmGroup``: all-reduce (sum), all-gather and reduce-scatter for float32 / bfloat16 CPU
  tensors among ranks of one process group that share a host, through a shared-memory segment.
  All ranks of the group must construct it together (it is a collective call).
* ``ShmChannel``: one-way send / recv between two ranks on one host (pipeline neighbours),
  falling back to ``dist.send`` / ``dist.recv`` when the ranks are on different hosts.
* ``quantize_int8`` / ``dequantize_int8`` / ``dequantize_sum_int8``: block-wise symmetric
  int8 quantisation (one fp32 scale per ``block_size`` elements along the last dim), fused
  error feedback, on CPU and CUDA, with plain-PyTorch references (``*_ref``).

The reference for the collectives is ``torch.distributed`` itself. Segments are unlinked from
``/dev/shm`` as soon as every rank has mapped them, so nothing is left behind by a normal exit
or a crash; a rank that waits on a dead peer raises a ``RuntimeError`` naming that peer.

Environment knobs: ``RAG_MM_HOST_ID`` overrides the host identity (to simulate several nodes on
one machine), ``RAG_MM_SHM_CHUNK_BYTES`` the per-rank buffer half (default 1 MiB),
``RAG_MM_SHM_TIMEOUT_S`` how long a wait on a live but absent peer may last (default 300 s).
"""

from __future__ import annotations

import itertools
import logging
import os
import secrets
import socket

import torch
import torch.distributed as dist

from parallel.kernels._build import BuildResult, load_extension

log = logging.getLogger(__name__)

CPU_SOURCES = [
    "comm/comm.cpp",
    "comm/cpu/shm_segment.cpp",
    "comm/cpu/shm_collectives.cpp",
    "comm/cpu/quant.cpp",
]
CUDA_SOURCES = ["comm/cuda/quant.cu"]
SHM_DTYPES = (torch.float32, torch.bfloat16)
# 1 MiB halves: a chunk stays in a core's L2 (1-2 MiB on current x86 server cores) between one
# rank's copy-in and a peer's read, and the per-chunk barrier (a few microseconds) is small next
# to moving 1 MiB.
DEFAULT_CHUNK_BYTES = 1 << 20
DEFAULT_TIMEOUT_S = 300.0

_build: BuildResult | None = None
_group_sizes: dict[int, int] = {}  # handle -> nranks, for the fake kernels
_names = itertools.count()


def load() -> BuildResult:
    """Build (first use) and load the extension; returns why not when it cannot.

    The CUDA kernels are built only when a GPU is visible: nothing could run them otherwise,
    and linking needs the CUDA runtime library. ``cuda_compile_check`` compiles them anyway.
    """
    global _build
    if _build is None:
        cuda = CUDA_SOURCES if torch.cuda.is_available() else None
        _build = load_extension("rmm_comm", CPU_SOURCES, cuda)
        if _build.ok:
            _register_python_parts()
    return _build


def cuda_compile_check(out_dir: str, arch: str = "90") -> tuple[bool, str]:
    """Compile ``csrc/comm/cuda/*.cu`` to objects with nvcc (no link, no GPU needed)."""
    import subprocess

    from torch.utils import cpp_extension as ce

    from parallel.kernels._build import CSRC, cuda_build_possible

    can, why = cuda_build_possible()
    if not can:
        return False, why
    try:
        incs = ce.include_paths(device_type="cuda")
    except TypeError:  # older signature
        incs = ce.include_paths(cuda=True)
    major, minor = (int(v) for v in torch.__version__.split(".")[:2])
    std = "-std=c++20" if (major, minor) >= (2, 10) else "-std=c++17"
    nvcc = os.path.join(ce.CUDA_HOME, "bin", "nvcc")
    for src in CUDA_SOURCES:
        cmd = [
            nvcc,
            "-c",
            str(CSRC / src),
            "-o",
            os.path.join(out_dir, os.path.basename(src) + ".o"),
            std,
            "-O3",
            "--use_fast_math",
            "--expt-relaxed-constexpr",
            "--compiler-options",
            "-fPIC",
            f"-gencode=arch=compute_{arch},code=sm_{arch}",
            "-DTORCH_EXTENSION_NAME=rmm_comm",
            "-DTORCH_API_INCLUDE_EXTENSION_H",
            "-D__CUDA_NO_HALF_OPERATORS__",
            "-D__CUDA_NO_HALF_CONVERSIONS__",
            "-D__CUDA_NO_BFLOAT16_CONVERSIONS__",
            f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
        ]
        cmd += [f"-I{p}" for p in incs]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            return False, f"nvcc failed on {src}:\n{proc.stderr[-4000:]}"
    return True, "compiled " + ", ".join(CUDA_SOURCES)


def available() -> tuple[bool, str]:
    res = load()
    return res.ok, res.reason


def _ops():
    res = load()
    if not res.ok:
        raise RuntimeError(f"rmm_comm extension unavailable: {res.reason}")
    return torch.ops.rmm_comm


# ------------------------------------------------------------------------------- references
def quantize_int8_ref(x: torch.Tensor, block_size: int, error: torch.Tensor | None = None):
    """Plain PyTorch block-wise int8 quantisation along the last dim: returns (q, scales).

    ``q`` is int8 with ``x``'s shape; ``scales`` is float32 ``(*x.shape[:-1], ceil(n / block))``.
    With ``error`` (float32, in place): quantise ``x + error`` and store the new residual.
    """
    n = x.shape[-1]
    nb = -(-n // block_size)
    y = x.float() + (error if error is not None else 0.0)
    pad = nb * block_size - n
    yb = torch.nn.functional.pad(y, (0, pad)).reshape(*y.shape[:-1], nb, block_size)  # (..., nb, B)
    amax = yb.abs().amax(-1)  # (..., nb)
    scale = amax / 127.0
    inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    q = torch.round(yb * inv[..., None]).clamp_(-127, 127)  # round half to even, as rint
    if error is not None:
        resid = (yb - q * scale[..., None]).reshape(*y.shape[:-1], nb * block_size)[..., :n]
        error.copy_(resid)
    q = q.reshape(*y.shape[:-1], nb * block_size)[..., :n].to(torch.int8)
    return q, scale


def dequantize_int8_ref(q: torch.Tensor, scales: torch.Tensor, block_size: int) -> torch.Tensor:
    n = q.shape[-1]
    s = scales.repeat_interleave(block_size, dim=-1)[..., :n]
    return q.float() * s


def dequantize_sum_int8_ref(q: torch.Tensor, scales: torch.Tensor, block_size: int) -> torch.Tensor:
    return dequantize_int8_ref(q, scales, block_size).sum(0)


# ------------------------------------------------------------------------ kernels (or refs)
def _use_ext(t: torch.Tensor) -> bool:
    res = load()
    return res.ok and (t.device.type == "cpu" or (t.device.type == "cuda" and res.with_cuda))


def quantize_int8(x: torch.Tensor, block_size: int = 256, error: torch.Tensor | None = None):
    """Block-wise int8 quantisation (fused error feedback when ``error`` is given)."""
    if _use_ext(x):
        if error is None:
            return torch.ops.rmm_comm.quantize_int8(x, block_size)
        return torch.ops.rmm_comm.quantize_int8_ef(x, error, block_size)
    return quantize_int8_ref(x, block_size, error)


def dequantize_int8(q: torch.Tensor, scales: torch.Tensor, block_size: int = 256) -> torch.Tensor:
    if _use_ext(q):
        return torch.ops.rmm_comm.dequantize_int8(q, scales, block_size)
    return dequantize_int8_ref(q, scales, block_size)


def dequantize_sum_int8(
    q: torch.Tensor, scales: torch.Tensor, block_size: int = 256
) -> torch.Tensor:
    """Dequantise ``(G, ..., n)`` payloads and sum them over the leading dim, in fp32."""
    if _use_ext(q):
        return torch.ops.rmm_comm.dequantize_sum_int8(q, scales, block_size)
    return dequantize_sum_int8_ref(q, scales, block_size)


# ----------------------------------------------------------------- fake kernels and autograd
def _register_python_parts() -> None:
    lib = "rmm_comm::"

    def scales_shape(x, block_size):
        return (*x.shape[:-1], -(-x.shape[-1] // block_size))

    @torch.library.register_fake(lib + "quantize_int8")
    def _(x, block_size):
        return torch.empty_like(x, dtype=torch.int8), x.new_empty(
            scales_shape(x, block_size), dtype=torch.float32
        )

    @torch.library.register_fake(lib + "quantize_int8_ef")
    def _(x, error, block_size):
        return torch.empty_like(x, dtype=torch.int8), x.new_empty(
            scales_shape(x, block_size), dtype=torch.float32
        )

    @torch.library.register_fake(lib + "dequantize_int8")
    def _(q, scales, block_size):
        return torch.empty_like(q, dtype=torch.float32)

    @torch.library.register_fake(lib + "dequantize_sum_int8")
    def _(q, scales, block_size):
        return q.new_empty(q.shape[1:], dtype=torch.float32)

    @torch.library.register_fake(lib + "all_reduce_")
    def _(x, handle):
        return None

    @torch.library.register_fake(lib + "all_reduce")
    def _(x, handle):
        return torch.empty_like(x)

    @torch.library.register_fake(lib + "all_gather")
    def _(x, handle):
        return x.new_empty((_group_sizes[handle], *x.shape))

    @torch.library.register_fake(lib + "reduce_scatter")
    def _(x, handle):
        return x.new_empty((x.shape[0] // _group_sizes[handle], *x.shape[1:]))

    @torch.library.register_fake(lib + "send")
    def _(x, handle):
        return None

    @torch.library.register_fake(lib + "recv_")
    def _(out, handle):
        return None

    # Adjoints of the sum collectives: all-reduce <-> all-reduce, all-gather <-> reduce-scatter.
    def setup(ctx, inputs, output):
        ctx.handle = inputs[1]

    def ar_bwd(ctx, g):
        return torch.ops.rmm_comm.all_reduce(g.contiguous(), ctx.handle), None

    def ag_bwd(ctx, g):  # g: (W, *shape)
        return torch.ops.rmm_comm.reduce_scatter(g.contiguous(), ctx.handle).squeeze(0), None

    def rs_bwd(ctx, g):  # g: (k, ...) -> (W * k, ...)
        full = torch.ops.rmm_comm.all_gather(g.contiguous(), ctx.handle)
        return full.reshape(-1, *g.shape[1:]), None

    torch.library.register_autograd(lib + "all_reduce", ar_bwd, setup_context=setup)
    torch.library.register_autograd(lib + "all_gather", ag_bwd, setup_context=setup)
    torch.library.register_autograd(lib + "reduce_scatter", rs_bwd, setup_context=setup)


# ------------------------------------------------------------------------------ host layout
def host_id() -> str:
    """This process's host identity: ``$RAG_MM_HOST_ID`` (simulation) or the hostname."""
    return os.environ.get("RAG_MM_HOST_ID") or socket.gethostname()


def group_hosts(group=None) -> list[str]:
    """Host id of every rank of ``group`` (collective over the group), in group-rank order."""
    world = dist.get_world_size(group)
    out: list = [None] * world
    dist.all_gather_object(out, host_id(), group=group)
    return out


def _timeout() -> float:
    return float(os.environ.get("RAG_MM_SHM_TIMEOUT_S", DEFAULT_TIMEOUT_S))


def _segment_name(kind: str) -> str:
    # POSIX shm names: one leading slash, no other; uid + pid + counter + random make it unique
    # per job and per group even when several jobs share the machine.
    return f"/rmm_{kind}_{os.getuid()}_{os.getpid()}_{next(_names)}_{secrets.token_hex(4)}"


# ------------------------------------------------------------------------------- collectives
class ShmGroup:
    """Shared-memory collectives among the ranks of ``group`` (all of which must share a host).

    Collective constructor: every rank of ``group`` calls it. Group rank 0 creates the segment,
    the others map it, then it is unlinked, so ``/dev/shm`` never keeps its name.
    """

    def __init__(self, group=None, chunk_bytes: int | None = None, timeout_s: float | None = None):
        ops = _ops()
        self.group = group
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        self.chunk_bytes = int(
            chunk_bytes or os.environ.get("RAG_MM_SHM_CHUNK_BYTES", DEFAULT_CHUNK_BYTES)
        )
        self.chunk_bytes = max(4096, self.chunk_bytes // 64 * 64)
        timeout_s = _timeout() if timeout_s is None else timeout_s
        self.handle = -1
        leader = dist.get_global_rank(group, 0) if group is not None else 0
        name, err = None, ""
        if self.rank == 0:
            try:
                name = _segment_name("grp")
                self.handle = ops.group_open(name, 0, self.world, self.chunk_bytes, True, timeout_s)
            except RuntimeError as e:
                name, err = None, str(e)
        box = [name, err]
        dist.broadcast_object_list(box, src=leader, group=group)
        name, err = box
        if name is None:
            raise RuntimeError(f"ShmGroup: group rank 0 could not create the segment: {err}")
        ok = True
        try:
            if self.rank != 0:
                try:
                    self.handle = ops.group_open(
                        name, self.rank, self.world, self.chunk_bytes, False, timeout_s
                    )
                except RuntimeError as e:
                    ok, err = False, str(e)
            oks: list = [None] * self.world
            dist.all_gather_object(oks, (ok, err), group=group)  # also: everyone has mapped
        finally:
            if self.rank == 0:
                ops.shm_unlink(name)
        bad = [(r, e) for r, (o, e) in enumerate(oks) if not o]
        if bad:
            self.close()
            raise RuntimeError(f"ShmGroup: ranks could not map the segment (not one host?): {bad}")
        _group_sizes[self.handle] = self.world
        self.name = name

    def close(self) -> None:
        if self.handle >= 0:
            torch.ops.rmm_comm.group_close(self.handle)
            _group_sizes.pop(self.handle, None)
            self.handle = -1

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass

    # -- in-place / torch.distributed-shaped API
    def all_reduce_(self, t: torch.Tensor) -> torch.Tensor:
        """Sum ``t`` over the group, in place (any layout; float32 or bfloat16)."""
        if t.is_contiguous():
            torch.ops.rmm_comm.all_reduce_(t, self.handle)
        else:
            c = t.contiguous()
            torch.ops.rmm_comm.all_reduce_(c, self.handle)
            t.copy_(c)
        return t

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        return torch.ops.rmm_comm.all_reduce(t.contiguous(), self.handle)

    def all_gather(self, t: torch.Tensor) -> torch.Tensor:
        """``(W, *t.shape)``: every rank's ``t`` in group-rank order."""
        return torch.ops.rmm_comm.all_gather(t.contiguous(), self.handle)

    def reduce_scatter(self, t: torch.Tensor) -> torch.Tensor:
        """``t``: ``(W * k, ...)``; returns the sum over ranks of rows ``[r*k, (r+1)*k)``."""
        return torch.ops.rmm_comm.reduce_scatter(t.contiguous(), self.handle)

    def all_gather_into_tensor(self, out: torch.Tensor, inp: torch.Tensor) -> None:
        """Same contract as ``dist.all_gather_into_tensor``: ``out`` holds W * inp.numel()."""
        res = self.all_gather(inp)
        out.copy_(res.reshape(out.shape))

    def reduce_scatter_tensor(self, out: torch.Tensor, inp: torch.Tensor) -> None:
        """Same contract as ``dist.reduce_scatter_tensor`` (sum)."""
        res = self.reduce_scatter(inp.reshape(self.world, -1))
        out.copy_(res.reshape(out.shape))


# -------------------------------------------------------------------------- point to point
class ShmChannel:
    """One-way channel ``src -> dst`` (global ranks) for pipeline activations and gradients.

    Both ``src`` and ``dst`` construct it (a pairwise handshake over the default process
    group); then ``src`` calls ``send(t)`` and ``dst`` calls ``recv(out)``, in matching order
    and sizes. Sends are buffered up to ``slots * slot_bytes`` bytes, so a sender runs ahead of
    its receiver as a pipeline stage should. Ranks on different hosts, CUDA tensors, or a
    missing extension fall back to ``dist.send`` / ``dist.recv`` (``uses_shm`` says which).
    """

    NAME_BYTES = 128

    def __init__(
        self,
        src: int,
        dst: int,
        slot_bytes: int = 1 << 20,
        slots: int = 4,
        timeout_s: float | None = None,
    ):
        me = dist.get_rank()
        if me not in (src, dst) or src == dst:
            raise ValueError(
                f"ShmChannel({src}, {dst}) must be built by rank {src} and rank {dst}, not {me}"
            )
        self.src, self.dst, self.handle = src, dst, -1
        self.slot_bytes = max(64, slot_bytes // 64 * 64)
        timeout_s = _timeout() if timeout_s is None else timeout_s
        built, why = available()
        if me == src:
            name = ""
            if built:
                try:
                    name = _segment_name("chn")
                    self.handle = torch.ops.rmm_comm.channel_open(
                        name, 0, self.slot_bytes, slots, True, timeout_s, src, dst
                    )
                except RuntimeError as e:
                    name, why = "", str(e)
            msg = f"{name}|{host_id()}".encode()
            buf = torch.zeros(self.NAME_BYTES, dtype=torch.uint8)
            buf[: len(msg)] = torch.tensor(list(msg), dtype=torch.uint8)
            dist.send(buf, dst)
            ack = torch.zeros(1, dtype=torch.int64)
            try:
                dist.recv(ack, dst)
            finally:
                if name:
                    torch.ops.rmm_comm.shm_unlink(name)
            self.uses_shm = bool(ack.item())
            if not self.uses_shm and self.handle >= 0:
                torch.ops.rmm_comm.channel_close(self.handle)
                self.handle = -1
        else:
            buf = torch.zeros(self.NAME_BYTES, dtype=torch.uint8)
            dist.recv(buf, src)
            name, peer_host = bytes(buf.tolist()).rstrip(b"\0").decode().split("|")
            ok = bool(name) and peer_host == host_id() and built
            if ok:
                try:
                    self.handle = torch.ops.rmm_comm.channel_open(
                        name, 1, self.slot_bytes, slots, False, timeout_s, src, dst
                    )
                except RuntimeError as e:
                    ok, why = False, str(e)
            elif peer_host != host_id():
                why = f"rank {src} is on host {peer_host!r}, rank {dst} on {host_id()!r}"
            dist.send(torch.tensor([int(ok)], dtype=torch.int64), src)
            self.uses_shm = ok
        self.reason = "shared memory" if self.uses_shm else f"process group ({why or 'no segment'})"
        log.debug("ShmChannel %d->%d: %s", src, dst, self.reason)

    def send(self, t: torch.Tensor) -> None:
        if self.uses_shm and t.device.type == "cpu":
            torch.ops.rmm_comm.send(t.contiguous(), self.handle)
        else:
            dist.send(t.contiguous(), self.dst)

    def recv(self, out: torch.Tensor) -> torch.Tensor:
        """Fill ``out`` (any layout) with the next tensor sent; returns ``out``."""
        if self.uses_shm and out.device.type == "cpu":
            tgt = (
                out
                if out.is_contiguous()
                else torch.empty_like(out, memory_format=torch.contiguous_format)
            )
            torch.ops.rmm_comm.recv_(tgt, self.handle)
        else:
            tgt = out if out.is_contiguous() else out.contiguous()
            dist.recv(tgt, self.src)
        if tgt is not out:
            out.copy_(tgt)
        return out

    def rewind(self) -> None:
        """End of a step: this side's ring position jumps to the next multiple of the ring size,
        so every step reuses the same (warm, already mapped) slots. Both sides call it after
        their last message of the step (see channel_rewind in csrc/comm/cpu/shm_segment.cpp)."""
        if self.uses_shm:
            torch.ops.rmm_comm.channel_rewind(self.handle)

    def close(self) -> None:
        if self.handle >= 0:
            torch.ops.rmm_comm.channel_close(self.handle)
            self.handle = -1

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


__all__ = [
    "ShmChannel",
    "ShmGroup",
    "available",
    "dequantize_int8",
    "dequantize_int8_ref",
    "dequantize_sum_int8",
    "dequantize_sum_int8_ref",
    "group_hosts",
    "host_id",
    "load",
    "quantize_int8",
    "quantize_int8_ref",
]
