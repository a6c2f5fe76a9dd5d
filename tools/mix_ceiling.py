"""What a plain elementwise kernel (stock PyTorch, or a Triton stream) reaches on the byte mix of a bench row (GPU
only).

    python tools/mix_ceiling.py            # each bench row's mix next to a plain kernel of it
    python tools/mix_ceiling.py --curve [BLOCK WARPS]  # one Triton stream across read:write mixes, large and 93 MB

The bench judges every row against one ceiling: a large device-to-device copy (reads = writes). Rows that read
more than they write, write more than they read, or move under 100 MB differ from that copy in ways no kernel
of ours controls. Each case here times a stock PyTorch kernel or a Triton streaming kernel whose bytes read, bytes
written and size roughly match one row's (timed as the bench times, ``bench.median_us`` with rotating input sets),
and prints its % of the copy ceiling measured in the same process: a reference point for that row's figure, not a
bound.
"""
from __future__ import annotations

import torch

from tilefuse import bench


def _sets(nbytes: int) -> int:
    """Input sets that rotate through more than L2 holds (as the bench does)."""
    return max(2, -(-bench._L2_ROTATE_BYTES // nbytes))


def _convert(n: int, src: torch.dtype, dst: torch.dtype):
    """read n elements of src, write n of dst (``Tensor.copy_`` with a dtype conversion)."""
    k = _sets(n * torch.tensor([], dtype=src).element_size())
    ins = [torch.zeros(n, dtype=src, device="cuda") for _ in range(k)]
    outs = [torch.empty(n, dtype=dst, device="cuda") for _ in range(k)]
    return (lambda i: outs[i].copy_(ins[i])), k, n * (ins[0].element_size() + outs[0].element_size())


def _add(n: int, dtype: torch.dtype):
    """read 2 n elements, write n (``torch.add(a, b, out=c)``)."""
    es = torch.tensor([], dtype=dtype).element_size()
    k = _sets(2 * n * es)
    a = [torch.zeros(n, dtype=dtype, device="cuda") for _ in range(k)]
    b = [torch.zeros(n, dtype=dtype, device="cuda") for _ in range(k)]
    c = [torch.empty(n, dtype=dtype, device="cuda") for _ in range(k)]
    return (lambda i: torch.add(a[i], b[i], out=c[i])), k, 3 * n * es


def _fill(n: int, dtype: torch.dtype):
    """write n elements, read nothing (``Tensor.fill_``)."""
    es = torch.tensor([], dtype=dtype).element_size()
    k = _sets(n * es)
    outs = [torch.empty(n, dtype=dtype, device="cuda") for _ in range(k)]
    return (lambda i: outs[i].fill_(1.0)), k, n * es


def _triton(name: str, n: int, n_in: int, outs: tuple):
    """A Triton streaming kernel of ``tools/_mix_triton.py`` over n elements: ``n_in`` int32 inputs, one output per
    dtype in ``outs`` (4096 elements per program, 8 warps). Unlike the stock kernels above, its loads and stores
    are 16-byte vectors whatever the element type, as ours are: n must be a multiple of 16 (Triton vectorizes a
    masked access only when it knows that of N)."""
    assert n % 16 == 0, n
    import _mix_triton

    kern = getattr(_mix_triton, name)
    per = 4 * n_in + sum(torch.tensor([], dtype=d).element_size() for d in outs)
    k = _sets(n * per)
    ins = [[torch.zeros(n, dtype=torch.int32, device="cuda") for _ in range(n_in)] for _ in range(k)]
    res = [[torch.empty(n, dtype=d, device="cuda") for d in outs] for _ in range(k)]
    grid = (-(-n // 4096),)
    return (lambda i: kern[grid](*ins[i], *res[i], n, BLOCK=4096, num_warps=8)), k, n * per


# (label, the bench row whose byte mix it mirrors, builder returning (fn(i), n_sets, bytes moved))
CASES = [
    ("copy 1:1, 93 MB", "per_block_cast_lossless (reads 36, writes 57 MB)",
     lambda: _convert(46_500_000, torch.uint8, torch.uint8)),
    # the device copy runs ~8 points faster when its size is a multiple of 64 KB (H200, 2026-11-30: 88% vs 80%)
    ("copy 1:1, 93 MB, a multiple of 64 KB", "per_block_cast_lossless (reads 36, writes 57 MB)",
     lambda: _convert(711 << 16, torch.uint8, torch.uint8)),
    ("uint8 -> int16 1:2, 86 MB", "per_block_cast_lossless (reads 36, writes 57 MB)",
     lambda: _convert(28_700_000, torch.uint8, torch.int16)),
    ("uint8 -> int16 1:2, 352 MB", "swiglu_backward_and_per_token_cast (reads 117, writes 235 MB)",
     lambda: _convert(117_400_000, torch.uint8, torch.int16)),
    ("uint8 add 2:1, 176 MB", "norm_forward_and_per_token_cast (reads 117, writes 59 MB)",
     lambda: _add(8192 * 7168, torch.uint8)),
    ("bf16 add 2:1, 352 MB", "norm_backward (reads 235, writes 117 MB)",
     lambda: _add(8192 * 7168, torch.bfloat16)),
    ("fp32 fill 0:1, 229 MB", "per_token_cast_back e2m1 -> fp32, unpack_from_e2m1fn_x2 (read 29-36, write 229 MB)",
     lambda: _fill(8001 * 7168, torch.float32)),
    ("bf16 copy 1:1, 235 MB", "norm_forward (reads 117, writes 117 MB)",
     lambda: _convert(8192 * 7168, torch.bfloat16, torch.bfloat16)),
    ("Triton 1:1, 93 MB", "per_block_cast_lossless (reads 36, writes 57 MB)",
     lambda: _triton("copy_1_1", 11_624_960, 1, (torch.int32,))),
    ("Triton 1:1.5, 93 MB (int32 in; int32 and int16 out)", "per_block_cast_lossless (reads 36, writes 57 MB)",
     lambda: _triton("copy_1_15", 9_300_000, 1, (torch.int32, torch.int16))),
    ("Triton 1:2, 352 MB (int32 -> int64)", "swiglu_backward_and_per_token_cast (reads 119, writes 237 MB)",
     lambda: _triton("widen_1_2", 29_350_000, 1, (torch.int64,))),
    ("Triton 2:4, 352 MB (two inputs, four outputs)", "swiglu_backward_and_per_token_cast (reads 119, writes 237 MB)",
     lambda: _triton("add_2_4", 14_674_944, 2, (torch.int32,) * 4)),
    ("Triton 2:1, 352 MB", "norm_backward (reads 235, writes 117 MB)",
     lambda: _triton("add_2_1", 29_360_128, 2, (torch.int32,))),
]


def main() -> None:
    ceiling = bench.copy_ceiling_gbs()
    print(f"{torch.cuda.get_device_name()}  copy ceiling {ceiling:.0f} GB/s")
    print("| stock kernel | mirrors | µs | GB/s | % ceiling |")
    print("| --- | --- | ---: | ---: | ---: |")
    for label, row, build in CASES:
        fn, n_sets, nbytes = build()
        us = bench.median_us(fn, n_sets)
        gbs = nbytes / us / 1e3
        print(f"| {label} | {row} | {us:.1f} | {gbs:.0f} | {100 * gbs / ceiling:.1f} |")
        del fn
        torch.cuda.empty_cache()


# (label, IN, NOUT, NARROW): bytes per element read 4 IN, written 4 NOUT + NARROW (int8 1, int16 2)
MIXES = [("1:0 (read only)", 1, 0, 0), ("2:1", 1, 0, 2), ("1:1", 1, 1, 0), ("1:1.25", 1, 1, 1),
         ("1:1.5", 1, 1, 2), ("1:2", 1, 2, 0), ("1:3", 1, 3, 0), ("0:1 (write only)", 0, 1, 0)]


def _mix_stream(total: int, i_n: int, n_out: int, narrow: int, block: int = 4096, warps: int = 8):
    """``tools/_mix_triton.mix`` moving about ``total`` bytes, ``block`` elements per program: (fn(i), n_sets,
    bytes moved)."""
    import _mix_triton

    per = 4 * i_n + 4 * n_out + narrow
    n = total // per // 65536 * 65536
    k = _sets(n * per)
    blocks = n // block
    ins = [torch.zeros(n if i_n else 1, dtype=torch.int32, device="cuda") for _ in range(k)]
    outs = [[torch.empty(n if j < n_out else 1, dtype=torch.int32, device="cuda") for j in range(3)]
            + [torch.empty(n if narrow else blocks, dtype=(torch.int8, torch.int16)[narrow - 1] if narrow
                           else torch.int32, device="cuda")] for _ in range(k)]
    return (lambda i: _mix_triton.mix[(blocks,)](ins[i], *outs[i], n, IN=i_n, NOUT=n_out, NARROW=narrow,
                                                   BLOCK=block, num_warps=warps)), k, n * per


def curve(block: int = 4096, warps: int = 8) -> None:
    """% of the copy ceiling of one streaming kernel across read:write byte mixes: at ~1.2 GB (the steady rate:
    the per-call fixed cost is under 1% there) and at ~93 MB (the lossless cast's size). ``block`` elements per
    program and ``warps`` per program (H200, 2026-11-30: 1024 and 4 streamed 1:1 and 1:1.5 fastest of five shapes)."""
    ceiling = bench.copy_ceiling_gbs()
    print(f"{torch.cuda.get_device_name()}  copy ceiling {ceiling:.0f} GB/s")
    print("| read:write bytes | 1.2 GB: µs | % ceiling | 93 MB: µs | % ceiling |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for label, i_n, n_out, narrow in MIXES:
        cells = []
        for total in (1_200_000_000, 93_000_000):
            fn, n_sets, nbytes = _mix_stream(total, i_n, n_out, narrow, block, warps)
            us = bench.median_us(fn, n_sets)
            cells += [f"{us:.1f}", f"{100 * nbytes / us / 1e3 / ceiling:.1f}"]
            del fn
            torch.cuda.empty_cache()
        print(f"| {label} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    import sys

    # --curve [BLOCK WARPS]
    args = sys.argv[1:]
    curve(*map(int, args[1:3])) if args[:1] == ["--curve"] else main()
