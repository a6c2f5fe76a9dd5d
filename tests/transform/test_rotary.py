"""Reference tier of apply_rotary / rotary_embedding_ref (transform.md 3.4, 5, 6, 8.3), on the CPU: the reference
against an exact per-element model, the invariants bit for bit on the reference and on the op's CPU path, the
round trip, the tolerance against upstream's promotion order, and every validation row."""
import re

import pytest
import torch

from tilefuse.reference import rotary_embedding_ref
from tilefuse.transform import apply_rotary
from tests.transform.rotary_data import bits, draw_positions, make_cos_sin_cache, model, rand, special_values

DTYPES = (torch.bfloat16, torch.float32)
FLAGS = [(False, False), (False, True), (True, False), (True, True)]
# section 8.3: a rotation followed by its conjugate returns each element within TOL * |(f, s)|
ROUND_TRIP_TOL = {torch.bfloat16: 2.0 ** -6, torch.float32: 2.0 ** -20}


def _ref(x, cache, positions=None, offset=0, interleaved=False, conjugate=False):
    half = cache.shape[1] // 2
    return rotary_embedding_ref(x, cache[:, :half], cache[:, half:], positions, offset, interleaved, conjugate)


def _op(x, cache, key=None, positions=None, interleaved=False, conjugate=False, offset=0):
    """The op's CPU path on clones; returns the rotated (query, key)."""
    q = x.clone()
    k = None if key is None else key.clone()
    assert apply_rotary(q, cache, k, positions, interleaved, conjugate, offset) is None
    return q, k


def _same(a, b):
    assert a.shape == b.shape and a.dtype == b.dtype
    assert torch.equal(bits(a), bits(b))


# ---- the reference against the exact model ----

@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("interleaved,conjugate", FLAGS)
@pytest.mark.parametrize("d", (64, 128))
def test_reference_matches_exact_model(dtype, interleaved, conjugate, d):
    rows = 40
    cache = make_cos_sin_cache(rows, d)
    cache[3] = torch.randn(d) * 3  # one arbitrary, non-unit row
    x = rand((3, 2, d), dtype) * 4
    positions = torch.tensor([3, 39, 40])  # the last is out of range: unchanged
    got = _ref(x, cache, positions, 0, interleaved, conjugate)
    _same(got, model(x, cache, positions, 0, interleaved, conjugate))
    _same(got[2], x[2])
    assert not torch.equal(got[0], x[0])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("conjugate", (False, True))
def test_special_values_match_exact_model(dtype, conjugate):
    d = 64
    x = special_values(4 * 3 * d, dtype).view(4, 3, d)
    cache = special_values(6 * d, torch.float32).view(6, d)
    cache[0] = make_cos_sin_cache(1, d)[0]
    positions = torch.tensor([0, 1, 5, 2])
    got = _ref(x, cache, positions, 0, False, conjugate)
    _same(got, model(x, cache, positions, 0, False, conjugate))
    q, _ = _op(x, cache, positions=positions, conjugate=conjugate)
    _same(q, got)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_reference_rotates_only_the_leading_columns(dtype):
    x = rand((5, 2, 192), dtype)
    cache = make_cos_sin_cache(16, 64)
    out = _ref(x, cache, None, 3, True, False)
    _same(out[..., 64:], x[..., 64:])
    _same(out[..., :64], model(x[..., :64], cache, None, 3, True, False))
    assert out.is_contiguous() and out.data_ptr() != x.data_ptr()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_reference_odd_width_and_strided_inputs(dtype):
    """Any even rotated width works in the reference; inputs of any strides are read, never written."""
    base = rand((2, 7, 4, 40), dtype)
    x = base.transpose(0, 1)[:, :, 1:3]  # (7, 2, 2, 40): 4-D, non-contiguous
    keep = base.clone()
    cos = torch.randn(12, 10)
    sin = torch.randn(12, 10)
    out = rotary_embedding_ref(x, cos, sin, None, 2)
    _same(base, keep)
    cache = torch.cat((cos, sin), 1)
    _same(out[..., :20], model(x[..., :20], cache, None, 2, False, False))
    _same(out[..., 20:], x[..., 20:])


# ---- the invariants of section 3.4, on the reference and on the op's CPU path ----

def _both(x, cache, positions=None, offset=0, interleaved=False, conjugate=False):
    ref = _ref(x, cache, positions, offset, interleaved, conjugate)
    q, _ = _op(x, cache, None, positions, interleaved, conjugate, offset)
    _same(q, ref)
    return ref


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("interleaved", (False, True))
def test_conjugate_is_a_negated_sine(dtype, interleaved):
    cache = torch.randn(64, 128)
    x = rand((9, 3, 128), dtype)
    positions = draw_positions((9,), 64, 0)
    neg = cache.clone()
    neg[:, 64:] = -neg[:, 64:]
    _same(_both(x, cache, positions, 0, interleaved, True), _both(x, neg, positions, 0, interleaved, False))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("conjugate", (False, True))
def test_interleaved_is_a_permutation(dtype, conjugate):
    cache = make_cos_sin_cache(100, 64)
    x = rand((6, 2, 64), dtype)
    de = torch.cat((x[..., 0::2], x[..., 1::2]), -1)
    out = _both(de, cache, None, 17, False, conjugate)
    back = torch.stack((out[..., :32], out[..., 32:]), -1).flatten(-2)
    _same(_both(x, cache, None, 17, True, conjugate), back)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_three_and_four_dims(dtype):
    cache = make_cos_sin_cache(64, 64)
    x = rand((3, 11, 2, 64), dtype)
    pos = draw_positions((3, 11), 64, 5)
    # 3-D == 4-D with B = 1
    _same(_both(x[0], cache, pos[0], 5, True), _both(x[:1], cache, pos[:1], 5, True)[0])
    # 4-D with positions == 3-D on the (B S, H, D) reshape with flat positions
    _same(_both(x, cache, pos, 5).reshape(33, 2, 64), _both(x.reshape(33, 2, 64), cache, pos.reshape(33), 5))
    # 4-D without positions == B separate 3-D calls with the same offset
    full = _both(x, cache, None, 7, False, True)
    for b in range(3):
        _same(full[b], _both(x[b], cache, None, 7, False, True))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("interleaved", (False, True))
def test_identity_row_changes_only_zero_signs(dtype, interleaved):
    d = 64
    cache = torch.cat((torch.ones(4, d // 2), torch.zeros(4, d // 2)), 1)
    x = rand((4, 3, d), dtype)
    zeros = torch.rand(x.shape) < 0.3
    x = torch.where(zeros, torch.where(torch.rand(x.shape) < 0.5, -0.0, 0.0).to(dtype), x)
    out = _both(x, cache, None, 0, interleaved)
    f, s = (x[..., 0::2], x[..., 1::2]) if interleaved else (x[..., :32], x[..., 32:])
    neg = torch.signbit
    first_to_pos = (f == 0) & neg(f) & neg(s)  # f = -0 and s negative or -0
    second_to_pos = (s == 0) & neg(s) & ~neg(f)  # s = -0 and f positive or +0
    want_f = torch.where(first_to_pos, torch.zeros_like(f), f)
    want_s = torch.where(second_to_pos, torch.zeros_like(s), s)
    want = torch.stack((want_f, want_s), -1).flatten(-2) if interleaved else torch.cat((want_f, want_s), -1)
    assert (first_to_pos.any() or second_to_pos.any())
    _same(out, want)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_batch_invariance_and_determinism(dtype):
    cache = make_cos_sin_cache(512, 128)
    x = rand((257, 4, 128), dtype)
    pos = draw_positions((257,), 512, 0)
    full = _both(x, cache, pos, 0, True)
    _same(full, _both(x, cache, pos, 0, True))
    for t in (0, 1, 100, 256):
        _same(full[t:t + 1], _both(x[t:t + 1], cache, pos[t:t + 1], 0, True))
        _same(full[t:t + 1, 1:3], _both(x[t:t + 1, 1:3], cache, pos[t:t + 1], 0, True))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("interleaved", (False, True))
def test_round_trip(dtype, interleaved):
    d = 128
    cache = make_cos_sin_cache(R := 8192, d)
    x = rand((64, 4, d), dtype)
    pos = draw_positions((64,), R, 0)
    q, _ = _op(x, cache, positions=pos, interleaved=interleaved)
    back, _ = _op(q, cache, positions=pos, interleaved=interleaved, conjugate=True)
    xf, bf = x.float(), back.float()
    f, s = (xf[..., 0::2], xf[..., 1::2]) if interleaved else (xf[..., :64], xf[..., 64:])
    r = torch.sqrt(f.double() ** 2 + s.double() ** 2).float()
    r = torch.stack((r, r), -1).flatten(-2) if interleaved else torch.cat((r, r), -1)
    assert ((bf - xf).abs() <= ROUND_TRIP_TOL[dtype] * r).all()
    assert not torch.equal(q, x)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("interleaved,conjugate", FLAGS)
def test_against_promotion_order_within_section_8_3(dtype, interleaved, conjugate):
    """Upstream's reference rounds f c (or f n) on its own and adds: the two differ by at most 2^-21 (|f| + |s|),
    plus one ulp of the result for bf16."""
    d = 64
    cache = make_cos_sin_cache(8192, d)
    x = rand((200, 4, d), dtype) * 8
    pos = draw_positions((200,), 8192, 0)
    got = _ref(x, cache, pos, 0, interleaved, conjugate).float()
    c, n = cache[pos, :32][:, None], cache[pos, 32:][:, None]
    xf = x.float()
    f, s = (xf[..., 0::2], xf[..., 1::2]) if interleaved else (xf[..., :32], xf[..., 32:])
    if conjugate:
        first, second = f * c + s * n, s * c - f * n
    else:
        first, second = f * c - s * n, f * n + s * c
    first, second = first.to(dtype).float(), second.to(dtype).float()
    want = torch.stack((first, second), -1).flatten(-2) if interleaved else torch.cat((first, second), -1)
    mag = f.abs() + s.abs()
    mag = torch.stack((mag, mag), -1).flatten(-2) if interleaved else torch.cat((mag, mag), -1)
    bound = 2.0 ** -21 * mag
    if dtype == torch.bfloat16:  # one bf16 ulp of the result
        bound = bound + torch.where(got == 0, 2.0 ** -133, 2.0 ** (torch.floor(torch.log2(got.abs())) - 7))
    assert ((got - want).abs() <= bound).all()


# ---- CPU path of the op ----

@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_op_views_rotate_in_place_and_leave_the_rest(dtype):
    """Tail and leading slices of wide heads, q and k views of one fused buffer: exactly the views change."""
    T, H, Hk, d = 6, 3, 2, 64
    cache = make_cos_sin_cache(32, d)
    fused = rand((T, (H + 2 * Hk) * (d + 64)), dtype)
    keep = fused.clone()
    heads = fused.view(T, H + 2 * Hk, d + 64)
    q = heads[:, :H, -d:]
    k = heads[:, H:H + Hk, :d]
    want_q = _ref(q, cache, None, 4)
    want_k = _ref(k, cache, None, 4)
    apply_rotary(q, cache, k, None, False, False, 4)
    _same(q, want_q)
    _same(k, want_k)
    mask = torch.ones_like(heads, dtype=torch.bool)
    mask[:, :H, -d:] = False
    mask[:, H:H + Hk, :d] = False
    _same(heads[mask], keep.view_as(heads)[mask])


def test_op_key_with_its_own_length_without_positions():
    """Without positions each tensor uses its own token index, and each is checked against R on its own S."""
    cache = make_cos_sin_cache(64, 64)
    q = rand((10, 2, 64), torch.float32)
    k = rand((3, 1, 64), torch.float32)
    qq, kk = _op(q, cache, k, None, False, False, 54)
    _same(qq, _ref(q, cache, None, 54))
    _same(kk, _ref(k, cache, None, 54))
    with pytest.raises(ValueError, match="seqlen_offset.*query's S=10"):
        _op(q, cache, k, None, False, False, 60)
    with pytest.raises(ValueError, match="seqlen_offset.*key's S=10"):
        _op(k, cache, q, None, False, False, 61)


def test_op_out_of_range_positions_leave_tokens_unchanged():
    cache = make_cos_sin_cache(16, 64)
    x = rand((5, 2, 64), torch.bfloat16)
    pos = torch.tensor([-1, 16, 2 ** 31 - 1, -(2 ** 31), 3], dtype=torch.int64)
    q, _ = _op(x, cache, positions=pos, offset=5)  # rows 4, 21, 2^31 + 4, -2^31 + 5, 8
    _same(q[1:4], x[1:4])
    assert not torch.equal(q[0], x[0]) and not torch.equal(q[4], x[4])
    _same(q, _ref(x, cache, pos, 5))
    q32, _ = _op(x[[0, 1, 3, 4]], cache, positions=pos.to(torch.int32)[[0, 1, 3, 4]], offset=5)
    _same(q32, q[[0, 1, 3, 4]])


@pytest.mark.parametrize("shape", ((0, 2, 64), (3, 0, 64), (0, 5, 2, 64), (2, 0, 2, 64)))
def test_op_empty_query_still_rotates_key(shape):
    cache = make_cos_sin_cache(8, 64)
    q = torch.empty(shape)
    k = rand((*shape[:-3], 3, 1, 64) if len(shape) == 3 else (1, 3, 1, 64), torch.float32)
    kk = k.clone()
    apply_rotary(q, cache, kk, None, True, False, 1)
    _same(kk, _ref(k, cache, None, 1, True))


def test_op_flags_take_ints():
    cache = make_cos_sin_cache(8, 64)
    x = rand((3, 1, 64), torch.float32)
    _same(_op(x, cache, None, None, 1, 0)[0], _op(x, cache, None, None, True, False)[0])
    _same(_op(x, cache, None, None, 0, 2)[0], _op(x, cache, None, None, False, True)[0])


def test_positional_argument_orders():
    """apply_rotary: (query, cache, key, positions, interleaved, conjugate, seqlen_offset); the reference:
    (x, cos, sin, positions, seqlen_offsets, interleaved, conjugate)."""
    cache = make_cos_sin_cache(32, 64)
    x = rand((4, 2, 64), torch.float32)
    q = x.clone()
    apply_rotary(q, cache, None, None, True, True, 9)
    _same(q, rotary_embedding_ref(x, cache[:, :32], cache[:, 32:], None, 9, True, True))
    _same(q, _ref(x, cache, None, 9, True, True))


# ---- validation (section 5): exception type and the argument named ----

def _args():
    q = torch.randn(4, 2, 64)
    return dict(query=q, cos_sin_cache=make_cos_sin_cache(16, 64), key=torch.randn(4, 1, 64),
                positions=torch.tensor([0, 1, 2, 3]), interleaved=False, conjugate=False, seqlen_offset=0)


def _overlapping():
    return torch.randn(4, 1, 64).expand(4, 2, 64)


ERRORS = [
    ("query not a tensor", dict(query=[1.0]), TypeError, "query"),
    ("query 2-D", dict(query=torch.randn(4, 64)), ValueError, "query"),
    ("query 5-D", dict(query=torch.randn(1, 1, 4, 2, 64)), ValueError, "query"),
    ("query fp16", dict(query=torch.randn(4, 2, 64).half()), TypeError, "query"),
    ("cache not a tensor", dict(cos_sin_cache=None), TypeError, "cos_sin_cache"),
    ("cache bf16", dict(cos_sin_cache=torch.randn(16, 64).bfloat16()), TypeError, "cos_sin_cache"),
    ("cache 3-D", dict(cos_sin_cache=torch.randn(2, 16, 64)), ValueError, "cos_sin_cache"),
    ("cache width 96", dict(cos_sin_cache=torch.randn(16, 96)), ValueError, "cos_sin_cache"),
    ("cache column stride", dict(cos_sin_cache=torch.randn(64, 16).t()), ValueError, "cos_sin_cache"),
    ("query width", dict(query=torch.randn(4, 2, 128)), ValueError, "query"),
    ("query last stride", dict(query=torch.randn(4, 64, 2).transpose(1, 2)), ValueError, "query"),
    ("query overlap", dict(query=_overlapping()), ValueError, "query"),
    ("key not a tensor", dict(key=3), TypeError, "key"),
    ("key dtype", dict(key=torch.randn(4, 1, 64).bfloat16()), TypeError, "key"),
    ("key rank", dict(key=torch.randn(1, 4, 1, 64)), ValueError, "key"),
    ("key width", dict(key=torch.randn(4, 1, 128)), ValueError, "key"),
    ("key last stride", dict(key=torch.randn(4, 64, 2).transpose(1, 2)[:, :1]), ValueError, "key"),
    ("key overlap", dict(key=_overlapping()), ValueError, "key"),
    ("key tokens with positions", dict(key=torch.randn(5, 1, 64)), ValueError, "key"),
    ("positions not a tensor", dict(positions=[0, 1, 2, 3]), TypeError, "positions"),
    ("positions float", dict(positions=torch.zeros(4)), TypeError, "positions"),
    ("positions int16", dict(positions=torch.zeros(4, dtype=torch.int16)), TypeError, "positions"),
    ("positions shape", dict(positions=torch.zeros(1, 4, dtype=torch.int64)), ValueError, "positions"),
    ("positions length", dict(positions=torch.zeros(5, dtype=torch.int64)), ValueError, "positions"),
    ("positions stride", dict(positions=torch.zeros(8, dtype=torch.int64)[::2]), ValueError, "positions"),
    ("offset float", dict(seqlen_offset=1.0), TypeError, "seqlen_offset"),
    ("offset bool", dict(seqlen_offset=True), TypeError, "seqlen_offset"),
    ("offset above int32", dict(seqlen_offset=2 ** 31), ValueError, "seqlen_offset"),
    ("offset below int32", dict(seqlen_offset=-(2 ** 31) - 1), ValueError, "seqlen_offset"),
    ("offset negative without positions", dict(positions=None, seqlen_offset=-1), ValueError, "seqlen_offset"),
    ("offset past R without positions", dict(positions=None, seqlen_offset=13), ValueError, "seqlen_offset"),
    ("interleaved str", dict(interleaved="yes"), TypeError, "interleaved"),
    ("interleaved None", dict(interleaved=None), TypeError, "interleaved"),
    ("conjugate float", dict(conjugate=1.0), TypeError, "conjugate"),
    ("cache on meta", dict(cos_sin_cache=torch.empty(16, 64, device="meta")), ValueError, "cos_sin_cache"),
    ("key on meta", dict(key=torch.empty(4, 1, 64, device="meta")), ValueError, "key"),
    ("positions on meta", dict(positions=torch.empty(4, dtype=torch.int64, device="meta")), ValueError, "positions"),
]


@pytest.mark.parametrize("what,change,exc,name", ERRORS, ids=[e[0] for e in ERRORS])
def test_validation(what, change, exc, name):
    args = _args()
    args.update(change)
    keep = args["query"].clone() if isinstance(args["query"], torch.Tensor) and args["query"].device.type == "cpu" \
        else None
    with pytest.raises(exc, match=rf"^apply_rotary: .*\b{name}\b"):
        apply_rotary(**args)
    if keep is not None and not keep.is_meta:
        assert torch.equal(args["query"], keep)  # nothing written before the checks pass


def test_validation_baseline_passes():
    args = _args()
    apply_rotary(**args)
    args.update(positions=None, seqlen_offset=12)  # 12 + 4 == R: the last valid offset
    apply_rotary(**args)


def test_empty_views_of_any_offset_pass_without_positions():
    """S = 0: no row is used, so no offset is out of range (section 5 counts tensors with S > 0)."""
    apply_rotary(torch.empty(0, 2, 64), make_cos_sin_cache(4, 64), None, None, False, False, 100)


REF_ERRORS = [
    (dict(x=torch.randn(4, 2, 64).half()), TypeError, "x"),
    (dict(x=torch.randn(4, 64)), ValueError, "x"),
    (dict(cos=torch.randn(16, 32).double()), TypeError, "cos"),
    (dict(sin=torch.randn(16, 31)), ValueError, "sin"),
    (dict(cos=torch.randn(16, 40), sin=torch.randn(16, 40)), ValueError, "cos"),
    (dict(positions=torch.zeros(4)), TypeError, "positions"),
    (dict(positions=torch.zeros(3, dtype=torch.int64)), ValueError, "positions"),
    (dict(seqlen_offsets=True), TypeError, "seqlen_offsets"),
    (dict(positions=None, seqlen_offsets=13), ValueError, "seqlen_offsets"),
    (dict(interleaved="no"), TypeError, "interleaved"),
]


@pytest.mark.parametrize("change,exc,name", REF_ERRORS, ids=[str(i) for i in range(len(REF_ERRORS))])
def test_reference_validation(change, exc, name):
    args = dict(x=torch.randn(4, 2, 64), cos=torch.randn(16, 32), sin=torch.randn(16, 32),
                positions=torch.tensor([0, 1, 2, 3]), seqlen_offsets=0, interleaved=False, conjugate=False)
    args.update(change)
    with pytest.raises(exc, match=rf"^rotary_embedding_ref: .*\b{name}\b"):
        rotary_embedding_ref(**args)


def test_custom_op_mutates_query_and_key():
    """``tilefuse::apply_rotary`` (the torch.compile path) declares both tensors written and returns nothing."""
    from torch._library.simple_registry import singleton

    schema = torch.ops.tilefuse.apply_rotary.default._schema
    assert [a.name for a in schema.arguments if a.is_write] == ["query", "key"]
    assert len(schema.returns) == 0
    assert singleton.find("tilefuse::apply_rotary").fake_impl.kernel is not None
    assert torch._C._dispatch_has_kernel_for_dispatch_key("tilefuse::apply_rotary", "CUDA")


def test_validated_layouts_take_the_kept_plan_and_still_check_the_offset(monkeypatch):
    """A layout that passed the checks once (CUDA tensors in use; CPU tensors stand in here) launches from its kept
    plan; the offset, which is not part of the layout, is still checked on every call."""
    from tilefuse import _jit
    from tilefuse.transform import _rotary_kernel as K
    from tilefuse.transform import ops

    calls = []
    monkeypatch.setattr(_jit, "get", lambda name, cfg: lambda *args: calls.append((cfg, args)))
    monkeypatch.setattr(ops, "_VALIDATED", {})
    cache = make_cos_sin_cache(64, 64)
    q, k = rand((10, 2, 64), torch.bfloat16), rand((3, 1, 64), torch.bfloat16)
    pk = K.plan_key(q, cache, k, None, True, False)
    ops._VALIDATED[pk] = K._plan(q, cache, k, None, True)
    apply_rotary(q, cache, k, None, True, False, 54)
    (cfg, args), = calls
    assert cfg == ("bf16", 64, 8, 4, True, "none", 3) and args[0] is q and args[1] is k and args[4:6] == (54, 1.0)
    for off, exc in ((55, ValueError), (-1, ValueError), (True, TypeError), (2 ** 31, ValueError), (1.0, TypeError)):
        with pytest.raises(exc, match="seqlen_offset"):
            apply_rotary(q, cache, k, None, True, False, off)
    assert len(calls) == 1
    # both tensors empty but with tokens (no heads): no launch, and the offset is still checked against S
    e = torch.empty(10, 0, 64, dtype=torch.bfloat16)
    ops._VALIDATED[K.plan_key(e, cache, None, None, False, False)] = None
    apply_rotary(e, cache, None, None, False, False, 54)
    with pytest.raises(ValueError, match="seqlen_offset"):
        apply_rotary(e, cache, None, None, False, False, 55)
    assert len(calls) == 1


def test_info_lists_apply_rotary_as_kernel(capsys):
    from tilefuse import _registry, cli

    assert _registry.load_all()["transform.apply_rotary"]["path"] == "kernel"
    assert cli.main(["info"]) == 0
    assert re.search(r"^\s+apply_rotary\s+kernel$", capsys.readouterr().out, re.M)
