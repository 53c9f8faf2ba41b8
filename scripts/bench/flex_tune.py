"""FlexAttention on the retrieval layout at the 1B reader's shapes: which mask formulation, block
size and kernel options run fastest, timed beside SDPA (with the layout's mask, and dense without
one as the ceiling of a fused kernel). Prints JSON.

    python scripts/bench/flex_tune.py                 # CUDA: the 1B's shapes, bf16
    python scripts/bench/flex_tune.py --dry-run   # tiny shapes on the CPU (forward only)

Variants (each compiled on its own; outputs checked against the first):

* ``segments``: the layout over per-position segment ids (a gather per query row and per key);
* ``interval``: ``parallel.kernels.flex``'s mask, a key interval per query row (documents come
  first and the query last, so a document row sees ``[its start, its end)`` and a query row
  ``[0, q]``): a gather per query row, none per key;
* ``/64``: 64 x 64 sparse blocks (and kernel tiles) instead of 128 x 128: fewer masked pairs
  computed, more tiles;
* kernel options (``num_warps``, ``num_stages``, tile sizes) and Inductor's max-autotune.

Each variant's milliseconds: median of 10 calls, forward under ``no_grad`` and forward + backward.
SDPA is timed first; each variant prints one JSON line as soon as it is done (a call cut off by its
time limit keeps what finished), and a summary line with every variant closes the run.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from parallel.kernels import flex  # noqa: E402
from parallel.kernels.attention_ref import layout_mask  # noqa: E402
from scripts.bench.verify_steps import _retrieval_case, _time_ms  # noqa: E402

# forward tiles (BLOCK_M, BLOCK_N) and the backward's (dK/dV: BLOCK_M1 x BLOCK_N1, dQ: BLOCK_M2 x
# BLOCK_N2) no larger than 64, so that 64-token sparse blocks hold whole tiles
TILES_64 = {
    "BLOCK_M": 64,
    "BLOCK_N": 64,
    "BLOCK_M1": 32,
    "BLOCK_N1": 64,
    "BLOCK_M2": 64,
    "BLOCK_N2": 32,
}


def segments_mask_mod(seg: torch.Tensor):
    """The layout over segment ids (``flex.retrieval_segments``): a document row sees the keys of
    its own segment, a query row every document's and causally its own; padding nothing."""

    def mask_mod(b, h, q_idx, kv_idx):
        sq, sk = seg[b, q_idx], seg[b, kv_idx]
        in_doc = (sq == sk) & (sq >= 0) & (sq != flex.QUERY_SEG)
        from_query = (
            (sq == flex.QUERY_SEG) & (sk >= 0) & ((sk != flex.QUERY_SEG) | (kv_idx <= q_idx))
        )
        return in_doc | from_query

    return mask_mod


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dry-run", action="store_true", help="tiny shapes, any device")
    ap.add_argument("--budget", type=float, default=150, help="seconds; later variants skipped")
    ap.add_argument("--no-autotune", action="store_true", help="skip the max-autotune variant")
    args = ap.parse_args()
    t_start = time.perf_counter()
    device = torch.device("cuda" if torch.cuda.is_available() and not args.dry_run else "cpu")
    ctx = SimpleNamespace(dry=args.dry_run, device=device)
    gen = torch.Generator().manual_seed(0)
    B, Hq, Hkv, D, S, offsets = _retrieval_case(ctx, gen)
    dt = torch.bfloat16 if device.type == "cuda" else torch.float32
    mk = lambda h: torch.randn(B, h, S, D, generator=gen).to(device, dt)  # noqa: E731
    q, k, v = mk(Hq), mk(Hkv), mk(Hkv)
    go = torch.randn(B, Hq, S, D, generator=gen).to(device, dt)
    allowed = layout_mask(offsets.long(), S)  # (B, 1, S, S) bool
    useful = 4 * D * Hq * int(allowed.sum())
    grad_ok = device.type == "cuda"  # flex has no CPU backward
    from torch.nn.attention.flex_attention import create_block_mask
    from torch.nn.attention.flex_attention import flex_attention as fa

    torch._dynamo.config.cache_size_limit = 256
    compiled = {"default": torch.compile(fa)}

    seg = flex.retrieval_segments(offsets, S)
    lo, hi = flex.retrieval_bounds(offsets, S)
    masks = {}

    def block_mask(kind: str, block: int):
        if (kind, block) not in masks:
            mod = segments_mask_mod(seg) if kind == "segments" else flex._interval_mask_mod(lo, hi)
            masks[kind, block] = create_block_mask(
                mod, B, None, S, S, device=device, BLOCK_SIZE=block
            )
        return masks[kind, block]

    def bm_stats(bm) -> dict:
        part = int(bm.kv_num_blocks.sum())
        full = 0 if bm.full_kv_num_blocks is None else int(bm.full_kv_num_blocks.sum())
        n = B * math.ceil(S / bm.BLOCK_SIZE[0]) * math.ceil(S / bm.BLOCK_SIZE[1])
        return {"partial": part, "full": full, "total": n}

    variants = [
        ("segments/128", "segments", 128, None, "default"),
        ("interval/128", "interval", 128, None, "default"),
        # 64 x 64 sparse blocks: every kernel tile, the backward's too, must divide them
        ("interval/64", "interval", 64, TILES_64, "default"),
        ("interval/128 warps8", "interval", 128, {"num_warps": 8}, "default"),
        ("interval/128 stages2", "interval", 128, {"num_stages": 2}, "default"),
        ("interval/128 tile 128x64", "interval", 128, {"BLOCK_M": 128, "BLOCK_N": 64}, "default"),
        ("interval/128 tile 64x128", "interval", 128, {"BLOCK_M": 64, "BLOCK_N": 128}, "default"),
        ("dense (no mask, timing only)", None, 128, None, "default"),
    ]
    if not args.no_autotune and device.type == "cuda":
        variants.append(("interval/128 max-autotune", "interval", 128, None, "max-autotune"))
    out = {
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "shape": {"B": B, "Hq": Hq, "Hkv": Hkv, "D": D, "S": S, "dtype": str(dt)[6:]},
        "allowed_pairs": int(allowed.sum()),
        "dense_pairs": B * S * S,
        "variants": {},
    }

    def emit(name: str, rec: dict) -> None:
        print(json.dumps({"variant": name} | rec), flush=True)

    # SDPA: with the layout's dense mask (rag_mm's sdpa backend), and dense without a mask
    rep = Hq // Hkv
    kr, vr = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    sd = torch.nn.functional.scaled_dot_product_attention
    for name, mask in (("sdpa with the mask", allowed), ("sdpa dense (timing only)", None)):
        qg, kg, vg = (t.detach().clone().requires_grad_() for t in (q, kr, vr))

        def fwd():
            with torch.no_grad():
                sd(q, kr, vr, attn_mask=mask)

        def fwdbwd():
            sd(qg, kg, vg, attn_mask=mask).backward(go)

        rec = {"fwd_ms": round(sorted(_time_ms(device, fwd) for _ in range(10))[5], 3)}
        if grad_ok:
            rec["fwdbwd_ms"] = round(sorted(_time_ms(device, fwdbwd) for _ in range(10))[5], 3)
        out["variants"][name] = rec
        emit(name, rec)
    ref = None
    valid = (torch.arange(S, device=device)[None] < offsets[:, -1:])[:, None, :, None]
    for name, kind, block, opts, mode in variants:
        if time.perf_counter() - t_start > args.budget:
            out["variants"][name] = {"skipped": "budget"}
            emit(name, out["variants"][name])
            continue
        try:
            if mode not in compiled:
                compiled[mode] = torch.compile(fa, mode="max-autotune-no-cudagraphs")
            fn = compiled[mode]
            bm = None if kind is None else block_mask(kind, block)
            kw = dict(block_mask=bm, enable_gqa=True, kernel_options=opts)
            t0 = time.perf_counter()
            with torch.no_grad():
                o = fn(q, k, v, **kw)
            rec = {"compile_s": None}
            if kind is not None:
                rec["blocks"] = bm_stats(bm)
                if ref is None:
                    ref = o.float() * valid
                else:
                    rec["rel_err_vs_first"] = float(
                        ((o.float() * valid - ref).norm() / ref.norm()).item()
                    )

            def fwd():
                with torch.no_grad():
                    fn(q, k, v, **kw)

            qg, kg, vg = (t.detach().clone().requires_grad_() for t in (q, k, v))

            def fwdbwd():
                fn(qg, kg, vg, **kw).backward(go)

            if grad_ok:
                fwdbwd()
            rec["compile_s"] = round(time.perf_counter() - t0, 1)
            rec["fwd_ms"] = round(sorted(_time_ms(device, fwd) for _ in range(10))[5], 3)
            if grad_ok:
                rec["fwdbwd_ms"] = round(sorted(_time_ms(device, fwdbwd) for _ in range(10))[5], 3)
                rec["fwdbwd_useful_tflops"] = round(3.5 * useful / rec["fwdbwd_ms"] / 1e9, 1)
            rec["fwd_useful_tflops"] = round(useful / rec["fwd_ms"] / 1e9, 1)
            if "fwdbwd_ms" in rec and "fwdbwd_ms" in out["variants"]["sdpa with the mask"]:
                rec["over_sdpa_masked"] = round(
                    rec["fwdbwd_ms"] / out["variants"]["sdpa with the mask"]["fwdbwd_ms"], 3
                )
            out["variants"][name] = rec
        except Exception as e:  # one variant failing must not hide the others
            out["variants"][name] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"}
        emit(name, out["variants"][name])
    base = out["variants"]["sdpa with the mask"].get("fwdbwd_ms")
    if base:
        for name in ("sdpa with the mask", "sdpa dense (timing only)"):
            out["variants"][name]["over_sdpa_masked"] = round(
                out["variants"][name]["fwdbwd_ms"] / base, 3
            )
    out["wall_s"] = round(time.perf_counter() - t_start, 1)
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
