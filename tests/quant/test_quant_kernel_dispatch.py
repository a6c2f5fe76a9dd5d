"""The public quant ops hand CUDA tensors to their kernels (after validation) and return exactly what the
reference returns for the same CUDA tensors: data, sf and strides, bitwise (packed-sf padding cleared, as
quant.md 6.1 allows). The kernels' own tiers are in the test_*_kernel.py files; this checks the wiring."""
import pytest
import torch

import tilefuse.quant as Q
from tilefuse import _registry, formats as F
from tilefuse.quant import norm as N, swiglu as S
from tilefuse.reference import quant as R
from tilefuse.testing import assert_equal, clear_unused_sf

WIRED = ("per_token_cast", "per_token_cast_with_sf_only", "per_token_cast_with_precomputed_sf", "per_block_cast",
         "per_block_cast_with_sf_only", "per_block_cast_with_precomputed_sf", "per_block_cast_lossless",
         "cast_back", "per_token_cast_back", "cast_back_e5m6", "unpack_from_e2m1fn_x2", "per_token_cast_to_e5m6",
         "per_channel_cast", "per_channel_cast_and_transpose", "per_channel_cast_fused",
         "swiglu_backward_and_per_token_cast", "swiglu_forward_and_per_channel_cast_and_transpose",
         "batched_transpose_weight_sf", "swiglu_forward_and_per_token_cast", "per_token_cast_and_cast_back",
         "norm_forward", "norm_forward_and_per_token_cast", "norm_backward")
T, H = 133, 512


def test_registry_says_kernel():
    ops = _registry.load_all()
    assert {name for name in WIRED if ops[f"quant.{name}"]["path"] != "kernel"} == set()


def _x(dtype=torch.bfloat16):
    return (torch.randn(T, H, device="cuda") * torch.exp2(torch.randint(-8, 9, (T, 1), device="cuda"))).to(dtype)


def _same_sf(got, want, hidden, npc):
    if want.dtype == torch.int32:  # packed UE8M0: the padding bytes of the last word are unspecified
        assert_equal(clear_unused_sf(got, hidden, npc), clear_unused_sf(want, hidden, npc))
    else:
        assert_equal(got, want)


def _same(got, want, hidden=H, npc=None):
    assert_equal(got[0], want[0])
    _same_sf(got[1], want[1], hidden, npc)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ("e4m3", "e2m1"))
@pytest.mark.parametrize("block", ((32, 128), (128, 32)))
@pytest.mark.parametrize("layout", ((False, False, False), (True, True, True)))
def test_per_block_family(fmt, block, layout):
    x = _x(torch.float32)
    want = R.cast(x, fmt, block, round_sf=layout[1], use_tma_aligned_col_major_sf=layout[0],
                  use_packed_ue8m0=layout[2])
    _same(Q.per_block_cast(x, fmt, block, *layout), want, npc=block[1])
    _same_sf(Q.per_block_cast_with_sf_only(x, fmt, block, *layout), want[1], H, block[1])
    sf = R.cast(x, fmt, block)[1]
    assert_equal(Q.per_block_cast_with_precomputed_sf(x, fmt, block, sf), R.cast(x, fmt, block, sf=sf))


@pytest.mark.gpu
@pytest.mark.parametrize("out_block", ((1, 128), (128, 128)))
def test_lossless(out_block):
    pair = R.cast(torch.randn(T, H, device="cuda"), "e2m1", (1, 32), round_sf=True)  # exponents within 11
    want = R.per_block_cast_lossless(pair, (1, 32), out_block, False, False)
    _same(Q.per_block_cast_lossless(pair, "e4m3", (1, 32), out_block), want)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ("e4m3", "e2m1"))
@pytest.mark.parametrize("out", ("bf16", "fp32"))
def test_cast_back_family(fmt, out):
    pair = R.cast(_x(), fmt, (1, 128), round_sf=True, use_tma_aligned_col_major_sf=True, use_packed_ue8m0=True)
    want = R.cast_back(pair, out, (1, 128))
    assert_equal(Q.cast_back(pair, out, (1, 128)), want)
    assert_equal(Q.per_token_cast_back(pair, out, 128), want)
    block_pair = R.cast(_x(), fmt, (128, 128))
    assert_equal(Q.cast_back(block_pair, out, (128, 128)), R.cast_back(block_pair, out, (128, 128)))


@pytest.mark.gpu
@pytest.mark.parametrize("out_dtype", (torch.float32, torch.bfloat16))
def test_unpack(out_dtype):
    packed = torch.randint(-128, 128, (T, H // 2), device="cuda", dtype=torch.int8)
    want = F.e2m1_decode(F.e2m1_unpack(packed)).to(out_dtype)
    assert_equal(Q.unpack_from_e2m1fn_x2(packed, out_dtype), want)


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ((False, False, False), (True, True, False), (True, True, True)))
def test_e5m6(layout):
    x = _x()
    want = R.cast_to_e5m6(x, H, *layout)
    _same(Q.per_token_cast_to_e5m6(x, H, *layout), want, npc=H)
    _same(Q.per_token_cast(x, "e5m6", H, None, *layout), want, npc=H)
    pair = R.cast_to_e5m6(x, H)
    back = R.cast_back_from_e5m6(pair, "fp32", (1, H))
    assert_equal(Q.cast_back_e5m6(pair, "fp32", (1, H)), back)
    assert_equal(Q.cast_back(pair, "fp32", (1, H), "e5m6"), back)


@pytest.mark.gpu
@pytest.mark.parametrize("round_sf", (False, True))
def test_per_channel_family(round_sf):
    x = _x()[:128]
    want = R.cast(x, "e4m3", (128, 1), round_sf=round_sf)
    _same(Q.per_channel_cast(x, "e4m3", 128, round_sf), want)
    got = Q.per_channel_cast_and_transpose(x, "e4m3", 128, round_sf)
    assert_equal(got[0], want[0].T.contiguous())
    assert_equal(got[1], want[1])
    pos = torch.randint(-1, 128, (144,), dtype=torch.int32, device="cuda")
    _same(Q.per_channel_cast_fused(x, "e4m3", 128, round_sf, None, pos),
          R.per_channel_cast_fused(x, 128, None, round_sf, pos))


@pytest.mark.gpu
@pytest.mark.parametrize("without_transpose", (False, True))
def test_swiglu_per_channel(without_transpose):
    x = torch.randn(256, 2 * H, device="cuda").to(torch.bfloat16)
    from tilefuse.reference import swiglu as RS
    data, sf = R.cast(RS.swiglu_forward(x, swiglu_clamp_value=0.5).to(torch.bfloat16), "e4m3", (128, 1))
    got = Q.swiglu_forward_and_per_channel_cast_and_transpose(x, "e4m3", 128, False, without_transpose, 0.5)
    assert_equal(got[0], data if without_transpose else data.T.contiguous())
    assert_equal(got[1], sf)


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ((False, False, False), (True, True, True)))
def test_swiglu_per_token(layout):
    x = torch.randn(T, 2 * H, device="cuda").to(torch.bfloat16)
    p2t = torch.randint(-1, 2 * T, (T,), dtype=torch.int32, device="cuda")
    weights = torch.rand(T, 2, device="cuda")
    p2e = torch.randint(-1, 4, (T,), dtype=torch.int32, device="cuda")
    counts = [torch.zeros(3, dtype=torch.int64, device="cuda") for _ in range(2)]
    args = ("e4m3", 128, p2t, weights, p2e, *layout, 0.5)
    got = Q.swiglu_forward_and_per_token_cast(x, *args, counts[0], 1e-3)
    want = S.swiglu_forward_and_per_token_cast_reference(x, *args, counts[1], 1e-3)
    kept = p2e >= 0  # skipped rows (pos_to_expert < 0) have unspecified output (quant.md 3.12)
    assert_equal(got[0][kept], want[0][kept])
    sf_got, sf_want = (clear_unused_sf(t, H, 128) if layout[2] else t for t in (got[1], want[1]))
    assert got[1].stride() == want[1].stride()
    assert_equal(sf_got[kept], sf_want[kept])
    assert_equal(counts[0], counts[1])


@pytest.mark.gpu
@pytest.mark.parametrize("fmt,npc,round_sf,e4m3_sf", (("e4m3", 128, True, False), ("e2m1", 32, False, True)))
def test_cast_and_cast_back_in_place(fmt, npc, round_sf, e4m3_sf):
    base = _x()
    x = torch.empty(T, H + 64, device="cuda", dtype=torch.bfloat16)[:, :H]  # strided rows, updated in place
    x.copy_(base)
    assert Q.per_token_cast_and_cast_back(x, fmt, npc, round_sf, e4m3_sf) is None
    assert_equal(x, R.per_token_cast_and_cast_back_values(base, fmt, npc, round_sf, e4m3_sf), check_stride=False)


def _norm_inputs(residual: bool):
    x, r = _x(), (_x() if residual else None)
    w = (torch.rand(H, device="cuda") + 0.5).to(torch.bfloat16)
    return x, r, w


def _o(h_in, w, rstd, scale):
    """The spec's o from a given rstd (products only: exact in torch), as the kernel tier checks it."""
    return ((h_in.float() * rstd.unsqueeze(-1)) * (w.float() * scale)).to(h_in.dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("residual", (False, True))
def test_norm_forward(residual):
    x, r, w = _norm_inputs(residual)
    got = Q.norm_forward(x, w, 1e-6, r, 0.5, with_rstd=True)
    want = N.norm_forward_reference(x, w, 1e-6, r, 0.5, with_rstd=True)
    torch.testing.assert_close(got[1], want[1], rtol=(H + 8) * 2.0 ** -24, atol=0)
    assert_equal(got[2], want[2])
    assert (got[2] is x) == (not residual)
    assert_equal(got[0], _o(want[2], w, got[1], 0.5))
    assert Q.norm_forward(x, w, 1e-6, r, 0.5)[1] is None


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ((False, False, False), (True, True, True)))
def test_norm_forward_and_per_token_cast(layout):
    x, r, w = _norm_inputs(True)
    (data, sf), bf, rstd, norm_input = Q.norm_forward_and_per_token_cast(x, w, 1e-6, "e4m3", 32, r, 1.0, *layout,
                                                                         with_out_bf16=True, with_rstd=True)
    want = N.norm_forward_and_per_token_cast_reference(x, w, 1e-6, "e4m3", 32, r, 1.0, *layout, with_out_bf16=True,
                                                       with_rstd=True)
    torch.testing.assert_close(rstd, want[2], rtol=(H + 8) * 2.0 ** -24, atol=0)
    assert_equal(norm_input, want[3])
    o = _o(want[3], w, rstd, 1.0)
    assert_equal(bf, o)
    _same((data, sf), R.cast(o, "e4m3", (1, 32), round_sf=layout[1], use_tma_aligned_col_major_sf=layout[0],
                             use_packed_ue8m0=layout[2]), npc=32)
    plain = Q.norm_forward_and_per_token_cast(x, w, 1e-6, "bf16", None, r, 1.0)
    assert plain[1] is None and plain[2] is None
    assert_equal(plain[0], _o(want[3], w, Q.norm_forward(x, w, 1e-6, r, 1.0, with_rstd=True)[1], 1.0))


@pytest.mark.gpu
def test_norm_backward():
    x, rg, w = _norm_inputs(True)
    dy = _x()
    rstd = torch.rand(T, device="cuda") + 0.5
    acc = torch.randn(H, device="cuda")
    acc0 = acc.clone()
    rdx, rwg = N.norm_backward_reference(dy, x, w, rstd, rg, 0.75, acc.clone())
    dx, wg = Q.norm_backward(dy, x, w, rstd, rg, 0.75, acc)
    assert wg is acc
    torch.testing.assert_close(dx.float(), rdx.float(), rtol=2 ** -7, atol=2 ** -7)
    # weight_grad: a length-T sum per column, in the kernel's partial order: (T + 8) u of the sum of |terms|
    mag = ((x.float() * rstd[:, None]).abs() * (dy.float() * 0.75).abs()).sum(0) + acc0.abs()
    assert bool(((wg - rwg).abs() <= (T + 8) * 2.0 ** -24 * mag).all())
    assert Q.norm_backward(dy, x, None, rstd)[1] is None
