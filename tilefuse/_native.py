"""Native launch plans: a kernel's output allocation and launch in one C++ call (``_native.cc``).

An eager call of a quant op at one row spends most of its host time in two ``torch.empty_strided`` calls
and the TVM-FFI call's argument conversion. A :func:`plan` does both in C++ through ATen and the TVM-FFI C
API: the outputs are ordinary torch tensors from the caching allocator, the kernel launches on torch's
current stream. The extension is built on first use with the host compiler against the installed torch,
Python and tvm_ffi headers (about 20 s), cached next to the kernel libraries (``_cache.cache_dir()``) and
keyed by its source and those versions; ``python -m tilefuse precompile`` and ``python -m tilefuse info
--native`` build it too. It compiles with the C++ standard torch itself was built with (``torch.__config__``;
torch's headers need it: C++17 for torch 2.11, C++20 for 2.13 and 2.14). Where there is no host compiler or
``TILEFUSE_NATIVE=0``, :func:`plan` returns None and the launchers keep their Python path, which computes the
same outputs. A build that fails with a compiler present also falls back, but warns (``RuntimeWarning``) and
leaves its reason beside the library, where :func:`status` (``python -m tilefuse info``) reports it.
"""
from __future__ import annotations

import hashlib
import importlib.machinery
import importlib.util
import os
import re
import shlex
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import threading
import warnings

from tilefuse._cache import cache_dir

_SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_native.cc")
_NAME = "tilefuse_native"
_LOCK = threading.Lock()
_STATE: dict = {}  # "module": the loaded extension or None once tried; "error": why it is None


def enabled() -> bool:
    return os.environ.get("TILEFUSE_NATIVE", "1") != "0"


def compiler() -> list[str] | None:
    """The host C++ compiler command (``$CXX``, else ``c++``), or None when it is not on the PATH."""
    cmd = shlex.split(os.environ.get("CXX") or "c++")
    return cmd if cmd and shutil.which(cmd[0]) else None


# __cplusplus of each standard, newest first; GCC before 14 reports C++23 as 202100
_STANDARDS = ((202100, "c++23"), (202002, "c++20"), (201703, "c++17"))


def cxx_std() -> str:
    """The ``-std=`` value for the installed torch: the standard torch was compiled with, as its build config
    states it (``C++ Version: 202002``). Its headers may use everything of that standard (torch 2.14's use C++20
    ``requires`` clauses), and ``torch.utils.cpp_extension`` builds extensions with the same one. C++20 where
    the config does not say."""
    import torch

    m = re.search(r"C\+\+ Version: (\d+)", torch.__config__.show())
    if m:
        for value, std in _STANDARDS:
            if int(m.group(1)) >= value:
                return std
    return "c++20"


def _flags() -> tuple[list[str], list[str]]:
    """Include paths, compile and link flags for the installed torch, Python and tvm_ffi."""
    import torch
    import tvm_ffi.libinfo
    from torch.utils import cpp_extension

    inc = cpp_extension.include_paths() + tvm_ffi.libinfo.include_paths() + [sysconfig.get_paths()["include"]]
    libs = cpp_extension.library_paths() + [os.path.dirname(tvm_ffi.libinfo.find_libtvm_ffi())]
    cflags = [f"-I{p}" for p in inc] + [
        "-O2", f"-std={cxx_std()}", "-fPIC", "-shared", "-fvisibility=hidden", "-w",
        f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
        f"-DTORCH_EXTENSION_NAME={_NAME}", "-DTORCH_API_INCLUDE_EXTENSION_H",
    ]
    ldflags = [f"-L{p}" for p in libs] + [f"-Wl,-rpath,{p}" for p in libs] + [
        "-lc10", "-ltorch", "-ltorch_cpu", "-ltorch_python", "-ltvm_ffi"]
    return cflags, ldflags


def lib_path() -> str:
    """Where the built extension lives: keyed by its source and the versions it binds."""
    import torch
    import tvm_ffi

    with open(_SOURCE, "rb") as f:
        src = f.read()
    # not _flags(): importing torch.utils.cpp_extension costs a cold start more than the rest of a first call
    key = hashlib.sha256(repr((src, torch.__version__, torch._C._GLIBCXX_USE_CXX11_ABI, sys.version,
                               tvm_ffi.__version__)).encode())
    return os.path.join(cache_dir(), f"{_NAME}-{key.hexdigest()[:24]}.so")


def _first_error(text: str) -> str:
    """The compiler's first ``error:`` line of ``text`` (else its first non-empty line), for a one-line reason."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return next((line for line in lines if "error:" in line), lines[0] if lines else "no output")


def build(path: str | None = None) -> str:
    """Compile the extension to ``path`` (default :func:`lib_path`) unless it is there; returns the path.
    Concurrent builders (pytest workers) wait on a file lock and reuse the first one's library. Raises
    RuntimeError naming the compiler's first error, the compiler's stderr tail following it."""
    import fcntl

    path = path or lib_path()
    if os.path.exists(path):
        return path
    cxx = compiler()
    if cxx is None:
        raise RuntimeError(f"no C++ compiler: {os.environ.get('CXX') or 'c++'} is not on the PATH (set CXX)")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if os.path.exists(path):
            return path
        cflags, ldflags = _flags()
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=os.path.dirname(path))
        os.close(fd)
        try:
            cmd = [*cxx, _SOURCE, "-o", tmp, *cflags, *ldflags]
            proc = subprocess.run(cmd, capture_output=True, text=True)
            if proc.returncode != 0:
                raise RuntimeError(f"{cxx[0]} -std={cxx_std()} failed on {os.path.basename(_SOURCE)}: "
                                   f"{_first_error(proc.stderr)}\n{proc.stderr[-2000:]}")
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    return path


def _error_path(path: str) -> str:
    """Where a failed build or load leaves its reason, beside the library it was to be."""
    return path + ".error"


def module():
    """The loaded extension, built on first use; None when disabled or when it cannot be built or loaded.
    Without a compiler that is silent; a failure with a compiler present warns once (``RuntimeWarning``) and
    leaves its reason beside the library for :func:`status`. The reason is in ``error()``."""
    if "module" in _STATE:
        return _STATE["module"]
    with _LOCK:
        if "module" not in _STATE:
            mod = None
            if not enabled():
                _STATE["error"] = "disabled by TILEFUSE_NATIVE=0"
            else:
                path = None
                try:
                    import torch  # noqa: F401  (the extension links libtorch_python)

                    path = lib_path()
                    if compiler() is None and not os.path.exists(path):
                        _STATE["error"] = (f"no C++ compiler ({os.environ.get('CXX') or 'c++'} is not on the "
                                           "PATH; set CXX)")
                    else:
                        build(path)
                        loader = importlib.machinery.ExtensionFileLoader(_NAME, path)
                        spec = importlib.util.spec_from_file_location(_NAME, path, loader=loader)
                        mod = importlib.util.module_from_spec(spec)
                        loader.exec_module(mod)
                        if os.path.exists(_error_path(path)):
                            os.unlink(_error_path(path))
                except Exception as exc:  # a broken build or load: the Python launch path serves, loudly
                    _STATE["error"] = f"{type(exc).__name__}: {str(exc)[:1500]}"
                    if path is not None:
                        try:
                            with open(_error_path(path), "w") as f:
                                f.write(_STATE["error"])
                        except OSError:
                            pass
                    warnings.warn(f"tilefuse: native launcher unavailable, using the Python launch path "
                                  f"({_STATE['error']})", RuntimeWarning, stacklevel=2)
                    mod = None
            _STATE["module"] = mod
    return _STATE["module"]


def error() -> str | None:
    return _STATE.get("error")


def status() -> tuple[str, str]:
    """``(state, detail)`` of the extension for this host, without building it: ``ready`` (built; detail: the
    library), ``not built`` (it builds on first use), ``failed`` (the last build or load failed; detail: its
    reason, first line), ``no compiler`` or ``disabled``. A build tried in this process answers for itself."""
    if not enabled():
        return "disabled", "TILEFUSE_NATIVE=0: the launchers take their Python path"
    if "module" in _STATE:
        if _STATE["module"] is not None:
            return "ready", lib_path()
        reason = _STATE.get("error") or "unknown"
        return ("no compiler" if reason.startswith("no C++ compiler") else "failed"), reason.splitlines()[0]
    try:
        path = lib_path()
    except Exception as exc:  # torch or tvm_ffi missing or broken: nothing to build against
        return "failed", f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    if not os.path.exists(path) and compiler() is None:
        return "no compiler", (f"{os.environ.get('CXX') or 'c++'} is not on the PATH (set CXX): the launchers "
                               "take their Python path")
    if os.path.exists(_error_path(path)):
        with open(_error_path(path)) as f:
            return "failed", f.read().splitlines()[0]
    if os.path.exists(path):
        return "ready", path
    return "not built", "it builds on first use (15-25 s)"


def _is_ffi(fn) -> bool:
    """A TVM-FFI function (what the plans call through the C API); a stand-in recorder is not."""
    return type(fn).__module__ == "tvm_ffi.core" and hasattr(fn, "__chandle__")


# output layouts and kernel views of ``plan`` (see _native.cc)
ROW, COL_TIGHT, COL_STORAGE = 0, 1, 2
SAME, STORAGE, STORAGE_BYTES, WORDS = 0, 1, 2, 3


def plan(fn, x_dtype, align_bytes: int, row_multiple: int, outputs, x_kdtype=None) -> object | None:
    """A callable ``plan(x, t)`` for inputs of ``x_dtype``: allocates ``outputs``, copies ``x`` to contiguous
    rows where ``x.data_ptr() % align_bytes`` or (for t > 1) ``x.stride(0) % row_multiple``, and launches
    ``fn(x, outputs...)`` when t > 0 (the kernel reads x as ``x_kdtype`` words when given); returns the
    output, or a tuple of them. Each output is ``(cols, dtype, col_major)`` -- ``(t, cols)``, row-major or
    column-major with the column stride rounded up to 4 rows (minimal storage) -- or the full
    ``(cols, dtype, layout, row_div, kview, kdtype)`` of ``_native.cc`` (``ceil(t / row_div)`` rows; layout
    ROW / COL_TIGHT / COL_STORAGE; the kernel gets SAME / STORAGE / STORAGE_BYTES / WORDS). None when the
    extension is unavailable or ``fn`` is not a TVM-FFI function (a stand-in recorder, say)."""
    if not _is_ffi(fn):
        return None
    mod = module()
    if mod is None:
        return None
    outs = [o if len(o) == 6 else (o[0], o[1], COL_TIGHT if o[2] else ROW, 1, SAME, o[1]) for o in outputs]
    return mod.Plan(fn, align_bytes, row_multiple, [tuple(o) for o in outs], x_kdtype or x_dtype)


# sf kinds of ``norm_plan`` (see NormPlan in _native.cc)
NORM_SF = {None: -1, "row": 0, "row_packed": 1, "col": 2, "col_packed": 3}


def norm_plan(fn, hidden: int, x_dtype, out_dtype, sf_layout: str | None, has_weight: bool,
              with_rstd: bool) -> object | None:
    """A callable ``plan(x, weight, eps, out_scale) -> (out, sf or None, rstd or None)`` for the RMSNorm forward
    kernel ``fn`` of one config without residual, bf16 copy or mega-MoE sf (2-D x): its outputs allocated and the
    kernel launched in one C++ call. None when the extension is unavailable or ``fn`` is not a TVM-FFI function."""
    if not _is_ffi(fn):
        return None
    mod = module()
    if mod is None:
        return None
    return mod.NormPlan(fn, hidden, x_dtype, out_dtype, NORM_SF[sf_layout], has_weight, with_rstd)


def norm_backward_plan(fn, reduce, hidden: int, partials: int) -> object | None:
    """A callable ``plan(out_grad, x, weight, rstd, out_scale) -> (x_grad, weight_grad or None)`` for the RMSNorm
    backward's dx kernel ``fn`` and (with a weight) its assigning weight-gradient reduce ``reduce`` (None without
    a weight), for calls without residual_out_grad or a given weight_grad. None when the extension is unavailable
    or the kernels are not TVM-FFI functions."""
    if not (_is_ffi(fn) and (reduce is None or _is_ffi(reduce))):
        return None
    mod = module()
    if mod is None:
        return None
    return mod.NormBackwardPlan(fn, reduce, hidden, partials)


# parameter kinds of ``arg_plan`` (see ArgPlan in _native.cc)
INPUT, HELD, OUTPUT, FLOAT, INT = 0, 1, 2, 3, 4


def arg_plan(fn, slots, held, outs, floats, align_bytes: int) -> object | None:
    """A callable ``plan(x, x2, t)`` for a kernel ``fn`` of many parameters at one call pattern: ``slots`` gives
    each parameter as ``(kind, index)`` -- INPUT 0 (x) or 1 (x2, or None when unused), HELD (a tensor of
    ``held``), OUTPUT (``outs[index] = (cols, dtype)``, allocated ``(t, cols)``), FLOAT (``floats[index]``) or
    ``(INT, value)``. Returns the output, or a tuple of them. None when the extension is unavailable or ``fn``
    is not a TVM-FFI function."""
    if not _is_ffi(fn):
        return None
    mod = module()
    if mod is None:
        return None
    return mod.ArgPlan(fn, [tuple(s) for s in slots], list(held), [tuple(o) for o in outs], list(floats), align_bytes)
