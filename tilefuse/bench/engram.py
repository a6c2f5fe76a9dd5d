"""The bench cases of the Engram ops (``tilefuse.engram``, engram.md): the gate of one Engram layer at the issue's
shapes (T = 8192 tokens, M = 4 branches, H in {4096, 7168}), the n-gram hash, the fused weight and the v2.1
Sinkhorn helpers.

Rows (``--quick`` and the grid alike; the grid adds the momentum update without Nesterov):

- ``engram_gate_fwd``, statistics saved and not, at each H. The input is one packed ``kv (T, M+1, H)`` bf16 tensor:
  we read ``k = kv[:, :M]`` and ``v = kv[:, M]`` through strided views (our v1 op takes any strides with a unit last
  stride), TileKernels 2.1.0 gets ``kv`` itself, so both read the very same bytes. engram.md 4's data: x, kv, w_h,
  w_e standard normal bf16, ``w = w_h w_e`` fp32, eps = 1e-20, clamp = 1e-6.
- ``engram_gate_bwd`` including ``grad_w_reduce`` at each H: the backward from the *reference's* forward statistics
  (engram.md 3.4: the backward is validated with them), then the reduction of its 132 partials into two fp32
  accumulators. The accumulators are the caller's (a Megatron ``main_grad``), updated in place: the row is
  ``Case.in_place`` and the isolated timer restores them to zero before each call (untimed), so the timed region
  holds the backward and the reduction only (fresh accumulators made inside the call would add two fill kernels to
  both sides, and the check would see the same zero start).
- ``grad_w_reduce`` alone at each H (engram.md 4's row: random partials ``(132, 4, H)`` and accumulators).
- ``engram_hash`` at T = 8192, (N, L, K) = (3, 2, 8), engram.md 4's draw.
- ``fused_weight`` at M = 4, H in {4096, 7168}.
- The Sinkhorn helpers on the matrices the Engram layer's hidden sizes give: R = 4096 rows of D in {4096, 7168}
  (engram.md has no Sinkhorn benchmark shape; the kernels register exactly these). ``engram_sinkhorn_step`` writes
  3 x 132 = 396 partial rows, as TileKernels does on a 132-SM H100/H200, so the two partial buffers compare element
  by element there (on another SM count TileKernels' buffer has another shape and the check says so);
  ``engram_sinkhorn_step_reduce`` reduces a ``(396, D)`` buffer. ``engram_sinkhorn_momentum_update``: one row per
  (grad, buffer) dtype pair on a ``(4096, 7168)`` matrix, the base matrix of the D = 7168 rows (29.4 M elements,
  294 to 470 MB: far beyond L2, so the row measures bandwidth), beta1 = 0.9; Nesterov in ``--quick``, both flags in
  the grid. Data: the matrix standard normal fp32, the row and column scales uniform in [0.5, 1.5), eps = 1e-6,
  alpha = 0.7.
- ``engram_gate_step`` (the layer): ``tilefuse.modeling.engram.engram_gate`` forward and backward from a given
  output gradient at T = 8192, M = 4, H = 4096. Its inputs are leaves that require grad (the runner clones them as
  fresh leaves; the config trace skips the row, whose kernels the op rows trace). Ours reads ``k`` and ``v`` as leaf
  views of the packed ``kv`` (gradients ``k.grad``, ``v.grad``: what our v1 API returns), TileKernels 2.1.0 runs its
  own ``modeling.engram.engram_gate`` on the flat ``kv [T, (M+1) H]`` (gradient ``kv.grad``), TileKernels 1.0.0 its
  v1 layer on the same leaf views as ours. Its bytes are the inputs and outputs once, not the traffic of its
  kernels: its copy ratio is no target.

Bytes: each input read once and each output written once (``core.counted_bytes``), which is engram.md 4's
accounting (gate forward: x, k, v, w, output and, saved, dot, gate, rstd_x, rstd_k; gate backward: grad_out, x, k,
v, w, the four statistics, grad_x, grad_k, grad_v and the two fp32 weight gradients, the partial buffer not counted)
plus, in the backward row, what ``grad_w_reduce`` reads besides the partials: w_h, w_e and the accumulators it adds
to (192 KB at H = 4096, of 1.48 GB). In-place results are returned for the check and counted as written: the
momentum buffer, ``row_scale`` of the Sinkhorn step, the accumulators. The step reduce's destination is counted
once (written; ``Case.nbytes``).

Peers: TileKernels 2.1.0 (``tk2``, its v2.1 ``tile_kernels.engram`` API: the issue's yardstick), TileKernels 1.0.0
(``tk1``, in its second process: the v1 API, ours, called on the same strided views; it has no Sinkhorn helpers)
and ``torch.compile`` of our reference.
Agreement: bitwise for the hash, the fused weight, the momentum update, the step reduce and ``grad_w_reduce``
(engram.md 3.4); otherwise ``calc_diff`` per output under engram.md's bounds (``Case.check``): gate forward
outputs and statistics < 2e-10 (3.2), gate backward gradients < 1e-8 (3.2), Sinkhorn row norms, row scales and
finalize < 1e-14 and partial column sums < 1e-13 (the kernel tests' bounds, from 3.3's measurements), and the layer
step's output < 2e-10 and gradients < 1e-6 (each implementation's backward runs on its own forward statistics: 3.3
measured up to 6.1e-7 for upstream against the reference).
"""
from __future__ import annotations

import torch

from tilefuse.bench.core import Case, _dim, _nbytes, tensors
from tilefuse.bench.peers import _bytes

OPS = ("engram_gate_fwd", "engram_gate_bwd", "grad_w_reduce", "engram_hash", "fused_weight",
       "engram_sinkhorn_momentum_update", "engram_sinkhorn_step", "engram_sinkhorn_step_reduce",
       "engram_sinkhorn_finalize", "engram_gate_step")
M = 4                       # branches (hc_mult)
HIDDEN = (4096, 7168)       # the hidden sizes
TOKENS_GATE = 8192          # the gate's and the hash's T
STEP_HIDDEN = 4096          # the layer step's H
EPS, CLAMP = 1e-20, 1e-6    # the gate's eps and clamp (upstream's values, engram.md 4)
PARTIALS = 132              # the gate backward's partial rows (tilefuse.engram.ops.DEFAULT_NUM_SMS)
NGRAM, LAYERS, TABLES = 3, 2, 8  # the hash's (N, L, K)
SINKHORN_ROWS = 4096        # R of the Sinkhorn matrices
SINKHORN_PARTIALS = 3 * PARTIALS
SINKHORN_EPS, ALPHA, BETA1 = 1e-6, 0.7, 0.9
MOMENTUM_SHAPE = (SINKHORN_ROWS, 7168)
# the rows' token counts: the gate and hash T, the Sinkhorn matrices' R, 0 for the weight-only rows
TOKENS = (0, SINKHORN_ROWS, TOKENS_GATE)
FWD_DIFF, BWD_DIFF, STEP_GRAD_DIFF = 2e-10, 1e-8, 1e-6
ROW_DIFF, COL_DIFF = 1e-14, 1e-13
BF16, F32 = torch.bfloat16, torch.float32
_DT = {BF16: "bf16", F32: "fp32"}


def _normal(shape, dtype, device) -> torch.Tensor:
    return torch.randn(shape, device=device).to(dtype)


def _hidden(h: int, scale: float) -> int:
    """``h * scale`` on the gate backward's alignment (a multiple of 512, at least 1024)."""
    return max(1024, _dim(h, scale, 512))


def _within(*bounds):
    """A check ``(ours, theirs) -> (ok, text)``: output ``i`` bitwise equal or within ``calc_diff < bounds[i]`` (the
    last bound serves the outputs past the list)."""
    def check(ours, theirs):
        from tilefuse.testing import calc_diff

        a, b = tensors(ours), tensors(theirs)
        if len(a) != len(b):
            return False, f"{len(a)} vs {len(b)} outputs"
        diffs, ok = [], True
        for i, (x, y) in enumerate(zip(a, b)):
            if tuple(x.shape) != tuple(y.shape) or x.dtype != y.dtype:
                return False, f"output {i}: {tuple(x.shape)} {x.dtype} vs {tuple(y.shape)} {y.dtype}"
            d = 0.0 if torch.equal(_bytes(x), _bytes(y)) else calc_diff(x, y)
            ok = ok and d < bounds[min(i, len(bounds) - 1)]  # a NaN difference fails
            diffs.append(d)
        if not any(diffs):
            return True, "bitwise"
        return ok, "calc_diff " + " / ".join(f"{d:.1e}" for d in diffs)
    return check


def _split_kv(at: int):
    """The TileKernels 2.1.0 outputs in our layout: ``grad_kv`` (output ``at``, ``(T, M+1, H)`` or its flat
    ``(T, (M+1) H)``) as our ``grad_k (T, M, H)`` and ``grad_v (T, H)``."""
    def split(theirs):
        theirs = list(theirs)
        kv = theirs[at]
        kv = kv.view(kv.shape[0], M + 1, -1)
        return (*theirs[:at], kv[:, :M], kv[:, M], *theirs[at + 1:])
    return split


def _mapped(split, check):
    return lambda ours, theirs: check(ours, split(theirs))


# ---- the gate ----

def _gate_data(t: int, h: int, device):
    """engram.md 4's draw: ``x (T, M, H)``, the packed ``kv (T, M+1, H)``, ``w_h``, ``w_e`` standard normal bf16."""
    return (_normal((t, M, h), BF16, device), _normal((t, M + 1, h), BF16, device), _normal((M, h), BF16, device),
            _normal((M, h), BF16, device))


def _gate_fwd_case(h: int, save: bool) -> Case:
    from tilefuse import engram as E
    from tilefuse.reference import engram as R

    t, m = TOKENS_GATE, M
    flag = "save" if save else "no save"

    def label(t, h):
        return f"T={t} M={m} H={h} kv packed, {flag}"

    def make(device, scale):
        tt, hh = _dim(t, scale), _hidden(h, scale)
        x, kv, wh, we = _gate_data(tt, hh, device)
        return label(tt, hh), (x, kv, wh.float() * we.float())

    def v1(ns, x, kv, w):
        return ns.engram_gate_fwd(x, kv[:, :m], kv[:, m], w, EPS, CLAMP, save)

    def ref(x, kv, w):
        res = R._gate_fwd(x, kv[:, :m], kv[:, m], w, EPS, CLAMP)
        return res if save else res[:1]

    def tk2(tk, x, kv, w):
        return tk.engram.engram_gate_fwd(x, kv, w, EPS, CLAMP, save_for_backward=save)

    stats = [((t, m), F32)] * 4 if save else []
    check = _within(FWD_DIFF)
    return Case("engram_gate_fwd", make, lambda *args: v1(E, *args), ref,
                {"tk2": tk2, "tk1": lambda tk, *args: v1(tk.engram, *args)}, False,
                f"engram_gate_fwd|M={m} H={h} {flag}", t, check={"compile": check, "tk2": check, "tk1": check},
                describe=lambda: (label(t, h), [((t, m, h), BF16), ((t, m + 1, h), BF16), ((m, h), F32)],
                                  [((t, m, h), BF16), *stats]))


def _gate_bwd_case(h: int) -> Case:
    from tilefuse import engram as E
    from tilefuse.reference import engram as R

    t, m = TOKENS_GATE, M

    def label(t, h):
        return f"T={t} M={m} H={h} kv packed + grad_w_reduce P={PARTIALS}"

    def make(device, scale):
        tt, hh = _dim(t, scale), _hidden(h, scale)
        x, kv, wh, we = _gate_data(tt, hh, device)
        _, dot, g, rx, rk = R.engram_gate_ref(x, kv[:, :m], kv[:, m], wh, we, CLAMP, EPS, save_for_backward=True)
        acc = [torch.zeros(m, hh, dtype=F32, device=device) for _ in range(2)]
        return label(tt, hh), (_normal((tt, m, hh), BF16, device), x, kv, wh.float() * we.float(), dot, g, rx, rk,
                               wh, we, *acc)

    def v1(ns, grad, x, kv, w, dot, g, rx, rk, wh, we, acc_h, acc_e):
        gx, gk, gv, partial = ns.engram_gate_bwd(grad, x, kv[:, :m], kv[:, m], w, dot, g, rx, rk, CLAMP)
        ns.grad_w_reduce(partial, wh, we, acc_h, acc_e)
        return gx, gk, gv, acc_h, acc_e

    def ref(grad, x, kv, w, dot, g, rx, rk, wh, we, acc_h, acc_e):
        gx, gk, gv, partial = R._gate_bwd(grad, x, kv[:, :m], kv[:, m], w, dot, g, rx, rk, CLAMP, PARTIALS)
        R._grad_w_reduce(partial, wh, we, acc_h, acc_e)
        return gx, gk, gv, acc_h, acc_e

    def tk2(tk, grad, x, kv, w, dot, g, rx, rk, wh, we, acc_h, acc_e):
        gx, gkv, partial = tk.engram.engram_gate_bwd(grad, x, kv, w, dot, g, rx, rk, CLAMP)
        tk.engram.grad_w_reduce(partial, wh, we, acc_h, acc_e)
        return gx, gkv, acc_h, acc_e

    stat, wspec, acc = ((t, m), F32), ((m, h), BF16), ((m, h), F32)
    xspec = ((t, m, h), BF16)
    check = _within(BWD_DIFF)
    return Case("engram_gate_bwd", make, lambda *args: v1(E, *args), ref,
                {"tk2": tk2, "tk1": lambda tk, *args: v1(tk.engram, *args)}, False, f"engram_gate_bwd|M={m} H={h}", t,
                check={"compile": check, "tk2": _mapped(_split_kv(1), check), "tk1": check}, in_place=True,
                describe=lambda: (label(t, h), [xspec, xspec, ((t, m + 1, h), BF16), ((m, h), F32), stat, stat, stat,
                                                stat, wspec, wspec, acc, acc],
                                  [xspec, xspec, ((t, h), BF16), acc, acc]))


def _grad_w_reduce_case(h: int) -> Case:
    """engram.md 4's ``grad_w_reduce`` row: partials ``(132, M, H)`` and accumulators standard normal fp32."""
    from tilefuse import engram as E
    from tilefuse.reference import engram as R

    p, m = PARTIALS, M

    def label(h):
        return f"P={p} M={m} H={h}"

    def make(device, scale):
        hh = _hidden(h, scale)
        return label(hh), (_normal((p, m, hh), F32, device), _normal((m, hh), BF16, device),
                           _normal((m, hh), BF16, device), _normal((m, hh), F32, device),
                           _normal((m, hh), F32, device))

    def call(fn):
        return lambda partial, wh, we, acc_h, acc_e: (fn(partial, wh, we, acc_h, acc_e), (acc_h, acc_e))[1]

    wspec, acc = ((m, h), BF16), ((m, h), F32)
    return Case("grad_w_reduce", make, call(E.grad_w_reduce), call(R._grad_w_reduce),
                {peer: lambda tk, *args: call(tk.engram.grad_w_reduce)(*args) for peer in ("tk2", "tk1")}, True,
                f"grad_w_reduce|P={p} M={m} H={h}", 0, in_place=True,
                describe=lambda: (label(h), [((p, m, h), F32), wspec, wspec, acc, acc], [acc, acc]))


def _gate_step_case(h: int) -> Case:
    """The layer (``engram_gate_step``): forward and backward of the autograd gate; returns the output and the
    gradients of x, k, v (ours) or of x and kv (TileKernels, mapped by the check) and of the two weights (bf16: the
    engine casts the fp32 gradients to the parameters' dtype)."""
    from tilefuse.modeling import engram as layer
    from tilefuse.reference import engram as R

    t, m = TOKENS_GATE, M

    def label(t, h):
        return f"T={t} M={m} H={h} kv packed"

    def make(device, scale):
        tt, hh = _dim(t, scale), _hidden(h, scale)
        x, kv, wh, we = _gate_data(tt, hh, device)
        return label(tt, hh), (x.requires_grad_(), kv.view(tt, (m + 1) * hh).requires_grad_(), wh.requires_grad_(),
                               we.requires_grad_(), _normal((tt, m, hh), BF16, device))

    def v1_step(gate, x, kv, wh, we, grad):
        """``gate(x, k, v, w_h, w_e)`` on leaf views ``k``, ``v`` of the packed ``kv`` (no gradient flows into ``kv``:
        the v1 API returns ``grad_k`` and ``grad_v``)."""
        for leaf in (x, wh, we):
            leaf.grad = None
        packed = kv.detach().view(x.shape[0], m + 1, x.shape[-1])
        k, v = packed[:, :m].requires_grad_(), packed[:, m].requires_grad_()
        out = gate(x, k, v, wh, we)
        out.backward(grad)
        return out.detach(), x.grad, k.grad, v.grad, wh.grad, we.grad

    def ours(x, kv, wh, we, grad):
        return v1_step(lambda *a: layer.engram_gate(*a, CLAMP, EPS), x, kv, wh, we, grad)

    def ref(x, kv, wh, we, grad):
        return v1_step(lambda *a: R.engram_gate_ref(*a, CLAMP, EPS), x, kv, wh, we, grad)

    def tk1(tk, x, kv, wh, we, grad):
        return v1_step(lambda *a: tk.modeling.engram.engram_gate(*a, CLAMP, EPS), x, kv, wh, we, grad)

    def tk2(tk, x, kv, wh, we, grad):
        for leaf in (x, kv, wh, we):
            leaf.grad = None
        out = tk.modeling.engram.engram_gate(x, kv, wh, we, CLAMP, EPS, None)
        out.backward(grad)
        return out.detach(), x.grad, kv.grad, wh.grad, we.grad

    xspec, wspec = ((t, m, h), BF16), ((m, h), BF16)
    check = _within(FWD_DIFF, STEP_GRAD_DIFF)
    return Case("engram_gate_step", make, ours, ref, {"tk2": tk2, "tk1": tk1}, False,
                f"engram_gate_step|M={m} H={h}", t, check={"compile": check, "tk2": _mapped(_split_kv(2), check),
                                                           "tk1": check},
                describe=lambda: (label(t, h), [xspec, ((t, (m + 1) * h), BF16), wspec, wspec, xspec],
                                  [xspec, xspec, xspec, ((t, h), BF16), wspec, wspec]))


# ---- hash and weights ----

def _hash_case() -> Case:
    """engram.md 4's draw: ids in [0, 1e5) int32, multipliers in [0, 1e5) int64, table sizes in [1e5, 1e6) int32,
    offsets by ``make_offsets``; output ``(L, T, (N-1) K)`` int32."""
    from tilefuse import engram as E
    from tilefuse.reference import engram as R

    t, n, l, k = TOKENS_GATE, NGRAM, LAYERS, TABLES
    c = (n - 1) * k

    def label(t):
        return f"T={t} N={n} L={l} K={k}"

    def make(device, scale):
        tt = _dim(t, scale)
        sizes = torch.randint(100_000, 1_000_000, (l, n - 1, k), dtype=torch.int32, device=device)
        return label(tt), (torch.randint(0, 100_000, (tt, n), dtype=torch.int32, device=device),
                           torch.randint(0, 100_000, (l, n), dtype=torch.int64, device=device), sizes,
                           R.make_offsets(sizes))

    return Case("engram_hash", make, E.engram_hash, R.engram_hash_ref,
                {peer: lambda tk, *args: tk.engram.engram_hash(*args) for peer in ("tk2", "tk1")}, True,
                f"engram_hash|N={n} L={l} K={k}", t,
                describe=lambda: (label(t), [((t, n), torch.int32), ((l, n), torch.int64), ((l, n - 1, k), torch.int32),
                                             ((l, c), torch.int32)], [((l, t, c), torch.int32)]))


def _fused_weight_case(h: int) -> Case:
    from tilefuse import engram as E

    m = M

    def label(h):
        return f"M={m} H={h}"

    def make(device, scale):
        hh = _hidden(h, scale)
        return label(hh), (_normal((m, hh), BF16, device), _normal((m, hh), BF16, device))

    return Case("fused_weight", make, E.fused_weight, lambda wh, we: wh.float() * we.float(),
                {peer: lambda tk, wh, we: tk.engram.fused_weight(wh, we) for peer in ("tk2", "tk1")}, True,
                f"fused_weight|M={m} H={h}", 0,
                describe=lambda: (label(h), [((m, h), BF16), ((m, h), BF16)], [((m, h), F32)]))


# ---- Sinkhorn helpers ----

def _sinkhorn_dims(d: int, scale: float) -> tuple[int, int]:
    return _dim(SINKHORN_ROWS, scale), _dim(d, scale, 256)


def _sinkhorn_data(r: int, d: int, device):
    """The base matrix standard normal fp32, the row and column scales uniform in [0.5, 1.5)."""
    return (_normal((r, d), F32, device), 0.5 + torch.rand(r, device=device), 0.5 + torch.rand(d, device=device))


def _momentum_case(grad_dtype, buffer_dtype, nesterov: bool) -> Case:
    """``(grad, momentum_buffer)`` of ``MOMENTUM_SHAPE``; returns the updated buffer and the output (bitwise)."""
    from tilefuse import engram as E
    from tilefuse.reference import engram as R

    (r, d), names = MOMENTUM_SHAPE, f"grad {_DT[grad_dtype]} buffer {_DT[buffer_dtype]}"
    flag = "nesterov" if nesterov else "no nesterov"

    def label(r, d):
        return f"{r}x{d} {names} beta1={BETA1} {flag}"

    def make(device, scale):
        rr, dd = _dim(r, scale), _dim(d, scale, 256)
        return label(rr, dd), (_normal((rr, dd), grad_dtype, device), _normal((rr, dd), buffer_dtype, device))

    def call(fn):
        return lambda grad, buf: (buf, fn(grad, buf, BETA1, nesterov))

    return Case("engram_sinkhorn_momentum_update", make, call(E.engram_sinkhorn_momentum_update),
                call(R._sinkhorn_momentum_update),
                {"tk2": lambda tk, *args: call(tk.engram.engram_sinkhorn_momentum_update)(*args)}, True,
                f"engram_sinkhorn_momentum_update|{names} {flag}", r, in_place=True,
                describe=lambda: (label(r, d), [((r, d), grad_dtype), ((r, d), buffer_dtype)],
                                  [((r, d), buffer_dtype), ((r, d), F32)]))


def _step_case(d: int) -> Case:
    """One row normalisation: returns ``row_norm``, the ``(396, D)`` partial column sums and the updated
    ``row_scale`` (in place)."""
    from tilefuse import engram as E
    from tilefuse.reference import engram as R

    r, p = SINKHORN_ROWS, SINKHORN_PARTIALS

    def label(r, d):
        return f"R={r} D={d} P={p}"

    def make(device, scale):
        rr, dd = _sinkhorn_dims(d, scale)
        return label(rr, dd), _sinkhorn_data(rr, dd, device)

    def ours(matrix, row_scale, col_scale):
        return (*E.engram_sinkhorn_step(matrix, row_scale, col_scale, SINKHORN_EPS), row_scale)

    def ref(matrix, row_scale, col_scale):
        return (*R._sinkhorn_step(matrix, row_scale, col_scale, SINKHORN_EPS, p), row_scale)

    def tk2(tk, matrix, row_scale, col_scale):
        return (*tk.engram.engram_sinkhorn_step(matrix, row_scale, col_scale, SINKHORN_EPS), row_scale)

    check = _within(ROW_DIFF, COL_DIFF, ROW_DIFF)
    return Case("engram_sinkhorn_step", make, ours, ref, {"tk2": tk2}, False, f"engram_sinkhorn_step|D={d}", r,
                check={"compile": check, "tk2": check}, in_place=True,
                describe=lambda: (label(r, d), [((r, d), F32), ((r,), F32), ((d,), F32)],
                                  [((r,), F32), ((p, d), F32), ((r,), F32)]))


def _step_reduce_case(d: int) -> Case:
    """``col_sumsq = Σ_p partial[p]`` over a ``(396, D)`` buffer of positive partial sums (uniform in [0, 1));
    the destination is an input, returned for the check and counted once (written)."""
    from tilefuse import engram as E
    from tilefuse.reference import engram as R

    p = SINKHORN_PARTIALS

    def label(d):
        return f"P={p} D={d}"

    def make(device, scale):
        dd = _dim(d, scale, 256)
        return label(dd), (torch.rand(p, dd, device=device), torch.empty(dd, device=device))

    def call(fn):
        return lambda partial, col_sumsq: (fn(partial, col_sumsq), col_sumsq)[1]

    return Case("engram_sinkhorn_step_reduce", make, call(E.engram_sinkhorn_step_reduce),
                lambda partial, col_sumsq: col_sumsq.copy_(R._sequential_sum(partial)),
                {"tk2": lambda tk, *args: call(tk.engram.engram_sinkhorn_step_reduce)(*args)}, True,
                f"engram_sinkhorn_step_reduce|D={d}", SINKHORN_ROWS,
                describe=lambda: (label(d), [((p, d), F32), ((d,), F32)], []),
                nbytes=lambda inputs, outputs: _nbytes(inputs))


def _finalize_case(d: int) -> Case:
    from tilefuse import engram as E
    from tilefuse.reference import engram as R

    r = SINKHORN_ROWS

    def label(r, d):
        return f"R={r} D={d} alpha={ALPHA}"

    def make(device, scale):
        rr, dd = _sinkhorn_dims(d, scale)
        return label(rr, dd), _sinkhorn_data(rr, dd, device)

    check = _within(ROW_DIFF)
    return Case("engram_sinkhorn_finalize", make,
                lambda *args: E.engram_sinkhorn_finalize(*args, SINKHORN_EPS, ALPHA),
                lambda *args: R._sinkhorn_finalize(*args, SINKHORN_EPS, ALPHA, None),
                {"tk2": lambda tk, *args: tk.engram.engram_sinkhorn_finalize(*args, SINKHORN_EPS, ALPHA)}, False,
                f"engram_sinkhorn_finalize|D={d}", r, check={"compile": check, "tk2": check},
                describe=lambda: (label(r, d), [((r, d), F32), ((r,), F32), ((d,), F32)], [((r, d), F32)]))


def _cases(nesterov_flags: tuple) -> list[Case]:
    return ([_gate_fwd_case(h, save) for h in HIDDEN for save in (True, False)]
            + [_gate_bwd_case(h) for h in HIDDEN] + [_grad_w_reduce_case(h) for h in HIDDEN]
            + [_hash_case()] + [_fused_weight_case(h) for h in HIDDEN]
            + [_momentum_case(g, b, n) for n in nesterov_flags for g in (BF16, F32) for b in (BF16, F32)]
            + [_step_case(d) for d in HIDDEN] + [_step_reduce_case(d) for d in HIDDEN]
            + [_finalize_case(d) for d in HIDDEN] + [_gate_step_case(STEP_HIDDEN)])


def quick_cases() -> list[Case]:
    return _cases((True,))


def grid_cases() -> list[Case]:
    return _cases((True, False))


def host_calls(device: str = "cuda") -> list:
    """The one-token gate forward (T = 1, M = 4, H = 4096, statistics not saved: the inference call) for
    ``--host-overhead``: the bare TileLang call (JITKernel, preallocated output; k and v as the launcher binds them)
    beside the public op. Each call returns its output, so a test can check that both compute the same thing."""
    from tilefuse import _jit, engram
    from tilefuse.engram import _gate_fwd_kernel as K

    h = STEP_HIDDEN
    x = _normal((1, M, h), BF16, device)
    kv = _normal((1, M + 1, h), BF16, device)
    k, v = kv[:, :M], kv[:, M]
    w = _normal((M, h), F32, device)
    group = f"engram_gate_fwd, M={M} H={h}, no save, 1 token"
    calls = []
    if device == "cuda":
        jk = _jit.get_jit_kernel("engram_gate_fwd", (M, h, False))
        out = torch.empty_like(x)
        (k_rows, (k_s0, k_s1)), (v_rows, (v_s0,)) = K._vector_rows(k), K._vector_rows(v)
        calls.append((group, "bare TileLang kernel call (JITKernel, preallocated outputs)",
                      lambda: (jk(x, k_rows, v_rows, w, out, k_s0, k_s1, v_s0, EPS, CLAMP), out)[1]))
    calls.append((group, "tilefuse.engram.engram_gate_fwd (public op)",
                  lambda: engram.engram_gate_fwd(x, k, v, w, EPS, CLAMP, False)[0]))
    return calls
