"""The command line: ``python -m tilefuse {info, demo, bench, precompile}`` (DESIGN.md).

``info`` and ``demo`` live here and in ``tilefuse.demo``; ``bench`` and ``precompile`` forward their
arguments to ``tilefuse.bench.main`` and ``tilefuse._jit.precompile_main``, imported only when asked for.
Nothing here imports TileLang: ``info`` reads its version from the installed package's metadata.
"""
from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import os
import platform
import sys
from collections import defaultdict

USAGE = """usage: python -m tilefuse <command> [options]

commands:
  info        versions, GPU, TileLang cache directory, and which path each op takes on CUDA tensors
  demo        a miniature DeepSeek-V4-style block through the public API (python -m tilefuse demo -h)
  bench       benchmark every op on the GPU (forwards its options to tilefuse.bench)
  precompile  compile the TileLang kernels ahead of time (forwards its options to tilefuse._jit)
"""

# command -> (module, function) for commands implemented elsewhere, imported lazily.
_FORWARDED = {
    "bench": ("tilefuse.bench", "main"),
    "precompile": ("tilefuse._jit", "precompile_main"),
}


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def tilelang_cache_dir() -> str:
    """TileLang's kernel cache: ``$TILELANG_CACHE_DIR``, else TileLang's default ``~/.tilelang/cache``."""
    return os.environ.get("TILELANG_CACHE_DIR") or os.path.expanduser("~/.tilelang/cache")


def _gpu_lines(torch) -> list[str]:
    if not torch.cuda.is_available():
        return ["GPU         none (CUDA tensors unavailable: every op runs its PyTorch reference)"]
    lines = []
    for i in range(torch.cuda.device_count()):
        major, minor = torch.cuda.get_device_capability(i)
        lines.append(f"GPU {i:<7} {torch.cuda.get_device_name(i)} (sm_{major}{minor})")
    return lines


def info(argv: list[str]) -> int:
    """Print versions, GPUs, the TileLang cache and, per area, the path CUDA tensors take for each op."""
    argparse.ArgumentParser(prog="python -m tilefuse info", description=info.__doc__).parse_args(argv)
    import torch

    import tilefuse
    from tilefuse._registry import load_all

    tilelang = _version("tilelang")
    print(f"tilefuse    {tilefuse.__version__}")
    print(f"python      {platform.python_version()}")
    print(f"torch       {torch.__version__} (CUDA {torch.version.cuda or 'none'})")
    print(f"tilelang    {tilelang or 'not installed (CUDA tensors fall back to the references)'}")
    for line in _gpu_lines(torch):
        print(line)
    print(f"cache       {tilelang_cache_dir()}")

    by_area: dict[str, list[tuple[str, str]]] = defaultdict(list)
    for key, entry in load_all().items():
        area, name = key.split(".", 1)
        by_area[area].append((name, entry["path"]))
    total = sum(len(ops) for ops in by_area.values())
    kernels = sum(path == "kernel" for ops in by_area.values() for _, path in ops)
    print(f"\nops         {total} public ops, {kernels} with a TileLang kernel; path taken by CUDA tensors "
          "(CPU tensors always take the reference):")
    for area in sorted(by_area):
        print(f"[{area}]")
        for name, path in sorted(by_area[area]):
            print(f"  {name:<52} {path}")
    return 0


def _forward(command: str, argv: list[str]) -> int:
    module_name, function_name = _FORWARDED[command]
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name != module_name:
            raise
        print(f"tilefuse {command}: not available in this installation ({module_name} is missing)", file=sys.stderr)
        return 2
    function = getattr(module, function_name, None)
    if function is None:
        print(f"tilefuse {command}: not available ({module_name}.{function_name} is missing)", file=sys.stderr)
        return 2
    return int(function(argv) or 0)


def main(argv: list[str] | None = None) -> int:
    """Dispatch ``argv`` (default ``sys.argv[1:]``) to a command; return the exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(USAGE, end="")
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command == "info":
        return info(rest)
    if command == "demo":
        from tilefuse.demo import main as demo_main

        return demo_main(rest)
    if command in _FORWARDED:
        return _forward(command, rest)
    print(f"tilefuse: unknown command {command!r}\n\n{USAGE}", end="", file=sys.stderr)
    return 2
