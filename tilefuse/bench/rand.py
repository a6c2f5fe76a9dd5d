"""The bench cases of ``tilefuse.rand.randn`` (rand.md 12): three prefill-sized draws and one decode-sized draw.
Bytes are the output only. Our ``randn`` is ``torch.randn`` behind argument checks, and so is TileKernels 2.1.0's
on CUDA, so the expected speedup is 1.00x: any other figure is noise or wrapper overhead. The draws of two calls
come from different generator states, so a peer agrees when its output has our shape and dtype and is finite
(the bits are torch's by construction; tests/rand checks them against torch.randn)."""
from __future__ import annotations

import torch

from tilefuse.bench.core import Case

OPS = ("randn",)
TOKENS = (128, 4001, 8192)
SHAPES = (((8192, 7168), torch.bfloat16), ((8192, 7168), torch.float32), ((4001, 7168), torch.bfloat16),
          ((128, 7168), torch.bfloat16))


def _same_kind(ours, theirs) -> tuple[bool, str]:
    ok = ours.shape == theirs.shape and ours.dtype == theirs.dtype and bool(torch.isfinite(theirs).all())
    return ok, "same shape, dtype, all finite" if ok else f"{tuple(theirs.shape)} {theirs.dtype}"


def _case(shape, dtype) -> Case:
    from tilefuse import rand

    label = f"{str(dtype).removeprefix('torch.')} {shape[0]}x{shape[1]}"
    # The one "input" is the device (no tensor: nothing is read, and the counted bytes are the output's).
    return Case(
        "randn", lambda device, scale: (label, (torch.device(device),)),
        lambda device: rand.randn(shape, dtype=dtype, device=device),
        lambda device: torch.randn(shape, dtype=dtype, device=device),
        {"tk2": lambda tk, device: tk.rand.randn(*shape, dtype=dtype, device=device)},
        exact=False, key=f"randn|{label}", tokens=shape[0],
        check={"tk2": _same_kind, "compile": _same_kind},
        describe=lambda: (label, [], [(shape, dtype)]))


def quick_cases() -> list[Case]:
    return [_case(*SHAPES[0])]


def grid_cases() -> list[Case]:
    return [_case(shape, dtype) for shape, dtype in SHAPES]
