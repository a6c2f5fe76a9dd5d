"""Run the CUDA source that TileLang generates for the norm-weight merge, the reduce/RMS kernels and the TF32
rounding of the projection's backward operands on the CPU (not a test module).

The kernel function is compiled by g++ with ``post_emulation``'s shim plus ``rsqrtf`` as ``1 / sqrt`` in double
rounded once to fp32 (CUDA's ``rsqrtf`` is within 2 ulp of that, so an output that passes through it is compared with a bound; every
other output bit for bit). These kernels exchange nothing between threads, so the threads of each CTA run one
after another. Scalar parameters (the row or token count, fp32 constants) are passed by value.
"""
import ctypes
from pathlib import Path

from tests.cuda_emulation import signature, values
from tests.mhc import post_emulation as emu

HAS_GXX = emu.HAS_GXX

EXTRA = r"""
static inline float rsqrtf(float x) { return (float)(1.0 / std::sqrt((double)x)); }
"""


def build(src: str, name: str, threads: int, workdir: Path):
    """Compile the ``__global__`` function ``name`` of ``src`` for the CPU; returns ``run(args: dict, blocks)``,
    which binds tensors (CPU, contiguous) and Python numbers by the kernel's parameter names."""
    body = src[src.index('extern "C" __global__ void __launch_bounds__'):]
    decl, cargs, call = signature(body, name)
    cpp = emu.SHIM + EXTRA + body.replace('extern "C" __global__', "static") + f"""
extern "C" void run({cargs}, int64_t blocks) {{
  for (int64_t b = 0; b < blocks; ++b) for (unsigned t = 0; t < {threads}; ++t) {{
    blockIdx.x = b; threadIdx.x = t; {name}({call});
  }}
}}
"""
    fn = emu.compile_run(cpp, name, workdir)

    def run(args: dict, blocks: int) -> None:
        fn(*values(decl, args), ctypes.c_int64(blocks))

    return run
