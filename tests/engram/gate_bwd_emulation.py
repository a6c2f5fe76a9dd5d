"""Run the CUDA source that TileLang generates for the gate backward and grad_w_reduce kernels on the CPU (not a
test module).

g++ compiles the ``__global__`` function with a shim: ``bfloat16_t`` rounding to nearest even, the vector types
(no alignment demands), ``__f*_rn`` as one IEEE-rounded fp32 operation each (``-ffp-contract=off``, ``std::fmaf``,
``std::sqrt``), dynamic shared memory as one host buffer (filled with NaN bytes before each CTA), static shared
memory as function statics, and every thread of a CTA as a host thread: ``__syncthreads`` is a barrier of the CTA,
``__syncwarp`` a barrier of the warp, ``__shfl_xor_sync`` an exchange through 32 slots of the warp between two
barriers of the warp, ``cp.async`` as the PTX states it (``cuda_emulation.CP_ASYNC``: a read before its wait sees
NaN). CTAs run one after another. So the CPU computes what the GPU
computes, bit for bit, and checks the kernels' indexing, chunking, barriers and reductions without a GPU.
"""
import ctypes
import re
from pathlib import Path

import torch

from tests.cuda_emulation import HAS_GXX  # noqa: F401 (re-exported)
from tests.cuda_emulation import CP_ASYNC, CTA_EXCHANGE, PREAMBLE, compile_run, launch_loop, signature, values

SHIM = PREAMBLE + r"""
struct uint4 { uint x, y, z, w; };
struct uint2 { uint x, y; };
struct float4 { float x, y, z, w; };
static inline float4 make_float4(float a, float b, float c, float d) { return float4{a, b, c, d}; }
static uchar g_smem[232448] __attribute__((aligned(1024)));
#define __shared__ static
""" + CTA_EXCHANGE + r"""
static inline void __syncwarp() { g_wbar[threadIdx.x / 32]->arrive_and_wait(); }
""" + CP_ASYNC


def build(src: str, name: str, threads: int, workdir: Path):
    """Compile the ``__global__`` function ``name`` of ``src`` for the CPU, run with ``threads`` threads a CTA;
    returns ``run(args: dict, blocks)``, which binds CPU tensors (any strides: the kernel is given their data
    pointers, its stride arguments come from ``args``) and Python numbers by the kernel's parameter names."""
    assert threads % 32 == 0 and threads <= 1024, threads
    body = src[src.index('extern "C" __global__ void __launch_bounds__'):]
    body = re.sub(r"extern __shared__ [^;]*buf_dyn_shmem\[\];", "uchar* buf_dyn_shmem = g_smem;", body)
    decl, cargs, call = signature(body, name)
    cpp = SHIM + body.replace('extern "C" __global__', "static") + f"""
extern "C" void run({cargs}, int64_t blocks) {{
  {launch_loop("cta_warps", name, call, threads)}
}}
"""
    fn = compile_run(cpp, name, workdir)

    def run(args: dict, blocks: int) -> None:
        fn(*values(decl, args, contiguous=False), ctypes.c_int64(blocks))

    return run


def emulate_launches(monkeypatch, workdir: Path) -> None:
    """Route the kernel module's launches on CPU tensors through the emulated kernels: ``_jit.get`` returns a
    callable that binds the launcher's arguments to the prim_func's parameters (``kernel_binding.bind``: the same
    checks as ``fake_jit``) and runs the generated source; ``takes`` / ``takes_reduce`` accept CPU tensors. The
    public ops then take their kernel path end to end (validation, launcher, kernel) without a GPU."""
    from tilefuse import _jit
    from tilefuse.engram import _gate_bwd_kernel as K
    from tests.quant.kernel_binding import bind

    built = {}

    def get(name, cfg):
        func = _jit._FACTORIES[name][0](*cfg)
        threads = K.layout(cfg[0])[1] if name == "engram_gate_bwd" else K.REDUCE_THREADS
        if (name, cfg) not in built:
            src = _jit.compile_kernel(name, cfg, "sm_90", export=False).get_kernel_source()
            built[name, cfg] = build(src, name + "_kernel", threads, workdir / f"{name}{cfg}")

        def launch(*args):
            env = bind(func, args)
            values = dict(env)
            for param, arg in zip(func.params, args):
                if param not in func.buffer_map:
                    values[param.name] = arg
                    continue
                buf = func.buffer_map[param]
                values[buf.name] = arg
                for stride, value in zip(buf.strides, arg.stride()):  # strides of size-1 dims: not bound
                    if hasattr(stride, "name"):
                        values.setdefault(stride.name, value)
            blocks = (env["num_partials"] if name == "engram_gate_bwd"
                      else -(-env["numel"] // (K.REDUCE_VEC * threads)))
            built[name, cfg](values, blocks)

        return launch

    monkeypatch.setattr(_jit, "get", get)
    monkeypatch.setattr(K, "takes", lambda x: x.dim() == 3 and x.shape[1] == K.M and K.takes_hidden(x.shape[2]))
    monkeypatch.setattr(K, "takes_reduce", lambda p: p.dtype == torch.float32)
