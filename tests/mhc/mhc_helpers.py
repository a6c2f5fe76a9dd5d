"""Shared helpers of the mHC tests (not a test module)."""
import torch

BF16 = torch.bfloat16
F32 = torch.float32
F64 = torch.float64


def bf16_ulp(t: torch.Tensor) -> torch.Tensor:
    """Spacing of bf16 numbers at |t| (8 significant bits): 2^(floor(log2|t|) - 7), elementwise, float64."""
    _, exp = torch.frexp(t.to(F64))
    return torch.ldexp(torch.ones_like(t, dtype=F64), (exp - 8).clamp(min=-133))


def assert_bf16_round_of(actual: torch.Tensor, exact: torch.Tensor, ulps: float = 1.0) -> None:
    """``actual`` (bf16) is within ``ulps`` bf16 ulps of the float64 ``exact`` value, elementwise.

    An fp32 computation rounded once to bf16 lands on one of the two bf16 neighbours of the exact value
    as long as its fp32 error is far below half a bf16 ulp, i.e. within 1 ulp of it.
    """
    assert actual.dtype == BF16 and actual.shape == exact.shape
    err = (actual.to(F64) - exact.to(F64)).abs()
    bound = ulps * bf16_ulp(exact)
    bad = err > bound
    assert not bad.any(), f"{int(bad.sum())} elements off by more than {ulps} ulp; worst err {err.max().item():.3g}"


def f64(*tensors, requires_grad: bool = True):
    """float64 leaf copies of the tensors (for gradcheck and exact references)."""
    return tuple(t.detach().to(F64).requires_grad_(requires_grad) for t in tensors)


def leaf(t: torch.Tensor) -> torch.Tensor:
    """A detached copy of ``t`` that requires grad."""
    return t.detach().clone().requires_grad_(True)
