"""TileLang kernel of ``engram_hash`` (engram.md §2.2, v1): the row indices ``(L, T, C)`` int32 of every n-gram table.

Work split: one thread per output element: the grid is ``ceil(T C / THREADS)`` CTAs along a layer's ``T`` rows of
``C = (N - 1) K`` indices times ``L`` along the layers. Thread ``g`` of layer ``l`` takes token ``t = g / C`` and
column ``c = g % C`` (order ``j = c / K + 1``, head ``e = c % K``): it reads the token's ids ``0..j`` (shared by the
``C`` threads of a token: cached loads), the layer's multipliers, one table size and one offset, and writes one
int32; a warp writes 128 contiguous bytes. The 64-bit remainder is the costly step (GPUs have no 64-bit integer
divide instruction: it is a software routine); one remainder a thread gives every SM enough warps to hide its
latency. The hash prefix ``h_j`` is recomputed by every column of a token (``j`` multiplies: cheap).

Arithmetic (§2.2.2), all integer and exact:
* products and the XOR chain in uint64: ``h_0 = a_0 μ_0``, ``h_j = h_{j-1} ^ a_j μ_j``, the id sign-extended to
  64 bits first. Unsigned multiplication wraps modulo 2^64 by definition, which is the low 64 bits of the exact
  two's-complement product (signed overflow would be undefined behaviour in C++);
* ``floormod(h, V)`` from C's truncating remainder on int64: ``r = h % V``; if ``r != 0`` and ``r`` and ``V``
  have different signs, ``r += V`` (the result takes the divisor's sign, as PyTorch's and Python's ``%``).
  ``V`` is a runtime value per column, so this is a 64-bit division at run time;
* ``low32(r + offset)`` as a uint32 wrapping add of the low words, reinterpreted as int32.

Kernel constraints: ``N >= 2``, ``L >= 1``, ``K >= 1`` (compile-time), any token count (a runtime 64-bit value).
Table sizes must be nonzero (``V = 0`` is undefined, §2.2.2). No shared memory, no atomics, no floating point:
deterministic and batch-invariant (a row depends only on its token's ids).

Speed: docs/BENCHMARKS.md (its mHC and Engram section). ptxas (sm_90, (N, L, K) = (3, 2, 8)): 30 registers, no spills.
"""
import torch

from tilefuse import _jit, _ops

# ---- tuning knobs (TILEFUSE_KNOBS; results unchanged) ----
THREADS = 128  # output elements per CTA (one thread each)

I32, I64, U32, U64 = "int32", "int64", "uint32", "uint64"


def hash_kernel(N: int, L: int, K: int):
    """Factory: ``N`` id columns, ``L`` layers, ``K`` heads. Launch: ``IDS (T, N)`` int32, ``MULT (L, N)`` int64,
    ``SIZES (L, N - 1, K)`` int32, ``OFFS (L, C)`` int32, ``OUT (L, T, C)`` int32, all contiguous; ``T`` symbolic."""
    import tilelang.language as T

    assert N >= 2 and L >= 1 and K >= 1, (N, L, K)
    C = (N - 1) * K
    threads = THREADS
    Tn = T.dynamic("num_tokens", I64)

    @T.prim_func
    def engram_hash(IDS: T.Tensor((Tn, N), I32), MULT: T.Tensor((L, N), I64), SIZES: T.Tensor((L, N - 1, K), I32),
                    OFFS: T.Tensor((L, C), I32), OUT: T.Tensor((L, Tn, C), I32)):
        with T.Kernel(T.ceildiv(Tn * C, threads), L, threads=threads) as (bx, by):
            h = T.alloc_local((1,), U64)   # running hash (two's-complement bits)
            r = T.alloc_local((1,), I64)   # remainder
            v = T.alloc_local((1,), I64)   # table size
            g = T.cast(bx, I64) * threads + T.cast(T.get_thread_binding(), I64)  # element (t, c) of layer by
            if g < Tn * C:
                t = g // C
                c = T.cast(g % C, I32)
                j = c // K + 1  # the column's n-gram: ids 0..j
                h[0] = T.cast(T.cast(IDS[t, 0], I64), U64) * T.cast(MULT[by, 0], U64)
                for jj in T.unroll(1, N):
                    if jj <= j:
                        h[0] = h[0] ^ (T.cast(T.cast(IDS[t, jj], I64), U64) * T.cast(MULT[by, jj], U64))
                v[0] = T.cast(SIZES[by, j - 1, c % K], I64)
                r[0] = T.truncmod(T.cast(h[0], I64), v[0])
                if T.And(r[0] != 0, (r[0] < 0) != (v[0] < 0)):
                    r[0] = r[0] + v[0]
                OUT[by, t, c] = T.cast(T.cast(r[0], U32) + T.cast(OFFS[by, c], U32), I32)

    return engram_hash


# The bench's launch: N = 3, L = 2, K = 8 (engram.md §4); the token count is symbolic.
BENCH_NLK = ((3, 2, 8),)

_jit.register("engram_hash", hash_kernel, lambda: list(BENCH_NLK))


# ---- launcher (no validation: the public op validates) ----

def takes(ngram_token_ids: torch.Tensor, vocab_sizes: torch.Tensor) -> bool:
    """Whether the kernel takes these (validated) inputs: CUDA, ``N >= 2`` and ``K >= 1`` (a nonempty output row)."""
    return ngram_token_ids.is_cuda and ngram_token_ids.shape[1] >= 2 and vocab_sizes.shape[2] >= 1


def hash_launch(ngram_token_ids: torch.Tensor, multipliers: torch.Tensor, vocab_sizes: torch.Tensor,
                offsets: torch.Tensor, out: torch.Tensor) -> None:
    """Write the hash indices into ``out (L, T, C)`` (contiguous int32); no launch for ``T = 0`` or ``L = 0``."""
    t, n = ngram_token_ids.shape
    layers, _, k = vocab_sizes.shape
    if t and layers:
        _jit.get("engram_hash", (n, layers, k))(ngram_token_ids, multipliers, vocab_sizes, offsets, out)


def hash_alloc(ngram_token_ids: torch.Tensor, vocab_sizes: torch.Tensor) -> torch.Tensor:
    """The output ``(L, T, C)`` int32 on the ids' device, uninitialised."""
    layers, n1, k = vocab_sizes.shape
    return torch.empty((layers, ngram_token_ids.shape[0], n1 * k), dtype=torch.int32,
                       device=ngram_token_ids.device)


# ---- torch.library registration (torch.compile / fake tensors) ----

@_ops.kernel_op("tilefuse::engram_hash", mutates_args=())
def _hash_op(ngram_token_ids: torch.Tensor, multipliers: torch.Tensor, vocab_sizes: torch.Tensor,
             offsets: torch.Tensor) -> torch.Tensor:
    out = hash_alloc(ngram_token_ids, vocab_sizes)
    hash_launch(ngram_token_ids, multipliers, vocab_sizes, offsets, out)
    return out


@_hash_op.register_fake
def _hash_fake(ngram_token_ids, multipliers, vocab_sizes, offsets):
    layers, n1, k = vocab_sizes.shape
    return ngram_token_ids.new_empty((layers, ngram_token_ids.shape[0], n1 * k))


def hash_cuda(ngram_token_ids: torch.Tensor, multipliers: torch.Tensor, vocab_sizes: torch.Tensor,
              offsets: torch.Tensor) -> torch.Tensor:
    """CUDA entry: a direct launch in eager mode, the custom op under ``torch.compile``."""
    if torch.compiler.is_compiling():
        return torch.ops.tilefuse.engram_hash(ngram_token_ids, multipliers, vocab_sizes, offsets)
    out = hash_alloc(ngram_token_ids, vocab_sizes)
    hash_launch(ngram_token_ids, multipliers, vocab_sizes, offsets, out)
    return out
