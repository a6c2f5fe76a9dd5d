"""The command line: ``python -m tilefuse {info, demo, bench, precompile}`` (DESIGN.md).

``info`` and ``demo`` live here and in ``tilefuse.demo``; ``bench`` forwards its arguments to
``tilefuse.bench.cli.main``. ``precompile`` parses its options here, chooses the work list (every registered
config, or with ``--bench`` those the bench launches, from ``tilefuse.bench.runner.bench_configs``) and hands it to
``tilefuse._jit.precompile``: the runtime never imports the bench. Modules are imported only when asked for;
nothing here imports TileLang: ``info`` reads its version from the installed package's metadata.

Every command validates its arguments before any work; a bad one raises ``_cli_errors.UsageError`` (argparse's
own errors included, through ``_cli_errors.ArgumentParser``), which :func:`main` prints as one line to stderr
with exit status 2.
"""
from __future__ import annotations

import importlib
import importlib.metadata
import os
import platform
import re
import sys
from collections import defaultdict

from tilefuse._cli_errors import ArgumentParser, UsageError, one_line

USAGE = """usage: python -m tilefuse <command> [options]

commands:
  info        versions, GPU, TileLang cache, native launcher status, and the path each op takes on CUDA
  demo        a miniature DeepSeek-V4-style block through the public API (python -m tilefuse demo -h)
  bench       benchmark every op on the GPU (python -m tilefuse bench -h; --list and --report need no GPU)
  precompile  compile the TileLang kernels ahead of time (python -m tilefuse precompile -h)
"""

# command -> (module, function) for commands implemented elsewhere, imported lazily.
_FORWARDED = {
    "bench": ("tilefuse.bench.cli", "main"),
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


def _native_line(build: bool) -> str:
    """The native launcher's state; with ``build``, build it first (15-25 s once per torch version)."""
    import time
    import warnings

    from tilefuse import _native

    note = ""
    if build and _native.enabled():
        start = time.perf_counter()
        with warnings.catch_warnings():  # the failure's reason is on this line
            warnings.simplefilter("ignore", RuntimeWarning)
            _native.module()
        note = f" (built or loaded in {time.perf_counter() - start:.1f} s)"
    state, detail = _native.status()
    if state == "not built":
        detail += "; python -m tilefuse info --native builds it now"
    return f"native      {state}: {one_line(detail)}{note}"


def info(argv: list[str]) -> int:
    """Print versions, GPUs, the TileLang cache, the native launcher's state and, per area, the path CUDA
    tensors take for each op."""
    parser = ArgumentParser(prog="python -m tilefuse info",
                            description="Print versions, GPUs, the TileLang cache, the native launcher's state "
                                        "and, per area, the path CUDA tensors take for each op.")
    parser.add_argument("--native", action="store_true",
                        help="build the native launch extension first if it is not built (15-25 s), then report")
    args = parser.parse_args(argv)
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
    print(_native_line(args.native))

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


def precompile(argv: list[str]) -> int:
    """Compile the registered kernel configs (or, with ``--bench``, those the bench launches) into the disk cache."""
    parser = ArgumentParser(prog="python -m tilefuse precompile",
                            description="Compile every registered kernel config into TileLang's disk cache.")
    parser.add_argument("--ops", nargs="*", default=None,
                        help="kernel names (or prefixes) to compile; default: all")
    parser.add_argument("--arch", default=None, help="target arch, e.g. sm_90 (default: current GPU, else sm_90)")
    parser.add_argument("--jobs", type=int, default=max(1, min(8, os.cpu_count() or 1)), help="parallel compiles")
    parser.add_argument("--list", action="store_true", help="list the configs and exit")
    parser.add_argument("--bench", action="store_true",
                        help="only the configs the bench rows launch (of the bench ops named by --ops)")
    parser.add_argument("--force", action="store_true",
                        help="also recompile configs whose library is already in tilefuse's disk cache")
    parser.add_argument("--no-native", action="store_true",
                        help="skip building the native launch extension (tilefuse._native) for this host")
    args = parser.parse_args(argv)
    if args.jobs < 1:
        parser.fail(f"--jobs must be >= 1, got {args.jobs}")
    if args.arch is not None and not re.fullmatch(r"sm_\d+[af]?", args.arch):
        parser.fail(f"--arch must look like sm_90 (sm_ and the compute capability), got {args.arch!r}")
    if args.ops is not None and not args.ops:
        parser.fail("--ops needs at least one name")

    from tilefuse import _jit

    if args.bench:
        from tilefuse.bench.runner import bench_configs

        work = bench_configs(args.ops)
    else:
        names = sorted(_jit.registered())
        unknown = [o for o in args.ops or () if not any(name.startswith(o) for name in names)]
        if unknown:
            parser.fail(f"--ops: no kernel name starts with {', '.join(map(repr, unknown))}; "
                        f"the kernels are: {', '.join(names)}")
        work = _jit.select(args.ops)
    if args.ops and not work:
        parser.fail(f"--ops {' '.join(args.ops)} selects no kernel config")
    if args.list:
        for name, cfg in work:
            print(name, cfg)
        return 0
    return _jit.precompile(work, arch=args.arch, jobs=args.jobs, force=args.force, native=not args.no_native)


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
    """Dispatch ``argv`` (default ``sys.argv[1:]``) to a command; return the exit code. A bad argument
    (``UsageError``) prints one line to stderr and returns 2."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        return _dispatch(argv)
    except UsageError as exc:
        print(one_line(str(exc)), file=sys.stderr)
        return 2


def _dispatch(argv: list[str]) -> int:
    if not argv:
        raise UsageError("python -m tilefuse: error: a command is needed: info, demo, bench or precompile "
                         "(python -m tilefuse --help)")
    if argv[0] in ("-h", "--help", "help"):
        print(USAGE, end="")
        return 0
    command, rest = argv[0], argv[1:]
    if command == "info":
        return info(rest)
    if command == "demo":
        from tilefuse.demo import main as demo_main

        return demo_main(rest)
    if command == "precompile":
        return precompile(rest)
    if command in _FORWARDED:
        return _forward(command, rest)
    raise UsageError(f"python -m tilefuse: error: unknown command {command!r} (commands: info, demo, bench, "
                     "precompile; python -m tilefuse --help)")
