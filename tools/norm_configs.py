"""RMSNorm forward and backward across the configs the bench does not time: bf16 / fp32, H = 2048 / 4096 / 7168,
with or without a weight, with a residual (forward: residual and rstd; backward: residual_out_grad). T = 8192,
timed as the bench times (``bench.median_us``, two input sets), % of the copy ceiling measured in the same process.
Bytes: each input tensor read once, each output written once (the forward's returned ``norm_input`` is ``x`` itself
without a residual and is not counted). Compiles its configs first, 16 at a time (GPU only).

    python3 tools/norm_configs.py
"""
import torch

from tilefuse import _jit, bench
from tilefuse import quant as q
import tilefuse.quant._norm_kernel as NK

T = 8192
DT = {"bfloat16": torch.bfloat16, "float32": torch.float32}
CASES = [(xd, h, w, res) for xd in DT for h in (2048, 4096, 7168) for w, res in ((True, False), (False, False),
                                                                                 (True, True))]
WORK = ([("norm_forward", (xd, h, w, res, False, "row", False, False, res, 0)) for xd, h, w, res in CASES]
        + [("norm_backward", c) for c in CASES]
        + [("norm_weight_grad_reduce", (xd, h, True, NK._partials(xd, h))) for xd in DT for h in (2048, 4096, 7168)])


def _row(op, xd, h, w, res, fn, inputs, outputs, ceiling):
    ins = [t for t in inputs if t is not None]
    outs = [t for t in outputs if t is not None and all(t is not i for i in ins)]
    us = bench.median_us(fn, 2)
    pct = 100 * bench.counted_bytes(tuple(ins), tuple(outs)) / us / 1e3 / ceiling
    print(f"| {op} | {xd} | {h} | {w} | {res} | {us:.1f} | {pct:.1f} |", flush=True)


def main() -> None:
    for (name, cfg), err in _jit.compile_many(WORK, _jit.current_arch(), 16):
        print("FAILED", name, cfg, err[:300])
    ceiling = bench.copy_ceiling_gbs()
    print(f"{torch.cuda.get_device_name()}  copy ceiling {ceiling:.0f} GB/s, T = {T}")
    print("| op | dtype | H | weight | residual | µs | % ceiling |\n| --- | --- | ---: | --- | --- | ---: | ---: |")
    for xd, h, w, res in CASES:
        d = DT[xd]
        sets = [(torch.randn(T, h, device="cuda").to(d), torch.randn(h, device="cuda").to(d) if w else None,
                 torch.randn(T, h, device="cuda").to(d) if res else None) for _ in range(2)]
        _row("norm_forward", xd, h, w, res, lambda i: q.norm_forward(sets[i][0], sets[i][1], 1e-6, sets[i][2],
                                                                     with_rstd=res),
             sets[0], q.norm_forward(sets[0][0], sets[0][1], 1e-6, sets[0][2], with_rstd=res), ceiling)
        sets = [(torch.randn(T, h, device="cuda").to(d), torch.randn(T, h, device="cuda").to(d),
                 torch.randn(h, device="cuda").to(d) if w else None, torch.rand(T, device="cuda") + 0.5,
                 torch.randn(T, h, device="cuda").to(d) if res else None) for _ in range(2)]
        _row("norm_backward", xd, h, w, res, lambda i: q.norm_backward(*sets[i]), sets[0],
             q.norm_backward(*sets[0]), ceiling)
        sets = None
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
