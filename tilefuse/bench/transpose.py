"""The bench cases of the transposes (``tilefuse.transpose``, quant.md 3.15): the ``--quick`` rows at the spec's
benchmark shapes and the grid rows (TileKernels 1.0.0 has both ops; both matrix dims % 64 == 0). Each case
declares its tensors' shapes (``Case.describe``) for ``--list``."""
from __future__ import annotations

import torch

from tilefuse.bench.core import Case, _dim, _randn

OPS = ("batched_transpose", "transpose")
HIDDEN = (1536, 2048, 4096, 7168, 18432)
TOKENS = (128, 4096, 16384)
BATCHED_TOKENS = (128, 4096)


def _peers(call) -> dict:
    return {"tk1": lambda tk, *inputs: call(tk.transpose, *inputs)}


def quick_cases() -> list[Case]:
    """bf16 ``(8, 8192, 7168)`` batched, and an e4m3 ``8064 x 7168`` view with row stride 2H."""
    from tilefuse import transpose as tr

    def batched(device, scale):
        b, t, h = _dim(8, scale), _dim(8192, scale, 128), _dim(7168, scale, 128)
        return f"bf16 ({b}, {t}, {h})", (_randn((b, t, h), torch.bfloat16, device),)

    def strided(device, scale):
        t, h = _dim(8064, scale, 128), _dim(7168, scale, 128)
        return f"e4m3 {t}x{h} row stride 2H", (_randn((t, 2 * h), torch.float8_e4m3fn, device)[:, :h],)

    bt = lambda ns, x: ns.batched_transpose(x)  # noqa: E731
    t2 = lambda ns, x: ns.transpose(x)  # noqa: E731
    bf16, e4m3 = torch.bfloat16, torch.float8_e4m3fn
    return [
        Case("batched_transpose", batched, lambda x: bt(tr, x), lambda x: x.transpose(1, 2).contiguous(), _peers(bt),
             describe=lambda: ("bf16 (8, 8192, 7168)", [((8, 8192, 7168), bf16)], [((8, 7168, 8192), bf16)])),
        Case("transpose", strided, lambda x: t2(tr, x), lambda x: x.t().contiguous(), _peers(t2),
             describe=lambda: ("e4m3 8064x7168 row stride 2H", [((8064, 7168), e4m3)], [((7168, 8064), e4m3)])),
    ]


def grid_cases() -> list[Case]:
    """``transpose`` of bf16 and e4m3 ``T x H`` and ``batched_transpose`` of ``(8, T, H)``, T >= 128."""
    from tilefuse import transpose as tr

    cases: list[Case] = []
    for dt, name in ((torch.bfloat16, "bf16"), (torch.float8_e4m3fn, "e4m3")):
        for op, tokens in (("transpose", TOKENS), ("batched_transpose", BATCHED_TOKENS)):
            call = (lambda ns, x, op=op: getattr(ns, op)(x))
            ref = ((lambda x: x.t().contiguous()) if op == "transpose" else (lambda x: x.transpose(1, 2).contiguous()))
            lead = () if op == "transpose" else (8,)
            label = ((lambda t, h, name=name: f"{name} {t}x{h}") if op == "transpose"
                     else (lambda t, h, name=name: f"{name} (8, {t}, {h})"))
            for h in HIDDEN:
                for t in tokens:
                    make = (lambda t, h, dt=dt, lead=lead, label=label: lambda device, scale: (
                        label(t, h), (_randn(lead + (t, h), dt, device),)))(t, h)
                    describe = (lambda t, h, dt=dt, lead=lead, label=label: lambda: (
                        label(t, h), [(lead + (t, h), dt)], [(lead + (h, t), dt)]))(t, h)
                    cases.append(Case(op, make, lambda x, call=call: call(tr, x), ref, _peers(call), True,
                                      f"{op}|{label(0, h)}", t, describe=describe))
    return cases
