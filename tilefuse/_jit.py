"""The TileLang runtime shared by every kernel: target, compile cache, static-config registry, precompile.

A kernel module registers a *factory* (Python arguments that change the generated code -> a TileLang
``prim_func`` whose token count is symbolic) and the list of static configs the tests and the bench use::

    register("transpose", _transpose_kernel, configs=lambda: [(1,), (2,), (4,)])
    fn = get("transpose", (2,))          # compiled once per process, then a dict lookup
    fn(x, out)                           # launches on torch's current CUDA stream (TVM-FFI)

``import tilelang`` happens on the first compile, never at import time. Compiled binaries land in
TileLang's disk cache (``TILELANG_CACHE_DIR``, default ``~/.tilelang/cache``), so a second process loads
them instead of compiling. Kernels are compiled with fast-math off (IEEE division; quant.md 9.1).

``python -m tilefuse precompile [--ops NAME ...] [--arch sm_90] [--jobs N]`` compiles every registered
config in parallel, with or without a GPU.
"""
from __future__ import annotations

import argparse
import importlib
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from typing import Callable, Hashable, Iterable

import torch

# Kernel modules that register factories here; ``precompile`` imports them all.
KERNEL_MODULES = ("tilefuse.transpose._kernel", "tilefuse.quant._per_token_cast_kernel")

_FACTORIES: dict[str, tuple[Callable, Callable[[], Iterable[tuple]]]] = {}
_COMPILED: dict[tuple, Callable] = {}
_LOCK = threading.Lock()
_DEFAULT_ARCH = "sm_90"
_PASS_CONFIGS = {"tl.enable_fast_math": False}


def register(name: str, factory: Callable, configs: Callable[[], Iterable[tuple]]) -> None:
    """Record a kernel factory and a callable listing its static configs (tuples of factory args)."""
    _FACTORIES[name] = (factory, configs)


def registered() -> dict[str, list[tuple]]:
    """Every registered kernel with its static configs (imports all kernel modules)."""
    for mod in KERNEL_MODULES:
        importlib.import_module(mod)
    return {name: list(cfgs()) for name, (_, cfgs) in _FACTORIES.items()}


def current_arch() -> str:
    """``sm_XY`` of the current CUDA device, or sm_90 without a GPU."""
    if torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability()
        return f"sm_{major}{minor}"
    return _DEFAULT_ARCH


def compile_kernel(name: str, config: tuple, arch: str | None = None):
    """Compile (or load from TileLang's disk cache) one static config; returns the ``JITKernel``."""
    import tilelang

    factory, _ = _FACTORIES[name]
    return tilelang.compile(
        factory(*config),
        target={"kind": "cuda", "arch": arch or current_arch()},
        execution_backend="tvm_ffi",
        pass_configs=dict(_PASS_CONFIGS),
    )


def _launcher(kernel) -> Callable:
    """The cheapest callable for a compiled kernel: the TVM-FFI executable taking (inputs..., outputs...).

    All our kernels take their outputs as arguments (no ``out_idx``), so the executable can be called
    directly; it reads torch's current stream through the DLPack exchange API.
    """
    adapter = getattr(kernel, "adapter", None)
    get_exe = getattr(adapter, "get_exportable_executable", None)
    if get_exe is not None:
        try:
            return get_exe()
        except Exception:  # pragma: no cover - older/newer adapters: fall back to the JITKernel call
            pass
    return kernel


def get(name: str, config: tuple) -> Callable:
    """The launch callable of ``name`` at ``config`` for the current device, compiled on first use."""
    key = (name, config)
    fn = _COMPILED.get(key)
    if fn is None:
        with _LOCK:
            fn = _COMPILED.get(key)
            if fn is None:
                fn = _launcher(compile_kernel(name, config))
                _COMPILED[key] = fn
    return fn


def get_jit_kernel(name: str, config: tuple):
    """The ``JITKernel`` object itself (for benchmarks of a bare TileLang call and for source dumps)."""
    return compile_kernel(name, config)


def precompile_main(argv: list[str]) -> int:
    """``python -m tilefuse precompile``: compile every registered static config in parallel."""
    parser = argparse.ArgumentParser(prog="python -m tilefuse precompile",
                                     description="Compile every registered kernel config into TileLang's disk cache.")
    parser.add_argument("--ops", nargs="*", default=None,
                        help="kernel names (or prefixes) to compile; default: all")
    parser.add_argument("--arch", default=None, help="target arch, e.g. sm_90 (default: current GPU, else sm_90)")
    parser.add_argument("--jobs", type=int, default=max(1, min(8, os.cpu_count() or 1)), help="parallel compiles")
    parser.add_argument("--list", action="store_true", help="list the configs and exit")
    args = parser.parse_args(argv)

    work = [(name, cfg) for name, cfgs in registered().items() for cfg in cfgs
            if not args.ops or any(name.startswith(o) for o in args.ops)]
    if args.list:
        for name, cfg in work:
            print(name, cfg)
        return 0
    arch = args.arch or current_arch()
    try:
        from tqdm.auto import tqdm
    except ImportError:  # pragma: no cover
        tqdm = None
    start = time.perf_counter()
    failures = []
    bar = tqdm(total=len(work), desc=f"precompile {arch}", unit="kernel") if tqdm else None
    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        futures = {pool.submit(compile_kernel, name, cfg, arch): (name, cfg) for name, cfg in work}
        for fut in as_completed(futures):
            try:
                fut.result()
            except Exception as exc:  # report every failure, keep compiling the others
                failures.append((futures[fut], exc))
            if bar:
                bar.update(1)
    if bar:
        bar.close()
    print(f"compiled {len(work) - len(failures)}/{len(work)} kernels for {arch} in "
          f"{time.perf_counter() - start:.1f} s")
    for (name, cfg), exc in failures:
        print(f"FAILED {name} {cfg}: {type(exc).__name__}: {exc}")
    return 1 if failures else 0
