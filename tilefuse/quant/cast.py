"""Public per-token / per-block / per-channel casts, cast-back and E5M6 (quant.md sections 3, 5).

Each op validates its arguments on metadata only, then computes on the input's device: CUDA tensors of
``per_token_cast`` (e4m3/e2m1), ``per_token_cast_with_sf_only`` and ``per_token_cast_with_precomputed_sf``
go to the TileLang kernel (``_per_token_cast_kernel``: a direct launch in eager mode, its
``torch.library`` custom op under ``torch.compile``); every other op, and every CPU tensor, takes the exact
reference (``tilefuse.reference.quant``). Where upstream asserts,
we raise ``ValueError`` (shapes, values, flags) or ``TypeError`` (types, dtypes) naming the argument.
Flag combinations follow v1 (section 1.5): packed UE8M0 needs the column-major layout and ``round_sf``.
"""
from __future__ import annotations

from typing import Sequence

import torch

from .. import _check
from .. import formats as F
from .._registry import public
from ..reference import quant as R
from . import _cast_back_kernel as KC, _e5m6_kernel as KE, _per_block_cast_kernel as KB
from . import _cast_and_cast_back_kernel as KCC, _per_channel_cast_kernel as KP
from . import _per_token_cast_kernel as K

__all__ = [
    "per_token_cast", "per_token_cast_with_sf_only", "per_token_cast_with_precomputed_sf",
    "per_block_cast", "per_block_cast_with_sf_only", "per_block_cast_with_precomputed_sf",
    "per_block_cast_lossless", "per_channel_cast", "per_channel_cast_and_transpose", "per_channel_cast_fused",
    "cast_back", "per_token_cast_back", "unpack_from_e2m1fn_x2", "per_token_cast_to_e5m6", "cast_back_e5m6",
    "per_token_cast_and_cast_back",
]

_HIGH = (torch.bfloat16, torch.float32)
_NPC = (16, 32, 64, 128)


# ---------------------------------------------------------------------------------------------------------
# Validation helpers (metadata only)
# ---------------------------------------------------------------------------------------------------------

def _is_pair(x) -> bool:
    return isinstance(x, (tuple, list))


def _pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def _block(op: str, name: str, value) -> tuple[int, int]:
    """A (rows, channels) block size: two positive ints."""
    if not (isinstance(value, (tuple, list)) and len(value) == 2):
        _check.fail(op, f"{name} must be a pair of ints (rows, channels), got {value!r}", TypeError)
    return (_check.integer(op, f"{name}[0]", value[0], min=1), _check.integer(op, f"{name}[1]", value[1], min=1))


def _flags(op: str, col: bool, round_sf: bool, packed: bool) -> None:
    """v1 sf layout flags (section 1.5): packed UE8M0 exists only column-major and with round_sf."""
    if packed:
        _check.expect(col, op, "use_packed_ue8m0 requires use_tma_aligned_col_major_sf=True (packed UE8M0 is "
                      "column-major only), got use_tma_aligned_col_major_sf=False")
        _check.expect(round_sf, op, "use_packed_ue8m0 requires round_sf=True (UE8M0 holds powers of two), "
                      "got round_sf=False")


def _plain(op: str, x, *, contiguous: bool = False, dtype=_HIGH) -> tuple[int, int]:
    """A 2-D bf16/fp32 input; row-strided views are fine unless ``contiguous``."""
    _check.tensor(op, "x", x, dtype=dtype, ndim=2, contiguous=contiguous, inner_contiguous=True)
    return tuple(x.shape)


def _sf_in(op: str, name: str, sf, data: torch.Tensor, T: int, H: int, bm: int, bk: int) -> None:
    """An input sf for the grid of ``(T, H)`` with block ``(bm, bk)``: fp32 ``(nbm, nbk)`` row- or
    column-major, or packed UE8M0 int32 ``(nbm, cdiv(nbk, 4))`` (section 1.5)."""
    _check.tensor(op, name, sf, dtype=(torch.float32, torch.int32), ndim=2, device=data.device)
    nbm, nbk = F.cdiv(T, bm), F.cdiv(H, bk)
    width = F.cdiv(nbk, 4) if sf.dtype == torch.int32 else nbk
    if tuple(sf.shape) != (nbm, width):
        _check.fail(op, f"{name} must have shape {(nbm, width)} for {tuple(data.shape)} data with block {(bm, bk)}, "
                        f"got {tuple(sf.shape)}")
    unit = sf.size(0) <= 1 or sf.size(1) <= 1 or sf.stride(0) == 1 or sf.stride(1) == 1
    if not unit:
        _check.fail(op, f"{name} must be row-major or column-major, got strides {sf.stride()}")


def _pair(op: str, x, x_block_size, *, data_fmts=("e4m3", "e2m1"), contiguous: bool = False):
    """A pre-quantized ``(data, sf)`` pair with input block ``x_block_size``; returns (T, H logical, block)."""
    if len(x) != 2:
        _check.fail(op, f"x must be a tensor or a (data, sf) pair, got a sequence of length {len(x)}", TypeError)
    data, sf = x
    dtypes = [{"e4m3": torch.float8_e4m3fn, "e2m1": torch.int8, "e5m6": torch.uint8}[f] for f in data_fmts]
    _check.tensor(op, "x[0] (data)", data, dtype=dtypes, ndim=2, contiguous=contiguous, inner_contiguous=True)
    _check.expect(x_block_size is not None, op, "x_block_size is required for a (data, sf) pair x, got None")
    bm, bk = _block(op, "x_block_size", x_block_size)
    T, H = data.size(0), F.logical_width(data, F.fmt_of(data))
    _sf_in(op, "x[1] (sf)", sf, data, T, H, bm, bk)
    return T, H, (bm, bk)


def _npc(op: str, npc, H: int, *, allow_full: bool) -> None:
    """num_per_channels in {16, 32, 64, 128}, or == H with H % 64 == 0 where ``allow_full``."""
    _check.integer(op, "num_per_channels", npc)
    if allow_full and npc == H and npc not in _NPC:
        if H % 64 != 0:
            _check.fail(op, f"num_per_channels == hidden needs hidden % 64 == 0, got hidden {H}")
        return
    allowed = "16, 32, 64, 128" + (" or hidden" if allow_full else "")
    if npc not in _NPC:
        _check.fail(op, f"num_per_channels must be one of {allowed}, got {npc}")


def _even(op: str, fmt: str, H: int) -> None:
    if fmt == "e2m1":
        if H % 2 != 0:
            _check.fail(op, f"x must have an even hidden size for fmt 'e2m1', got hidden {H}")


def _precomputed_sf(op: str, sf, x: torch.Tensor, nbm: int, nbk: int, col: bool, packed: bool) -> None:
    """Precomputed mode: a row-major fp32 ``(nbm, nbk)`` sf and neither col nor packed requested."""
    _check.expect(not col, op, "use_tma_aligned_col_major_sf is not supported with a precomputed sf, got True")
    _check.expect(not packed, op, "use_packed_ue8m0 is not supported with a precomputed sf, got True")
    _check.tensor(op, "sf", sf, dtype=torch.float32, shape=(nbm, nbk), inner_contiguous=True, device=x.device)


def _per_token_checks(op: str, x, fmt: str, npc, x_block_size, *, allow_pair: bool) -> tuple[int, int]:
    _check.choice(op, "fmt", fmt, ("e4m3", "e2m1"))
    if _is_pair(x):
        _check.expect(allow_pair, op, "x must be a bf16/fp32 tensor; a (data, sf) pair is not accepted here",
                      TypeError)
        T, H, (ibm, ibk) = _pair(op, x, x_block_size)
        _npc(op, npc, H, allow_full=False)
        if not (_pow2(ibm) and _pow2(ibk) and ibm <= 128 and ibk <= 128):
            _check.fail(op, f"x_block_size must hold powers of two <= 128, got {tuple(x_block_size)}")
        if not (npc >= 32):
            _check.fail(op, f"num_per_channels must be >= 32 for a (data, sf) pair x, got {npc}")
    else:
        T, H = _plain(op, x)
        if x_block_size is not None:
            _check.fail(op, f"x_block_size is only for a (data, sf) pair x, got {x_block_size!r}")
        _npc(op, npc, H, allow_full=allow_pair)
    _even(op, fmt, H)
    return T, H


# ---------------------------------------------------------------------------------------------------------
# Per-token casts (sections 3.1-3.4)
# ---------------------------------------------------------------------------------------------------------

# Eager CUDA calls with a plain 2-D tensor skip the checks once the same facts passed them: the key holds all
# the checks read (x's dtype, strides, hidden size and the other arguments; the token count is free: one entry
# per row stride), and maps to the kernel's launch closure ``launch(x, t)``. The two ops below test for it
# inline, reading ``x.shape`` once: a helper call and a second shape read cost about 1 µs per call on the host.
_VALIDATED: dict[tuple, object] = {}
_is_compiling = torch.compiler.is_compiling  # one lookup fewer per call (dynamo knows the function itself)


def _validated_launch(key: tuple, x: torch.Tensor, fmt: str, npc: int, col, round_sf, packed, mode: str):
    """Record the launch closure of an argument set that has just passed the checks."""
    launch = _VALIDATED[key] = K.launcher(x.dtype, x.shape[1], None, fmt, npc, None, col, round_sf, packed, mode)
    return launch


@public("quant", path="kernel")
def per_token_cast(x, fmt: str, num_per_channels: int, x_block_size: Sequence[int] | None = None,
                   use_tma_aligned_col_major_sf: bool = False, round_sf: bool = False,
                   use_packed_ue8m0: bool = False):
    """Row-wise group quantization with block ``(1, num_per_channels)`` (section 3.1) -> ``(out, out_sf)``.

    ``x`` is bf16/fp32 ``(T, H)`` (any row stride) or a pre-quantized ``(data, sf)`` pair with
    ``x_block_size``. ``fmt='e5m6'`` dispatches to the E5M6 cast (section 3.4).
    """
    op, key = "per_token_cast", None
    if (type(x) is torch.Tensor and x.is_cuda and x_block_size is None and type(fmt) is str
            and type(num_per_channels) is int and not _is_compiling()):  # eager: the _VALIDATED fast path
        shape = x.shape
        if len(shape) == 2:
            key = (op, x.dtype, x.stride(), shape[1], fmt, num_per_channels, use_tma_aligned_col_major_sf,
                   round_sf, use_packed_ue8m0)
            launch = _VALIDATED.get(key)
            if launch is not None:
                return launch(x, shape[0])
    _check.choice(op, "fmt", fmt, ("e4m3", "e2m1", "e5m6"))
    if fmt == "e5m6":
        if x_block_size is not None:
            _check.fail(op, f"x_block_size must be None for fmt 'e5m6', got {x_block_size!r}")
        return _to_e5m6(op, x, num_per_channels, use_tma_aligned_col_major_sf, round_sf, use_packed_ue8m0)
    _per_token_checks(op, x, fmt, num_per_channels, x_block_size, allow_pair=True)
    _flags(op, use_tma_aligned_col_major_sf, round_sf, use_packed_ue8m0)
    if key is not None:  # a cacheable eager call that passed the checks
        return _validated_launch(key, x, fmt, num_per_channels, use_tma_aligned_col_major_sf, round_sf,
                                 use_packed_ue8m0, "cast")(x, x.shape[0])
    if (x[0] if _is_pair(x) else x).is_cuda:
        return K.per_token_cast_cuda(x, fmt, num_per_channels, x_block_size, use_tma_aligned_col_major_sf,
                                     round_sf, use_packed_ue8m0)
    return R.cast(x, fmt, (1, num_per_channels), x_block_size=x_block_size, round_sf=round_sf,
                  use_tma_aligned_col_major_sf=use_tma_aligned_col_major_sf, use_packed_ue8m0=use_packed_ue8m0)


@public("quant", path="kernel")
def per_token_cast_with_sf_only(x, fmt: str, num_per_channels: int, x_block_size: Sequence[int] | None = None,
                                use_tma_aligned_col_major_sf: bool = False, round_sf: bool = False,
                                use_packed_ue8m0: bool = False) -> torch.Tensor:
    """Only the sf of ``per_token_cast`` (section 3.2); plain inputs and num_per_channels != hidden only."""
    op, key = "per_token_cast_with_sf_only", None
    if (type(x) is torch.Tensor and x.is_cuda and x_block_size is None and type(fmt) is str
            and type(num_per_channels) is int and not _is_compiling()):  # eager: the _VALIDATED fast path
        shape = x.shape
        if len(shape) == 2:
            key = (op, x.dtype, x.stride(), shape[1], fmt, num_per_channels, use_tma_aligned_col_major_sf,
                   round_sf, use_packed_ue8m0)
            launch = _VALIDATED.get(key)
            if launch is not None:
                return launch(x, shape[0])
    _per_token_checks(op, x, fmt, num_per_channels, x_block_size, allow_pair=False)
    _flags(op, use_tma_aligned_col_major_sf, round_sf, use_packed_ue8m0)
    if key is not None:  # a cacheable eager call that passed the checks
        return _validated_launch(key, x, fmt, num_per_channels, use_tma_aligned_col_major_sf, round_sf,
                                 use_packed_ue8m0, "sf_only")(x, x.shape[0])
    if x.is_cuda:
        return K.per_token_cast_with_sf_only_cuda(x, fmt, num_per_channels, use_tma_aligned_col_major_sf, round_sf,
                                                  use_packed_ue8m0)
    return R.cast(x, fmt, (1, num_per_channels), round_sf=round_sf,
                  use_tma_aligned_col_major_sf=use_tma_aligned_col_major_sf, use_packed_ue8m0=use_packed_ue8m0)[1]


@public("quant", path="kernel")
def per_token_cast_with_precomputed_sf(x, fmt: str, num_per_channels: int, sf: torch.Tensor,
                                       x_block_size: Sequence[int] | None = None,
                                       use_tma_aligned_col_major_sf: bool = False, round_sf: bool = False,
                                       use_packed_ue8m0: bool = False) -> torch.Tensor:
    """Cast with a caller-given row-major fp32 sf ``(T, cdiv(H, npc))`` (section 3.3): ``sf_inv = 1 / sf``.
    Returns only the data; ``round_sf`` is ignored."""
    op = "per_token_cast_with_precomputed_sf"
    T, H = _per_token_checks(op, x, fmt, num_per_channels, x_block_size, allow_pair=False)
    _precomputed_sf(op, sf, x, T, F.cdiv(H, num_per_channels), use_tma_aligned_col_major_sf, use_packed_ue8m0)
    if x.is_cuda:
        return K.per_token_cast_with_precomputed_sf_cuda(x, fmt, num_per_channels, sf)
    return R.cast(x, fmt, (1, num_per_channels), sf=sf)


def _to_e5m6(op: str, x, npc, col: bool, round_sf: bool, packed: bool):
    key = None
    if type(x) is torch.Tensor and x.is_cuda and type(npc) is int and not _is_compiling():
        shape = x.shape
        if len(shape) == 2:  # eager: the _VALIDATED fast path (the checks below read no token count)
            key = (op, x.dtype, x.stride(), shape[1], npc, col, round_sf, packed)
            launch = _VALIDATED.get(key)
            if launch is not None:
                return launch(x, shape[0])
    _check.expect(not _is_pair(x), op, "x must be a bf16/fp32 tensor for fmt 'e5m6', got a (data, sf) pair",
                  TypeError)
    T, H = _plain(op, x)
    _check.integer(op, "num_per_channels", npc)
    if npc != H:
        _check.fail(op, f"num_per_channels must equal hidden ({H}) for fmt 'e5m6', got {npc}")
    if H % 8 != 0:
        _check.fail(op, f"x must have hidden % 8 == 0 for fmt 'e5m6', got shape {(T, H)}")
    _flags(op, col, round_sf, packed)
    if x.is_cuda:
        if key is not None and T > 0:
            launch = KE.native_launcher(x.dtype, H, bool(col), bool(round_sf), bool(packed))
            if launch is not None:
                _VALIDATED[key] = launch
                return launch(x, T)
        return KE.per_token_cast_to_e5m6_cuda(x, npc, col, round_sf, packed)
    return R.cast_to_e5m6(x, npc, col, round_sf, packed)


@public("quant", path="kernel")
def per_token_cast_to_e5m6(x: torch.Tensor, num_per_channels: int, use_tma_aligned_col_major_sf: bool = False,
                           round_sf: bool = False, use_packed_ue8m0: bool = False):
    """E5M6 per-token cast, one scale per row (section 3.4) -> ``(uint8 (T, 3H/2), sf)``."""
    return _to_e5m6("per_token_cast_to_e5m6", x, num_per_channels, use_tma_aligned_col_major_sf, round_sf,
                    use_packed_ue8m0)


# ---------------------------------------------------------------------------------------------------------
# Per-block casts (sections 3.6, 3.7)
# ---------------------------------------------------------------------------------------------------------

def _per_block_checks(op: str, x, fmt: str, block_size) -> tuple[int, int, int, int]:
    _check.choice(op, "fmt", fmt, ("e4m3", "e2m1"))
    T, H = _plain(op, x, contiguous=True)
    bm, bk = _block(op, "block_size", block_size)
    if not (bm in (32, 128) and bk in (32, 128)):
        _check.fail(op, f"block_size must be (32 or 128, 32 or 128), got {tuple(block_size)}")
    if H % 64 != 0:
        _check.fail(op, f"x must have hidden % 64 == 0, got shape {(T, H)}")
    return T, H, bm, bk


def _block_key(op: str, x, fmt, block_size, col, round_sf, packed) -> tuple | None:
    """The _VALIDATED key of an eager per_block_cast call on a contiguous-by-strides 2-D CUDA tensor (row
    stride = hidden: contiguous at every token count) with a tuple block_size; None for any other call."""
    if (type(x) is torch.Tensor and x.is_cuda and type(block_size) is tuple and type(fmt) is str
            and not _is_compiling()):
        shape = x.shape
        if len(shape) == 2 and x.stride() == (shape[1], 1):
            return (op, x.dtype, shape[1], fmt, block_size, col, round_sf, packed)
    return None


def _block_plan(key: tuple, x, fmt: str, H: int, bm: int, bk: int, col, round_sf, packed, mode: str):
    """Record and return the native plan of a checked per_block_cast call (None: take the launcher)."""
    if key is None or x.numel() == 0:
        return None
    launch = KB.native_launcher(x.dtype, H, fmt, bm, bk, bool(round_sf), KB._layout(col, packed), mode)
    if launch is not None:
        _VALIDATED[key] = launch
    return launch


@public("quant", path="kernel")
def per_block_cast(x: torch.Tensor, fmt: str, block_size: Sequence[int], use_tma_aligned_col_major_sf: bool = False,
                   round_sf: bool = False, use_packed_ue8m0: bool = False):
    """One scale per ``block_size`` block of a contiguous bf16/fp32 ``(T, H)`` (section 3.6) -> (out, out_sf)."""
    op = "per_block_cast"
    key = _block_key(op, x, fmt, block_size, use_tma_aligned_col_major_sf, round_sf, use_packed_ue8m0)
    launch = _VALIDATED.get(key) if key is not None else None
    if launch is not None:  # the same facts passed the checks before (the token count is free)
        return launch(x, x.shape[0])
    T, H, bm, bk = _per_block_checks(op, x, fmt, block_size)
    _flags(op, use_tma_aligned_col_major_sf, round_sf, use_packed_ue8m0)
    if x.is_cuda:
        launch = _block_plan(key, x, fmt, H, bm, bk, use_tma_aligned_col_major_sf, round_sf, use_packed_ue8m0, "cast")
        if launch is not None:
            return launch(x, T)
        return KB.per_block_cast_cuda(x, fmt, block_size, use_tma_aligned_col_major_sf, round_sf, use_packed_ue8m0)
    return R.cast(x, fmt, tuple(block_size), round_sf=round_sf,
                  use_tma_aligned_col_major_sf=use_tma_aligned_col_major_sf, use_packed_ue8m0=use_packed_ue8m0)


@public("quant", path="kernel")
def per_block_cast_with_sf_only(x: torch.Tensor, fmt: str, block_size: Sequence[int],
                                use_tma_aligned_col_major_sf: bool = False, round_sf: bool = False,
                                use_packed_ue8m0: bool = False) -> torch.Tensor:
    """Only the sf of ``per_block_cast`` (section 3.6)."""
    op = "per_block_cast_with_sf_only"
    key = _block_key(op, x, fmt, block_size, use_tma_aligned_col_major_sf, round_sf, use_packed_ue8m0)
    launch = _VALIDATED.get(key) if key is not None else None
    if launch is not None:
        return launch(x, x.shape[0])
    T, H, bm, bk = _per_block_checks(op, x, fmt, block_size)
    _flags(op, use_tma_aligned_col_major_sf, round_sf, use_packed_ue8m0)
    if x.is_cuda:
        launch = _block_plan(key, x, fmt, H, bm, bk, use_tma_aligned_col_major_sf, round_sf, use_packed_ue8m0,
                             "sf_only")
        if launch is not None:
            return launch(x, T)
        return KB.per_block_cast_with_sf_only_cuda(x, fmt, block_size, use_tma_aligned_col_major_sf, round_sf,
                                                   use_packed_ue8m0)
    return R.cast(x, fmt, tuple(block_size), round_sf=round_sf,
                  use_tma_aligned_col_major_sf=use_tma_aligned_col_major_sf, use_packed_ue8m0=use_packed_ue8m0)[1]


@public("quant", path="kernel")
def per_block_cast_with_precomputed_sf(x: torch.Tensor, fmt: str, block_size: Sequence[int], sf: torch.Tensor,
                                       use_tma_aligned_col_major_sf: bool = False, round_sf: bool = False,
                                       use_packed_ue8m0: bool = False) -> torch.Tensor:
    """Per-block cast with a caller-given row-major fp32 sf ``(cdiv(T,bm), cdiv(H,bk))`` (section 3.6)."""
    op = "per_block_cast_with_precomputed_sf"
    T, H, bm, bk = _per_block_checks(op, x, fmt, block_size)
    _precomputed_sf(op, sf, x, F.cdiv(T, bm), F.cdiv(H, bk), use_tma_aligned_col_major_sf, use_packed_ue8m0)
    if x.is_cuda:
        return KB.per_block_cast_with_precomputed_sf_cuda(x, fmt, (bm, bk), sf)
    return R.cast(x, fmt, (bm, bk), sf=sf)


@public("quant", path="kernel")
def per_block_cast_lossless(x, fmt: str, x_block_size: Sequence[int], out_block_size: Sequence[int],
                            use_tma_aligned_col_major_sf: bool = False, round_sf: bool = False,
                            use_packed_ue8m0: bool = False):
    """Exact re-encoding of FP4 data with power-of-two sf into E4M3 with coarser power-of-two sf
    (section 3.7) -> ``(out, out_sf)``. ``round_sf`` has no effect (the output sf are powers of two)."""
    op = "per_block_cast_lossless"
    _check.choice(op, "fmt", fmt, ("e4m3",))
    if not _is_pair(x):
        _check.fail(op, f"x must be a (data, sf) pair of packed e2m1 data, got {type(x).__name__}", TypeError)
    T, H, (ibm, ibk) = _pair(op, x, x_block_size, data_fmts=("e2m1",), contiguous=True)
    obm, obk = _block(op, "out_block_size", out_block_size)
    if H % 32 != 0:
        _check.fail(op, f"x must have logical hidden % 32 == 0, got hidden {H}")
    if not _pow2(ibk):
        _check.fail(op, f"x_block_size[1] must be a power of two, got {ibk}")
    if not _pow2(obk):
        _check.fail(op, f"out_block_size[1] must be a power of two, got {obk}")
    if not (obm % ibm == 0 and obk % ibk == 0):
        _check.fail(op, f"out_block_size must be a multiple of x_block_size, got {tuple(out_block_size)} and "
                        f"{tuple(x_block_size)}")
    if use_packed_ue8m0:
        _check.expect(use_tma_aligned_col_major_sf, op, "use_packed_ue8m0 requires use_tma_aligned_col_major_sf="
                      "True (packed UE8M0 is column-major only), got use_tma_aligned_col_major_sf=False")
    if x[0].is_cuda:
        return KB.per_block_cast_lossless_cuda(x, fmt, (ibm, ibk), (obm, obk), use_tma_aligned_col_major_sf, round_sf,
                                               use_packed_ue8m0)
    return R.per_block_cast_lossless(x, (ibm, ibk), (obm, obk), use_tma_aligned_col_major_sf, use_packed_ue8m0)


# ---------------------------------------------------------------------------------------------------------
# Per-channel casts (sections 3.8-3.10)
# ---------------------------------------------------------------------------------------------------------

def _per_channel_checks(op: str, x, fmt: str, npt, allowed_npt, dtype=_HIGH) -> None:
    _check.choice(op, "fmt", fmt, ("e4m3",))
    T, H = _plain(op, x, contiguous=True, dtype=dtype)
    _check.integer(op, "num_per_tokens", npt)
    _check.choice(op, "num_per_tokens", npt, allowed_npt)
    if T % 128 != 0:
        _check.fail(op, f"x must have num_tokens % 128 == 0, got shape {(T, H)}")
    if H % 64 != 0:
        _check.fail(op, f"x must have hidden % 64 == 0, got shape {(T, H)}")


@public("quant", path="kernel")
def per_channel_cast(x: torch.Tensor, fmt: str, num_per_tokens: int, round_sf: bool = False):
    """Column-wise quantization with block ``(128, 1)`` (section 3.8) -> e4m3 ``(T, H)``, fp32 ``(T/128, H)``."""
    _per_channel_checks("per_channel_cast", x, fmt, num_per_tokens, (128,))
    if x.is_cuda:
        return KP.per_channel_cast_cuda(x, fmt, num_per_tokens, round_sf)
    return R.cast(x, "e4m3", (num_per_tokens, 1), round_sf=round_sf)


@public("quant", path="kernel")
def per_channel_cast_and_transpose(x: torch.Tensor, fmt: str, num_per_tokens: int, round_sf: bool = False):
    """Per-channel quantization with block ``(npt, 1)``, data transposed (section 3.9) ->
    e4m3 ``(H, T)`` contiguous and fp32 ``(T/npt, H)`` (not transposed)."""
    _per_channel_checks("per_channel_cast_and_transpose", x, fmt, num_per_tokens, (32, 128), dtype=torch.bfloat16)
    if x.is_cuda:
        return KP.per_channel_cast_and_transpose_cuda(x, fmt, num_per_tokens, round_sf)
    out, sf = R.cast(x, "e4m3", (num_per_tokens, 1), round_sf=round_sf)
    return out.T.contiguous(), sf


@public("quant", path="kernel")
def per_channel_cast_fused(x, fmt: str, num_per_tokens: int, round_sf: bool = False,
                           num_per_channels: int | None = None, pos_to_token: torch.Tensor | None = None):
    """Per-channel ``(128, 1)`` quantization fused with an optional row gather and with dequantization of a
    per-token ``(1, 128)`` e4m3 pair (section 3.10) -> e4m3 ``(T_out, H)``, fp32 ``(cdiv(T_out, 128), H)``."""
    op = "per_channel_cast_fused"
    _check.choice(op, "fmt", fmt, ("e4m3",))
    _check.integer(op, "num_per_tokens", num_per_tokens)
    _check.choice(op, "num_per_tokens", num_per_tokens, (128,))
    if _is_pair(x):
        if num_per_channels != 128:
            _check.fail(op, f"num_per_channels must be 128 for a (data, sf) pair x, got {num_per_channels!r}")
        T, H, _ = _pair(op, x, (1, 128), data_fmts=("e4m3",), contiguous=True)
        _check.tensor(op, "x[1] (sf)", x[1], dtype=torch.float32, contiguous=True)
        if H % 128 != 0:
            _check.fail(op, f"x must have hidden % 128 == 0 for a (data, sf) pair, got hidden {H}")
        device = x[0].device
    else:
        T, H = _plain(op, x, contiguous=True)
        if num_per_channels is not None:
            _check.fail(op, f"num_per_channels is only for a (data, sf) pair x, got {num_per_channels!r}")
        device = x.device
    if pos_to_token is None:
        if T % 128 != 0:
            _check.fail(op, f"x must have num_tokens % 128 == 0 without pos_to_token, got {T}")
    else:
        _check.tensor(op, "pos_to_token", pos_to_token, dtype=torch.int32, ndim=1, contiguous=True, device=device)
        if pos_to_token.numel() % 16 != 0:
            _check.fail(op, f"pos_to_token must have a length % 16 == 0, got {pos_to_token.numel()}")
    if device.type == "cuda":
        return KP.per_channel_cast_fused_cuda(x, fmt, num_per_tokens, round_sf, num_per_channels, pos_to_token)
    return R.per_channel_cast_fused(x, num_per_tokens, num_per_channels, round_sf, pos_to_token)


# ---------------------------------------------------------------------------------------------------------
# Cast-back (section 3.5) and FP4 unpacking (section 1.2)
# ---------------------------------------------------------------------------------------------------------

def _cast_back_key(op: str, x, fmt, x_block_size, x_special_fmt) -> tuple | None:
    """The _VALIDATED key of an eager cast-back call: a (data, sf) tuple of 2-D CUDA tensors, a tuple block,
    and an sf with a unit stride (row- or column-major, so the check holds at every token count). What the
    checks read that depends on the token count (the sf's rows) is compared at each call."""
    if type(x) is tuple and len(x) == 2 and type(x_block_size) is tuple and not _is_compiling():
        data, sf = x
        if type(data) is torch.Tensor and type(sf) is torch.Tensor and data.is_cuda and sf.dim() == 2:
            st = sf.stride()
            if data.dim() == 2 and (st[0] == 1 or st[1] == 1):
                return (op, fmt, x_special_fmt, x_block_size, data.dtype, data.stride(), data.shape[1],
                        data.get_device(), sf.dtype, sf.shape[1], sf.get_device(), st[0] == 1, st[1] == 1)
    return None


def _cast_back(op: str, x, fmt: str, x_block_size, x_special_fmt) -> torch.Tensor:
    key = _cast_back_key(op, x, fmt, x_block_size, x_special_fmt)
    if key is not None:
        entry = _VALIDATED.get(key)
        if entry is not None:
            launch, max_rows = entry
            data, sf = x
            t = data.shape[0]
            if sf.shape[0] == -(-t // x_block_size[0]) and t <= max_rows:
                return launch(data, t, sf) if t else KC.cast_back_launch(data, sf, fmt, x_block_size, x_special_fmt)
    _check.choice(op, "fmt", fmt, ("bf16", "fp32"))
    _check.choice(op, "x_special_fmt", x_special_fmt, (None, "e5m6"))
    if not _is_pair(x):
        _check.fail(op, f"x must be a (data, sf) pair, got {type(x).__name__}", TypeError)
    if x_special_fmt == "e5m6":
        _check.tensor(op, "x[0] (data)", x[0], dtype=torch.uint8, ndim=2)
        if x[0].size(1) % 12 != 0:
            _check.fail(op, f"x[0] (data) must have width % 12 == 0 (hidden % 8 == 0), got shape {tuple(x[0].shape)}")
        T, H, block = _pair(op, x, x_block_size, data_fmts=("e5m6",))
        if x[0].is_cuda:
            _cast_back_plan(key, x, fmt, "e5m6", H, block)
            return KE.cast_back_e5m6_cuda(x, fmt, tuple(x_block_size))
        return R.cast_back_from_e5m6(x, fmt, tuple(x_block_size))
    T, H, block = _pair(op, x, x_block_size)
    if H % 64 != 0:
        _check.fail(op, f"x must have logical hidden % 64 == 0, got hidden {H}")
    if x[0].is_cuda:
        _cast_back_plan(key, x, fmt, None, H, block)
        return KC.cast_back_cuda(x, fmt, block)
    return R.cast_back(x, fmt, block)


def _cast_back_plan(key: tuple | None, x, fmt: str, special: str | None, H: int, block) -> None:
    """Record the native plan of a checked cast-back call for its key (the call itself takes the launcher)."""
    if key is not None and x[0].numel() > 0:
        data, sf = x
        plan, max_rows = KC.native_launcher(data.dtype, KC._dfmt(data, special), fmt, H, block[0], block[1],
                                            sf.dtype == torch.int32)
        if plan is not None:
            _VALIDATED[key] = (plan, max_rows)


@public("quant", path="kernel")
def cast_back(x, fmt: str, x_block_size: Sequence[int], x_special_fmt: str | None = None) -> torch.Tensor:
    """Dequantize ``(data, sf)`` with block ``x_block_size`` to bf16/fp32 (section 3.5)."""
    return _cast_back("cast_back", x, fmt, x_block_size, x_special_fmt)


@public("quant", path="kernel")
def per_token_cast_back(x, fmt: str, num_per_channels: int, x_special_fmt: str | None = None) -> torch.Tensor:
    """``cast_back`` with block ``(1, num_per_channels)`` (section 3.5)."""
    op = "per_token_cast_back"
    _check.integer(op, "num_per_channels", num_per_channels, min=1)
    return _cast_back(op, x, fmt, (1, num_per_channels), x_special_fmt)


@public("quant", path="kernel")
def cast_back_e5m6(x, fmt: str, x_block_size: Sequence[int]) -> torch.Tensor:
    """Dequantize ``(uint8 packed E5M6 (T, 3H/2), sf)`` to bf16/fp32 (section 3.5, ``x_special_fmt='e5m6'``)."""
    return _cast_back("cast_back_e5m6", x, fmt, x_block_size, "e5m6")


@public("quant", path="kernel")
def unpack_from_e2m1fn_x2(x: torch.Tensor, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Decode a packed FP4 container ``[..., K]`` (int8/uint8) to ``[..., 2K]`` of ``out_dtype`` (section 1.2)."""
    op = "unpack_from_e2m1fn_x2"
    _check.tensor(op, "x", x, dtype=(torch.int8, torch.uint8))
    _check.expect(x.dim() >= 1, op, "x must have at least one dimension, got a 0-d tensor")
    if not isinstance(out_dtype, torch.dtype):
        _check.fail(op, f"out_dtype must be a torch.dtype, got {type(out_dtype).__name__}", TypeError)
    if x.is_cuda:
        return KC.unpack_from_e2m1fn_x2_cuda(x, out_dtype)
    return F.e2m1_decode(F.e2m1_unpack(x)).to(out_dtype)


# ---------------------------------------------------------------------------------------------------------
# v2.1: in-place quantization round trip (section 5.8)
# ---------------------------------------------------------------------------------------------------------

@public("quant", path="kernel")
def per_token_cast_and_cast_back(x: torch.Tensor, fmt: str, num_per_channels: int, round_sf: bool = False,
                                 use_e4m3_sf: bool = False) -> None:
    """In place: ``x <- round_{x.dtype}(decode(narrow(x * sf_inv)) * sf)`` per ``(1, npc)`` group (section 5.8)."""
    op = "per_token_cast_and_cast_back"
    _check.choice(op, "fmt", fmt, ("e4m3", "e2m1"))
    T, H = _plain(op, x)
    _npc(op, num_per_channels, H, allow_full=False)
    if not (H % num_per_channels == 0 and H % 64 == 0):
        _check.fail(op, f"x must have hidden % num_per_channels == 0 and hidden % 64 == 0, got shape {(T, H)}")
    _check.expect(not (round_sf and use_e4m3_sf), op, "round_sf and use_e4m3_sf cannot both be True")
    if x.is_cuda:
        return KCC.per_token_cast_and_cast_back_cuda(x, fmt, num_per_channels, round_sf, use_e4m3_sf)
    x.copy_(R.per_token_cast_and_cast_back_values(x, fmt, num_per_channels, round_sf, use_e4m3_sf))
