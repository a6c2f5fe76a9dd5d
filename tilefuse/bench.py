"""``python -m tilefuse bench``: kernel bandwidth against the GPU's copy ceiling, and host overhead (DESIGN.md).

Each op runs at the spec's benchmark shapes (quant.md 7.3): median µs per call after warm-up, from CUDA
events around batches of back-to-back calls queued behind a device-side sleep (so host launch time is not
counted as kernel time), inputs rotated across several copies so L2 never serves them, GB/s counting each
input read once and each output written once (decimal), % of the copy ceiling measured in the same run (a
large device-to-device copy, bytes read + written), and the speed ratio to ``torch.compile`` of the
reference where it compiles.
``--host-overhead`` times one-row calls on the host: our eager entry, the custom op, a bare TileLang
kernel call with preallocated outputs, and ``torch.empty``.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from typing import Callable

import torch

_L2_ROTATE_BYTES = 512 << 20
_SLEEP_CYCLES = 200_000  # ~100 µs of GPU time queued ahead of each timed batch


def median_us(fn: Callable[[int], object], n_sets: int, warmup: int = 5, iters: int = 30,
              calls: int = 10) -> float:
    """Median µs per call: each sample times ``calls`` back-to-back calls between one pair of CUDA events,
    call ``i`` using input set ``i % n_sets``. A short device-side sleep is queued before the start event,
    so the host enqueues the calls while the GPU is still busy: host launch and allocation time stay out of
    the figure unless they exceed the kernel time (then the GPU waits on the host and it shows)."""
    for i in range(warmup):
        fn(i % n_sets)
    torch.cuda.synchronize()
    times = []
    k = 0
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(_SLEEP_CYCLES)
        start.record()
        for _ in range(calls):
            fn(k % n_sets)
            k += 1
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls)
    return statistics.median(times)


def copy_ceiling_gbs() -> float:
    """GB/s of a 2 GiB device-to-device copy (read + write counted)."""
    n = 1 << 30
    src = torch.empty(n, dtype=torch.uint8, device="cuda").random_(0, 255)
    dst = torch.empty_like(src)
    us = median_us(lambda i: dst.copy_(src), 1, calls=3)
    return 2 * n / us / 1e3


def _nbytes(*tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def _cases():
    """(name, shape string, make_inputs() -> tuple, kernel(inputs) -> outputs, reference(inputs) or None)."""
    from tilefuse.quant import _per_token_cast_kernel as Q
    from tilefuse.transpose import _kernel as TR
    from tilefuse.reference.quant import cast as ref_cast

    cases = []

    def ptc(x_dtype, fmt, flags):
        col, rnd, packed = flags
        shape = f"{str(x_dtype).replace('torch.', '')} 8192x7168 npc128 {fmt}" + \
            "".join(f" {n}" for n, on in (("col", col), ("round", rnd), ("ue8m0", packed)) if on)
        make = lambda: (torch.randn(8192, 7168, device="cuda").to(x_dtype),)
        run = lambda x: Q.per_token_cast_launch(x, None, fmt, 128, None, col, rnd, packed)
        ref = lambda x: ref_cast(x, fmt, (1, 128), round_sf=rnd, use_tma_aligned_col_major_sf=col,
                                 use_packed_ue8m0=packed)
        cases.append(("per_token_cast", shape, make, run, ref))

    for x_dtype, fmt, flags in ((torch.bfloat16, "e4m3", (False, True, False)),
                                (torch.bfloat16, "e4m3", (True, True, True)),
                                (torch.bfloat16, "e4m3", (False, False, False)),
                                (torch.float32, "e4m3", (True, True, True)),
                                (torch.bfloat16, "e2m1", (True, True, True))):
        ptc(x_dtype, fmt, flags)
    cases.append(("batched_transpose", "bf16 (8, 8192, 7168)",
                  lambda: (torch.randn(8, 8192, 7168, device="cuda").to(torch.bfloat16),),
                  TR.batched_transpose_launch, lambda x: x.transpose(1, 2).contiguous()))
    cases.append(("transpose", "e4m3 8064x7168 row stride 2H",
                  lambda: (torch.randn(8064, 2 * 7168, device="cuda").to(torch.float8_e4m3fn)[:, :7168],),
                  TR.transpose_launch, None))
    return cases


def _flat(out) -> list:
    return list(out) if isinstance(out, (tuple, list)) else [out]


def run_bench(ops: list[str] | None, with_compile: bool = True) -> dict:
    ceiling = copy_ceiling_gbs()
    rows = []
    for name, shape, make, run, ref in _cases():
        if ops and not any(o in (name, _area(name)) for o in ops):
            continue
        first = make()
        n_sets = max(2, -(-_L2_ROTATE_BYTES // max(1, _nbytes(*first))))
        sets = [first] + [make() for _ in range(min(n_sets, 4) - 1)]
        outs = _flat(run(*first))
        nbytes = _nbytes(*first) + _nbytes(*outs)
        us = median_us(lambda i: run(*sets[i % len(sets)]), len(sets))
        gbs = nbytes / us / 1e3
        row = {"op": name, "shape": shape, "us": us, "gbs": gbs, "pct_ceiling": 100 * gbs / ceiling}
        if with_compile and ref is not None:
            try:
                cref = torch.compile(ref)
                row["compile_us"] = median_us(lambda i: cref(*sets[i % len(sets)]), len(sets))
                row["speedup_vs_compile"] = row["compile_us"] / us
            except Exception as exc:  # torch.compile of a reference may fail; report, keep going
                row["compile_error"] = f"{type(exc).__name__}: {str(exc)[:120]}"
        rows.append(row)
        del sets, first, outs
        torch.cuda.empty_cache()
    return {"gpu": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d"), "copy_ceiling_gbs": ceiling,
            "rows": rows}


def _area(name: str) -> str:
    return "transpose" if "transpose" in name else "quant"


def host_overhead(iters: int = 2000) -> list[dict]:
    """Median wall µs per call at one row (7168 bf16 channels -> e4m3, col + round + ue8m0)."""
    from tilefuse import _jit
    from tilefuse import quant
    from tilefuse.quant import _per_token_cast_kernel as Q

    x = torch.randn(1, 7168, device="cuda").to(torch.bfloat16)
    cfg = ("bfloat16", "e4m3", 7168, 128, True, "col_packed", "cast")
    jk = _jit.get_jit_kernel("per_token_cast", cfg)
    out, sf = Q.per_token_cast_launch(x, None, "e4m3", 128, None, True, True, True)
    calls = {
        "torch.empty(1, 7168)": lambda: torch.empty((1, 7168), dtype=torch.float8_e4m3fn, device="cuda"),
        "bare TileLang kernel call (JITKernel, preallocated outputs)": lambda: jk(x, out, sf),
        "tilefuse launcher (per_token_cast_launch: allocation + launch)": lambda: Q.per_token_cast_launch(
            x, None, "e4m3", 128, None, True, True, True),
        "tilefuse.quant.per_token_cast (public op: validation + launcher)": lambda: quant.per_token_cast(
            x, "e4m3", 128, None, True, True, True),
        "torch.ops.tilefuse.per_token_cast (custom op)": lambda: torch.ops.tilefuse.per_token_cast(
            x, None, "e4m3", 128, None, True, True, True),
    }
    rows = []
    for name, fn in calls.items():
        for _ in range(50):
            fn()
        torch.cuda.synchronize()
        samples = []
        for _ in range(5):
            t0 = time.perf_counter()
            for _ in range(iters // 5):
                fn()
            samples.append((time.perf_counter() - t0) / (iters // 5) * 1e6)
            torch.cuda.synchronize()
        rows.append({"call": name, "us": statistics.median(samples)})
    return rows


_COLD = """
import time, sys
t0 = time.perf_counter()
import torch
torch.cuda.init(); x = torch.randn(4096, 7168, device="cuda").to(torch.bfloat16); torch.cuda.synchronize()
t1 = time.perf_counter()
import tilefuse.quant as q
t2 = time.perf_counter()
out, sf = q.per_token_cast(x, "e4m3", 128, None, True, True, True); torch.cuda.synchronize()
t3 = time.perf_counter()
ref = q.per_token_cast(x.cpu(), "e4m3", 128, None, True, True, True)
ok = torch.equal(out.cpu().view(torch.uint8), ref[0].view(torch.uint8))
print(f"{t1 - t0:.3f} {t2 - t1:.3f} {t3 - t2:.3f} {ok} {'tilelang' in sys.modules}")
"""


def cold_start() -> dict:
    """A second process's first call of an already-compiled kernel (disk cache warm): seconds for
    ``import tilefuse.quant`` and for the first ``per_token_cast`` call (load + launch + sync)."""
    import subprocess
    import sys

    from tilefuse.quant import per_token_cast

    x = torch.randn(8, 7168, device="cuda").to(torch.bfloat16)
    per_token_cast(x, "e4m3", 128, None, True, True, True)  # make sure this config is in the disk cache
    res = subprocess.run([sys.executable, "-c", _COLD], capture_output=True, text=True, timeout=120)
    fields = res.stdout.split()
    if res.returncode or len(fields) != 5:
        return {"error": (res.stdout + res.stderr)[-500:]}
    return {"torch_and_cuda_init_s": float(fields[0]), "import_tilefuse_s": float(fields[1]),
            "first_call_s": float(fields[2]), "equals_reference": fields[3] == "True",
            "imported_tilelang": fields[4] == "True"}


def _sweep_cases() -> list[tuple]:
    """(shape, make_inputs, fmt, col, round, packed, kernel config without the tile) of each per_token_cast case."""
    from tilefuse.quant import _per_token_cast_kernel as Q

    rows = []
    for name, shape, make, run, _ in _cases():
        if name != "per_token_cast":
            continue
        col, rnd, packed = (" col" in shape, " round" in shape, " ue8m0" in shape)
        fmt = "e2m1" if "e2m1" in shape else "e4m3"
        layout = "col_packed" if packed else ("col" if col else "row")
        x_dtype = torch.float32 if shape.startswith("float32") else torch.bfloat16
        base = (Q._TL_DTYPE[x_dtype], fmt, 7168, 128, rnd, layout, "cast", 0, 0, False)
        rows.append((shape, make, fmt, col, rnd, packed, base))
    return rows


def sweep_work(tiles: list[tuple[int, int]]) -> list[tuple[str, tuple]]:
    """The ``(kernel, config)`` pairs a tile sweep compiles (for ``_jit.compile_many``)."""
    return [("per_token_cast", base + (tile,)) for *_, base in _sweep_cases() for tile in tiles]


def parse_tiles(text: str) -> list[tuple[int, int]]:
    """``"256x4,512x8"`` -> ``[(256, 4), (512, 8)]``."""
    return [tuple(int(v) for v in t.split("x")) for t in text.split(",")]


def tile_sweep(tiles: list[tuple[int, int]], jobs: int = 16) -> list[dict]:
    """Time each ``per_token_cast`` bench case at each ``(threads, pairs per thread)`` tile (the tile never
    changes results: each variant's outputs are compared bitwise with the default tile's)."""
    from tilefuse import _jit
    from tilefuse.quant import _per_token_cast_kernel as Q

    plans = [(shape, make()[0], fmt, col, rnd, packed, base) for shape, make, fmt, col, rnd, packed, base in _sweep_cases()]
    work = sweep_work(tiles)
    arch = _jit.current_arch()
    todo = [w for w in work if not os.path.exists(_jit._lib_path(*w, arch))]  # precompiled ones are skipped
    failures = dict(_jit.compile_many(todo, arch, jobs)) if todo else {}
    rows = []
    for shape, x, fmt, col, rnd, packed, base in plans:
        want = Q.per_token_cast_launch(x, None, fmt, 128, None, col, rnd, packed)
        sets = [x] + [torch.randn_like(x, dtype=torch.float32).to(x.dtype) for _ in range(2)]
        for tile in tiles:
            cfg = base + (tile,)
            if ("per_token_cast", cfg) in failures:
                rows.append({"shape": shape, "tile": tile, "error": failures[("per_token_cast", cfg)][:200]})
                continue
            fn = _jit.get("per_token_cast", cfg)
            got = [torch.full_like(want[0], 0x7F if fmt == "e2m1" else 1.0), torch.empty_like(want[1])]
            fn(x, *got)
            same = torch.equal(got[0].view(torch.uint8), want[0].view(torch.uint8)) and torch.equal(got[1], want[1])
            us = median_us(lambda i: fn(sets[i % 3], *got), 3)
            nbytes = _nbytes(x, *want)
            rows.append({"shape": shape, "tile": tile, "us": us, "gbs": nbytes / us / 1e3, "bitwise_equal": same})
        del sets
        torch.cuda.empty_cache()
    return rows


def _print_table(result: dict) -> None:
    print(f"\n{result['gpu']}  {result['date']}  copy ceiling {result['copy_ceiling_gbs']:.0f} GB/s")
    print(f"| op | shape | µs | GB/s | % ceiling | torch.compile µs | speed-up |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: |")
    for r in result["rows"]:
        cu = f"{r['compile_us']:.1f}" if "compile_us" in r else r.get("compile_error", "-")[:40]
        sp = f"{r['speedup_vs_compile']:.2f}x" if "speedup_vs_compile" in r else "-"
        print(f"| {r['op']} | {r['shape']} | {r['us']:.1f} | {r['gbs']:.0f} | {r['pct_ceiling']:.1f} | {cu} | {sp} |")


def _plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{r['op']}\n{r['shape']}" for r in result["rows"]]
    vals = [r["pct_ceiling"] for r in result["rows"]]
    fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(vals)), 5))
    ax.bar(range(len(vals)), vals)
    ax.axhline(92, color="red", linestyle="--", label="92% target")
    ax.set_xticks(range(len(vals)), labels, rotation=30, ha="right", fontsize=7)
    ax.set_ylabel("% of copy ceiling")
    ax.set_title(f"tilefuse on {result['gpu']} ({result['copy_ceiling_gbs']:.0f} GB/s copy)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def _save(result: dict, path: str | None) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(result, f, indent=1)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m tilefuse bench")
    parser.add_argument("--ops", nargs="*", default=None, help="op names or areas (quant, transpose)")
    parser.add_argument("--json", default=None, help="write the results as JSON")
    parser.add_argument("--plot", default=None, help="write a PNG bar chart of %% of the copy ceiling")
    parser.add_argument("--host-overhead", action="store_true", help="also time one-row calls on the host")
    parser.add_argument("--no-compile-ref", action="store_true", help="skip torch.compile of the references")
    parser.add_argument("--cold-start", action="store_true",
                        help="also time a second process's first per_token_cast call (warm disk cache)")
    parser.add_argument("--tiles", default=None,
                        help="per_token_cast tile sweep, e.g. 256x4,512x8 (threads x pairs per thread)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench needs a CUDA GPU")
        return 1
    # Each part is printed and saved as soon as it is done, so a run cut short keeps what it measured.
    result = run_bench(args.ops, with_compile=not args.no_compile_ref)
    _print_table(result)
    _save(result, args.json)
    if args.plot:
        _plot(result, args.plot)
    if args.host_overhead:
        result["host_overhead"] = host_overhead()
        print("\n| call at one row | µs per call | vs bare call |\n| --- | ---: | ---: |")
        bare = next(r["us"] for r in result["host_overhead"] if r["call"].startswith("bare"))
        for r in result["host_overhead"]:
            print(f"| {r['call']} | {r['us']:.2f} | {r['us'] / bare:.2f}x |")
        _save(result, args.json)
    if args.cold_start:
        result["cold_start"] = cold_start()
        print("\ncold start (second process, warm disk cache):", result["cold_start"])
        _save(result, args.json)
    if args.tiles:
        result["tile_sweep"] = tile_sweep(parse_tiles(args.tiles))
        print("\n| per_token_cast case | tile | µs | % ceiling | bitwise equal |\n| --- | --- | ---: | ---: | --- |")
        for r in result["tile_sweep"]:
            if "error" in r:
                print(f"| {r['shape']} | {r['tile']} | error: {r['error'][:80]} | | |")
            else:
                print(f"| {r['shape']} | {r['tile']} | {r['us']:.1f} | "
                      f"{100 * r['gbs'] / result['copy_ceiling_gbs']:.1f} | {r['bitwise_equal']} |")
        _save(result, args.json)
    return 0
