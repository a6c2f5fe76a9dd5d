"""``python -m tilefuse bench``: kernel bandwidth against the GPU's copy ceiling, and host overhead (DESIGN.md).

Each op runs at the spec's benchmark shapes (quant.md 7.3): median µs of CUDA-event timings after warm-up,
inputs rotated across several copies so L2 never serves them, GB/s counting each input read once and each
output written once (decimal), % of the copy ceiling measured in the same run (a large device-to-device
copy, bytes read + written), and the speed ratio to ``torch.compile`` of the reference where it compiles.
``--host-overhead`` times one-row calls on the host: our eager entry, the custom op, a bare TileLang
kernel call with preallocated outputs, and ``torch.empty``.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Callable

import torch

_L2_ROTATE_BYTES = 512 << 20


def _median_us(fn: Callable[[int], object], n_sets: int, warmup: int = 5, iters: int = 30) -> float:
    """Median of per-call CUDA-event times; call ``i`` uses input set ``i % n_sets``."""
    for i in range(warmup):
        fn(i % n_sets)
    torch.cuda.synchronize()
    times = []
    for i in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn(i % n_sets)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


def copy_ceiling_gbs() -> float:
    """GB/s of a 2 GiB device-to-device copy (read + write counted)."""
    n = 1 << 30
    src = torch.empty(n, dtype=torch.uint8, device="cuda").random_(0, 255)
    dst = torch.empty_like(src)
    us = _median_us(lambda i: dst.copy_(src), 1)
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
        us = _median_us(lambda i: run(*sets[i % len(sets)]), len(sets))
        gbs = nbytes / us / 1e3
        row = {"op": name, "shape": shape, "us": us, "gbs": gbs, "pct_ceiling": 100 * gbs / ceiling}
        if with_compile and ref is not None:
            try:
                cref = torch.compile(ref)
                row["compile_us"] = _median_us(lambda i: cref(*sets[i % len(sets)]), len(sets))
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
    from tilefuse.quant import _per_token_cast_kernel as Q

    x = torch.randn(1, 7168, device="cuda").to(torch.bfloat16)
    cfg = ("bfloat16", "e4m3", 7168, 128, True, "col_packed", "cast")
    jk = _jit.get_jit_kernel("per_token_cast", cfg)
    out, sf = Q.per_token_cast_launch(x, None, "e4m3", 128, None, True, True, True)
    sf_store = torch.empty((14, 4), dtype=torch.int32, device="cuda")  # (cdiv(56 groups, 4), align(1 row, 4))
    sf_arg = sf_store.view(torch.uint8).view(14, 4, 4)
    calls = {
        "torch.empty(1, 7168)": lambda: torch.empty((1, 7168), dtype=torch.float8_e4m3fn, device="cuda"),
        "bare TileLang kernel call (preallocated outputs)": lambda: jk(x, out, sf_arg),
        "tilefuse eager entry (per_token_cast_cuda)": lambda: Q.per_token_cast_cuda(x, "e4m3", 128, None, True, True,
                                                                                     True),
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


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m tilefuse bench")
    parser.add_argument("--ops", nargs="*", default=None, help="op names or areas (quant, transpose)")
    parser.add_argument("--json", default=None, help="write the results as JSON")
    parser.add_argument("--plot", default=None, help="write a PNG bar chart of %% of the copy ceiling")
    parser.add_argument("--host-overhead", action="store_true", help="also time one-row calls on the host")
    parser.add_argument("--no-compile-ref", action="store_true", help="skip torch.compile of the references")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench needs a CUDA GPU")
        return 1
    result = run_bench(args.ops, with_compile=not args.no_compile_ref)
    if args.host_overhead:
        result["host_overhead"] = host_overhead()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    if args.plot:
        _plot(result, args.plot)
    _print_table(result)
    if "host_overhead" in result:
        print("\n| call at one row | µs per call |\n| --- | ---: |")
        for r in result["host_overhead"]:
            print(f"| {r['call']} | {r['us']:.2f} |")
    return 0
