"""mhc_pre_big_fuse / mhc_pre_big_fuse_fwd (mhc.md §2.8, §5.2).

No tolerances: the spec requires bit-identity with the unfused chain (§3 contract 2).
"""
import pytest
import torch

from tilefuse.mhc import (mhc_pre_apply_mix_fwd, mhc_pre_big_fuse, mhc_pre_big_fuse_fwd, mhc_pre_norm_fn,
                          mhc_pre_split_mixes, mhc_pre_split_mixes_fwd, mhc_reduce_partials_and_rmsnorm_fwd,
                          mhc_sinkhorn_fwd, mhc_pre_apply_mix, sinkhorn_normalize)
from tilefuse.reference import mhc_pre_norm_fn_partials_ref
from tilefuse.testing import assert_equal
from tests.mhc.mhc_helpers import BF16

N, C = 4, 16
K, M = N * C, N * (N + 2)
RMS_EPS, PRE_EPS, SK_EPS, V, REPEAT = 1e-6, 1e-6, 1e-6, 1.0, 10


def _inputs(B=2, S=6):
    residual = torch.randn(B, S, N, C).to(BF16)
    fn = torch.randn(M, K) * 1e-2
    return residual, fn, 0.1 * torch.randn(3), 0.1 * torch.randn(M)


def test_bit_identical_to_unfused_chain():
    residual, fn, scale, base = _inputs()
    post, comb, layer_input = mhc_pre_big_fuse(residual, fn, scale, base, RMS_EPS, PRE_EPS, SK_EPS, V, REPEAT)
    with torch.no_grad():
        mixes = mhc_pre_norm_fn(residual, fn, None, RMS_EPS, fuse_grad_acc=False)
        pre, post_u, comb_u = mhc_pre_split_mixes(mixes, scale, base, N, V, PRE_EPS)
        comb_u = sinkhorn_normalize(comb_u, REPEAT, SK_EPS)
        li_u = mhc_pre_apply_mix(residual, pre)
    assert_equal(post, post_u)
    assert_equal(comb, comb_u)
    assert_equal(layer_input, li_u)
    # the comb output really is Sinkhorn-normalised: columns sum to 1
    assert (comb.sum(-2) - 1).abs().max() < 1e-5


@pytest.mark.parametrize("S", [1, 4])
def test_v21_bit_identical_to_v21_chain(S):
    residual, fn, scale, base = _inputs(1, 9)
    residual = residual[0]
    T = residual.shape[0]
    out_mul, sqrsum = mhc_pre_norm_fn_partials_ref(residual, fn, S)
    out_mul, sqrsum = out_mul[:, :, 0].contiguous(), sqrsum[:, :, 0].contiguous()
    post, comb, li = torch.empty(T, N), torch.empty(T, N * N), torch.empty(T, C, dtype=BF16)
    mhc_pre_big_fuse_fwd(out_mul, sqrsum, scale, base, residual, post, comb, li, RMS_EPS, PRE_EPS, SK_EPS, V,
                         REPEAT, S)
    # unfused v2.1 chain with the same S partials
    pm, q, mixes = torch.empty(T, 1, M), torch.empty(T, 1), torch.empty(T, M)
    mhc_reduce_partials_and_rmsnorm_fwd(out_mul.unsqueeze(2), sqrsum.unsqueeze(2), pm, q, mixes, K, RMS_EPS, S)
    pre, post_u, comb_u = torch.empty(T, N), torch.empty(T, N), torch.empty(T, N * N)
    mhc_pre_split_mixes_fwd(mixes, scale, base, pre, post_u, comb_u, V, PRE_EPS)
    comb_s = torch.empty(T, N, N)
    mhc_sinkhorn_fwd(comb_u.view(T, N, N), comb_s, REPEAT, SK_EPS)
    li_u = torch.empty(T, C, dtype=BF16)
    mhc_pre_apply_mix_fwd(residual, pre, li_u)
    assert_equal(post, post_u)
    assert_equal(comb, comb_s.view(T, N * N))
    assert_equal(li, li_u)
    if S == 1:  # one partial over all of K: the v1 fused op on the same inputs
        v1 = mhc_pre_big_fuse(residual, fn, scale, base, RMS_EPS, PRE_EPS, SK_EPS, V, REPEAT)
        assert_equal(li, v1[2])


def test_zero_tokens():
    residual, fn, scale, base = _inputs(1, 0)
    post, comb, li = mhc_pre_big_fuse(residual, fn, scale, base, RMS_EPS, PRE_EPS, SK_EPS, V, REPEAT)
    assert post.shape == (1, 0, N, 1) and comb.shape == (1, 0, N, N) and li.shape == (1, 0, C)


def test_errors():
    residual, fn, scale, base = _inputs()
    args = (RMS_EPS, PRE_EPS, SK_EPS, V, REPEAT)
    with pytest.raises(ValueError, match="fn"):
        mhc_pre_big_fuse(residual, fn[:20], scale, base, *args)
    with pytest.raises(TypeError, match="residual"):
        mhc_pre_big_fuse(residual.float(), fn, scale, base, *args)
    with pytest.raises(ValueError, match="sinkhorn_repeat"):
        mhc_pre_big_fuse(residual, fn, scale, base, RMS_EPS, PRE_EPS, SK_EPS, V, 0)
    with pytest.raises(ValueError, match="mhc_post_mult_value"):
        mhc_pre_big_fuse(residual, fn, scale, base, RMS_EPS, PRE_EPS, SK_EPS, 0.0, REPEAT)
    T = 3
    li = torch.zeros(T, C, dtype=BF16)
    with pytest.raises(ValueError, match="n_splits"):
        mhc_pre_big_fuse_fwd(torch.zeros(2, T, M), torch.zeros(2, T), scale, base, torch.zeros(T, N, C, dtype=BF16),
                             torch.zeros(T, N), torch.zeros(T, N * N), li, *args, n_splits=16)
    with pytest.raises(ValueError, match="gemm_out_sqrsum"):
        mhc_pre_big_fuse_fwd(torch.zeros(2, T, M), torch.zeros(3, T), scale, base, torch.zeros(T, N, C, dtype=BF16),
                             torch.zeros(T, N), torch.zeros(T, N * N), li, *args, n_splits=2)
