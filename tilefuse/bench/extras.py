"""The optional measurements of ``python -m tilefuse bench``: ``--host-overhead`` (one-row calls timed on the
host: our eager entry, the custom op, a bare TileLang kernel call with preallocated outputs, ``torch.empty``),
``--cold-start`` (a second process's first call) and ``--tiles`` (a per_token_cast tile sweep)."""
from __future__ import annotations

import os
import statistics
import time

import torch

from tilefuse.bench.core import _nbytes, median_us
from tilefuse.bench.engram import host_calls as engram_host_calls
from tilefuse.bench.mhc import host_calls as mhc_host_calls
from tilefuse.bench.transform import host_calls as rotary_host_calls


def _interleaved_call_us(calls: list, batch: int = 200, rounds: int = 11) -> list[float]:
    """Median wall µs per call of each function in ``calls``: ``rounds`` rounds, each timing a batch of
    ``batch`` calls of every function in turn, so host drift (clock, other processes) hits them alike."""
    for fn in calls:
        for _ in range(50):
            fn()
    torch.cuda.synchronize()
    samples = [[] for _ in calls]
    for _ in range(rounds):
        for k, fn in enumerate(calls):
            t0 = time.perf_counter()
            for _ in range(batch):
                fn()
            samples[k].append((time.perf_counter() - t0) / batch * 1e6)
            torch.cuda.synchronize()
    return [statistics.median(v) for v in samples]


def _gate_host_calls() -> dict:
    """The one-token gate calls of issue 25's host target (<= 1.5x a bare TileLang call of the same kernel with
    preallocated outputs): topk_gate and moe_topk_gate_forward (sqrtsoftplus + bias), bare and public."""
    from tilefuse import _jit, moe
    from tilefuse._launch import placeholder as ph

    scores = torch.randn(1, 256, device="cuda")
    idx = torch.empty(1, 8, dtype=torch.int64, device="cuda")
    wts = torch.empty(1, 8, dtype=torch.float32, device="cuda")
    bias = torch.randn(256, device="cuda")
    topk = _jit.get_jit_kernel("topk_gate", (256, 8))
    gate = _jit.get_jit_kernel("moe_topk_gate_forward", (256, 8, 0, "bias"))
    d = "cuda"
    u8 = torch.uint8
    gate_args = (scores, bias, ph(d, torch.float32), ph(d, u8), ph(d, u8), ph(d, u8), ph(d, u8),
                 ph(d, torch.int32, (1, 1)), ph(d, torch.int32), ph(d, torch.int64, (1, 8)), idx, wts,
                 ph(d, torch.float32, (1, 256)), 2.5, 0, 0)
    g1, g2 = "topk_gate, 256 experts, top-8", "moe_topk_gate_forward, 256 experts, top-8, bias"
    return [
        (g1, "bare TileLang kernel call (JITKernel, preallocated output)", lambda: topk(scores, idx)),
        (g1, "tilefuse.moe.topk_gate (public op)", lambda: moe.topk_gate(scores, 8)),
        (g2, "bare TileLang kernel call (JITKernel, preallocated outputs)", lambda: gate(*gate_args)),
        (g2, "tilefuse.moe.moe_topk_gate_forward (public op)",
         lambda: moe.moe_topk_gate_forward(scores, 8, False, 0, 2.5, 0, bias=bias)),
    ]


def host_overhead(iters: int = 2000) -> list[dict]:
    """Median wall µs per call at one row (7168 bf16 channels -> e4m3), for two sf layouts, of six other
    public ops at one row (their bench rows' configs; group "other public ops", no baseline), of the two
    one-token MoE gates beside their bare kernels (``_gate_host_calls``), and of the one-token rotary, mHC and
    Engram calls (``host_calls`` of their bench modules). Each layout group has
    two baselines: the bare TileLang call with preallocated outputs, and TileLang's own allocating call
    (``out_idx``: the kernel returns its outputs), which does what the public op does minus validation; the
    latter exists for the row-major layout only (TileLang allocates plain contiguous outputs). All calls are
    timed interleaved (see ``_interleaved_call_us``)."""
    import tilelang

    from tilefuse import _jit
    from tilefuse import quant
    from tilefuse.quant import _per_token_cast_kernel as Q

    x = torch.randn(1, 7168, device="cuda").to(torch.bfloat16)
    everything = []
    for layout, col in (("col_packed", True), ("row", False)):
        cfg = ("bfloat16", "e4m3", 7168, 128, True, layout, "cast")
        jk = _jit.get_jit_kernel("per_token_cast", cfg)
        out, sf = Q.per_token_cast_launch(x, None, "e4m3", 128, None, col, True, col)
        raw = _jit.get("per_token_cast", cfg)
        group = "col + round + ue8m0" if col else "row-major sf, round"
        calls = {
            "torch.empty(1, 7168)": lambda: torch.empty((1, 7168), dtype=torch.float8_e4m3fn, device="cuda"),
            "x.new_empty((1, 7168), fp8)": lambda: x.new_empty((1, 7168), dtype=torch.float8_e4m3fn),
            "raw TVM-FFI call (preallocated outputs)": lambda raw=raw, out=out, sf=sf: raw(x, out, sf),
            "bare TileLang kernel call (JITKernel, preallocated outputs)": lambda jk=jk, out=out, sf=sf: jk(x, out, sf),
        }
        if not col:
            alloc = tilelang.compile(Q.per_token_cast_kernel(*cfg), out_idx=[1, 2],
                                     target={"kind": "cuda", "arch": _jit.current_arch()},
                                     execution_backend="tvm_ffi", pass_configs=dict(_jit._PASS_CONFIGS))
            calls["bare TileLang kernel call allocating its outputs (JITKernel, out_idx)"] = lambda: alloc(x)
        calls["tilefuse launcher (per_token_cast_launch: allocation + launch)"] = (
            lambda col=col: Q.per_token_cast_launch(x, None, "e4m3", 128, None, col, True, col))
        py_plan = Q._plan(x.dtype, 7168, None, "e4m3", 128, None, col, True, col, "cast", native=False)
        calls["its Python launch path (torch.empty_strided x2 + TVM-FFI call; TILEFUSE_NATIVE=0)"] = (
            lambda py_plan=py_plan: py_plan(x, 1))
        calls["tilefuse.quant.per_token_cast (public op: validation + launcher)"] = (
            lambda col=col: quant.per_token_cast(x, "e4m3", 128, None, col, True, col))
        calls["torch.ops.tilefuse.per_token_cast (custom op)"] = (
            lambda col=col: torch.ops.tilefuse.per_token_cast(x, None, "e4m3", 128, None, col, True, col))
        everything += [(group, name, fn) for name, fn in calls.items()]
    # other public ops at one row, at their bench rows' static configs (no target: where the host time goes)
    w = torch.randn(7168, device="cuda").to(torch.bfloat16)
    ptc_pair = quant.per_token_cast(x, "e4m3", 128, None, True, True, True)
    pbc_pair = quant.per_block_cast(x, "e4m3", (128, 128))
    others = {
        "per_block_cast e4m3 128x128 col round ue8m0": lambda: quant.per_block_cast(x, "e4m3", (128, 128), True, True,
                                                                                    True),
        "per_token_cast_back e4m3 npc128 col round ue8m0 -> bf16": lambda: quant.per_token_cast_back(ptc_pair, "bf16",
                                                                                                     128),
        "cast_back e4m3 block128x128 -> bf16": lambda: quant.cast_back(pbc_pair, "bf16", (128, 128)),
        "per_token_cast_to_e5m6 npc=H col round ue8m0": lambda: quant.per_token_cast_to_e5m6(x, 7168, True, True, True),
        "norm_forward (weight)": lambda: quant.norm_forward(x, w, 1e-6),
        "norm_forward_and_per_token_cast e4m3 npc32 col round ue8m0": lambda: quant.norm_forward_and_per_token_cast(
            x, w, 1e-6, "e4m3", 32, None, 1.0, True, True, True),
    }
    everything += [("other public ops", name, fn) for name, fn in others.items()]
    everything += _gate_host_calls()
    everything += rotary_host_calls()
    everything += mhc_host_calls() + engram_host_calls()
    times = _interleaved_call_us([fn for _, _, fn in everything], batch=max(1, iters // 10))
    return [{"group": group, "call": name, "us": us} for (group, name, _), us in zip(everything, times)]


def host_overhead_table(rows: list[dict]) -> list[str]:
    """The markdown lines of :func:`host_overhead`'s rows, each with its ratio to the group's two baselines."""
    lines = ["| sf layout | call at one row | µs per call | vs bare call | vs allocating bare call |",
             "| --- | --- | ---: | ---: | ---: |"]
    for r in rows:
        same = [o for o in rows if o["group"] == r["group"]]
        bare = next((o["us"] for o in same if o["call"].startswith("bare TileLang kernel call (JIT")), None)
        alloc = next((o["us"] for o in same if "allocating" in o["call"]), None)
        vs_bare = f"{r['us'] / bare:.2f}x" if bare else "-"
        vs_alloc = f"{r['us'] / alloc:.2f}x" if alloc else "-"
        lines.append(f"| {r['group']} | {r['call']} | {r['us']:.2f} | {vs_bare} | {vs_alloc} |")
    return lines


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
from tilefuse import _native
print(f"{t1 - t0:.3f} {t2 - t1:.3f} {t3 - t2:.3f} {ok} {'tilelang' in sys.modules} {_native.module() is not None}")
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
    if res.returncode or len(fields) != 6:
        return {"error": (res.stdout + res.stderr)[-500:]}
    return {"torch_and_cuda_init_s": float(fields[0]), "import_tilefuse_s": float(fields[1]),
            "first_call_s": float(fields[2]), "equals_reference": fields[3] == "True",
            "imported_tilelang": fields[4] == "True", "native_launcher": fields[5] == "True"}


def _sweep_cases(only: str | None = None) -> list[tuple]:
    """(shape, make_inputs, fmt, col, round, packed, kernel config without the tile) of each per_token_cast case."""
    from tilefuse.bench.quant import quick_cases
    from tilefuse.quant import _per_token_cast_kernel as Q

    rows = []
    for case in quick_cases():
        if case.name != "per_token_cast":
            continue
        shape = case.describe()[0]
        make = lambda make_case=case.make: make_case("cuda", 1.0)[1]
        col, rnd, packed = (" col" in shape, " round" in shape, " ue8m0" in shape)
        fmt = "e2m1" if "e2m1" in shape else "e4m3"
        layout = "col_packed" if packed else ("col" if col else "row")
        x_dtype = torch.float32 if shape.startswith("float32") else torch.bfloat16
        base = (Q._TL_DTYPE[x_dtype], fmt, 7168, 128, rnd, layout, "cast", 0, 0, False)
        if only is None or only in shape:
            rows.append((shape, make, fmt, col, rnd, packed, base))
    return rows


def sweep_work(tiles: list[tuple[int, int]], only: str | None = None) -> list[tuple[str, tuple]]:
    """The ``(kernel, config)`` pairs a tile sweep compiles (for ``_jit.compile_many``)."""
    return [("per_token_cast", base + (tile,)) for *_, base in _sweep_cases(only) for tile in tiles]


def parse_tiles(text: str) -> list[tuple[int, ...]]:
    """``"256x4,512x8"`` -> ``[(256, 4), (512, 8)]`` (``ValueError`` on a part that is no integer)."""
    return [tuple(int(v) for v in t.split("x")) for t in text.split(",")]


def tile_sweep(tiles: list[tuple[int, int]], jobs: int = 16, only: str | None = None) -> list[dict]:
    """Time each ``per_token_cast`` bench case at each ``(threads, pairs per thread)`` tile (the tile never
    changes results: each variant's outputs are compared bitwise with the default tile's)."""
    from tilefuse import _jit
    from tilefuse.quant import _per_token_cast_kernel as Q

    plans = [(shape, make()[0], fmt, col, rnd, packed, base) for shape, make, fmt, col, rnd, packed, base in _sweep_cases(only)]
    work = sweep_work(tiles, only)
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


