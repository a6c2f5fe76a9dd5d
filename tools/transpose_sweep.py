"""Sweep of transpose tilings on one GPU (issue #3): compile in parallel, check bitwise, time.

Every tiling of ``tilefuse.transpose._kernel.transpose_kernel`` listed in ``VARIANTS`` is compiled (in
parallel threads), checked bitwise against ``x.transpose(1, 2).contiguous()`` on poisoned outputs over
edge shapes (M or N smaller than a tile, strided rows, B > 1), then timed at the benchmark shapes:
median of CUDA-event timings after warm-up, inputs rotated so L2 never serves them, GB/s counting the
input read once and the output written once, % of a device-to-device copy ceiling measured in the same
run (before and after the sweep). The table goes to stdout (last), the rows to ``--json``.

    python tools/transpose_sweep.py --json sweep.json
"""
from __future__ import annotations

import argparse
import json
import sys
import time
import multiprocessing
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tilefuse import _jit  # noqa: E402
from tilefuse.bench import copy_ceiling_gbs, median_us  # noqa: E402
from tilefuse.transpose import _kernel as K  # noqa: E402

DTYPES = {1: torch.float8_e4m3fn, 2: torch.bfloat16, 4: torch.float32}
# (BM, BN, threads, m_major) per element size; the committed K.TILING entry is added to each list.
VARIANTS = {
    2: [(64, 64, 64, False), (128, 64, 128, False), (64, 128, 128, False), (128, 128, 128, False),
        (128, 128, 256, False), (256, 64, 256, False), (256, 128, 256, False), (128, 256, 256, False)],
    1: [(128, 128, 32, False), (128, 128, 64, False), (128, 128, 64, True), (256, 128, 128, False),
        (128, 256, 128, False), (256, 256, 256, True)],
    4: [(32, 32, 64, False), (64, 64, 128, False), (64, 32, 128, False), (32, 64, 128, False),
        (128, 64, 256, False), (64, 64, 256, False), (64, 128, 256, False)],
}
# (B, M, N, row stride) edge shapes for the bitwise check
CHECK_SHAPES = [(1, 64, 64, 64), (3, 192, 320, 320), (2, 320, 192, 256), (1, 4032, 576, 1152),
                (1, 64, 7168, 7168), (2, 7168, 64, 128)]
BIG = (8, 8192, 7168)


def _rand(b: int, m: int, n: int, stride: int, dtype: torch.dtype) -> torch.Tensor:
    return (torch.randn(b, m, stride, device="cuda") * 4).to(dtype)[:, :, :n]


def _launch(fn, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    fn(x.view(torch.int32), out.view(torch.int32))
    return out


def _check(fn, es: int) -> str:
    """'ok' or the first failing shape: bitwise vs torch on a 0xFF-poisoned output (NaN in every dtype)."""
    for b, m, n, s in CHECK_SHAPES + [BIG + (BIG[2],)]:
        x = _rand(b, m, n, s, DTYPES[es])
        out = torch.empty(b, n, m, dtype=x.dtype, device="cuda")
        out.view(torch.uint8).fill_(0xFF)
        _launch(fn, x, out)
        if not torch.equal(out.view(torch.uint8), x.transpose(1, 2).contiguous().view(torch.uint8)):
            return f"MISMATCH {(b, m, n, s)}"
    return "ok"


def _time(run, es: int, shape: tuple, row_stride: int) -> tuple[float, float]:
    """(µs, GB/s) of ``run(x, out)`` at ``shape`` with rows ``row_stride`` apart; inputs rotated over >= 1 GiB."""
    b, m, n = shape
    one = b * m * n * es
    n_sets = max(2, -(-(1 << 30) // one))
    xs = [_rand(b, m, n, row_stride, DTYPES[es]) for _ in range(n_sets)]
    out = torch.empty(b, n, m, dtype=xs[0].dtype, device="cuda")
    us = median_us(lambda i: run(xs[i], out), n_sets)
    return us, 2 * one / us / 1e3


def _compile(work: tuple) -> str:
    """Compile one (element size, tiling) into TileLang's disk cache (in a worker process); '' or the error."""
    try:
        _jit.compile_kernel("batched_transpose", work, "sm_90")
        return ""
    except Exception as exc:  # keep sweeping the others
        return f"{type(exc).__name__}: {exc}"


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default=None)
    parser.add_argument("--sizes", nargs="*", type=int, default=[2, 1, 4])
    parser.add_argument("--jobs", type=int, default=16, help="compile processes")
    parser.add_argument("--compile-only", action="store_true")
    parser.add_argument("--quick", action="store_true", help="only the committed tilings and their grid-order twins")
    args = parser.parse_args(argv)

    if args.quick:  # the committed tiling and its grid-order twin
        variants = {es: [K.TILING[es][:3] + (not K.TILING[es][3],)] for es in args.sizes}
    else:
        variants = VARIANTS
    work = [(es, t) for es in args.sizes for t in [K.TILING[es]] + [v for v in variants[es] if v != K.TILING[es]]]
    t0 = time.perf_counter()
    with ProcessPoolExecutor(args.jobs, mp_context=multiprocessing.get_context("fork")) as pool:
        errors = dict(zip(work, pool.map(_compile, work)))
    kernels = {}
    for w in work:  # loads from the disk cache
        if errors[w]:
            print(f"COMPILE FAILED {w}: {errors[w]}")
        else:
            kernels[w] = _jit.compile_kernel("batched_transpose", w, "sm_90")
    print(f"compiled {len(kernels)}/{len(work)} in {time.perf_counter() - t0:.1f} s", flush=True)
    if args.compile_only:
        return 0

    ceiling = copy_ceiling_gbs()
    print(f"copy ceiling {ceiling:.0f} GB/s", flush=True)
    rows = []
    for (es, tiling), kern in kernels.items():
        status = _check(kern, es)
        row = {"dtype": str(DTYPES[es]).replace("torch.", ""), "tiling": tiling, "check": status,
               "committed": tiling == K.TILING[es]}
        if status == "ok":
            run = lambda x, out: _launch(kern, x, out)  # noqa: E731
            row["us"], row["gbs"] = _time(run, es, BIG, BIG[2])
            row["t2d_us"], row["t2d_gbs"] = _time(run, es, (1, 8064, 7168), 2 * 7168)
        rows.append(row)
        print(row, flush=True)
    for es in args.sizes:  # torch's own strided copy, for scale
        us, gbs = _time(lambda x, out: out.copy_(x.transpose(1, 2)), es, BIG, BIG[2])
        rows.append({"dtype": str(DTYPES[es]).replace("torch.", ""), "tiling": "torch copy_", "check": "-",
                     "committed": False, "us": us, "gbs": gbs, "t2d_us": 0.0, "t2d_gbs": 0.0})
    ceiling2 = copy_ceiling_gbs()
    result = {"gpu": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d"),
              "ceiling_gbs": [ceiling, ceiling2], "rows": rows}
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    ref = max(ceiling, ceiling2)
    print(f"\n{result['gpu']} {result['date']} copy ceiling {ceiling:.0f} / {ceiling2:.0f} GB/s (start / end)")
    print("| dtype | BM, BN, threads, m_major | check | B=8 8192x7168 µs | GB/s | % ceil | 8064x7168 s=2H µs | % ceil |")
    for r in sorted(rows, key=lambda r: (r["dtype"], r.get("us", 1e9))):
        if "us" in r:
            print(f"| {r['dtype']} | {r['tiling']}{' *' if r['committed'] else ''} | {r['check']} | {r['us']:.1f} | "
                  f"{r['gbs']:.0f} | {100 * r['gbs'] / ref:.1f} | {r['t2d_us']:.1f} | {100 * r['t2d_gbs'] / ref:.1f} |")
        else:
            print(f"| {r['dtype']} | {r['tiling']} | {r['check']} | - | - | - | - | - |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
