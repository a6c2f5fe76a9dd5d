"""Host time of the RMSNorm ops' Python path on a machine without a GPU (kernel calls stubbed).

    PYTHONPATH=. python3 tools/host_path_cpu.py

CPU tensors are taken for eager CUDA ones (``norm._eager_cuda``) and every kernel is a no-op, so what is timed is
validation, allocation and argument handling: the public op on its validated fast path (after the first call),
the launcher alone and the checks alone, at one row of 7168 channels (best of 5 rounds of 20000 calls, us per call).
A proxy for the device host, which is slower and adds the kernel launch. The stub is a TVM-FFI function, so the
forward launchers take their native launch plans (``tilefuse._native``); with ``TILEFUSE_NATIVE=0`` they take the
Python launch path.
"""
import time

import torch

from tilefuse import _jit
from tilefuse.quant import _norm_kernel as K
from tilefuse.quant import norm as N


def _us(fn, n: int = 20000) -> float:
    for _ in range(n // 10):
        fn()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t) / n * 1e6


def main() -> None:
    N._eager_cuda = lambda x: True
    import tvm_ffi

    stub = tvm_ffi.convert(lambda *args: None)
    _jit.get = lambda name, cfg: stub
    x = torch.randn(1, 7168, dtype=torch.bfloat16)
    w = torch.randn(7168, dtype=torch.bfloat16)
    dy, rstd = torch.randn_like(x), torch.ones(1)
    cases = {
        "norm_forward (public op, validated path)": lambda: N.norm_forward(x, w, 1e-6),
        "norm_forward launcher": lambda: K.norm_forward_cuda(x, w, 1e-6, None, 1.0, None, None, False),
        "norm_forward_and_per_token_cast (public op, validated path)": lambda: N.norm_forward_and_per_token_cast(
            x, w, 1e-6, "e4m3", 32, None, 1.0, True, True, True),
        "norm_forward_and_per_token_cast launcher": lambda: K.norm_forward_and_per_token_cast_cuda(
            x, w, 1e-6, "e4m3", 32, None, 1.0, True, True, True, False, None, None, None, None, 0, False),
        "forward checks (_check_forward)": lambda: N._check_forward("norm_forward", x, w, 1e-6, None, 1.0, None),
        "norm_backward (public op, validated path)": lambda: N.norm_backward(dy, x, w, rstd),
        "norm_backward launcher": lambda: K.norm_backward_cuda(dy, x, w, rstd),
    }
    print("| call | us |\n| --- | ---: |")
    for name, fn in cases.items():
        print(f"| {name} | {min(_us(fn) for _ in range(5)):.2f} |")


if __name__ == "__main__":
    main()
