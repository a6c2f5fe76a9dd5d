"""The bench cases of the mHC ops (``tilefuse.mhc``, mhc.md): the v2.1 kernel-level ops of a DeepSeek-V4 layer's
memory-bound and latency-bound steps, at T = 8192 tokens and n = 4 streams. Rows: ``expand_to_mhc`` forward and
backward, ``mhc_pre_apply_mix`` forward and backward, ``mhc_post`` forward and backward at C in {2560, 4096, 7168}
(``--quick``: 4096), the split mixes and the head mix forward and backward (M = n(n + 2) = 24 logits a token; mhc.md
4's v = 2, eps = 1e-2), and the Sinkhorn forward and backward on 32768 matrices of 4 x 4 with 20 iterations (issue
#35's shapes), the norm-weight merge of the projection weight (M = 24, K = 4 C) forward and backward, and the
reduction of 16 split-K partials with the RMS step forward and backward (T = 8192, K = 16384), and the prenorm
projection ``mhc_pre_norm_fn`` (forward; the backward GEMMs) at the issue's T x C = 4096 x 2048 and 8192 x 4096.
``mhc_multilayer_steps`` runs the L apply-mix and P post steps that ``mhc_multilayer_recompute`` fuses, one op a
step (ours; TileKernels 2.1.0's), on its inputs: its bytes are mhc.md 4's ``io_ref`` (the recompute's row counts
``io_fused``), so the recompute's efficiency is the ratio of the two rows' times over the ratio of their bytes.
Inputs are standard normal (the mixes positive, as the layer makes them: sigmoid / softmax of a normal draw; the
Sinkhorn logits as drawn).

Bytes: each input read once and each output written once. The v2.1 ops write into the caller's buffers, so a
case passes the destination as an input and returns it for the agreement check; ``Case.nbytes`` then counts it
once (written), and ``mhc_pre_apply_mix_bwd``'s ``x_grad``, which it reads and accumulates into, twice. That op
is ``Case.in_place`` (the isolated timer restores ``x_grad`` before each call).

Peers: TileKernels 2.1.0 (``tk2``), whose ``tile_kernels.mhc`` has the same v2.1 functions and signatures
(mhc.md 5.2), and ``torch.compile`` of our reference. Agreement by ``calc_diff`` (mhc.md 3: the kernels are not
bit-exact against each other in general); the expansion, a copy, bitwise.
"""
from __future__ import annotations

import torch

from tilefuse.bench.core import Case, _dim, _nbytes

OPS = ("expand_to_mhc_fwd", "expand_to_mhc_bwd", "mhc_pre_apply_mix_fwd", "mhc_pre_apply_mix_bwd", "mhc_post_fwd",
       "mhc_post_bwd", "mhc_pre_split_mixes_fwd", "mhc_pre_split_mixes_bwd", "mhc_head_compute_mix_fwd",
       "mhc_head_compute_mix_bwd", "mhc_sinkhorn_fwd", "mhc_sinkhorn_bwd", "mhc_fn_normw_merge_fwd",
       "mhc_fn_normw_merge_bwd", "mhc_reduce_partials_and_rmsnorm_fwd", "mhc_reduce_partials_and_rmsnorm_bwd",
       "mhc_pre_norm_fn", "mhc_pre_norm_fn_bwd", "mhc_pre_big_fuse_fwd", "mhc_multilayer_recompute",
       "mhc_multilayer_steps", "mhc_layer_step")
# v1 ops -> the v2.1 op whose kernels they run (timed by that op's rows; the v1 fused pre also runs the
# projection's kernels, timed by the mhc_pre_norm_fn rows)
SAME_KERNELS = {"expand_to_mhc": "expand_to_mhc_fwd", "mhc_pre_apply_mix": "mhc_pre_apply_mix_fwd",
                "mhc_post": "mhc_post_fwd", "sinkhorn_normalize": "mhc_sinkhorn_fwd",
                "mhc_pre_split_mixes": "mhc_pre_split_mixes_fwd", "mhc_head_compute_mix": "mhc_head_compute_mix_fwd",
                "mhc_pre_big_fuse": "mhc_pre_big_fuse_fwd"}
N = 4                   # streams (DeepSeek-V4)
TOKENS_LAYER = 8192     # tokens of the layer rows
POST_MULT, PRE_EPS = 2.0, 1e-2  # mhc.md 4's split-mix values
PARTIALS = 132          # the head mix backward's num_sms (an H200's SM count)
SINKHORN_MATRICES = 32768
SINKHORN_REPEAT, SINKHORN_EPS = 20, 1e-6
HIDDEN = (2560, 4096, 7168)
NORM_FN_SHAPES = ((4096, 2048), (8192, 4096))  # (T, C) of the projection rows (issue #35)
QUICK_HIDDEN = 4096
SPLITS, RMS_EPS = 16, 1e-6  # the prenorm projection's split-K partials and RMS epsilon (mhc.md 4)
# the rows' token counts (0: the weight-only rows of the normw merge)
TOKENS = tuple(sorted({0, TOKENS_LAYER, SINKHORN_MATRICES, *(t for t, _ in NORM_FN_SHAPES)}))
BF16, F32 = torch.bfloat16, torch.float32


def _normal(shape, dtype, device) -> torch.Tensor:
    return torch.randn(shape, device=device).to(dtype)


def _positive_mix(shape, device) -> torch.Tensor:
    return torch.randn(shape, device=device).sigmoid()


def _written_once(inputs, outputs) -> int:
    """The inputs' bytes: the destination buffer is among them and is the output (returned for the check)."""
    return _nbytes(inputs)


def _unfused_bytes(inputs, outputs) -> int:
    """``mhc_multilayer_steps`` (mhc.md 4's ``io_ref``, L = P): every per-layer tensor once, and the residual each
    apply and post step reads (two a layer)."""
    return _nbytes(inputs[1:]) + 2 * len(inputs[1]) * _nbytes(inputs[0])


def _accumulated(inputs, outputs) -> int:
    """``mhc_pre_apply_mix_bwd``: every input once, ``x_grad`` (the last) once more (written), and ``mix_grad``."""
    return _nbytes(inputs) + _nbytes(inputs[-1]) + _nbytes(outputs[1])


def _layer_cases(c: int) -> list[Case]:
    from tilefuse import mhc
    from tilefuse.reference import mhc as R

    t, n = TOKENS_LAYER, N
    label = f"T={t} n={n} C={c}"

    def sized(make):
        """``make(t, c, device)`` at the case's shape times ``scale`` (C kept a multiple of 256)."""
        return lambda device, scale: (label if scale == 1.0 else f"T={_dim(t, scale)} n={n} C={_dim(c, scale, 256)}",
                                      make(_dim(t, scale), _dim(c, scale, 256), device))

    def key(name):
        return f"{name}|n={n} C={c}"

    def tk2(name, returns):
        return {"tk2": lambda tk, *args: (getattr(tk.mhc, name)(*args), returns(args))[1]}

    cases = []
    # expand: o[t, i, :] = x[t, :]
    cases.append(Case(
        "expand_to_mhc_fwd",
        sized(lambda t, c, d: (_normal((t, c), BF16, d), torch.empty(t, n, c, dtype=BF16, device=d))),
        lambda x, o: (mhc.expand_to_mhc_fwd(x, o), o)[1],
        lambda x, o: o.copy_(R.expand_to_mhc_ref(x, n)), tk2("expand_to_mhc_fwd", lambda a: a[1]), True,
        key("expand_to_mhc_fwd"), t, describe=lambda: (label, [((t, c), BF16), ((t, n, c), BF16)], []),
        nbytes=_written_once))
    cases.append(Case(
        "expand_to_mhc_bwd",
        sized(lambda t, c, d: (_normal((t, n, c), BF16, d), torch.empty(t, c, dtype=BF16, device=d))),
        lambda g, xg: (mhc.expand_to_mhc_bwd(g, xg), xg)[1],
        lambda g, xg: xg.copy_(R.expand_to_mhc_bwd_ref(g)), tk2("expand_to_mhc_bwd", lambda a: a[1]), False,
        key("expand_to_mhc_bwd"), t, describe=lambda: (label, [((t, n, c), BF16), ((t, c), BF16)], []),
        nbytes=_written_once))
    # apply mix: o[t, :] = sum_i mix[t, i] x[t, i, :]
    cases.append(Case(
        "mhc_pre_apply_mix_fwd",
        sized(lambda t, c, d: (_normal((t, n, c), BF16, d), _positive_mix((t, n), d),
                               torch.empty(t, c, dtype=BF16, device=d))),
        lambda x, mix, o: (mhc.mhc_pre_apply_mix_fwd(x, mix, o), o)[1],
        lambda x, mix, o: o.copy_(R.mhc_pre_apply_mix_ref(x, mix.unsqueeze(-1))),
        tk2("mhc_pre_apply_mix_fwd", lambda a: a[2]), False, key("mhc_pre_apply_mix_fwd"), t,
        describe=lambda: (label, [((t, n, c), BF16), ((t, n), F32), ((t, c), BF16)], []), nbytes=_written_once))
    cases.append(Case(
        "mhc_pre_apply_mix_bwd",
        sized(lambda t, c, d: (_normal((t, c), BF16, d), _normal((t, n, c), BF16, d), _positive_mix((t, n), d),
                               _normal((t, n, c), BF16, d))),
        lambda g, x, mix, xg: (xg, mhc.mhc_pre_apply_mix_bwd(g, x, mix, xg)),
        lambda g, x, mix, xg: [d.view(xg.shape if i == 0 else mix.shape)
                               for i, d in enumerate(R.mhc_pre_apply_mix_bwd_ref(g, x, mix.unsqueeze(-1), xg))],
        {"tk2": lambda tk, g, x, mix, xg: (xg, tk.mhc.mhc_pre_apply_mix_bwd(g, x, mix, xg))}, False,
        key("mhc_pre_apply_mix_bwd"), t, in_place=True,
        describe=lambda: (label, [((t, c), BF16), ((t, n, c), BF16), ((t, n), F32), ((t, n, c), BF16),
                                  ((t, n, c), BF16)], [((t, n), F32)]),
        nbytes=_accumulated))
    # post: R'[o] = post[o] x + sum_i comb[i, o] R[i]   (v1/v2.1 4-D layout [1, T, ...])
    post_inputs = lambda t, c, d: (_normal((1, t, c), BF16, d), _normal((1, t, n, c), BF16, d),  # noqa: E731
                                   _positive_mix((1, t, n, 1), d), _positive_mix((1, t, n, n), d))
    post_specs = [((1, t, c), BF16), ((1, t, n, c), BF16), ((1, t, n, 1), F32), ((1, t, n, n), F32)]
    cases.append(Case(
        "mhc_post_fwd", sized(lambda t, c, d: (*post_inputs(t, c, d), torch.empty(1, t, n, c, dtype=BF16, device=d))),
        lambda x, r, p, cm, out: mhc.mhc_post_fwd(x, r, p, cm, out),
        lambda x, r, p, cm, out: out.copy_(R.mhc_post_ref(x, r, p, cm)),
        {"tk2": lambda tk, *args: tk.mhc.mhc_post_fwd(*args)}, False, key("mhc_post_fwd"), t,
        describe=lambda: (label, [*post_specs, ((1, t, n, c), BF16)], []), nbytes=_written_once))
    cases.append(Case(
        "mhc_post_bwd", sized(lambda t, c, d: (*post_inputs(t, c, d), _normal((1, t, n, c), BF16, d))),
        lambda x, r, p, cm, g: mhc.mhc_post_bwd(x, r, p, cm, g, False),
        lambda x, r, p, cm, g: R.mhc_post_bwd_ref(x, r, p, cm, g),
        {"tk2": lambda tk, *args: tk.mhc.mhc_post_bwd(*args)}, False, key("mhc_post_bwd"), t,
        describe=lambda: (label, [*post_specs, ((1, t, n, c), BF16)],
                          [((1, t, c), BF16), ((1, t, n, c), BF16), ((1, t, n, 1), F32), ((1, t, n, n), F32)])))
    return cases


def _mix_cases() -> list[Case]:
    """The split of a token's 24 mix logits and the head's mix, forward and backward (per-token work and, in the
    backward, the parameter gradients' token partials)."""
    from tilefuse import mhc
    from tilefuse.reference import mhc as R

    t, n, v, eps = TOKENS_LAYER, N, POST_MULT, PRE_EPS
    m = n * (n + 2)
    label = f"T={t} n={n}"

    def sized(make):
        return lambda device, scale: (label if scale == 1.0 else f"T={_dim(t, scale)} n={n}",
                                      make(_dim(t, scale), device))

    def empty(*shape, device):
        return torch.empty(shape, dtype=F32, device=device)

    def split_fwd_ref(x, scale, base, pre, post, comb):
        for out, part in zip((pre, post, comb), R.mhc_pre_split_mixes_ref(x, scale, base, n, v, eps)):
            out.copy_(part.reshape(out.shape))
        return pre, post, comb

    def split_bwd_ref(d_pre, d_post, d_comb, x, post, scale, base, dx, d_scale, d_base):
        for out, part in zip((dx, d_scale, d_base), R.mhc_pre_split_mixes_bwd_ref(d_pre, d_post, d_comb, x, post,
                                                                                  scale, base, v)):
            out.copy_(part)
        return dx, d_scale, d_base

    def head_bwd_ref(d_out, x, scale, base, dx, d_scale, d_base):
        for out, part in zip((dx, d_scale, d_base), R.mhc_head_compute_mix_bwd_ref(d_out, x, scale, base, PARTIALS)):
            out.copy_(part)
        return dx, d_scale, d_base

    split_fwd = lambda ns, x, scale, base, pre, post, comb: (  # noqa: E731
        ns.mhc_pre_split_mixes_fwd(x, scale, base, pre, post, comb, v, eps), (pre, post, comb))[1]
    split_bwd = lambda ns, d_pre, d_post, d_comb, x, post, scale, base, dx, d_scale, d_base: (  # noqa: E731
        ns.mhc_pre_split_mixes_bwd(d_pre, d_post, d_comb, x, post, scale, base, dx, d_scale, d_base, v),
        (dx, d_scale, d_base))[1]
    head_fwd = lambda ns, x, scale, base, out: (  # noqa: E731
        ns.mhc_head_compute_mix_fwd(x, scale, base, out, eps), out)[1]
    head_bwd = lambda ns, d_out, x, scale, base, dx, d_scale, d_base: (  # noqa: E731
        ns.mhc_head_compute_mix_bwd(d_out, x, scale, base, dx, d_scale, d_base, PARTIALS), (dx, d_scale, d_base))[1]
    ours = lambda call: lambda *args: call(mhc, *args)  # noqa: E731
    peer = lambda call: {"tk2": lambda tk, *args: call(tk.mhc, *args)}  # noqa: E731
    f32 = lambda *shape: (shape, F32)  # noqa: E731
    return [
        Case("mhc_pre_split_mixes_fwd",
             sized(lambda t, d: (_normal((t, m), F32, d), _normal((3,), F32, d), _normal((m,), F32, d),
                                 empty(t, n, device=d), empty(t, n, device=d), empty(t, n * n, device=d))),
             ours(split_fwd), split_fwd_ref, peer(split_fwd), False, f"mhc_pre_split_mixes_fwd|n={n}", t,
             describe=lambda: (label, [f32(t, m), f32(3), f32(m), f32(t, n), f32(t, n), f32(t, n * n)], []),
             nbytes=_written_once),
        Case("mhc_pre_split_mixes_bwd",
             sized(lambda t, d: (_normal((t, n), F32, d), _normal((t, n), F32, d), _normal((t, n * n), F32, d),
                                 _normal((t, m), F32, d), _positive_mix((t, n), d) * v, _normal((3,), F32, d),
                                 _normal((m,), F32, d), empty(t, m, device=d), empty(3, device=d),
                                 empty(m, device=d))),
             ours(split_bwd), split_bwd_ref, peer(split_bwd), False, f"mhc_pre_split_mixes_bwd|n={n}", t,
             describe=lambda: (label, [f32(t, n), f32(t, n), f32(t, n * n), f32(t, m), f32(t, n), f32(3), f32(m),
                                       f32(t, m), f32(3), f32(m)], []),
             nbytes=_written_once),
        Case("mhc_head_compute_mix_fwd",
             sized(lambda t, d: (_normal((t, n), F32, d), _normal((1,), F32, d), _normal((n,), F32, d),
                                 empty(t, n, device=d))),
             ours(head_fwd), lambda x, scale, base, out: out.copy_(R.mhc_head_compute_mix_ref(x, scale, base, eps)),
             peer(head_fwd), False, f"mhc_head_compute_mix_fwd|n={n}", t,
             describe=lambda: (label, [f32(t, n), f32(1), f32(n), f32(t, n)], []), nbytes=_written_once),
        Case("mhc_head_compute_mix_bwd",
             sized(lambda t, d: (_normal((t, n), F32, d), _normal((t, n), F32, d), _normal((1,), F32, d),
                                 _normal((n,), F32, d), empty(t, n, device=d), empty(PARTIALS, 1, device=d),
                                 empty(PARTIALS, n, device=d))),
             ours(head_bwd), head_bwd_ref, peer(head_bwd), False, f"mhc_head_compute_mix_bwd|n={n}", t,
             describe=lambda: (label, [f32(t, n), f32(t, n), f32(1), f32(n), f32(t, n), f32(PARTIALS, 1),
                                       f32(PARTIALS, n)], []),
             nbytes=_written_once),
    ]


def _sinkhorn_cases() -> list[Case]:
    from tilefuse import mhc
    from tilefuse.reference import mhc as R

    m, n, rep, eps = SINKHORN_MATRICES, N, SINKHORN_REPEAT, SINKHORN_EPS
    label = f"{m} x {n} x {n}, {rep} iterations"

    def sized(make):
        return lambda device, scale: (label if scale == 1.0 else f"{_dim(m, scale)} x {n} x {n}, {rep} iterations",
                                      make(_dim(m, scale), device))

    spec = ((m, n, n), F32)
    return [
        Case("mhc_sinkhorn_fwd",
             sized(lambda m, d: (_normal((m, n, n), F32, d), torch.empty(m, n, n, dtype=F32, device=d))),
             lambda x, out: (mhc.mhc_sinkhorn_fwd(x, out, rep, eps), out)[1],
             lambda x, out: out.copy_(R.sinkhorn_normalize_ref(x, rep, eps)),
             {"tk2": lambda tk, x, out: (tk.mhc.mhc_sinkhorn_fwd(x, out, rep, eps), out)[1]}, False,
             f"mhc_sinkhorn_fwd|n={n} R={rep}", m, describe=lambda: (label, [spec, spec], []), nbytes=_written_once),
        Case("mhc_sinkhorn_bwd",
             sized(lambda m, d: (_normal((m, n, n), F32, d), _normal((m, n, n), F32, d),
                                 torch.empty(m, n, n, dtype=F32, device=d))),
             lambda g, x, gx: (mhc.mhc_sinkhorn_bwd(g, x, gx, rep, eps), gx)[1],
             lambda g, x, gx: gx.copy_(R.sinkhorn_normalize_bwd_ref(g, x, rep, eps)),
             {"tk2": lambda tk, g, x, gx: (tk.mhc.mhc_sinkhorn_bwd(g, x, gx, rep, eps), gx)[1]}, False,
             f"mhc_sinkhorn_bwd|n={n} R={rep}", m, describe=lambda: (label, [spec, spec, spec], []),
             nbytes=_written_once),
    ]


def _normw_cases(c: int) -> list[Case]:
    """The norm-weight merge of the projection weight ``fn [M, K]`` (K = n C) and its backward, which accumulates
    into the caller's ``fn_grad`` and ``normw_grad`` (``Case.in_place``; bytes: every input read, the two
    accumulated gradients written)."""
    from tilefuse import mhc
    from tilefuse.reference import mhc as R

    n = N
    m = n * (n + 2)
    label = f"M={m} K={n * c}"

    def sized(make):
        return lambda device, scale: (label if scale == 1.0 else f"M={m} K={n * _dim(c, scale, 256)}",
                                      make(n * _dim(c, scale, 256), device))

    def weights(k, d):
        return _normal((m, k), F32, d) * 1e-2, 1 + 0.1 * _normal((k,), F32, d)

    def bwd_ref(fn, w, dw, fn_grad, w_grad):
        d_fn, d_w = R.mhc_fn_normw_merge_bwd_ref(fn, w, dw)
        return fn_grad + d_fn, w_grad + d_w

    k = n * c
    mk, kk = ((m, k), F32), ((k,), F32)
    return [
        Case("mhc_fn_normw_merge_fwd",
             sized(lambda k, d: (*weights(k, d), torch.empty(m, k, dtype=F32, device=d))),
             lambda fn, w, out: (mhc.mhc_fn_normw_merge_fwd(fn, w, out), out)[1],
             lambda fn, w, out: out.copy_(fn * w),
             {"tk2": lambda tk, fn, w, out: (tk.mhc.mhc_fn_normw_merge_fwd(fn, w, out), out)[1]}, True,
             f"mhc_fn_normw_merge_fwd|K={k}", 0, describe=lambda: (label, [mk, kk, mk], []), nbytes=_written_once),
        Case("mhc_fn_normw_merge_bwd",
             sized(lambda k, d: (*weights(k, d), _normal((m, k), F32, d), _normal((m, k), F32, d),
                                 _normal((k,), F32, d))),
             lambda fn, w, dw, fg, wg: (mhc.mhc_fn_normw_merge_bwd(fn, w, dw, fg, wg), (fg, wg))[1],
             bwd_ref,
             {"tk2": lambda tk, fn, w, dw, fg, wg: (tk.mhc.mhc_fn_normw_merge_bwd(fn, w, dw, fg, wg), (fg, wg))[1]},
             False, f"mhc_fn_normw_merge_bwd|K={k}", 0, in_place=True,
             describe=lambda: (label, [mk, kk, mk, mk, kk], [mk, kk])),
    ]


def _reduce_cases() -> list[Case]:
    """The prenorm projection's reduction of ``S`` split-K partials with the RMS step (T = 8192, n = 4, C = 4096:
    K = 16384, M = 24, S = 16) and its backward. Partials of a GEMM's sizes: ``Q / K`` about 1."""
    from tilefuse import mhc
    from tilefuse.reference import mhc as R

    t, n, s, eps = TOKENS_LAYER, N, SPLITS, RMS_EPS
    m, k = n * (n + 2), n * QUICK_HIDDEN
    label = f"T={t} S={s} M={m} K={k}"

    def sized(make):
        return lambda device, scale: (label if scale == 1.0 else f"T={_dim(t, scale)} S={s} M={m} K={k}",
                                      make(_dim(t, scale), device))

    def empty(*shape, device):
        return torch.empty(shape, dtype=F32, device=device)

    def partials(t, d):
        return (_normal((s, t, 1, m), F32, d) * (k / s) ** 0.5 * 1e-2,
                (0.5 + torch.rand(s, t, 1, device=d)) * (k / s))

    def fwd_ref(ps, qs, pm, qm, out):
        for dst, part in zip((pm, qm, out), R.mhc_reduce_partials_and_rmsnorm_ref(ps, qs, k, eps)):
            dst.copy_(part)
        return pm, qm, out

    def bwd_ref(d_out, pm, qm, dpm, dqm):
        for dst, part in zip((dpm, dqm), R.mhc_reduce_partials_and_rmsnorm_bwd_ref(d_out, pm, qm, k, eps)):
            dst.copy_(part)
        return dpm, dqm

    def saved(t, d):
        pm = _normal((t, 1, m), F32, d) * k ** 0.5 * 1e-2
        return pm, (0.5 + torch.rand(t, 1, device=d)) * k

    def fwd(ns, ps, qs, pm, qm, out):
        ns.mhc_reduce_partials_and_rmsnorm_fwd(ps, qs, pm, qm, out, k, eps, s)
        return pm, qm, out

    def bwd(ns, d_out, pm, qm, dpm, dqm):
        ns.mhc_reduce_partials_and_rmsnorm_bwd(d_out, pm, qm, dpm, dqm, k, eps)
        return dpm, dqm

    f32 = lambda *shape: (shape, F32)  # noqa: E731
    return [
        Case("mhc_reduce_partials_and_rmsnorm_fwd",
             sized(lambda t, d: (*partials(t, d), empty(t, 1, m, device=d), empty(t, 1, device=d),
                                 empty(t, m, device=d))),
             lambda *args: fwd(mhc, *args), fwd_ref, {"tk2": lambda tk, *args: fwd(tk.mhc, *args)}, False,
             f"mhc_reduce_partials_and_rmsnorm_fwd|S={s} M={m}", t,
             describe=lambda: (label, [f32(s, t, 1, m), f32(s, t, 1), f32(t, 1, m), f32(t, 1), f32(t, m)], []),
             nbytes=_written_once),
        Case("mhc_reduce_partials_and_rmsnorm_bwd",
             sized(lambda t, d: (_normal((t, m), F32, d), *saved(t, d), empty(t, 1, m, device=d),
                                 empty(t, 1, device=d))),
             lambda *args: bwd(mhc, *args), bwd_ref, {"tk2": lambda tk, *args: bwd(tk.mhc, *args)}, False,
             f"mhc_reduce_partials_and_rmsnorm_bwd|M={m}", t,
             describe=lambda: (label, [f32(t, m), f32(t, 1, m), f32(t, 1), f32(t, 1, m), f32(t, 1)], []),
             nbytes=_written_once),
    ]


def _fused_cases(c: int) -> list[Case]:
    """The fused pre from external GEMM partials (``mhc_pre_big_fuse_fwd``: reduce + RMS, split, Sinkhorn, apply;
    T = 8192, S = 16, mhc.md 4's epsilons, v = 1, 10 Sinkhorn iterations) and the recompute of L = 10 layers
    with P = 10 post steps on [1, 8192] tokens (mhc.md 4's benchmark: every tensor once is its ``io_fused``)."""
    from tilefuse import mhc
    from tilefuse.reference import mhc as R

    t, n, s, layers = TOKENS_LAYER, N, SPLITS, 10
    m = n * (n + 2)
    eps, v, rep = 1e-6, 1.0, 10
    label = f"T={t} n={n} C={c}"

    def sized(make):
        return lambda device, scale: (label if scale == 1.0 else f"T={_dim(t, scale)} n={n} C={_dim(c, scale, 256)}",
                                      make(_dim(t, scale), _dim(c, scale, 256), device))

    def fuse_inputs(t, c, d):
        k = n * c
        return (_normal((s, t, m), F32, d) * (k / s) ** 0.5 * 1e-2, (0.5 + torch.rand(s, t, device=d)) * (k / s),
                _normal((3,), F32, d) * 0.1, _normal((m,), F32, d) * 0.1, _normal((t, n, c), BF16, d),
                torch.empty(t, n, device=d), torch.empty(t, n * n, device=d),
                torch.empty(t, c, dtype=BF16, device=d))

    def fuse(ns, ps, qs, scale, base, res, post, comb, li):
        ns.mhc_pre_big_fuse_fwd(ps, qs, scale, base, res, post, comb, li, eps, eps, eps, v, rep, s)
        return post, comb, li

    def fuse_ref(ps, qs, scale, base, res, post, comb, li):
        k = res.shape[1] * res.shape[2]
        _, _, mixes = R.mhc_reduce_partials_and_rmsnorm_ref(ps.unsqueeze(2), qs.unsqueeze(2), k, eps)
        pre, p, cm = R.mhc_pre_split_mixes_ref(mixes, scale, base, n, v, eps)
        post.copy_(p.view(post.shape))
        comb.copy_(R.sinkhorn_normalize_ref(cm, rep, eps).view(comb.shape))
        li.copy_(R.mhc_pre_apply_mix_ref(res, pre))
        return post, comb, li

    def layer_inputs(t, c, d):
        return (_normal((1, t, n, c), BF16, d), [_positive_mix((1, t, n, 1), d) for _ in range(layers)],
                [_normal((1, t, c), BF16, d) for _ in range(layers)],
                [_positive_mix((1, t, n, 1), d) for _ in range(layers)],
                [_positive_mix((1, t, n, n), d) for _ in range(layers)],
                [torch.empty(1, t, c, dtype=BF16, device=d) for _ in range(layers)],
                [torch.empty(1, t, n, c, dtype=BF16, device=d) for _ in range(layers)])

    def recompute(ns, r0, pre, out, post, comb, li, res):
        ns.mhc_multilayer_recompute(r0, pre, out, post, comb, li, res)
        return li, res

    def steps(ns, r0, pre, out, post, comb, li, res):
        # the unfused chain the recompute replaces: the apply-mix and post ops, one a step
        r = r0
        for l in range(layers):
            ns.mhc_pre_apply_mix_fwd(r.flatten(0, 1), pre[l].flatten(0, 1).squeeze(-1), li[l].flatten(0, 1))
            r = ns.mhc_post_fwd(out[l], r, post[l], comb[l], res[l])
        return li, res

    def recompute_ref(r0, pre, out, post, comb, li, res):
        r = r0
        for l in range(layers):
            li[l].copy_(R.mhc_pre_apply_mix_ref(r, pre[l]))
            r = res[l].copy_(R.mhc_post_ref(out[l], r, post[l], comb[l]))
        return li, res

    f32 = lambda *shape: (shape, F32)  # noqa: E731
    per_layer = [f32(1, t, n, 1), ((1, t, c), BF16), f32(1, t, n, 1), f32(1, t, n, n), ((1, t, c), BF16),
                 ((1, t, n, c), BF16)]
    per_step = per_layer + [((1, t, n, c), BF16)] * 2  # and the residual each step reads (two a layer)
    return [
        Case("mhc_pre_big_fuse_fwd", sized(fuse_inputs), lambda *args: fuse(mhc, *args), fuse_ref,
             {"tk2": lambda tk, *args: fuse(tk.mhc, *args)}, False, f"mhc_pre_big_fuse_fwd|n={n} C={c}", t,
             describe=lambda: (label, [f32(s, t, m), f32(s, t), f32(3), f32(m), ((t, n, c), BF16), f32(t, n),
                                       f32(t, n * n), ((t, c), BF16)], []),
             nbytes=_written_once),
        Case("mhc_multilayer_recompute", sized(layer_inputs), lambda *args: recompute(mhc, *args), recompute_ref,
             {"tk2": lambda tk, *args: recompute(tk.mhc, *args)}, False, f"mhc_multilayer_recompute|n={n} C={c}",
             t, describe=lambda: (label, [((1, t, n, c), BF16), *per_layer * layers], []),
             nbytes=_written_once),
        # the recompute's efficiency (mhc.md 4): this row's time over the recompute's, divided by io_ref / io_fused
        # (this row's bytes over the recompute's row's)
        Case("mhc_multilayer_steps", sized(layer_inputs), lambda *args: steps(mhc, *args), recompute_ref,
             {"tk2": lambda tk, *args: steps(tk.mhc, *args)}, False,
             f"mhc_multilayer_steps|n={n} C={c}", t,
             describe=lambda: (label, per_step * layers, []), nbytes=_unfused_bytes),
    ]


def _norm_fn_cases(t: int, c: int) -> list[Case]:
    """The prenorm projection (a skinny TF32 GEMM, K = n C by M = 24, plus the RMS factor). ``mhc_pre_norm_fn``:
    the v1 autograd op's forward. ``mhc_pre_norm_fn_bwd``: its backward GEMMs (no public op of their own: the
    autograd layer's ``norm_fn_gemm_bwd``) from the RMS step's gradients ``d_mul [T, M]``, ``d_sq [T]``: the
    residual gradient accumulated into ``x_grad`` (``Case.in_place``) and the weight gradient. The peer is
    TileKernels 1.0.0 (2.1.0 dropped the GEMM, mhc.md 5.1): its v1 op, and its backward GEMM kernel after its
    TF32 rounding of ``d_mul``. Inputs: mhc.md 4's scales (weight N 1e-4)."""
    import importlib

    from tilefuse import mhc
    from tilefuse.mhc import _functions as F
    from tilefuse.reference import mhc as R

    n = N
    m = n * (n + 2)
    label = f"T={t} n={n} C={c}"

    def sized(make):
        return lambda device, scale: (label if scale == 1.0 else f"T={_dim(t, scale)} n={n} C={_dim(c, scale, 256)}",
                                      make(_dim(t, scale), _dim(c, scale, 256), device))

    def fwd_inputs(t, c, d):
        return _normal((1, t, n, c), BF16, d), _normal((m, n * c), F32, d) * 1e-4

    def bwd_inputs(t, c, d):
        return (_normal((t, m), F32, d), _normal((t,), F32, d) * 1e-3, *fwd_inputs(t, c, d),
                _normal((1, t, n, c), BF16, d))

    def ours_bwd(d_mul, d_sq, x, fn, x_grad):
        return x_grad, F.norm_fn_gemm_bwd(d_mul, d_sq, x, fn, x_grad)[1]

    def ref_bwd(d_mul, d_sq, x, fn, x_grad):
        dx, d_fn = R.mhc_pre_norm_fn_gemm_bwd_ref(d_mul, d_sq, x, fn, x_grad)
        return x_grad.copy_(dx), d_fn

    def tk1_bwd(tk, d_mul, d_sq, x, fn, x_grad):
        kern = importlib.import_module(tk.__name__ + ".mhc.norm_fn_kernel")
        d_fn = torch.empty_like(fn)
        kern._mhc_pre_norm_fn_bwd_mul(m, 1, n * c)(kern.round_to_tf32(d_mul).view(-1, 1, m), d_sq.view(-1, 1),
                                                   x.view(-1, n * c), fn, x_grad.view(-1, n * c), d_fn)
        return x_grad, d_fn

    def tk1_fwd(tk, r, f):
        return importlib.import_module(tk.__name__ + ".modeling.mhc.ops").mhc_pre_norm_fn(r, f, None, RMS_EPS, False)

    x_spec, fn_spec, xg_spec = ((1, t, n, c), BF16), ((m, n * c), F32), ((1, t, n, c), BF16)
    return [
        Case("mhc_pre_norm_fn", sized(fwd_inputs), lambda r, f: mhc.mhc_pre_norm_fn(r, f, None, RMS_EPS, False),
             lambda r, f: R.mhc_pre_norm_fn_ref(r, f, None, RMS_EPS), {"tk1": tk1_fwd}, False,
             f"mhc_pre_norm_fn|n={n} C={c}", t, describe=lambda: (label, [x_spec, fn_spec], [((1, t, m), F32)])),
        Case("mhc_pre_norm_fn_bwd", sized(bwd_inputs), ours_bwd, ref_bwd, {"tk1": tk1_bwd}, False,
             f"mhc_pre_norm_fn_bwd|n={n} C={c}", t, in_place=True,
             describe=lambda: (label, [((t, m), F32), ((t,), F32), x_spec, fn_spec, xg_spec], [xg_spec, fn_spec])),
    ]


def _step_cases(c: int) -> list[Case]:
    """One layer step of the autograd layer (``mhc_layer_step``): ``mhc_pre`` (projection, split, Sinkhorn of
    10 iterations, apply) then ``mhc_post`` with the layer input as the sublayer's output, forward and backward
    from a given output gradient, at T = 8192, n = 4 (mhc.md 4's split-mix values). It returns the new residual
    and the residual's gradient. Peers: the same composition of TileKernels 1.0.0's autograd ops (2.1.0 has no
    projection), and Liger-Kernel's (its coefficient op takes the projection transposed, ``[n C, M]``). Its bytes
    are the inputs and outputs once, not the traffic of the dozen kernels: its copy ratio is no target."""
    from tilefuse import mhc
    from tilefuse.modeling import mhc as layer
    from tilefuse.reference import mhc as R

    t, n, m = TOKENS_LAYER, N, N * (N + 2)
    label = f"T={t} n={n} C={c}"
    transposed = {}  # Liger's [n C, M] leaf of each projection, made once (outside the timed calls)

    def sized(make):
        return lambda device, scale: (label if scale == 1.0 else f"T={_dim(t, scale)} n={n} C={_dim(c, scale, 256)}",
                                      make(_dim(t, scale), _dim(c, scale, 256), device))

    def inputs(t, c, d):
        return (_normal((1, t, n, c), BF16, d).requires_grad_(), (_normal((m, n * c), F32, d) * 1e-4).requires_grad_(),
                (_normal((3,), F32, d) * 0.1).requires_grad_(), (_normal((m,), F32, d) * 0.1).requires_grad_(),
                _normal((1, t, n, c), BF16, d))

    def step(pre, post, r, fn, scale, base, grad):
        for leaf in (r, fn, scale, base):
            leaf.grad = None
        u, (p, comb) = pre(r, fn, scale, base)
        out = post(u, r, p, comb)
        out.backward(grad)
        return out.detach(), r.grad

    def ours(r, fn, scale, base, grad):
        return step(lambda *a: layer.mhc_pre(*a, post_mult_value=POST_MULT, pre_eps=PRE_EPS), mhc.mhc_post,
                    r, fn, scale, base, grad)

    def ref_pre(r, fn, scale, base):
        mixes = R.mhc_pre_norm_fn_ref(r, fn, None, RMS_EPS)
        pre, p, comb = R.mhc_pre_split_mixes_ref(mixes, scale, base, n, POST_MULT, PRE_EPS)
        return R.mhc_pre_apply_mix_ref(r, pre), (p, R.sinkhorn_normalize_ref(comb, 10, SINKHORN_EPS))

    def tk1(tk, r, fn, scale, base, grad):
        import importlib
        functional = importlib.import_module(tk.__name__ + ".modeling.mhc.functional")
        return step(lambda *a: functional.mhc_pre(*a, post_mult_value=POST_MULT, pre_eps=PRE_EPS),
                    functional.mhc_post, r, fn, scale, base, grad)

    def liger(lk, r, fn, scale, base, grad):
        import importlib
        ops = importlib.import_module(lk.__name__ + ".ops.mhc")
        key = (fn.data_ptr(), fn.shape)
        if key not in transposed:
            transposed[key] = fn.detach().t().contiguous().requires_grad_()
        phi = transposed[key]
        phi.grad = None

        def pre(r, fn, scale, base):
            h_pre, h_post, h_res = ops.LigerMHCCoeffsFunction.apply(
                r, phi, base, scale[0], scale[1], scale[2], False, 10, RMS_EPS, PRE_EPS, SINKHORN_EPS, POST_MULT)
            return ops.LigerMHCPreFunction.apply(r, h_pre), (h_post, h_res)

        return step(pre, lambda u, r, p, comb: ops.LigerMHCPostResFunction.apply(r, u, p, comb),
                    r, fn, scale, base, grad)

    def close(ours, theirs):
        """The new residual within 1e-6 and its gradient within 1e-5 (calc_diff): a layer's residual gradient
        sums three bf16 gradients, so implementations differ at bf16 level (mhc.md 3: about 3e-6)."""
        from tilefuse.testing import calc_diff

        diffs = [calc_diff(a.float(), b.float()) for a, b in zip(ours, theirs)]
        return diffs[0] <= 1e-6 and diffs[1] <= 1e-5, "calc_diff " + " / ".join(f"{d:.1e}" for d in diffs)

    x_spec = ((1, t, n, c), BF16)
    return [Case("mhc_layer_step", sized(inputs), ours, lambda *a: step(ref_pre, R.mhc_post_ref, *a),
                 {"tk1": tk1, "liger": liger}, False, f"mhc_layer_step|n={n} C={c}", t,
                 check={"compile": close, "tk1": close, "liger": close},
                 describe=lambda: (label, [x_spec, ((m, n * c), F32), ((3,), F32), ((m,), F32), x_spec],
                                   [x_spec, x_spec]))]


def quick_cases() -> list[Case]:
    return (_layer_cases(QUICK_HIDDEN) + _mix_cases() + _sinkhorn_cases() + _normw_cases(QUICK_HIDDEN)
            + _reduce_cases() + [case for t, c in NORM_FN_SHAPES for case in _norm_fn_cases(t, c)]
            + _fused_cases(QUICK_HIDDEN) + _step_cases(QUICK_HIDDEN))


def grid_cases() -> list[Case]:
    return ([case for c in HIDDEN for case in _layer_cases(c)] + _mix_cases() + _sinkhorn_cases()
            + [case for c in HIDDEN for case in _normw_cases(c)] + _reduce_cases()
            + [case for t, c in NORM_FN_SHAPES for case in _norm_fn_cases(t, c)]
            + [case for c in HIDDEN for case in _fused_cases(c)] + _step_cases(QUICK_HIDDEN))


DECODE_HIDDEN = 4096  # the one-token host calls' C


def host_calls(device: str = "cuda") -> list:
    """The one-token decode calls of an mHC sub-layer (T = 1, n = 4, C = 4096) for ``--host-overhead``: the post
    and the apply-mix forward, each as a bare TileLang call (JITKernel, preallocated output) beside its public ops,
    and the three-launch fused pre (``mhc_pre_big_fuse``) alone. Each call returns its output, so a test can check
    that the calls of a group compute the same thing."""
    from tilefuse import _jit, mhc

    n, c = N, DECODE_HIDDEN
    x = _normal((1, 1, c), BF16, device)
    residual = _normal((1, 1, n, c), BF16, device)
    post = _positive_mix((1, 1, n, 1), device)
    comb = _positive_mix((1, 1, n, n), device)
    out = torch.empty_like(residual)
    stream = residual.view(1, n, c)
    mix = post.view(1, n)
    layer_input = torch.empty(1, c, dtype=BF16, device=device)
    fn = _normal((n * (n + 2), n * c), F32, device)
    scale, base = _normal((3,), F32, device), _normal((n * (n + 2),), F32, device)
    calls = []
    if device == "cuda":
        post_jk = _jit.get_jit_kernel("mhc_post_fwd", (n, c))
        apply_jk = _jit.get_jit_kernel("mhc_apply_mix_fwd", (n, c))
        post_flat = (x.view(1, c), stream, mix, comb.view(1, n, n))
        calls += [
            ("post", "bare TileLang kernel call (JITKernel, preallocated outputs)",
             lambda: (post_jk(*post_flat, out.view(1, n, c)), out)[1]),
            ("apply", "bare TileLang kernel call (JITKernel, preallocated outputs)",
             lambda: (apply_jk(stream, mix, layer_input), layer_input)[1]),
        ]
    calls += [
        ("post", "tilefuse.mhc.mhc_post_fwd (public op, preallocated out)",
         lambda: mhc.mhc_post_fwd(x, residual, post, comb, out)),
        ("post", "tilefuse.mhc.mhc_post (autograd op, inputs without grad: its forward alone)",
         lambda: mhc.mhc_post(x, residual, post, comb)),
        ("apply", "tilefuse.mhc.mhc_pre_apply_mix_fwd (public op, preallocated o)",
         lambda: (mhc.mhc_pre_apply_mix_fwd(stream, mix, layer_input), layer_input)[1]),
        ("pre", "tilefuse.mhc.mhc_pre_big_fuse (public op: three launches)",
         lambda: mhc.mhc_pre_big_fuse(residual, fn, scale, base, RMS_EPS, PRE_EPS, SINKHORN_EPS, POST_MULT, 20)[2]),
    ]
    groups = {"post": f"mhc_post_fwd, n={n} C={c}, 1 token", "apply": f"mhc_pre_apply_mix_fwd, n={n} C={c}, 1 token",
              "pre": "other public ops"}
    return [(groups[g], name, call) for g, name, call in calls]
