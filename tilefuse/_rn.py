"""Explicitly rounded IEEE fp32 operations for TileLang kernels: CUDA's ``__f*_rn`` intrinsics, each one rounding
to nearest even, which nvcc never contracts into a fused multiply-add or reorders. A kernel that must reproduce a
spec's exact order of roundings writes its arithmetic with these. No TileLang at import; a kernel module that uses
them names this module in its ``KERNEL_HELPERS`` (its source is part of that module's cache key)."""


def call(name: str, *args):
    """The fp32 device function ``name`` applied to ``args`` (``T.call_extern``)."""
    import tilelang.language as T

    return T.call_extern("float32", name, *args)


def add(a, b):
    return call("__fadd_rn", a, b)


def sub(a, b):
    return call("__fsub_rn", a, b)


def mul(a, b):
    return call("__fmul_rn", a, b)


def div(a, b):
    return call("__fdiv_rn", a, b)


def fma(a, b, c):
    """``RN(a * b + c)``, one rounding."""
    return call("__fmaf_rn", a, b, c)
