"""Random normals (rand.md): ``randn``, ``randn_like`` and ``set_seed``.

The contract (rand.md 2.2) is the bits of ``torch.randn``: on every device the values, and the state of the
device's default generator afterwards, are exactly those of ``torch.randn(shape, dtype=dtype, device=device)``
called at the same point of the program. So these functions validate their arguments (rand.md 10, before any
generator is touched, so a rejected call changes no RNG state) and call torch's factory; there is no kernel of
ours and no custom op: ``torch.compile`` and CUDA graphs see ``torch.randn`` itself.
"""
from __future__ import annotations

import operator

import torch

from tilefuse._registry import public

__all__ = ["randn", "randn_like", "set_seed"]

# The dtypes torch.randn is defined for (rand.md 2.1).
_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.complex64, torch.complex128)
_SEED_MIN, _SEED_END = -(1 << 63), 1 << 64  # torch.manual_seed's accepted range

# The last seed given to set_seed (None before the first call). Upstream keeps such a counter for its Ascend
# kernel; on CPU and CUDA it has no observable effect (rand.md 4).
last_seed: int | None = None


def _integer(value, what: str) -> int:
    """``value`` as a Python int: ints and objects with ``__index__``; ``bool`` is refused."""
    if isinstance(value, bool):
        raise TypeError(f"{what} must be an integer, got bool {value!r}")
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"{what} must be an integer, got {type(value).__name__} {value!r}") from None


def _shape(size: tuple) -> tuple[int, ...]:
    """rand.md 2.1: one tuple, ``torch.Size`` or list is the shape; otherwise the arguments are."""
    if len(size) == 1 and isinstance(size[0], (tuple, list)):
        size = tuple(size[0])
    elif any(isinstance(s, (tuple, list)) for s in size):
        raise TypeError(f"randn: size must be integers or one tuple of integers, got {size!r}")
    shape = tuple(_integer(s, "randn: size entry") for s in size)
    if any(s < 0 for s in shape):
        raise ValueError(f"randn: size entries must be >= 0, got {shape}")
    return shape


def _dtype(dtype) -> torch.dtype:
    if dtype is None:
        return torch.get_default_dtype()
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"randn: dtype must be a torch.dtype or None, got {type(dtype).__name__} {dtype!r}")
    if dtype not in _DTYPES:
        names = ", ".join(str(d).removeprefix("torch.") for d in _DTYPES)
        raise TypeError(f"randn: dtype must be one of {names}, got {dtype}")
    return dtype


def _device(device) -> torch.device:
    """rand.md 2.1: ``None`` is the current CUDA device ('cpu' without CUDA); else what ``torch.device`` takes
    (an int is a CUDA ordinal, 0 included)."""
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if isinstance(device, bool):
        raise ValueError(f"randn: device must be a torch.device, a string or a CUDA ordinal, got bool {device!r}")
    try:
        return torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        raise ValueError(f"randn: device must be a torch.device, a string or a CUDA ordinal, got {device!r}") from None


@public("rand", path="torch")
def randn(*size, dtype: torch.dtype | None = None, device=None) -> torch.Tensor:
    """A new contiguous tensor of standard normals: exactly ``torch.randn(shape, dtype=dtype, device=device)``,
    generator state included (rand.md 2). ``randn(2, 3)``, ``randn((2, 3))`` and ``randn([2, 3])`` are the same
    call; ``dtype=None`` is torch's default dtype and ``device=None`` the current CUDA device (CPU without CUDA)."""
    shape = _shape(size)
    return torch.randn(shape, dtype=_dtype(dtype), device=_device(device))


@public("rand", path="torch")
def randn_like(input: torch.Tensor) -> torch.Tensor:
    """``randn(input.shape, dtype=input.dtype, device=input.device)`` (rand.md 3): always contiguous, values in
    row-major logical order whatever ``input``'s strides (unlike ``torch.randn_like``), no ``requires_grad``."""
    if not isinstance(input, torch.Tensor):
        raise TypeError(f"randn_like: input must be a torch.Tensor, got {type(input).__name__}")
    return randn(tuple(input.shape), dtype=input.dtype, device=input.device)


@public("rand", path="torch")
def set_seed(seed: int) -> None:
    """``torch.manual_seed(seed)``: seeds the CPU generator and every CUDA device's default generator (rand.md 4).
    ``seed`` is an integer in ``[-2**63, 2**64)``; the value is also kept in ``tilefuse.rand.ops.last_seed``."""
    global last_seed
    value = _integer(seed, "set_seed: seed")
    if not _SEED_MIN <= value < _SEED_END:
        raise ValueError(f"set_seed: seed must lie in [-2**63, 2**64), got {value}")
    torch.manual_seed(value)
    last_seed = value
