"""The TileLang runtime shared by every kernel: target, compile cache, static-config registry, precompile.

A kernel module registers a *factory* (Python arguments that change the generated code -> a TileLang
``prim_func`` whose token count is symbolic) and the list of static configs that ``precompile`` builds: those the
package launches for the bench (any other config, a test's included, compiles on its first use)::

    register("transpose", _transpose_kernel, configs=lambda: [(1,), (2,), (4,)])
    fn = get("transpose", (2,))          # compiled once per process, then a dict lookup
    fn(x, out)                           # launches on torch's current CUDA stream (TVM-FFI)

``import tilelang`` happens on the first compile, never at import time. Every compiled kernel is also
exported as a shared library into tilefuse's own disk cache (``TILEFUSE_CACHE_DIR``, default
``<TILELANG_CACHE_DIR or ~/.tilelang/cache>/tilefuse``), keyed by the kernel name, its static config, the
target arch, the TileLang version and a digest of the kernel module's source. A later process loads that
library through TVM-FFI and TileLang's runtime libraries, without importing TileLang or rebuilding the
``prim_func``: a warm start costs tens of milliseconds. Kernels are compiled with fast-math off (IEEE
division; quant.md 9.1).

``precompile(work, arch, jobs)`` compiles a list of ``(name, config)`` pairs in parallel, with or without a
GPU; ``python -m tilefuse precompile`` (``tilefuse.cli``) chooses that list.
"""
from __future__ import annotations

import ast
import ctypes
import hashlib
import importlib
import importlib.util
import os
import shutil
import sys
import tempfile
import threading
import time
import multiprocessing
from concurrent.futures import ProcessPoolExecutor, as_completed
from typing import Callable, Iterable

import torch

from tilefuse._cache import cache_dir

# Kernel modules that register factories here; ``precompile`` imports them all.
KERNEL_MODULES = (
    "tilefuse.transpose._kernel",
    "tilefuse.quant._per_token_cast_kernel",
    "tilefuse.quant._per_block_cast_kernel",
    "tilefuse.quant._cast_back_kernel",
    "tilefuse.quant._e5m6_kernel",
    "tilefuse.quant._per_channel_cast_kernel",
    "tilefuse.quant._swiglu_kernel",
    "tilefuse.quant._norm_kernel",
    "tilefuse.quant._weight_sf_kernel",
    "tilefuse.quant._cast_and_cast_back_kernel",
    "tilefuse.moe._topk_kernel",
    "tilefuse.moe._top2_sum_gate_kernel",
    "tilefuse.moe._moe_gate_kernel",
    "tilefuse.moe._mapping_kernel",
    "tilefuse.moe._shuffle_kernel",
    "tilefuse.moe._count_kernel",
    "tilefuse.transform._rotary_kernel",
    "tilefuse.mhc._sinkhorn_kernel",
    "tilefuse.mhc._post_kernel",
    "tilefuse.mhc._mix_kernel",
    "tilefuse.mhc._expand_kernel",
    "tilefuse.mhc._apply_mix_kernel", "tilefuse.mhc._normw_kernel", "tilefuse.mhc._reduce_norm_kernel",
    "tilefuse.mhc._norm_fn_kernel", "tilefuse.mhc._recompute_kernel", "tilefuse.mhc._pre_mixes_kernel",
    "tilefuse.engram._hash_kernel", "tilefuse.engram._sinkhorn_kernel", "tilefuse.engram._gate_fwd_kernel",
    "tilefuse.engram._gate_bwd_kernel",
)

# Modules of TileLang helpers that kernels import: their source is part of every kernel's cache key. A helper
# that only some kernel modules import is named by those modules instead, in their ``KERNEL_HELPERS`` tuple.
SHARED_KERNEL_MODULES = ("tilefuse.quant._tl",)

_FACTORIES: dict[str, tuple[Callable, Callable[[], Iterable[tuple]]]] = {}
_COMPILED: dict[tuple, Callable] = {}
_LOCK = threading.Lock()
_DEFAULT_ARCH = "sm_90"
_PASS_CONFIGS = {"tl.enable_fast_math": False}


def register(name: str, factory: Callable, configs: Callable[[], Iterable[tuple]]) -> None:
    """Record a kernel factory and a callable listing its static configs (tuples of factory args). The
    source digest of its module (part of the cache key) is taken now, while the module is being imported,
    so the key describes the code this process runs even if the file is edited later. Tuning overrides of
    the module's constants (``TILEFUSE_KNOBS``, see ``knobs``) are applied now too, and are part of the key."""
    _FACTORIES[name] = (factory, configs)
    module = sys.modules.get(factory.__module__)
    for attr, value in knobs(factory.__module__).items():
        if module is None or not hasattr(module, attr):
            raise ValueError(f"TILEFUSE_KNOBS: {factory.__module__} has no constant {attr}")
        setattr(module, attr, value)
    _module_digest(factory.__module__)


def knobs(mod: str) -> dict:
    """Overrides of kernel module ``mod``'s tuning constants from the environment, for benchmark sweeps:
    ``TILEFUSE_KNOBS="tilefuse.quant._cast_back_kernel.THREADS=64;<module>.<NAME>=<python literal>"``.
    A knob must only change how a kernel is tiled or scheduled, never its results (the GPU tier runs with
    the defaults). Empty unless set."""
    text = os.environ.get("TILEFUSE_KNOBS", "")
    out = {}
    for item in filter(None, (t.strip() for t in text.split(";"))):
        target, _, value = item.partition("=")
        owner, _, attr = target.strip().rpartition(".")
        if owner == mod:
            out[attr] = ast.literal_eval(value.strip())
    return out


def _module_digest(mod: str) -> str:
    """sha256 prefix of TileLang's version, the kernel module's source and its helper modules' (the shared ones
    and the module's own ``KERNEL_HELPERS``)."""
    digest = _DIGESTS.get(mod)
    if digest is None:
        h = hashlib.sha256(_tilelang_version().encode())
        h.update(repr(sorted(knobs(mod).items())).encode())
        own = getattr(sys.modules.get(mod), "KERNEL_HELPERS", ())
        for m in (mod, *SHARED_KERNEL_MODULES, *own):
            spec = importlib.util.find_spec(m)
            with open(spec.origin, "rb") as f:
                h.update(f.read())
        digest = _DIGESTS[mod] = h.hexdigest()[:16]
    return digest


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


def compile_kernel(name: str, config: tuple, arch: str | None = None, export: bool = True):
    """Compile (or load from TileLang's disk cache) one static config and, unless ``export`` is False, export
    its library into tilefuse's disk cache; returns the ``JITKernel``."""
    try:
        import tilelang
    except ImportError as exc:
        raise ImportError(f"tilefuse: compiling the {name} kernel needs TileLang (pip install tilelang==0.1.15)") from exc

    factory, _ = _FACTORIES[name]
    arch = arch or current_arch()
    kernel = tilelang.compile(
        factory(*config),
        target={"kind": "cuda", "arch": arch},
        execution_backend="tvm_ffi",
        pass_configs=dict(_PASS_CONFIGS),
    )
    if export:
        _export(kernel, _lib_path(name, config, arch))
    return kernel


_DIGESTS: dict[str, str] = {}


def _tilelang_version() -> str:
    """TileLang's installed version (part of every cache key), or "absent": then nothing cached matches and a
    compile is attempted, which fails with ImportError naming TileLang."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("tilelang")
    except PackageNotFoundError:
        return "absent"


def _lib_path(name: str, config: tuple, arch: str) -> str:
    """Where the exported library of ``name`` at ``config`` for ``arch`` lives in tilefuse's disk cache."""
    digest = _module_digest(_FACTORIES[name][0].__module__)
    key = hashlib.sha256(repr((name, config, arch, sorted(_PASS_CONFIGS.items()), digest)).encode()).hexdigest()
    return os.path.join(cache_dir(), f"{name}-{arch}-{key[:24]}.so")


def _export(kernel, path: str) -> None:
    """Write the kernel's host + device library to ``path``, atomically (concurrent writers are harmless)."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=os.path.dirname(path))
    os.close(fd)
    try:
        cached = getattr(kernel.adapter, "libpath", None)  # loaded from TileLang's own cache: copy that file
        if cached and os.path.exists(cached):
            shutil.copyfile(cached, tmp)
        else:
            kernel.adapter.get_exportable_executable().export_library(tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


_RUNTIME_LOADED = False


def _load_runtime() -> None:
    """Let TVM-FFI load CUDA kernel libraries: load TileLang's runtime libraries, without ``import tilelang``."""
    global _RUNTIME_LOADED
    if _RUNTIME_LOADED:
        return
    spec = importlib.util.find_spec("tilelang")
    libdir = os.path.join(list(spec.submodule_search_locations)[0], "lib") if spec else ""
    libs = [os.path.join(libdir, n) for n in ("libtvm_runtime.so", "libtilelang.so")]
    if all(os.path.exists(p) for p in libs):
        import tvm_ffi  # noqa: F401  (loads libtvm_ffi first)

        for p in libs:
            ctypes.CDLL(p, mode=ctypes.RTLD_GLOBAL | os.RTLD_LAZY)
    else:  # another install layout: let TileLang load its libraries
        import tilelang  # noqa: F401
    _RUNTIME_LOADED = True


def _load(path: str) -> Callable:
    """The entry function of an exported kernel library: a TVM-FFI function taking (inputs..., outputs...).

    All our kernels take their outputs as arguments (no ``out_idx``); the function launches on torch's
    current stream, which it reads through the DLPack exchange API.
    """
    import tvm_ffi

    _load_runtime()
    return tvm_ffi.load_module(path)["main"]


def get(name: str, config: tuple) -> Callable:
    """The launch function of ``name`` at ``config`` for the current device: loaded from the disk cache, or
    compiled (and exported there) on first use; later calls cost a dict lookup."""
    key = (name, config)
    fn = _COMPILED.get(key)
    if fn is None:
        with _LOCK:
            fn = _COMPILED.get(key)
            if fn is None:
                arch = current_arch()
                path = _lib_path(name, config, arch)
                if not os.path.exists(path):
                    compile_kernel(name, config, arch)
                fn = _load(path)
                _COMPILED[key] = fn
    return fn


def get_jit_kernel(name: str, config: tuple):
    """The ``JITKernel`` object itself (for benchmarks of a bare TileLang call and for source dumps)."""
    return compile_kernel(name, config, export=False)


def _compile_one(name: str, config: tuple, arch: str) -> None:
    if name not in _FACTORIES:  # a fresh (spawned) worker: import the kernel modules first
        registered()
    compile_kernel(name, config, arch)


def compile_many(work: list[tuple[str, tuple]], arch: str, jobs: int, progress: bool = False) -> list:
    """Compile and export ``(name, config)`` pairs in ``jobs`` worker processes (lowering holds the GIL, so
    threads would not overlap; workers are spawned, never forked from a process that holds CUDA); returns ``[((name, config), error message)]`` for the failures."""
    bar = None
    if progress:
        try:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(work), desc=f"precompile {arch}", unit="kernel")
        except ImportError:  # pragma: no cover
            pass
    failures = []
    with ProcessPoolExecutor(max_workers=jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
        futures = {pool.submit(_compile_one, name, cfg, arch): (name, cfg) for name, cfg in work}
        for fut in as_completed(futures):
            try:
                fut.result()
            except Exception as exc:  # report every failure, keep compiling the others
                failures.append((futures[fut], f"{type(exc).__name__}: {str(exc)[:500]}"))
            if bar:
                bar.update(1)
    if bar:
        bar.close()
    return failures


def select(ops: list[str] | None = None) -> list[tuple[str, tuple]]:
    """Every registered ``(name, config)`` pair, or only those whose kernel name starts with one of ``ops``."""
    return [(name, cfg) for name, cfgs in registered().items() for cfg in cfgs
            if not ops or any(name.startswith(o) for o in ops)]


def precompile(work: list[tuple[str, tuple]], arch: str | None = None, jobs: int = 1, force: bool = False,
               native: bool = True) -> int:
    """Compile and export the ``(name, config)`` pairs of ``work`` for ``arch`` (default: the current GPU, else
    sm_90) in ``jobs`` processes, skipping those already in tilefuse's disk cache unless ``force``; with
    ``native``, also build the native launch extension. Prints a summary; returns 1 if a compile failed, else 0.
    The command line (``python -m tilefuse precompile``, ``tilefuse.cli``) chooses the work list."""
    arch = arch or current_arch()
    cached = 0 if force else sum(os.path.exists(_lib_path(n, c, arch)) for n, c in work)
    if not force:
        work = [(n, c) for n, c in work if not os.path.exists(_lib_path(n, c, arch))]
    start = time.perf_counter()
    failures = compile_many(work, arch, jobs, progress=True) if work else []
    print(f"compiled {len(work) - len(failures)}/{len(work)} kernels for {arch} in "
          f"{time.perf_counter() - start:.1f} s ({cached} already in the disk cache)")
    for (name, cfg), exc in failures:
        print(f"FAILED {name} {cfg}: {exc}")
    if native:
        from tilefuse import _native

        start = time.perf_counter()
        mod = _native.module()
        print(f"native launcher: {'ready' if mod is not None else 'unavailable'} "
              f"({time.perf_counter() - start:.1f} s){'' if mod is not None else ': ' + str(_native.error())}")
    return 1 if failures else 0
