"""Time against size: µs per call of an op at several token counts T (H = 7168), and the least-squares line
``us = a + b * T``. ``b`` gives the steady-state rate (the op's bytes per row over b, as GB/s and % of the copy
ceiling), ``a`` the cost a call pays whatever its size (launch, ramp, tail; for norm_backward also the partial
weight-gradient store and the reduce). Plain PyTorch kernels of the same byte mix are scanned alongside.
Timing is ``tilefuse.bench.median_us`` (back-to-back calls behind a device sleep, inputs rotated).
Usage (GPU): python3 tools/t_scan.py [case ...]   (cases: see CASES; default all)"""
from __future__ import annotations

import sys

import torch

from tilefuse import bench
from tilefuse import quant as q
from tilefuse.quant import _norm_kernel as NK


def _norm_bwd_inputs(t, h=7168):
    x = torch.randn(t, h, device="cuda").bfloat16()
    dy = torch.randn(t, h, device="cuda").bfloat16()
    w = torch.randn(h, device="cuda").bfloat16()
    rstd = torch.rand(t, device="cuda") + 0.5
    return (dy, x, w, rstd), 3 * t * h * 2


def _norm_bwd(t, h=7168):
    """The public op (dx kernel and weight-gradient reduce)."""
    args, nbytes = _norm_bwd_inputs(t, h)
    return (lambda: q.norm_backward(*args)), nbytes


def _dx_only(t, h=7168):
    """The dx kernel alone (its partial rows written, no reduce)."""
    (dy, x, w, rstd), nbytes = _norm_bwd_inputs(t, h)
    fn = NK._jit.get("norm_backward", ("bfloat16", h, True, False))
    dx = torch.empty_like(x)
    part = torch.empty((NK._partials("bfloat16", h), h), device="cuda")
    dummy = torch.empty(1, device="cuda").bfloat16()
    return (lambda: fn(dy, x, w, rstd, dummy, dx, part, 1.0)), nbytes


def _dx_noweight(t, h=7168):
    """The public op without a weight: the dx kernel alone with no weight gradient (no partials, no reduce), the
    same rows per CTA. (Its H = 7168 kernel is not a registered config: it compiles on first use.)"""
    (dy, x, _, rstd), nbytes = _norm_bwd_inputs(t, h)
    return (lambda: q.norm_backward(dy, x, None, rstd)), nbytes


def _add21(t, h=7168):
    """torch.add of two bf16 (t, h) tensors: norm_backward's 2:1 read:write mix and bytes."""
    a = torch.randn(t, h, device="cuda").bfloat16()
    b = torch.randn(t, h, device="cuda").bfloat16()
    c = torch.empty_like(a)
    return (lambda: torch.add(a, b, out=c)), 3 * t * h * 2


def _lossless(t, h=7168):
    x = torch.randn(t, h, device="cuda").bfloat16()
    pair = q.per_token_cast(x, "e2m1", 32, None, False, True, False)
    f = lambda: q.per_block_cast_lossless(pair, "e4m3", (1, 32), (128, 128), True, True, True)
    out = f()
    return f, bench.counted_bytes((pair,), out)


def _copy(nbytes):
    """A device copy moving ``nbytes`` (read + write)."""
    src = torch.empty(nbytes // 2, dtype=torch.uint8, device="cuda").random_(0, 255)
    dst = torch.empty_like(src)
    return (lambda: dst.copy_(src)), nbytes


def _triton_1_15(t, row_bytes=11648):
    """tools/_mix_triton.py's 1:1.5 stream (int32 in; int32 and int16 out: 10 bytes per element, 16-byte accesses)
    moving about ``row_bytes`` per token: the lossless cast's byte mix (1:1.6) without its tiles and math."""
    import _mix_triton
    n = t * row_bytes // 10 // 16 * 16
    x = torch.zeros(n, dtype=torch.int32, device="cuda")
    y0, y1 = torch.empty_like(x), torch.empty(n, dtype=torch.int16, device="cuda")
    grid = (-(-n // 4096),)
    return (lambda: _mix_triton.copy_1_15[grid](x, y0, y1, n, BLOCK=4096, num_warps=8)), 10 * n


CASES = {
    "norm_backward": ([2048, 4096, 8192, 16384, 32768], _norm_bwd),
    "norm_dx": ([2048, 4096, 8192, 16384, 32768], _dx_only),
    "norm_dx_noweight": ([2048, 4096, 8192, 16384, 32768], _dx_noweight),
    "add_2to1": ([2048, 4096, 8192, 16384, 32768], _add21),
    "lossless": ([2000, 4000, 8001, 16000, 32000], _lossless),
    # token counts around the bench shape's 4.45 waves of 128 x 256 tiles (396 resident CTAs): is a partial last
    # wave costly? (measured on the H200: no; docs/BENCHMARKS.md, What we learned)
    "lossless_waves": ([7040, 7168, 7552, 7936, 8001, 8448, 8704, 8960, 9088], _lossless),
    # the lossless cast's bytes per row at H = 7168: 3584 data + 896 sf in, 7168 out (+ its small sf out). The device
    # copy is slower when its size is not a multiple of 64 KB (T = 8001: 79%; 88% at a 64 KB multiple of ~93 MB)
    "triton_lossless_mix": ([2000, 4000, 8001, 16000, 32000], _triton_1_15),
    "copy_lossless_bytes": ([2000, 4000, 8001, 16000, 32000], lambda t: _copy(t * 11648)),
}


def main(names):
    ceiling = bench.copy_ceiling_gbs()
    print(f"copy ceiling {ceiling:.0f} GB/s")
    for name in names:
        ts, make = CASES[name]
        pts = []
        for t in ts:
            fns = [make(t) for _ in range(2 if t >= 8000 else 4)]   # input sets, rotated (L2 never serves them)
            nbytes = fns[0][1]
            us = bench.median_us(lambda i, fns=fns: fns[i][0](), len(fns))
            pts.append((t, us, nbytes))
            print(f"  {name} T={t}: {us:.1f} us, {nbytes / 1e6:.0f} MB, {100 * nbytes / us / 1e3 / ceiling:.1f}%")
            fns = None
            torch.cuda.empty_cache()
        n = len(pts)
        mt = sum(p[0] for p in pts) / n
        mu = sum(p[1] for p in pts) / n
        b = sum((p[0] - mt) * (p[1] - mu) for p in pts) / sum((p[0] - mt) ** 2 for p in pts)
        a = mu - b * mt
        per_row = pts[-1][2] / pts[-1][0]
        print(f"{name}: us = {a:.2f} + {b * 1e3:.3f} ns * T; steady {per_row / b / 1e3:.0f} GB/s "
              f"({100 * per_row / b / 1e3 / ceiling:.1f}% of the copy ceiling), fixed {a:.2f} us")


if __name__ == "__main__":
    main(sys.argv[1:] or list(CASES))
