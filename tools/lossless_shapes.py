"""What plain CUDA kernels of several shapes reach on per_block_cast_lossless's bytes at the bench size (GPU only).

    python3 tools/lossless_shapes.py [--rounds N] [--large]

The bench row of per_block_cast_lossless (8001 x 7168, 93 MB) is judged against a 2 GiB copy. This times, in one
process and in alternating rounds, the op itself and the kernels of ``tools/_lossless_shapes.cu`` (built here with
nvcc): contiguous streams of the op's byte mix with CTAs of 64-512 threads, a persistent stream, persistent bulk-copy
(TMA engine) pipelines, and models of the op's own access pattern (128-, 64-, 32- and 16-row CTAs; 16-byte lanes;
without the block maximum). Each is checked (streams against their definition; the pattern models that keep the
op's result against the 128-row model) and timed as the bench times (``bench.median_us``, input sets rotated past
L2). ``--large`` adds the streams at 8x the size (their steady rate).
"""
from __future__ import annotations

import argparse
import ctypes
import os
import shutil
import statistics
import subprocess
import tempfile

import torch

from tilefuse import bench

_IN, _OUT = 20480, 32768  # bytes per unit: the op's CTA tile (128 rows x 256 channels)
_UNITS = 1764              # the bench shape's tiles: 28 x 63
# stream kinds of _lossless_shapes.cu -> (threads per CTA, M): each thread 5 M 16-byte loads and 8 M stores
_STREAM_SHAPES = {0: (64, 1), 1: (64, 2), 2: (128, 1), 3: (128, 2), 4: (256, 1), 5: (256, 2), 6: (512, 1), 7: (512, 2),
                  8: (256, 1), 9: (256, 1), 10: (256, 1), 11: (256, 1)}
# (label, kind, grid: 0 for one CTA per M NT / 256 units)
STREAMS = [(f"stream, {nt}-thread CTAs, {5 * m * nt * 16 // 1024} KB read per CTA", k, 0)
           for k, (nt, m) in _STREAM_SHAPES.items() if k < 8]
STREAMS += [("persistent stream, 528 CTAs", 8, 528), ("persistent stream, 1056 CTAs", 8, 1056),
            ("bulk copies, 2 stages, 264 CTAs", 9, 264), ("bulk copies, 3 stages, 132 CTAs", 10, 132),
            ("bulk copies, 4 stages, 132 CTAs", 11, 132)]
# (label, kind, check against kind 0: "all" outputs equal, "sf" the block sf equal, None: a different result)
PATTERNS = [("op pattern, 128-row CTAs", 0, None), ("op pattern, 64-row CTAs + block sf from L2", 1, "all"),
            ("op pattern, 32-row CTAs + block sf from L2", 2, "all"),
            ("op pattern, 16-row CTAs + block sf from L2", 3, "all"),
            ("op pattern, 64-row CTAs, own rows' max only (not the op)", 4, None),
            ("op pattern, 32-row CTAs, own rows' max only (not the op)", 5, None),
            ("op pattern, 16-row CTAs, own rows' max only (not the op)", 6, None),
            ("op tile, 16-byte lanes, 8 rows per thread (128 threads)", 7, "sf"),
            ("op tile, 16-byte lanes, 4 rows per thread (256 threads)", 8, "sf"),
            ("op tile, 16-byte lanes, 2 rows per thread (512 threads)", 9, "sf"),
            ("op tile, 16-byte lanes, 8 rows per thread, whole-line stores (placement model)", 10, "sf"),
            ("op tile, 16-byte lanes, 4 rows per thread, whole-line stores (placement model)", 11, "sf"),
            ("op tile, 16-byte lanes, 2 rows per thread, whole-line stores (placement model)", 12, "sf"),
            ("op pattern, 128-row CTAs, no block maximum (no barrier)", 13, None),
            ("op pattern, 32-row CTAs, no block maximum (no barrier)", 14, None)]

def compile_kernels(lib: str, nvcc: str | None = None) -> str:
    """Build ``_lossless_shapes.cu`` for sm_90 into the shared library ``lib`` (also the CPU test's build check)."""
    src = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_lossless_shapes.cu")
    nvcc = nvcc or shutil.which("nvcc") or "/usr/local/cuda/bin/nvcc"
    subprocess.run([nvcc, "-O3", "-shared", "-Xcompiler", "-fPIC", "-gencode=arch=compute_90,code=sm_90",
                    "-o", lib, src], check=True)
    return lib


def _build() -> ctypes.CDLL:
    dll = ctypes.CDLL(compile_kernels(os.path.join(tempfile.mkdtemp(), "lossless_shapes.so")))
    dll.lossless_shapes_stream.argtypes = [ctypes.c_int] + [ctypes.c_void_p] * 2 + [ctypes.c_int] * 2 + [
        ctypes.c_void_p]
    dll.lossless_shapes_pattern.argtypes = [ctypes.c_int] + [ctypes.c_void_p] * 4 + [ctypes.c_int, ctypes.c_void_p]
    return dll


def _stream_case(dll, kind: int, grid: int, units: int):
    nb = units * (_IN + _OUT)
    k = max(2, -(-bench._L2_ROTATE_BYTES // nb))
    ins = [torch.randint(-2**31, 2**31 - 1, (units * _IN // 4,), dtype=torch.int32, device="cuda") for _ in range(k)]
    outs = [torch.empty(units * _OUT // 4, dtype=torch.int32, device="cuda") for _ in range(k)]

    def run(i):
        err = dll.lossless_shapes_stream(kind, ins[i].data_ptr(), outs[i].data_ptr(), units, grid,
                                         torch.cuda.current_stream().cuda_stream)
        assert err == 0, f"launch failed ({err})"
    return run, k, nb, ins, outs


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--large", action="store_true")
    args = ap.parse_args()
    dll = _build()
    (case,) = [c for c in bench._cases() if c.name == "per_block_cast_lossless"]
    sets = [case.make("cuda", 1.0)[1] for _ in range(6)]
    op_bytes = bench.counted_bytes(sets[0], case.run(*sets[0]))
    rows = {"per_block_cast_lossless (the op)": ((lambda i: case.run(*sets[i])), 6, op_bytes, "bit-tested")}

    # the op's pattern: fp32 sf with power-of-two values, 8001 x 7168
    t, h = 8001, 7168
    n_sets = 6
    data = [torch.randint(-2**31, 2**31 - 1, (t, h // 8), dtype=torch.int32, device="cuda") for _ in range(n_sets)]
    sf = [(torch.randint(-12, 12, (t, h // 32), dtype=torch.int32, device="cuda") + 127) << 23 for _ in range(n_sets)]
    y = [torch.empty(t, h, dtype=torch.uint8, device="cuda") for _ in range(n_sets)]
    y_sf = [torch.zeros(-(-t // 128), h // 128, dtype=torch.int32, device="cuda") for _ in range(n_sets)]
    pat_bytes = sum(x[0].numel() * x[0].element_size() for x in (data, sf, y, y_sf))
    first = None
    for label, kind, compare in PATTERNS:
        def run(i, kind=kind):
            err = dll.lossless_shapes_pattern(kind, data[i].data_ptr(), sf[i].data_ptr(), y[i].data_ptr(),
                                              y_sf[i].data_ptr(), t, torch.cuda.current_stream().cuda_stream)
            assert err == 0, f"launch failed ({err})"
        run(0)
        torch.cuda.synchronize()
        got = (y[0].clone(), y_sf[0].clone())
        if first is None:
            first, check = got, "reference"
        elif compare == "all":
            check = "= 128-row" if torch.equal(got[0], first[0]) and torch.equal(got[1], first[1]) else "DIFFERS"
        elif compare == "sf":  # another thread mapping: the block maxima must agree
            check = "sf = 128-row" if torch.equal(got[1], first[1]) else "sf DIFFERS"
        else:
            check = "-"
        rows[label] = (run, n_sets, pat_bytes, check)

    for units in ((_UNITS, 8 * _UNITS) if args.large else (_UNITS,)):
        for label, kind, grid in STREAMS:
            run, k, nb, ins, outs = _stream_case(dll, kind, grid, units)
            run(0)
            torch.cuda.synchronize()
            ok = _stream_ok(kind, ins[0].view(-1, 4), outs[0].view(-1, 4))
            rows[f"{label}{'' if units == _UNITS else ', 8x size'}"] = (run, k, nb, "ok" if ok else "WRONG")

    results = {label: [] for label in rows}
    ceilings = []
    order = list(rows)
    for r in range(args.rounds):
        ceiling = bench.copy_ceiling_gbs()
        ceilings.append(ceiling)
        for label in (order if r % 2 == 0 else order[::-1]):
            run, k, nb, _ = rows[label]
            us = bench.median_us(lambda i: run(i % k), k)
            results[label].append((us, nb / us / 1e3 / ceiling * 100))
    print(f"{torch.cuda.get_device_name()}  copy ceilings {' / '.join(f'{c:.0f}' for c in ceilings)} GB/s")
    print("| kernel | MB | check | µs (median) | % ceiling, each round |")
    print("| --- | ---: | --- | ---: | --- |")
    for label in order:
        _, _, nb, check = rows[label]
        us = statistics.median(u for u, _ in results[label])
        pct = " / ".join(f"{p:.1f}" for _, p in results[label])
        print(f"| {label} | {nb / 1e6:.1f} | {check} | {us:.2f} | {pct} |")



def _stream_ok(kind: int, x: torch.Tensor, got: torch.Tensor) -> bool:
    """Output vector k of each thread is its input vector k mod 5M with the first word xor k (and the last word
    + 1 in the 2^-32 event that the xor of the thread's second words is 0x12345678, ignored here)."""
    nt, m = _STREAM_SHAPES[kind]
    xin = x.view(-1, 5 * m, nt, 4)
    parts = []
    for k in range(8 * m):
        v = xin[:, k % (5 * m)].clone()
        v[..., 0] ^= k
        parts.append(v)
    return torch.equal(torch.stack(parts, 1).reshape(-1, 4), got)


if __name__ == "__main__":
    main()
