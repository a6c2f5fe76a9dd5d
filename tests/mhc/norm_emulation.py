"""Run the CUDA source that TileLang generates for the norm-weight merge and the reduce/RMS kernels on the CPU (not a
test module).

The kernel function is compiled by g++ with ``post_emulation``'s shim plus ``__fadd_rn`` and ``__fdiv_rn`` (one
IEEE-rounded fp32 operation each, no contraction) and ``rsqrtf`` as ``1 / sqrt`` in double rounded once to fp32
(CUDA's ``rsqrtf`` is within 2 ulp of that, so an output that passes through it is compared with a bound; every
other output bit for bit). These kernels exchange nothing between threads, so the threads of each CTA run one
after another. Scalar parameters (the row or token count, fp32 constants) are passed by value.
"""
import ctypes
import re
from pathlib import Path

from tests.mhc import post_emulation as emu

HAS_GXX = emu.HAS_GXX

EXTRA = r"""
static inline float __fadd_rn(float a, float b) { volatile float r = a + b; return r; }
static inline float __fdiv_rn(float a, float b) { volatile float r = a / b; return r; }
static inline float rsqrtf(float x) { return (float)(1.0 / std::sqrt((double)x)); }
"""

_SCALARS = {"int64_t": ctypes.c_int64, "float": ctypes.c_float, "int": ctypes.c_int32}


def build(src: str, name: str, threads: int, workdir: Path):
    """Compile the ``__global__`` function ``name`` of ``src`` for the CPU; returns ``run(args: dict, blocks)``,
    which binds tensors (CPU, contiguous) and Python numbers by the kernel's parameter names."""
    body = src[src.index('extern "C" __global__ void __launch_bounds__'):]
    params = [p.replace("__restrict__", "").replace("const ", "").strip()
              for p in re.search(re.escape(name) + r"\(([^)]*)\)", body).group(1).split(",")]
    decl = [(p.rsplit(" ", 1)[0].strip(), p.rsplit(" ", 1)[1]) for p in params]
    cargs = ", ".join(f"void* {a}" if t.endswith("*") else f"{t} {a}" for t, a in decl)
    call = ", ".join(f"({t}){a}" if t.endswith("*") else a for t, a in decl)
    cpp = emu.SHIM + EXTRA + body.replace('extern "C" __global__', "static") + f"""
extern "C" void run({cargs}, int64_t blocks) {{
  for (int64_t b = 0; b < blocks; ++b) for (unsigned t = 0; t < {threads}; ++t) {{
    blockIdx.x = b; threadIdx.x = t; {name}({call});
  }}
}}
"""
    fn = emu.compile_run(cpp, name, workdir)

    def run(args: dict, blocks: int) -> None:
        values = []
        for t, a in decl:
            v = args[a]
            if t.endswith("*"):
                assert v.device.type == "cpu" and v.is_contiguous(), a
                values.append(ctypes.c_void_p(v.data_ptr()))
            else:
                values.append(_SCALARS[t](v))
        fn(*values, ctypes.c_int64(blocks))

    return run
