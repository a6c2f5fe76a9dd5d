"""Static SASS profile of one kernel config: a quick, GPU-free proxy for compute-bound kernels.

    python tools/sass_stats.py per_token_cast "('bfloat16','e2m1',7168,128,True,'col_packed','cast')" \
        --elems-per-thread 32 --elements 58720256 --bytes 147.3e6

``--resources`` prints only ptxas's register, stack-frame and spill counts (the first check for a spilling
config; no disassembler needed). Otherwise it compiles the config for sm_90 (TileLang + nvcc here), disassembles
it (``cuobjdump``: set CUOBJDUMP or put it on PATH; ``pip download nvidia-cuda-cuobjdump`` has one) and counts the
instructions of the main path (up to the first EXIT; slow-path subroutines such as IEEE division's come after it)
by issue class:

- fma: FADD/FMUL/FFMA/HADD2/HMUL2/HFMA2 (full rate: one warp instruction per clock per SM sub-partition),
- alu: integer, logic, shifts, compares, min/max, select, PRMT, F2FP packing (half rate),
- imad: IMAD* (half rate, on the FMA-heavy pipe, so it overlaps with alu),
- shfl (quarter rate), xu: MUFU/F2F/F2I/I2F (one eighth), mem: LDG/STG/LDS/STS/...

With ``--elems-per-thread`` and ``--elements`` it estimates the issue-bound time on an H200 (132 SMs x 4
sub-partitions at ``--clock`` GHz): warps x max(total, 2 alu, 2 imad, 4 shfl, 8 xu) cycles, next to the
memory time of ``--bytes`` at ``--ceiling`` GB/s. Static counts assume straight-line code: loops over tokens
(T.serial) repeat their body, so read the listing (--dump) when the kernel has one.
"""
from __future__ import annotations

import argparse
import ast
import os
import re
import shutil
import subprocess
import sys
import tempfile

FMA = {"FADD", "FMUL", "FFMA", "HADD2", "HMUL2", "HFMA2", "FMUL2", "FADD2", "FFMA2"}
IMAD = {"IMAD"}
SHFL = {"SHFL"}
XU = {"MUFU", "F2F", "F2I", "I2F", "FRND", "I2FP", "F2IP"}
MEM = {"LDG", "STG", "LDS", "STS", "LDL", "STL", "LD", "ST", "ATOM", "ATOMS", "RED", "LDSM", "STSM", "UBLKCP",
       "UTMALDG", "UTMASTG", "LDGSTS"}
FREE = {"NOP", "BRA", "BSSY", "BSYNC", "EXIT", "CALL", "RET", "BAR", "S2R", "S2UR", "CS2R", "ULDC", "UMOV",
        "USHF", "UIADD3", "UIMAD", "ULOP3", "ULEA", "USEL", "UISETP", "R2UR", "MOV", "WARPSYNC", "DEPBAR",
        "MEMBAR", "ERRBAR", "LDC", "YIELD", "PLOP3", "VOTE", "VOTEU", "UPRMT", "UFLO", "BMOV", "FENCE", "CCTL"}


def classify(op: str) -> str:
    base = op.split(".")[0]
    if base in FMA:
        return "fma"
    if base in IMAD:
        return "imad"
    if base in SHFL:
        return "shfl"
    if base in XU:
        return "xu"
    if base in MEM:
        return "mem"
    if base in FREE:
        return "other"
    return "alu"


def kernel_source(name: str, config: tuple) -> str:
    from tilefuse import _jit

    _jit.registered()
    return _jit.get_jit_kernel(name, config).get_kernel_source()


def sass(src: str) -> tuple[str, str]:
    import tilelang

    tl = os.path.dirname(tilelang.__file__)
    cuobjdump = os.environ.get("CUOBJDUMP") or shutil.which("cuobjdump") or "/tmp/cudatools/nvidia/cu13/bin/cuobjdump"
    with tempfile.TemporaryDirectory() as d:
        cu, cubin = os.path.join(d, "k.cu"), os.path.join(d, "k.cubin")
        open(cu, "w").write(src)
        subprocess.run(["nvcc", "-cubin", "-arch=sm_90", "-O3", "-std=c++17", f"-I{tl}/src",
                        f"-I{tl}/3rdparty/cutlass/include", "-DENABLE_BF16", "-w", "-o", cubin, cu],
                       check=True, capture_output=True)
        listing = subprocess.run([cuobjdump, "-sass", cubin], check=True, capture_output=True, text=True).stdout
        res = subprocess.run([cuobjdump, "-res-usage", cubin], capture_output=True, text=True).stdout
    return listing, res


def ptxas_resources(src: str) -> str:
    """ptxas's resource lines for ``src`` (registers, stack frame, spill stores and loads): no cuobjdump needed."""
    import tilelang

    tl = os.path.dirname(tilelang.__file__)
    with tempfile.TemporaryDirectory() as d:
        cu = os.path.join(d, "k.cu")
        open(cu, "w").write(src)
        done = subprocess.run(["nvcc", "-cubin", "-arch=sm_90", "-O3", "-std=c++17", f"-I{tl}/src",
                               f"-I{tl}/3rdparty/cutlass/include", "-DENABLE_BF16", "-w", "-Xptxas", "-v",
                               "-o", os.path.join(d, "k.cubin"), cu], capture_output=True, text=True)
    return "\n".join(ln.strip() for ln in done.stderr.splitlines() if "Used" in ln or "spill" in ln or "error" in ln)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("name")
    p.add_argument("config", help="the static config as a Python tuple literal")
    p.add_argument("--resources", action="store_true",
                   help="only ptxas's registers, stack frame and spills (no cuobjdump needed; TILEFUSE_KNOBS applies)")
    p.add_argument("--source", default=None, help="also write the generated CUDA source to this file")
    p.add_argument("--elems-per-thread", type=float, default=None)
    p.add_argument("--elements", type=float, default=None, help="elements of the whole problem")
    p.add_argument("--bytes", type=float, default=None, help="bytes the problem moves (for the memory time)")
    p.add_argument("--clock", type=float, default=1.755, help="SM clock, GHz")
    p.add_argument("--ceiling", type=float, default=4270.0, help="copy ceiling, GB/s")
    p.add_argument("--dump", action="store_true", help="print the main-path listing")
    args = p.parse_args(argv)
    src = kernel_source(args.name, ast.literal_eval(args.config))
    if args.source:
        with open(args.source, "w") as f:
            f.write(src)
    if args.resources:
        print(ptxas_resources(src))
        return 0
    listing, res = sass(src)
    lines = [re.sub(r"\s*/\*[0-9a-fx]+\*/\s*$", "", ln).strip() for ln in listing.splitlines()
             if re.match(r"\s+/\*[0-9a-f]{4,6}\*/", ln)]
    lines = [re.sub(r"^/\*[0-9a-f]{4,6}\*/\s*", "", ln) for ln in lines]
    main_path = []
    for ln in lines:
        main_path.append(ln)
        if re.match(r"(@!?U?P\w+\s+)?EXIT", ln) and not ln.startswith("@"):
            break
    counts: dict[str, int] = {}
    ops: dict[str, int] = {}
    for ln in main_path:
        op = re.sub(r"^@!?U?P\w+\s+", "", ln).split()[0].rstrip(";")
        cls = classify(op)
        counts[cls] = counts.get(cls, 0) + 1
        ops[op.split(".")[0]] = ops.get(op.split(".")[0], 0) + 1
    regs = re.search(r"REG:(\d+)", res)
    # local-memory loads/stores with any width suffix (LDL.64, STL.128), predicated or not
    spills = sum(1 for ln in main_path if re.match(r"(@!?U?P\w+\s+)?(LDL|STL)(\.|\s|$)", ln))
    total = sum(counts.values())
    print(f"registers {regs.group(1) if regs else '?'}, local-memory instructions {spills}, "
          f"main path {total} instructions ({len(lines)} in all)")
    print("  " + "  ".join(f"{k} {counts.get(k, 0)}" for k in ("fma", "alu", "imad", "shfl", "xu", "mem", "other")))
    print("  " + "  ".join(f"{k} {v}" for k, v in sorted(ops.items(), key=lambda kv: -kv[1])[:16]))
    cycles = max(total - counts.get("other", 0) // 2, 2 * counts.get("alu", 0), 2 * counts.get("imad", 0),
                 4 * counts.get("shfl", 0), 8 * counts.get("xu", 0))
    print(f"  issue-bound cycles per warp ~{cycles}")
    if args.elems_per_thread and args.elements:
        warps = args.elements / args.elems_per_thread / 32
        us = warps * cycles / (132 * 4 * args.clock * 1e3)
        line = f"  estimate: {warps:.0f} warps -> ~{us:.1f} us issue-bound"
        if args.bytes:
            line += f"; memory at {args.ceiling:.0f} GB/s: {args.bytes / args.ceiling / 1e3:.1f} us"
        print(line)
    if args.dump:
        print("\n".join(main_path))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
