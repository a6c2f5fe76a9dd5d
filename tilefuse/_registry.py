"""Registry of the public ops, read by ``python -m tilefuse info`` and ``precompile``.

``@public("quant")`` records a public function under ``quant.<name>`` and returns it unchanged (no
call overhead). ``path`` says what CUDA tensors take: ``"reference"`` until the op's TileLang kernel
exists, then ``"kernel"``. CPU tensors always take the reference.
"""
from __future__ import annotations

from typing import Callable

OPS: dict[str, dict] = {}


def public(area: str, *, path: str = "reference") -> Callable:
    if path not in ("reference", "kernel"):
        raise ValueError(f"path must be 'reference' or 'kernel', got {path!r}")

    def register(fn: Callable) -> Callable:
        OPS[f"{area}.{fn.__name__}"] = {"fn": fn, "path": path}
        return fn

    return register


def load_all() -> dict[str, dict]:
    """Import every area so that all ops are registered; return the registry."""
    import importlib

    for area in ("quant", "transpose", "moe", "engram", "mhc", "transform"):
        importlib.import_module(f"tilefuse.{area}")
    return OPS
