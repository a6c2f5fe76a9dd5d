"""Registry of the public ops, read by ``python -m tilefuse info`` and ``precompile``.

``@public("quant")`` records a public function under ``quant.<name>`` and returns it unchanged (no
call overhead). ``path`` says what CUDA tensors take: ``"reference"`` until the op's TileLang kernel
exists, then ``"kernel"``; ``"torch"`` for an op whose contract is a torch factory's bits (``rand``), which
every device runs. CPU tensors always take the reference.
"""
from __future__ import annotations

from typing import Callable

OPS: dict[str, dict] = {}
PATHS = ("reference", "kernel", "torch")
AREAS = ("quant", "transpose", "moe", "engram", "mhc", "transform", "rand")


def public(area: str, *, path: str = "reference") -> Callable:
    if path not in PATHS:
        raise ValueError(f"path must be one of {PATHS}, got {path!r}")

    def register(fn: Callable) -> Callable:
        OPS[f"{area}.{fn.__name__}"] = {"fn": fn, "path": path}
        return fn

    return register


def load_all() -> dict[str, dict]:
    """Import every area so that all ops are registered; return the registry."""
    import importlib

    for area in AREAS:
        importlib.import_module(f"tilefuse.{area}")
    return OPS
