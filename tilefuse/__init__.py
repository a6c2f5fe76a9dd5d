"""tilefuse: fused GPU kernels for LLM training and inference, written in TileLang.

Every op has an exact pure-PyTorch reference (``tilefuse.reference``); CUDA tensors take the TileLang
kernel where one exists, every other tensor takes the reference. Importing this package compiles
nothing and imports no TileLang: the areas below load on first attribute access.
"""
import importlib

__version__ = "0.1.0"

_SUBMODULES = ("engram", "formats", "mhc", "modeling", "moe", "quant", "reference", "testing", "transform",
               "transpose")
__all__ = ["__version__", *_SUBMODULES]


def __getattr__(name):
    if name in _SUBMODULES:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module 'tilefuse' has no attribute {name!r}")


def __dir__():
    return sorted(__all__)
